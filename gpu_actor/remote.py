"""The edge's end of the bridge: `RemoteWorker`, one process per GPU host in `bridge.hosts`.

To the edge's frontend and compositors it is an inference worker like any other (same input ring,
output ring, messages); it copies each batch from its input slot into the socket once (RemoteInfer,
tensors as raw frames, the deadline as the budget left), and the mouths from the socket into an output
slot once. A host goes away when its connection closes (its process died, the network dropped it:
what was in flight on it is lost, as replies to a dropped ZeroMQ peer are) or when it answers no
heartbeat for bridge.dead_after_s (it hangs, or the network is cut without a close): its requests then
get `unavailable` from the frontend. It is used again once it answers a heartbeat (no restart of the
edge). A host that shuts down says so
in its heartbeat answers (`draining`: new work is refused here at once), answers what it has, and
sends Goodbye: it is then `stopped`, and whatever it did not answer gets `unavailable` saying that it
shut down, never taken for a lost host.

Live sessions' pins: it counts the pins the host answered, per model and frontend process, and sends
them all (`Pins`) each time it finds the host ready, so that a bridge process that never had them (one
that took the connection over from a dead one, a restarted host, a DNS slot's new host) or that dropped
them (the edge silent for a while) keeps the sessions' models loaded; and again after a frontend of
the edge restarted, whose sessions' pins went with it. The GPU host's end is frontend/bridge/process.py. Everything
the host sends is checked like a client request: a malformed or unexpected message is logged and
dropped, never fatal.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from config import Config
from config.geometry import MOUTH_SHAPE, mouths_from_uint8, valid_model_id
from config.keys import make_client
from gpu_actor.discovery import SlotWatcher, parse_dns_device
from gpu_actor.handoff import acquire_slot, hand_off, route
from shm.child import child_main
from shm.codes import ErrorCode, ProcState
from shm.endpoints import Owners, RunSpec, make_socket, network_socket
from shm.messages import (Goodbye, InferDone, InferTask, LoadDone, LoadModel, ModelEvent, Pins, Ping, Pong,
                          ProcessEvent, ReleaseTask, RemoteInfer, ResetRequests, StatsQuery, StatsReport, UnloadModel,
                          unpack, pack)
from shm.requests import drop_owned_below, release_owned, same_owner_below
from shm.ring import RingError, SlotRing, SlotRings, StaleHandle

log = logging.getLogger(__name__)
FIRST_RESOLVE_S = 2.0     # a DNS slot waits this long at start for its first answer (then: vacant)

class RemoteWorker:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int):
        self.config, self.index = config, index
        self.device = run.devices[index]
        dns = parse_dns_device(self.device)
        if dns is None:
            self.endpoint: Optional[str] = self.device.removeprefix("remote:")
            host = next(h for h in config.bridge.hosts if h.endpoint == self.endpoint)
            self.watcher = None
        else:   # a slot for one of the hosts behind a DNS name (gpu_actor/discovery.py)
            name, port, slot = dns
            host = next(h for h in config.bridge.hosts if (h.dns, h.port) == (name, port))
            table = os.path.join(run.run_dir, f"dns-{name}-{port}.json")
            self.watcher = SlotWatcher(name, port, slot, host.max_hosts, config.bridge.resolve_s, table).start()
            self.watcher.resolved.wait(FIRST_RESOLVE_S)
            self.endpoint = self.watcher.endpoint
        self._server_key = host.server_key
        ep = run.endpoints
        self.tasks = make_socket(ctx, zmq.PULL, bind=ep.gpu[index])
        self.to_frontend = Owners(ctx, ep.frontend)
        self.to_cpu = [make_socket(ctx, zmq.PUSH, connect=a) for a in ep.cpu]
        self.inputs = SlotRings(run.inputs_to(index))   # one per client-facing process
        self.outputs = SlotRing.attach(run.output_rings[index])
        self.outputs.become_writer()
        self._ctx = ctx
        self.poller = zmq.Poller()
        self.poller.register(self.tasks, zmq.POLLIN)
        self.host: Optional[zmq.Socket] = None
        self._closes: Optional[zmq.Socket] = None   # the host socket's monitor: its connection's closes
        if self.endpoint:
            self._connect(self.endpoint)
        self.pending: dict[int, InferTask] = {}
        # "ready", "starting" (host answers, none of its workers is ready yet) or "unreachable";
        # None until the first heartbeat is answered or missed (the supervisor has said "ready").
        self.state: Optional[ProcState] = None if self.endpoint else ProcState.VACANT
        self.ready_state = self.state or ProcState.READY   # what the supervisor is told at start
        self.loaded: set[str] = set()
        self._last_pong = time.monotonic()
        self._next_ping = 0.0
        self._next_report = 0.0
        self._host_stopping = False   # the host said it is shutting down (a Pong's `draining`, its Goodbye)
        self._epoch = 0   # the answering bridge process (Pong.epoch); 0: none heard yet
        self._pins: dict[str, list[int]] = {}   # model -> the requests whose pins the host answered
        self._pinning: dict[int, str] = {}      # pins asked for, not answered yet: request -> model
        self._stopping = False
        self._handlers = {InferTask: self._infer_task, ReleaseTask: lambda m: self.outputs.release_request(m.req),
                          StatsQuery: lambda m: self._send_host([pack(m)]),   # the host answers for all its workers
                          LoadModel: self._model_op, UnloadModel: self._model_op, ResetRequests: self._reset}
        # what a GPU host sends, by type (each handler: the message and the frames after it)
        self._host_handlers: dict[type, Callable[[object, list], None]] = {
            Pong: lambda m, data: self._pong(m), InferDone: self._infer_done,
            LoadDone: self._to_frontend, StatsReport: self._to_frontend, Goodbye: lambda m, data: self._goodbye()}

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self._disconnect()
        self.inputs.close()
        self.outputs.close()

    def _connect(self, endpoint: str) -> None:
        sock = network_socket(self._ctx, zmq.DEALER, self.config.limits.max_message_bytes)
        if self.config.bridge.client_secret_key:
            make_client(sock, self.config.bridge.client_secret_key, self._server_key, "bridge")
        self._closes = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        self.host = sock
        self.poller.register(self.host, zmq.POLLIN)
        self.poller.register(self._closes, zmq.POLLIN)

    def _disconnect(self) -> None:
        if self.host is None:
            return
        self.poller.unregister(self.host)
        self.poller.unregister(self._closes)
        self.host.disable_monitor()
        self._closes.close(linger=0)
        self.host.close(linger=0)
        self.host = self._closes = None

    def _switch(self, endpoint: Optional[str]) -> None:
        """A DNS slot's host changed: the old one's work gets `unavailable`, the new one is used once it
        answers a heartbeat; None: no host behind this slot now (vacant)."""
        old = self.endpoint
        log.info("GPU host slot %s: %s -> %s", self.device, old or "vacant", endpoint or "vacant")
        self._disconnect()
        for req in list(self.pending):
            self._done(req, ErrorCode.UNAVAILABLE, f"GPU host {old} left (it is no longer behind its DNS name); retry")
        self.pending.clear()
        self._pinning.clear()
        self._sync_models(set())
        self.endpoint, self._host_stopping = endpoint, False
        if endpoint is None:
            self.state = ProcState.VACANT
        else:
            self._connect(endpoint)
            self.state = ProcState.UNREACHABLE   # until it answers a heartbeat: then READY is reported
            self._last_pong, self._next_ping, self._epoch = time.monotonic(), 0.0, 0
        self._report(self.state)

    def run(self) -> None:
        if self.state is ProcState.VACANT:
            self._report(self.state)
        beat = self.config.bridge.heartbeat_s
        while not self._stopping:
            if self.watcher is not None and self.watcher.endpoint != self.endpoint:
                self._switch(self.watcher.endpoint)
            events = dict(self.poller.poll(int(beat * 1000 / 2)))
            if self.host is not None and events.get(self.host):
                while self.host.poll(0):
                    frames = self.host.recv_multipart(copy=False)
                    try:
                        self._from_host(frames)
                    except Exception as err:  # a peer's message must never end this process
                        log.warning("dropped a malformed message from GPU host %s: %s: %s", self.endpoint,
                                    type(err).__name__, err)
            if events.get(self.tasks):
                while self.tasks.poll(0):
                    self._from_frontend(unpack(self.tasks.recv()))
            if self._closes is not None and events.get(self._closes):
                closed = False
                while self._closes.poll(0):
                    closed |= recv_monitor_message(self._closes)["event"] == zmq.EVENT_DISCONNECTED
                if closed:
                    self._lost("closed the connection")
            self._heartbeat()

    def _send_host(self, frames: list) -> bool:
        if self.host is None:
            return False
        try:
            self.host.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)  # the one copy into the socket
            return True
        except zmq.Again:
            return False

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.host is None:   # vacant: said again every second, like unreachable
            if now >= self._next_report:
                self._report(ProcState.VACANT)
            return
        if now >= self._next_ping:
            self._send_host([pack(Ping(sent=now))])
            self._next_ping = now + self.config.bridge.heartbeat_s
        gone = (ProcState.UNREACHABLE, ProcState.STOPPED)
        if self.state not in gone and now - self._last_pong > self.config.bridge.dead_after_s:
            self._lost("does not answer heartbeats")
        elif now >= self._next_report and (self.state in (*gone, ProcState.STARTING)
                                           or (self.watcher is not None and self.state is not None)):
            # NOTE: a DNS slot says every state again each second: the supervisor only knows its
            # process is up, and says "ready" to a restarted frontend.
            # Repeated while not ready, so a restarted frontend learns it too, and so it outlasts the
            # supervisor's own "ready" for this process should that arrive later.
            self._report(self.state)

    def _lost(self, why: str) -> None:
        """The host went silent or its connection closed: what is in flight on it will not be answered."""
        if self.state in (ProcState.UNREACHABLE, ProcState.STOPPED):
            return
        if self._host_stopping:   # it said it is shutting down: its silence is that
            log.warning("GPU host %s %s after saying it is shutting down (no Goodbye came)", self.endpoint, why)
            self._host_stopped()
            return
        log.warning("GPU host %s %s", self.endpoint, why)
        self.state = ProcState.UNREACHABLE
        self.pending.clear()  # the frontend answers them all `unavailable`
        self._pinning.clear()   # (their loads too: pinned again, if answered, by the next Pins)
        self._report(self.state)

    def _host_stopped(self) -> None:
        """The host shut down: what it did not answer gets `unavailable` saying so, before the frontend
        hears `stopped` (on the same socket: it would fail them as a lost process's)."""
        for req in self.pending:
            self._done(req, ErrorCode.UNAVAILABLE, self._shutting_down())
        self.pending.clear()
        log.info("GPU host %s shut down", self.endpoint)
        self.state = ProcState.STOPPED
        self._report(self.state)

    def _shutting_down(self) -> str:
        return f"GPU host {self.endpoint} is shutting down; retry on another"

    def _report(self, state: ProcState) -> None:
        self._next_report = time.monotonic() + 1.0
        device = self.device if self.watcher is None else f"{self.device}={self.endpoint or 'vacant'}"
        self.to_frontend.broadcast(pack(ProcessEvent(role="gpu", index=self.index, pid=os.getpid(), state=state,
                                                device=device)))

    def _from_frontend(self, msg) -> None:
        route(self._handlers, msg, f"GPU host forwarder {self.index}")

    def _infer_task(self, msg: InferTask) -> None:
        if self._host_stopping:
            self._done(msg.req, ErrorCode.UNAVAILABLE, self._shutting_down())
            return
        not_ready = {ProcState.UNREACHABLE: "is unreachable",
                     ProcState.STARTING: "has no ready inference worker",
                     ProcState.VACANT: "(a DNS slot) has no host behind it"}.get(self.state)
        if not_ready:
            self._done(msg.req, ErrorCode.UNAVAILABLE, f"GPU host {self.endpoint} {not_ready}; retry")
            return
        now = time.monotonic()
        budget_ms = max(msg.deadline - now, 0.0) * 1000 if msg.deadline else 0.0
        frames = [pack(RemoteInfer(
            req=msg.req, model=msg.model, batch=msg.batch, audio_shape=tuple(msg.audio.shape[1:]) or (1,),
            visual=msg.visual is not None, frames=msg.frames, composite=bool(msg.plan), budget_ms=budget_ms,
            version=msg.version, pcm=msg.audio.dtype == "int16", rows=msg.rows, utterance=msg.utterance,
            first_input=msg.first_input, due_ms=max(msg.due - now, 0.0) * 1000 if msg.due else None,
            client=msg.client))]
        try:
            if msg.visual is not None:
                frames.append(self.inputs.read(msg.visual))
            frames.append(self.inputs.read(msg.audio))
        except StaleHandle as err:   # the frontend ended the request while it was on its way here
            self._done(msg.req, ErrorCode.TIMEOUT, f"request was cancelled while queued ({err})")
            return
        if not self._send_host(frames):
            self._done(msg.req, ErrorCode.UNAVAILABLE, f"GPU host {self.endpoint} is not connected; retry")
            return
        self.pending[msg.req] = msg

    def _model_op(self, msg) -> None:   # LoadModel, UnloadModel: the host answers
        pin = msg.pin if isinstance(msg, LoadModel) else 0
        if pin > 0:
            self._pinning[msg.req] = msg.model
        elif pin < 0:   # (no answer)
            release_owned(self._pins, msg.model, msg.req)
        if not self._send_host([pack(msg)]) and pin >= 0:
            self._pinning.pop(msg.req, None)
            self.to_frontend.send(msg.req, pack(LoadDone(req=msg.req, worker=self.index, model=msg.model, ok=False,
                                                code=ErrorCode.UNAVAILABLE,
                                                message=f"GPU host {self.endpoint} is unreachable")))

    def _reset(self, msg: ResetRequests) -> None:
        """The frontend restarted: its predecessor's requests are gone (their answers, when they come, are
        dropped: `pending` no longer has them)."""
        for req in [req for req in self.pending if same_owner_below(req, msg.floor)]:
            del self.pending[req]
        self.outputs.release_below(msg.floor)
        for req in [req for req in self._pinning if same_owner_below(req, msg.floor)]:
            del self._pinning[req]
        # its sessions' pins went with it
        if drop_owned_below(self._pins, msg.floor) and self.state is ProcState.READY:
            self._send_pins()

    def _send_pins(self) -> None:
        """Every pin this edge's sessions hold on the host: the bridge matches them (shm/messages.py Pins)."""
        self._send_host([pack(Pins(models={model: len(reqs) for model, reqs in self._pins.items()}))])

    def _done(self, req: int, code: ErrorCode, message: str) -> None:
        self.to_frontend.send(req, pack(InferDone(req=req, worker=self.index, ok=False, code=code, message=message)))

    def _from_host(self, frames: list) -> None:
        msg = unpack(frames[0].buffer)
        handler = self._host_handlers.get(type(msg))
        if handler is None:
            raise ValueError(f"a {type(msg).__name__} is not a message a GPU host sends")
        handler(msg, frames[1:])

    def _pong(self, msg: Pong) -> None:
        self._last_pong = time.monotonic()
        if msg.epoch != self._epoch:
            if self._epoch and self.state not in (ProcState.UNREACHABLE, ProcState.STOPPED):
                # NOTE: ZeroMQ reconnected to another bridge process before a heartbeat was missed (the old
                # one died and another of the host's bridges, or its restart, took the connection): what was
                # in flight on the old one is lost. Unreachable for a moment, so the frontend answers it
                # `unavailable` now, not at its deadline.
                log.warning("GPU host %s answers from another bridge process: the work in flight on the old "
                            "one is lost", self.endpoint)
                self.state = ProcState.UNREACHABLE
                self.pending.clear()
                self._pinning.clear()
                self._report(self.state)
            self._epoch = msg.epoch
        if msg.draining and not self._host_stopping:
            log.info("GPU host %s is shutting down: it finishes (or answers) what it has, and takes no more",
                     self.endpoint)
        self._host_stopping = msg.draining
        if msg.draining and self.state is ProcState.STOPPED:
            return   # its last heartbeat answers, after its Goodbye
        state = ProcState.READY if msg.workers_ready else ProcState.STARTING
        if state != self.state:
            log.info("GPU host %s is reachable, %d inference worker(s) ready", self.endpoint, msg.workers_ready)
            if self.state is not None or state is not ProcState.READY or self.watcher is not None:
                self._report(state)   # (a DNS slot says which host it now is)
            self.state = state
            if state is ProcState.READY:
                self._send_pins()
        self._sync_models({m for m in msg.loaded if valid_model_id(m)})

    def _to_frontend(self, msg, data: list) -> None:   # LoadDone, StatsReport: as this worker's
        model = self._pinning.pop(msg.req, None) if isinstance(msg, LoadDone) else None
        if model is not None and msg.ok:
            self._pins.setdefault(model, []).append(msg.req)
        self.to_frontend.send(msg.req, pack(msgspec.structs.replace(msg, worker=self.index)))

    def _goodbye(self) -> None:   # after its last replies: the host closes once it has this answer
        self._send_host([pack(Goodbye())])
        self._host_stopping = True
        if self.state is not ProcState.STOPPED:
            self._host_stopped()

    def _sync_models(self, loaded: set[str]) -> None:
        for model, event in [(m, "loaded") for m in loaded - self.loaded] + [(m, "unloaded") for m in self.loaded - loaded]:
            self.to_frontend.broadcast(pack(ModelEvent(worker=self.index, model=model, event=event)))
        self.loaded = loaded

    def _infer_done(self, msg: InferDone, data: list) -> None:
        task = self.pending.pop(msg.req, None)
        if task is None:
            return  # the request ended meanwhile (deadline, host lost)
        if not msg.ok:
            self._done(task.req, msg.code, msg.message)
            return
        shape = (task.batch, *MOUTH_SHAPE)
        elements = int(np.prod(shape))
        size = len(data[0].buffer) if len(data) == 1 else -1
        if size not in (elements, 4 * elements):
            self._done(task.req, ErrorCode.INTERNAL, f"GPU host {self.endpoint} sent {size} bytes of mouths for a "
                       f"batch of {task.batch}; expected uint8 or float32 {list(shape)}")
            return
        mouths = np.frombuffer(data[0].buffer, np.uint8 if size == elements else "<f4")
        try:
            slot = acquire_slot(self.outputs, task.req, task.batch, 5.0, self.tasks, self._from_frontend)
        except RingError as err:
            self._done(task.req, ErrorCode.TIMEOUT, str(err))
            return
        out = self.outputs.writable(slot, 0, "float32", shape)
        if mouths.dtype == np.uint8:
            mouths_from_uint8(mouths.reshape(shape), out)
        else:
            out[...] = mouths.reshape(shape)
        ref = self.outputs.ref(slot, 0, "float32", shape)
        self.to_frontend.send(task.req, pack(InferDone(req=task.req, worker=self.index, ok=True, output=None if task.plan else ref,
                                             queue_ms=msg.queue_ms, inference_ms=msg.inference_ms,
                                             input_ms=msg.input_ms)))
        hand_off(self.to_cpu, task, self.index, ref)


def run_remote_worker_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("gpu", index, run, lambda ctx: RemoteWorker(ctx, config, run, index))
