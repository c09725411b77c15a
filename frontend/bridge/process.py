"""The GPU host's end of the bridge (`--role gpu`): `BridgeServer` takes the frontend's place there.

Edges (gpu_actor/remote.py) connect over CURVE; only the edge keys in `bridge.authorized_keys` get
in. Each RemoteInfer becomes an engine request (frontend/core/, the same engine and `Shell` as the
client frontend's: routing, slots, queues, gathering, deadlines, worker deaths and draining on
SIGTERM are handled once), its
tensors are written into a local worker's input ring, and the mouths go back to the edge. Audio-only
batches travel as audio only: this host builds the visual input from its own copy of the avatar's
assets (docs/security.md says which role needs which files). Composite mouths go back as the uint8
that compositing truncates them to anyway: 4x fewer bytes, same pixels.

An edge is a peer, not a trusted part of this host: every message is validated like a client
request; a malformed one is logged and dropped, one with a request id gets `bad_request`. Deadlines
arrive as a budget and are re-anchored on this host's clock (hosts never share a monotonic clock).

On SIGTERM every request an edge has here gets its result, or `unavailable` (shutting down) at
supervisor.shutdown_timeout_s; heartbeat answers say `draining` meanwhile. Then each edge is sent a
Goodbye after its last replies, and the bridge closes once every edge has answered it (at most
GOODBYE_WAIT_S): an edge never has to take this host's silence for an answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np
import zmq

from config import Config
from config.audio import ENCODER_INPUT_BYTES, WINDOW_ROWS, frame_count
from config.geometry import VISUAL_BYTES, mouths_to_uint8, valid_model_id
from config.keys import make_server, public_keys_in, start_authenticator
from frontend import probes
from frontend.core.request import Inputs, Kind, Request
from frontend.core.scheduler import STATS_TIMEOUT_S, Scheduler, merge_model_stats
from frontend.core.shell import Shell, first_request_id
from frontend.core.slots import RingRoom
from shm.child import CannotServe, bind_endpoint, bind_shared, child_main
from shm.codes import ErrorCode
from shm.endpoints import RunSpec, make_socket, network_socket
from shm.messages import (Goodbye, InferDone, LoadDone, LoadModel, ModelEvent, Pins, Ping, Pong, ProcessEvent,
                          RemoteInfer, StatsQuery, StatsReport, UnloadModel, pack, unpack)
from shm.requests import is_tenant, owner_of
from shm.ring import SlotRing, StaleHandle

log = logging.getLogger(__name__)
FROM_EDGE = (Ping, RemoteInfer, LoadModel, UnloadModel, StatsQuery, Goodbye, Pins)
MAX_PINS = 65536     # pins of one model an edge may ask for (Pins): more sessions than a host holds
# NOTE: below the edge's own wait (the engine's STATS_TIMEOUT_S), so that the edge gets this host's partial answer
STATS_WAIT_S = 0.75 * STATS_TIMEOUT_S
POLL_MS = 500
EDGE_GONE_S = 30.0   # an edge silent this long (it pings every bridge.heartbeat_s) has gone: its pins go
SHUTTING_DOWN = "this GPU host is shutting down; retry on another"
# NOTE: below the 2 s past supervisor.shutdown_timeout_s that the supervisor gives the bridge to exit
GOODBYE_WAIT_S = 1.0
LIVE_EDGE_S = 5.0    # an edge heard from this recently is told goodbye at shutdown


@dataclass
class EdgeCall:
    """An edge's request as the bridge keeps it: the engine's `Request.work` (core.request.Work), which
    answers the edge when the request ends."""

    identity: bytes
    edge_req: int
    message: object                 # the edge's RemoteInfer / LoadModel / UnloadModel / StatsQuery
    bridge: "BridgeServer" = field(repr=False)

    def done(self, r: Request) -> None:
        self.bridge.answer(self, r)

    def failed(self, r: Request, code, message: str) -> None:
        self.bridge.refuse(self, code, message)


@dataclass
class Repin:
    """The work of a pin the bridge makes to match an edge's `Pins`: no edge request waits for it."""

    identity: bytes
    bridge: "BridgeServer" = field(repr=False)

    def done(self, r: Request) -> None:
        self.bridge.repinned(self.identity, r)

    def failed(self, r: Request, code, message: str) -> None:
        self.bridge.repinned(self.identity, r)
        log.warning("could not pin model %s again for an edge's live session: %s", r.model, message)


class BridgeError(ValueError):
    """An edge's message that cannot be served; the message says why."""


class BridgeServer(Shell):
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int = 0):
        """`index`: which of the host's bridge processes (bridge.processes) this one is."""
        self.config, self.device, self.index = config, "bridge", index
        b = config.bridge
        self.edges = network_socket(ctx, zmq.ROUTER, config.limits.max_message_bytes)
        self.auth = None
        if b.secret_key:
            make_server(self.edges, b.secret_key, "bridge.secret_key")
            if not b.authorized_keys:
                raise CannotServe("bridge.authorized_keys: set it to a directory of edge public keys "
                                  "(a GPU host with a secret key accepts only listed edges)")
            self.auth = start_authenticator(ctx, public_keys_in(b.authorized_keys, "bridge.authorized_keys"),
                                            f"bridge {b.bind}")
        # NOTE: several processes: each binds bridge.bind, and the kernel gives each edge's connection to one
        (bind_shared if b.processes > 1 else bind_endpoint)(self.edges, b.bind, "bridge.bind")
        self.pull = make_socket(ctx, zmq.PULL, bind=run.endpoints.frontend[index])
        to_gpu = [make_socket(ctx, zmq.PUSH, connect=a) for a in run.endpoints.gpu]
        inputs = [SlotRing.attach(s) for s in run.inputs_of(index)]
        for ring in inputs:
            ring.become_writer()
        self.outputs = [SlotRing.attach(s) for s in run.output_rings]
        room = RingRoom(inputs, run.output_rings, share=len(run.endpoints.frontend))
        # (edges' live sessions: each pins its model here; while any do, their speech has its reserve)
        engine = Scheduler(list(run.devices), 0, room, config.limits.queue_depth, config.frontend.routing,
                           STATS_WAIT_S, first_id=first_request_id(index),
                           live_sessions=lambda: sum(map(len, self._pins.values())))
        Shell.__init__(self, engine, to_gpu, inputs, config.supervisor.shutdown_timeout_s)
        self._pins: dict[tuple[bytes, str], list[int]] = {}   # (edge, model) -> the workers pinning it for it
        self._repinning: dict[tuple[bytes, str], int] = {}    # (edge, model) -> pins asked for by its Pins, in flight
        self._edges_seen: dict[bytes, float] = {}
        self._next_pin_check = 0.0
        self._goodbye_until: Optional[float] = None
        self._farewells: set[bytes] = set()   # edges told goodbye that have not answered it yet
        # A GPU host has no frontend: its bridge answers the probes (/healthz, /readyz) on metrics.port (bridge
        # process i: metrics.port + i).
        self._stopping = False
        probes.serve(config.metrics.host, config.metrics.port_of(index), self.readiness)

    def readiness(self) -> tuple[str, Optional[str]]:
        return probes.readiness(list(self.engine.workers), [], self.engine.synced(), self.draining or self._stopping)

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.edges.close(linger=1000)   # NOTE: let the last replies of the drain leave (the context ends with linger 0)
        for ring in [*self.input_rings, *self.outputs]:
            ring.close()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.edges, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while True:
            now = time.monotonic()
            if self._stopping and self._stopped(now):
                return
            ends = self._goodbye_until if self._goodbye_until is not None else self.drain_due()
            due = min((d for d in (self.engine.next_deadline(), ends) if d is not None), default=None)
            timeout = POLL_MS if due is None else min(POLL_MS, max(int((due - now) * 1000) + 1, 0))
            events = dict(poller.poll(timeout))
            if events.get(self.edges):
                while self.edges.poll(0):
                    self._from_edge(self.edges.recv_multipart(copy=False))
            if events.get(self.pull):
                while self.pull.poll(0):
                    self._from_worker(unpack(self.pull.recv_multipart(copy=False)[0].buffer))
            now = time.monotonic()
            self.apply(self.engine.tick(now))
            if self._pins and now >= self._next_pin_check:   # once a second, not once per message
                self._next_pin_check = now + 1.0
                self._release_gone_edges(now)

    def _stopped(self, now: float) -> bool:
        """SIGTERM: take nothing new and finish (or answer) what is in flight (core/shell.py), then tell
        each edge goodbye and keep the socket open until it answers (or GOODBYE_WAIT_S): True once the
        bridge may close. NOTE: the replies of the drain are only known to have arrived once the edge
        answers the Goodbye sent after them; a socket closed right after them may lose them, and the
        edge would then see a silent host (`unreachable`) instead of an answer."""
        self.start_draining(now)
        if self._goodbye_until is None:
            if not self.drain_step(now, SHUTTING_DOWN):
                return False
            self._goodbye_until = now + GOODBYE_WAIT_S
            self._farewells = {e for e, seen in self._edges_seen.items() if now - seen < LIVE_EDGE_S}
            for identity in self._farewells:
                self._send(identity, Goodbye())
        return not self._farewells or now >= self._goodbye_until

    # -- edges ----------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg, data=()) -> None:
        self.edges.send_multipart([identity, pack(msg), *data], copy=True)   # the one copy into the socket

    def _from_edge(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            if len(frames) < 2:
                raise BridgeError("no message after the routing id")
            msg = unpack(frames[1].buffer)
            if not isinstance(msg, FROM_EDGE):
                raise BridgeError(f"a {type(msg).__name__} is not a message an edge sends")
        except (BridgeError, msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("dropped a malformed message from an edge: %s", err)
            return
        self._edges_seen[identity] = time.monotonic()
        if isinstance(msg, Ping):
            # NOTE: still the workers' own state while draining: a host that says none is ready has
            # its edges fail the work in flight on it, which draining is there to finish.
            loaded = sorted(set().union(*(w.models for w in self.engine.workers)))
            self._send(identity, Pong(sent=msg.sent, loaded=loaded, workers_ready=sum(w.ready for w in self.engine.workers),
                                      draining=self.draining, epoch=self.first_req))
            return
        if isinstance(msg, Goodbye):   # the edge has every reply of the drain
            self._farewells.discard(identity)
            return
        if isinstance(msg, LoadModel) and msg.pin < 0:   # an edge's session closed (no answer)
            self._unpin(identity, msg.model)
            return
        if isinstance(msg, Pins):
            if not self.draining:
                self._match_pins(identity, msg.models)
            return
        call = EdgeCall(identity, msg.req, msg, self)
        if self.draining:
            self.refuse(call, ErrorCode.UNAVAILABLE, SHUTTING_DOWN)
            return
        try:
            request = self._request(call, msg, frames[2:])
        except BridgeError as err:
            log.warning("refused a request from an edge: %s", err)
            self.refuse(call, ErrorCode.BAD_REQUEST, str(err))
            return
        self.apply(self.engine.submit(request, time.monotonic()))

    def _request(self, call: EdgeCall, msg, data: list) -> Request:
        """Validate an edge's request like a client's; the engine request for it."""
        model = getattr(msg, "model", None)
        if model is not None and not valid_model_id(model):
            raise BridgeError(f"model id {model[:80]!r} is not valid")
        now = time.monotonic()
        deadline = now + self.config.limits.request_timeout_s
        if isinstance(msg, LoadModel):   # pin +1: an edge's live session keeps the model on one worker
            return Request(Kind.LOAD, model, deadline=deadline, work=call, pin=1 if msg.pin > 0 else 0)
        if isinstance(msg, UnloadModel):
            return Request(Kind.UNLOAD, model, deadline=deadline, work=call)
        if isinstance(msg, StatsQuery):
            return Request(Kind.STATS, None, deadline=deadline, work=call)
        lim = self.config.limits
        if msg.batch > lim.max_batch:
            raise BridgeError(f"batch {msg.batch} is more than this host's limits.max_batch ({lim.max_batch})")
        if len(msg.frames) != msg.batch:
            raise BridgeError(f"{len(msg.frames)} frame indices for a batch of {msg.batch}")
        got = [len(f.buffer) for f in data]
        if msg.rows is not None:   # a pcm16 session's encoder inputs [J, 1, 80, 16] and each frame's rows
            inputs = len(data[-1].buffer) // ENCODER_INPUT_BYTES if data else 0
            flat = [r for row in msg.rows for r in row]
            if (len(msg.rows) != msg.batch or any(len(row) != WINDOW_ROWS for row in msg.rows) or not inputs
                    or min(flat) < -1 or max(flat) >= inputs):
                raise BridgeError(f"window rows for {len(msg.rows)} frames do not fit {inputs} encoder inputs")
            want = ([msg.batch * VISUAL_BYTES] if msg.visual else []) + [inputs * ENCODER_INPUT_BYTES]
        elif msg.pcm:
            samples = len(data[-1].buffer) // 2 if data else 0
            if frame_count(samples) != msg.batch or len(data[-1].buffer) % 2:
                raise BridgeError(f"{len(data[-1].buffer) if data else 0} bytes of PCM do not give {msg.batch} frames")
            want = ([msg.batch * VISUAL_BYTES] if msg.visual else []) + [samples * 2]
        else:
            elements = int(np.prod(msg.audio_shape))
            if elements > lim.max_audio_elements:
                raise BridgeError(f"audio window {list(msg.audio_shape)} is more than this host's "
                                  f"limits.max_audio_elements ({lim.max_audio_elements})")
            want = ([msg.batch * VISUAL_BYTES] if msg.visual else []) + [msg.batch * elements * 4]
        if got != want:
            raise BridgeError(f"tensor frames of {got} bytes; expected {want}")
        tensors = [f.bytes for f in data]
        layout = "encoder" if msg.rows is not None else ("pcm" if msg.pcm else "windows")
        # (re-anchored on this host's clock: a live session's due time, the deadline)
        inputs = Inputs(model, msg.version, list(msg.frames), tensors[-1], layout, tuple(msg.audio_shape),
                        tensors[0] if msg.visual else None, rows=msg.rows, utterance=msg.utterance,
                        first_input=msg.first_input, enqueued=now,
                        due=0.0 if msg.due_ms is None else now + msg.due_ms / 1000)
        if msg.budget_ms:
            deadline = now + msg.budget_ms / 1000
        return Request(Kind.INFER, model, msg.batch, deadline=deadline, work=call, inputs=inputs,
                       # a tenant's number as it is (the same from every edge), else the edge's client
                       client=msg.client if is_tenant(msg.client) else (call.identity, owner_of(msg.req), msg.client))

    def refuse(self, call: EdgeCall, code: ErrorCode, message: str) -> None:
        msg = call.message
        if isinstance(msg, RemoteInfer):
            self._send(call.identity, InferDone(req=call.edge_req, worker=0, ok=False, code=code, message=message))
        elif isinstance(msg, (LoadModel, UnloadModel)):
            self._send(call.identity, LoadDone(req=call.edge_req, worker=0, model=msg.model, ok=False, code=code,
                                               message=message))

    # -- local workers --------------------------------------------------------------------------

    def _from_worker(self, msg) -> None:
        if isinstance(msg, ProcessEvent):
            self.apply(self.engine.process_event(msg.role.value, msg.index, msg.state, msg.pid, msg.restarts))
        elif isinstance(msg, ModelEvent):
            self.apply(self.engine.model_event(msg))
        elif isinstance(msg, InferDone):
            self.apply(self.engine.infer_done(msg))
        elif isinstance(msg, (LoadDone, StatsReport)):
            self.apply(self.engine.control_done(msg))

    # -- how an edge's request ends (its EdgeCall calls these) -----------------------------------

    def answer(self, call: EdgeCall, r: Request) -> None:
        if r.kind is Kind.INFER:
            ring = self.outputs[r.worker]
            try:
                mouths = ring.read(r.output)
                data = [mouths_to_uint8(mouths) if call.message.composite else mouths]
                self._send(call.identity, InferDone(req=call.edge_req, worker=0, ok=True,
                                                    queue_ms=r.timing.get("queue_ms", 0.0),
                                                    inference_ms=r.timing.get("inference_ms", 0.0),
                                                    input_ms=r.timing.get("input_ms", 0.0)), data)
            except StaleHandle as err:
                self.refuse(call, ErrorCode.UNAVAILABLE, f"an inference worker restarted while the reply was read ({err})")
        elif r.kind is Kind.STATS:
            answers = r.results
            self._send(call.identity, StatsReport(
                req=call.edge_req, worker=0, device=f"{len(answers)} worker(s): " + ", ".join(a.device for a in answers),
                models=merge_model_stats(answers), loaded=sorted({m for a in answers for m in a.loaded}),
                queue=sum(a.queue for a in answers) + sum(len(w.queue) for w in self.engine.workers),
                architectures={key: arch for a in answers for key, arch in a.architectures.items()},
                steps={k: sum(a.steps.get(k, 0) for a in answers) for k in {k for a in answers for k in a.steps}}))
        else:
            if r.kind is Kind.LOAD and r.pin:
                self.pinned(call.identity, r)
            self._send(call.identity, LoadDone(req=call.edge_req, worker=0, model=r.model, ok=True,
                                               load_ms=max((a.load_ms for a in r.results), default=0.0)))

    # -- live sessions' pins --------------------------------------------------------------------

    def pinned(self, identity: bytes, r: Request) -> None:
        """A load with a pin for an edge's session is done: the worker that holds it is the one to unpin."""
        if r.results:
            self._pins.setdefault((identity, r.model), []).append(r.results[0].worker)

    def repinned(self, identity: bytes, r: Request) -> None:
        """A pin asked for by an edge's Pins ended (pinned, or failed)."""
        key = (identity, r.model)
        self._repinning[key] -= 1
        if not self._repinning[key]:
            del self._repinning[key]
        self.pinned(identity, r)

    def _match_pins(self, identity: bytes, wanted: dict[str, int]) -> None:
        """An edge says every pin its sessions hold here (Pins): pin what is missing, release the rest."""
        bad = [m for m, n in wanted.items() if not valid_model_id(m) or not 0 <= n <= MAX_PINS]
        if bad:
            log.warning("dropped an edge's pins: model %r or its count is not valid", bad[0][:80])
            return
        now = time.monotonic()
        for model in sorted({m for i, m in self._pins if i == identity} | set(wanted)):
            key = (identity, model)
            have = len(self._pins.get(key, ())) + self._repinning.get(key, 0)
            for _ in range(have - wanted.get(model, 0)):
                self._unpin(identity, model)
            for _ in range(wanted.get(model, 0) - have):
                self._repinning[key] = self._repinning.get(key, 0) + 1
                self.apply(self.engine.submit(Request(Kind.LOAD, model, deadline=now + self.config.limits.request_timeout_s,
                                                      work=Repin(identity, self), pin=1), now))

    def _unpin(self, identity: bytes, model: str) -> None:
        workers = self._pins.get((identity, model))
        if workers:
            self.apply(self.engine.unpin(workers.pop(), model))
            if not workers:
                del self._pins[(identity, model)]

    def _release_gone_edges(self, now: float) -> None:
        """Pins of an edge not heard from in EDGE_GONE_S (it pings every bridge.heartbeat_s): its
        sessions are gone with it, so their models may be evicted again."""
        for identity in {i for i, _ in self._pins}:
            if now - self._edges_seen.get(identity, 0.0) > EDGE_GONE_S:
                for key in [k for k in self._pins if k[0] == identity]:
                    while key in self._pins:
                        self._unpin(*key)
                log.info("released the pins of an edge not heard from in %g s", EDGE_GONE_S)


def run_bridge_process(config: Config, run: RunSpec, index: int = 0) -> None:
    child_main("bridge", index, run, lambda ctx: BridgeServer(ctx, config, run, index))
