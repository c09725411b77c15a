"""The remote bridge: inference on GPU hosts, compositing on edge hosts near the users.

Edge side, `RemoteWorker`: one process per GPU host in `bridge.hosts`. To the edge's frontend and
compositors it is an inference worker like any other (same input ring, output ring, messages); it
copies each batch from its input slot into the socket once, and the mouths from the socket into an
output slot once. Heartbeats tell it when a host goes away (its requests then get `unavailable` from
the frontend) and when it is back (used again, no restart of the edge).

GPU side, `BridgeServer` (`--role gpu`): takes the frontend's place on that host. It accepts only the
edge keys it lists (CURVE), writes batches into the local workers' input rings, and sends the mouths
back. Audio-only batches travel as audio only: the GPU host builds the visual input from its own copy
of the avatar's assets (docs/security.md says which role needs which files).

Over the bridge go the same structs as inside a host (shm/messages.py), tensors as raw frames after
them; every socket that faces the network has CURVE and ZMQ_MAXMSGSIZE.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from typing import Optional

import numpy as np
import zmq

from config import Config
from config.geometry import mouths_to_uint8
from gpu_actor.worker import hand_off
from shm.child import child_main
from shm.curve import make_client, make_server, public_keys_in, start_authenticator
from shm.endpoints import RunSpec, make_socket
from shm.messages import (InferDone, InferTask, LoadDone, LoadModel, ModelEvent, Ping, Pong,
                          ProcessEvent, ReleaseTask, ResetRequests, Shutdown, StatsQuery, StatsReport, UnloadModel,
                          decode, encode, merge_model_stats)
from shm.ring import RingError, SlotRing

log = logging.getLogger(__name__)
MOUTH = (3, 320, 320)


def _network_socket(ctx: zmq.Context, kind: int, config: Config) -> zmq.Socket:
    sock = make_socket(ctx, kind, max_message_bytes=config.limits.max_message_bytes)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue work for a host that is not connected
    return sock


# -- edge side --------------------------------------------------------------------------------------

class RemoteWorker:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int):
        self.config, self.index = config, index
        self.device = run.devices[index]
        self.endpoint = self.device.removeprefix("remote:")
        host = next(h for h in config.bridge.hosts if h.endpoint == self.endpoint)
        ep = run.endpoints
        self.tasks = make_socket(ctx, zmq.PULL, bind=ep.gpu[index])
        self.to_frontend = make_socket(ctx, zmq.PUSH, connect=ep.frontend)
        self.to_cpu = [make_socket(ctx, zmq.PUSH, connect=a) for a in ep.cpu]
        self.inputs = SlotRing.attach(run.input_rings[index])
        self.outputs = SlotRing.attach(run.output_rings[index])
        self.outputs.become_writer()
        self.host = _network_socket(ctx, zmq.DEALER, config)
        if config.bridge.client_secret_key:
            make_client(self.host, config.bridge.client_secret_key, host.server_key, "bridge")
        self.host.connect(self.endpoint)
        self.pending: dict[int, InferTask] = {}
        # "ready", "starting" (host answers, none of its workers is ready yet) or "unreachable";
        # None until the first heartbeat is answered or missed (the supervisor has said "ready").
        self.state: Optional[str] = None
        self.loaded: set[str] = set()
        self._last_pong = time.monotonic()
        self._next_ping = 0.0
        self._next_report = 0.0
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.inputs.close()
        self.outputs.close()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.tasks, zmq.POLLIN)
        poller.register(self.host, zmq.POLLIN)
        beat = self.config.bridge.heartbeat_s
        while not self._stopping:
            events = dict(poller.poll(int(beat * 1000 / 2)))
            if events.get(self.host):
                while self.host.poll(0):
                    self._from_host(self.host.recv_multipart(copy=False))
            if events.get(self.tasks):
                while self.tasks.poll(0):
                    self._from_frontend(decode(self.tasks.recv()))
            self._heartbeat()

    def _send_host(self, frames: list) -> bool:
        try:
            self.host.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)  # the one copy into the socket
            return True
        except zmq.Again:
            return False

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_ping:
            self._send_host([encode(Ping(sent=now))])
            self._next_ping = now + self.config.bridge.heartbeat_s
        if self.state != "unreachable" and now - self._last_pong > self.config.bridge.dead_after_s:
            log.warning("GPU host %s does not answer heartbeats", self.endpoint)
            self.state = "unreachable"
            self.pending.clear()  # the frontend answers them all `unavailable`
            self._report(self.state)
        elif self.state in ("unreachable", "starting") and now >= self._next_report:
            # Repeated while not ready, so a restarted frontend learns it too, and so it outlasts the
            # supervisor's own "ready" for this process should that arrive later.
            self._report(self.state)

    def _report(self, state: str) -> None:
        self._next_report = time.monotonic() + 1.0
        self.to_frontend.send(encode(ProcessEvent(role="gpu", index=self.index, pid=os.getpid(), state=state,
                                                  device=self.device)))

    def _from_frontend(self, msg) -> None:
        if isinstance(msg, InferTask):
            not_ready = {"unreachable": "is unreachable", "starting": "has no ready inference worker"}.get(self.state)
            if not_ready:
                self._done(msg.req, "unavailable", f"GPU host {self.endpoint} {not_ready}; retry")
                return
            frames = [encode(msg)]
            if msg.visual is not None:
                frames.append(self.inputs.read(msg.visual))
            frames.append(self.inputs.read(msg.audio))
            if not self._send_host(frames):
                self._done(msg.req, "unavailable", f"GPU host {self.endpoint} is not connected; retry")
                return
            self.pending[msg.req] = msg
        elif isinstance(msg, ReleaseTask):
            self.outputs.release_request(msg.req)
        elif isinstance(msg, StatsQuery):
            self._send_host([encode(msg)])  # the host answers for all its workers at once
        elif isinstance(msg, (LoadModel, UnloadModel)):
            if not self._send_host([encode(msg)]):
                self.to_frontend.send(encode(LoadDone(req=msg.req, worker=self.index, model=msg.model, ok=False, code="unavailable",
                                                      message=f"GPU host {self.endpoint} is unreachable")))
        elif isinstance(msg, ResetRequests):
            self.pending.clear()
            self.outputs.become_writer()
        elif isinstance(msg, Shutdown):
            self._stopping = True

    def _done(self, req: int, code: str, message: str) -> None:
        self.to_frontend.send(encode(InferDone(req=req, worker=self.index, ok=False, code=code, message=message)))

    def _from_host(self, frames: list) -> None:
        msg = decode(frames[0].buffer)
        if isinstance(msg, Pong):
            self._last_pong = time.monotonic()
            state = "ready" if msg.workers_ready else "starting"
            if state != self.state:
                log.info("GPU host %s is reachable, %d inference worker(s) ready", self.endpoint, msg.workers_ready)
                if self.state is not None or state != "ready":
                    self._report(state)
                self.state = state
            self._sync_models(set(msg.loaded))
        elif isinstance(msg, InferDone):
            self._infer_done(msg, frames[1:])
        elif isinstance(msg, (LoadDone, StatsReport)):
            self.to_frontend.send(encode(msg.__class__(**{**_fields(msg), "worker": self.index})))

    def _sync_models(self, loaded: set[str]) -> None:
        for model, event in [(m, "loaded") for m in loaded - self.loaded] + [(m, "unloaded") for m in self.loaded - loaded]:
            self.to_frontend.send(encode(ModelEvent(worker=self.index, model=model, event=event)))
        self.loaded = loaded

    def _infer_done(self, msg: InferDone, data: list) -> None:
        task = self.pending.pop(msg.req, None)
        if task is None:
            return  # the request ended meanwhile (deadline, host lost)
        if not msg.ok:
            self._done(task.req, msg.code, msg.message)
            return
        shape = (task.batch, *MOUTH)
        mouths = np.frombuffer(data[0].buffer, np.uint8 if len(data[0].buffer) == int(np.prod(shape)) else "<f4")
        try:
            slot = self.outputs.acquire(task.req, timeout_s=5.0, wait=self._wait_for_release)
        except RingError as err:
            self._done(task.req, "timeout", str(err))
            return
        out = self.outputs.writable(slot, 0, "float32", shape)
        if mouths.dtype == np.uint8:
            from_uint8(mouths.reshape(shape), out)
        else:
            out[...] = mouths.reshape(shape)
        ref = self.outputs.ref(slot, 0, "float32", shape)
        self.to_frontend.send(encode(InferDone(req=task.req, worker=self.index, ok=True, output=None if task.plan else ref,
                                               queue_ms=msg.queue_ms, inference_ms=msg.inference_ms,
                                               input_ms=msg.input_ms)))
        hand_off(self.to_cpu, task, self.index, ref)

    def _wait_for_release(self, remaining_s: float) -> None:
        if self.tasks.poll(int(remaining_s * 1000) + 1):
            self._from_frontend(decode(self.tasks.recv()))


def from_uint8(mouths_u8: np.ndarray, out: np.ndarray) -> None:
    """float32 values whose floor(255 * P) is exactly the given uint8: (u + 0.5) / 255."""
    np.add(mouths_u8, np.float32(0.5), out=out, dtype=np.float32)
    np.divide(out, np.float32(255), out=out)


def _fields(msg) -> dict:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}


# -- GPU side ---------------------------------------------------------------------------------------

class BridgeServer:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec):
        self.config, self.device = config, "bridge"
        b = config.bridge
        self.edges = _network_socket(ctx, zmq.ROUTER, config)
        self.auth = None
        if b.secret_key:
            make_server(self.edges, b.secret_key, "bridge.secret_key")
            if not b.authorized_keys:
                raise ValueError("bridge.authorized_keys: set it to a directory of edge public keys "
                                 "(a GPU host with a secret key accepts only listed edges)")
            self.auth = start_authenticator(ctx, public_keys_in(b.authorized_keys, "bridge.authorized_keys"),
                                            f"bridge {b.bind}")
        self.edges.bind(b.bind)
        self.pull = make_socket(ctx, zmq.PULL, bind=run.endpoints.frontend)
        self.workers = [make_socket(ctx, zmq.PUSH, connect=a) for a in run.endpoints.gpu]
        self.inputs = [SlotRing.attach(s) for s in run.input_rings]
        for ring in self.inputs:
            ring.become_writer()
        self.outputs = [SlotRing.attach(s) for s in run.output_rings]
        self.ready = [False] * len(self.workers)
        self.models: list[set[str]] = [set() for _ in self.workers]
        self.queues: list[deque] = [deque() for _ in self.workers]
        self.pending: dict[int, tuple] = {}   # local req -> (edge identity, edge req, worker, op)
        # Ops for every worker (stats, unload): local req -> (edge identity, edge query, workers left, answers)
        self.gathering: dict[int, tuple] = {}
        self._ids = itertools.count(1)
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        for ring in self.inputs + self.outputs:
            ring.close()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.edges, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll(500))
            if events.get(self.edges):
                while self.edges.poll(0):
                    self._from_edge(self.edges.recv_multipart(copy=False))
            if events.get(self.pull):
                while self.pull.poll(0):
                    self._from_worker(decode(self.pull.recv_multipart(copy=False)[0].buffer))

    def _reply(self, identity, msg, data=()) -> None:
        self.edges.send_multipart([identity, encode(msg), *data], copy=True)

    def _pick(self, model: str) -> Optional[int]:
        ready = [i for i, r in enumerate(self.ready) if r]
        if not ready:
            return None
        warm = [i for i in ready if model in self.models[i]] or ready
        return min(warm, key=lambda i: len(self.queues[i]) + self.inputs[i].slots_in_use())

    def _from_edge(self, frames: list) -> None:
        identity, msg, data = frames[0], decode(frames[1].buffer), frames[2:]
        if isinstance(msg, Ping):
            loaded = sorted(set().union(*self.models)) if self.models else []
            self._reply(identity, Pong(sent=msg.sent, loaded=loaded, workers_ready=sum(self.ready)))
            return
        if isinstance(msg, StatsQuery):
            self._gather(identity, msg, {i for i, r in enumerate(self.ready) if r})
            return
        if isinstance(msg, UnloadModel):
            self._gather(identity, msg, {i for i, r in enumerate(self.ready) if r})
            return
        worker = self._pick(getattr(msg, "model", ""))
        if worker is None:
            if isinstance(msg, InferTask):
                self._reply(identity, InferDone(req=msg.req, worker=0, ok=False, code="unavailable",
                                                message="no inference worker is ready on the GPU host"))
            return
        local = next(self._ids)
        self.pending[local] = (identity, msg.req, worker, msg)
        if isinstance(msg, InferTask):
            if len(self.queues[worker]) >= self.config.limits.queue_depth:
                del self.pending[local]
                self._reply(identity, InferDone(req=msg.req, worker=0, ok=False, code="overloaded",
                                                message="the GPU host's queue is full (limits.queue_depth); retry"))
                return
            self.queues[worker].append((local, msg, [bytes(f.buffer) for f in data]))
            self._pump(worker)
        else:
            self.workers[worker].send(encode(msg.__class__(**{**_fields(msg), "req": local})))

    def _gather(self, identity, msg, targets: set[int]) -> None:
        """Send an op to several local workers; the edge gets one answer for the whole host."""
        local = next(self._ids)
        self.gathering[local] = (identity, msg, targets, [])
        for i in targets:
            self.workers[i].send(encode(msg.__class__(**{**_fields(msg), "req": local})))
        self._gathered(local)

    def _gathered(self, local: int) -> None:
        identity, msg, waiting, answers = self.gathering[local]
        if waiting:
            return
        del self.gathering[local]
        if isinstance(msg, StatsQuery):
            self._reply(identity, StatsReport(
                req=msg.req, worker=0, device=f"{len(answers)} worker(s): " + ", ".join(r.device for r in answers),
                models=merge_model_stats(answers), loaded=sorted({m for r in answers for m in r.loaded}),
                queue=sum(r.queue for r in answers) + sum(len(q) for q in self.queues)))
            return
        failed = next((a for a in answers if not a.ok), None)
        self._reply(identity, LoadDone(req=msg.req, worker=0, model=msg.model, ok=failed is None,
                                       code=failed.code if failed else "", message=failed.message if failed else ""))

    def _pump(self, worker: int) -> None:
        ring = self.inputs[worker]
        while self.queues[worker]:
            local, task, data = self.queues[worker][0]
            slot = ring.try_acquire(local)
            if slot is None:
                return
            self.queues[worker].popleft()
            offset, visual = 0, None
            if task.visual is not None:
                shape = tuple(task.visual.shape)
                ring.writable(slot, 0, "float32", shape)[...] = np.frombuffer(data[0], "<f4").reshape(shape)
                visual = ring.ref(slot, 0, "float32", shape)
                offset = (len(data[0]) + 63) // 64 * 64
            a_shape = tuple(task.audio.shape)
            ring.writable(slot, offset, "float32", a_shape)[...] = np.frombuffer(data[-1], "<f4").reshape(a_shape)
            audio = ring.ref(slot, offset, "float32", a_shape)
            self.workers[worker].send(encode(InferTask(
                req=local, model=task.model, batch=task.batch, audio=audio, visual=visual, frames=task.frames,
                plan=[], deadline=task.deadline, enqueued=time.monotonic(), version=task.version)))

    def _from_worker(self, msg) -> None:
        if isinstance(msg, ProcessEvent):
            self._process_event(msg)
            return
        if isinstance(msg, ModelEvent):
            (self.models[msg.worker].add if msg.event == "loaded" else self.models[msg.worker].discard)(msg.model)
            return
        if isinstance(msg, (StatsReport, LoadDone)) and msg.req in self.gathering:
            self.gathering[msg.req][2].discard(msg.worker)
            self.gathering[msg.req][3].append(msg)
            self._gathered(msg.req)
            return
        entry = self.pending.pop(msg.req, None)
        if entry is None:
            if isinstance(msg, InferDone):
                self.workers[msg.worker].send(encode(ReleaseTask(req=msg.req)))
            return
        identity, edge_req, worker, _ = entry
        if isinstance(msg, InferDone):
            self.inputs[worker].release_request(msg.req)
            data = []
            if msg.ok:
                mouths = self.outputs[worker].read(msg.output)
                # Composite mouths go back as the uint8 the compositor truncates them to anyway: 4x fewer
                # bytes, same pixels. `infer` gets the float32 output itself.
                data = [mouths_to_uint8(mouths) if entry[3].plan else mouths]  # copied once into the socket below
            self._reply(identity, InferDone(**{**_fields(msg), "req": edge_req, "output": None}), data)
            self.workers[worker].send(encode(ReleaseTask(req=msg.req)))
            self._pump(worker)
        elif isinstance(msg, LoadDone):
            self._reply(identity, msg.__class__(**{**_fields(msg), "req": edge_req}))

    def _process_event(self, msg: ProcessEvent) -> None:
        if msg.role != "gpu":
            return
        was = self.ready[msg.index]
        self.ready[msg.index] = msg.state == "ready"
        if was and msg.state != "ready":
            self.models[msg.index].clear()
            self.inputs[msg.index].become_writer()
            for local, (identity, edge_req, worker, task) in list(self.pending.items()):
                if worker == msg.index:
                    del self.pending[local]
                    if isinstance(task, InferTask):
                        self._reply(identity, InferDone(req=edge_req, worker=0, ok=False, code="unavailable",
                                                        message="an inference worker on the GPU host died; retry"))
            self.queues[msg.index].clear()
            for local in list(self.gathering):  # a dead worker is not waited for
                self.gathering[local][2].discard(msg.index)
                self._gathered(local)
        elif msg.state == "ready":
            self._pump(msg.index)


def run_remote_worker_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("gpu", index, run, lambda ctx: RemoteWorker(ctx, config, run, index))


def run_bridge_process(config: Config, run: RunSpec, index: int = 0) -> None:
    child_main("bridge", index, run, lambda ctx: BridgeServer(ctx, config, run))
