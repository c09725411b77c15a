"""The client-facing frontend process: asyncio (uvloop) + ZeroMQ ROUTER, speaking docs/protocol.md.

A `Shell` over the request engine (frontend/core/), by concern: this module holds the process's
sockets and loops (client readers, connection monitors, the workers' and compositors' messages, the
viewer's start) and hosts live sessions (frontend/live/) through the small `Host` interface they are
handed; client requests come in through server/intake.py, replies leave through server/replies.py,
and each request ends through the work it carries (`Request.work`: a client's `Call`, server/calls.py,
or one of live/'s), which core/shell.py calls.

A client whose connection closes leaves nothing behind: a monitor on each ROUTER reports the
connection's file descriptor, which libzmq also stamps on every frame it received (ZMQ_SRCFD), so the
requests that came over it end at once (queued ones never reach a worker), with no reply to send.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from config import Config, resolve_path
from config.keys import load_public, make_server, start_authenticator
from frontend import probes
from frontend.core.alarm import Alarm
from frontend.core.backlog import Backlogs
from frontend.core.request import Kind, Request
from frontend.core.scheduler import Render, Scheduler
from frontend.core.shell import Shell, first_request_id
from frontend.core.slots import RingRoom
from frontend.live.capacity import ProcessCpu
from frontend.live.service import Live
from frontend.metrics import Metrics
from frontend.server.calls import ReplyTo, Tenant
from frontend.server.catalog import Catalog
from frontend.server.intake import Intake
from frontend.server.replies import Replies
from shm.board import PID, Board
from shm.child import bind_endpoint, bind_shared, child_main, listen_tcp
from shm.codes import ErrorCode, ProcState
from shm.endpoints import RunSpec, make_socket
from shm.messages import (CloseEncoder, CompositeDone, InferDone, LoadDone, ModelEvent, ProcessEvent, StatsReport,
                          StepDone, pack, unpack)
from shm.ring import SlotRing

log = logging.getLogger(__name__)
STATE_SYNC_TIMEOUT_S = 5.0
GAUGES_S = 1.0   # how often the depth gauges (queues, slots, backlogs, H.264 placement) are set
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)   # ints: no enum lookups per message


class Frontend(Shell):
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int = 0):
        """`index`: which of the host's client-facing processes (frontend.processes) this one is."""
        self.config, self.run_spec, self.index = config, run, index
        shared = config.frontend.processes > 1
        self.device = "cpu"
        self.ctx = ctx
        self.catalog = Catalog(config)
        self.metrics = Metrics()
        self.store_lookups: dict[str, dict[str, int]] = {}   # model -> {"hits", "misses"}
        self._stopping = False
        lim = config.limits
        self.auth = None
        self.tenants = self._tenants(ctx)
        self.clients = []
        self._readable: dict = {}   # client ROUTER -> its Reader
        for endpoint in config.frontend.bind:
            network = not endpoint.startswith(("ipc://", "inproc://"))
            # NOTE: plain (not asyncio) sockets: replies and frames leave with one non-blocking send each,
            # no future per message; the readers wait on the socket's fd (_read_clients).
            sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=lim.max_message_bytes if network else None)
            if config.frontend.curve is not None:
                make_server(sock, resolve_path(config, config.frontend.curve.secret_key),
                            "frontend.curve.secret_key")
            # NOTE: several processes: each binds every endpoint, and the kernel spreads connections
            (bind_shared if shared else bind_endpoint)(sock, endpoint, "frontend.bind")
            self.clients.append(sock)
        # One monitor per ROUTER, read without blocking (see _connections_closed).
        self.monitors = []
        for i, sock in enumerate(self.clients):
            address = f"inproc://frontend-monitor-{i}"
            sock.monitor(address, zmq.EVENT_DISCONNECTED)
            monitor = ctx.socket(zmq.PAIR)
            monitor.connect(address)
            self.monitors.append(monitor)
        self.pull = make_socket(self.ctx, zmq.PULL, bind=run.endpoints.frontend[index])
        inputs = [SlotRing.attach(spec) for spec in run.inputs_of(index)]
        for ring in inputs:
            ring.become_writer()   # this process is the one writer of its input rings
        to_gpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in run.endpoints.gpu]
        # (a worker's output ring is shared by every client-facing process: each holds its share in flight)
        room = RingRoom(inputs, run.output_rings, share=len(run.endpoints.frontend))
        engine = Scheduler(list(run.devices), len(run.endpoints.cpu), room, lim.queue_depth, config.frontend.routing,
                           first_id=first_request_id(index), live_sessions=lambda: len(self.live.table))
        Shell.__init__(self, engine, to_gpu, inputs, config.supervisor.shutdown_timeout_s)
        self.outputs = [SlotRing.attach(s) for s in run.output_rings]   # read for `infer` replies
        self.images = [SlotRing.attach(s, populate=False) for s in run.image_rings]   # raw frames
        self.to_cpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in run.endpoints.cpu]
        self.backlogs = Backlogs(lim.max_client_backlog_bytes, lim.max_backlog_bytes)
        self.replies = Replies(self.backlogs, self.metrics, self.to_cpu, self._readable)
        # The WebRTC viewer: its port bound here, so that a taken port ends the start; its stack (aiohttp,
        # aiortc: ~0.4 s of imports) loaded and served after READY (_main). Live sessions get it there.
        self.viewer = None
        self.viewer_sockets = (listen_tcp(config.viewer.host, config.viewer.port + index, "viewer.port",
                                          "(0: no viewer; process i of frontend.processes listens on viewer.port + i)")
                               if config.viewer.port else [])
        # session_open is refused `busy` past what this host's cores hold (live/capacity.py): by the CPU
        # time of the server's processes here, this one, the host's other client-facing processes (their
        # pids on the board) and those the supervisor reports (_process_event), and by the sessions of
        # every client-facing process (the board: shm/board.py)
        self.board = Board.attach(run.board, index, len(run.endpoints.frontend)) if run.board else None
        if self.board is not None:
            self.board.set(PID, os.getpid())
        self.cpu = ProcessCpu()
        self.cpu.track(self._frontend_name(index), os.getpid())
        self.live = Live(self, config, self.metrics, cpu=self._cpu_seconds, board=self.board)
        self.intake = Intake(self, self.live, self.tenants)
        self.deadlines = Alarm(self._on_deadline)
        # The workers' and compositors' messages, by type (anything else is ignored)
        self._handlers = {InferDone: self._infer_done, CompositeDone: self._composite_done,
                          LoadDone: self._control_done, StatsReport: self._control_done,
                          ModelEvent: self._model_event, ProcessEvent: self._process_event, StepDone: self._step_done}
        # (process i of frontend.processes: metrics.port + i)
        self.metrics.serve(config.metrics.host, config.metrics.port_of(index), self.readiness)

    def _frontend_name(self, index: int) -> str:
        """Client-facing process `index`'s name in admission's CPU counts (and its messages)."""
        return f"frontend{index}" if self.config.frontend.processes > 1 else "frontend"

    def _cpu_seconds(self) -> dict[str, float]:
        """The CPU seconds of the server's processes on this host (admission's, live/capacity.py)."""
        if self.board is not None:
            for row, pid in self.board.pids().items():
                self.cpu.follow(self._frontend_name(row), pid)
        return self.cpu.read()

    def readiness(self) -> tuple[str, Optional[str]]:
        """/readyz (frontend/probes.readiness). On an edge, one GPU host that is ready is enough.
        NOTE: called from the probes' thread; it only reads."""
        return probes.readiness(list(self.engine.workers), list(self.engine.compositors), self.engine.synced(),
                                self.draining or self._stopping)

    def _tenants(self, ctx: zmq.Context) -> Optional[dict[str, Tenant]]:
        """frontend.curve: client key (z85) -> its tenant; None when clients need no key."""
        curve = self.config.frontend.curve
        if curve is None:
            return None
        tenants: dict[str, Tenant] = {}
        for name, t in curve.tenants.items():
            models = None if "*" in t.models else frozenset(t.models)
            for key_file in t.keys:
                key = load_public(resolve_path(self.config, key_file), f"frontend.curve.tenants.{name}.keys")
                tenants[key.decode()] = Tenant(name, models)
        self.auth = start_authenticator(ctx, [k.encode() for k in tenants], "frontend")
        return tenants

    # -- life ---------------------------------------------------------------------------------

    def run(self) -> None:
        import uvloop
        uvloop.run(self._main())

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.replies.flush()   # what the last pass of the loop admitted
        self.catalog.close()
        for ring in self.images:
            ring.close()
        if self.auth is not None:
            self.auth.stop()
        # NOTE: close each socket here (linger 0 for internal ones), so that the context's term() cannot
        # block on one.
        for sock, monitor in zip(self.clients, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=1000)  # let the last replies leave
        for sock in [self.pull, *self.to_gpu, *self.to_cpu]:
            sock.close(linger=0)
        for ring in [*self.input_rings, *self.outputs]:
            ring.close()
        if self.board is not None:
            self.board.close()

    async def _main(self) -> None:
        internal = Reader(self.pull.FD, lambda: _take(self.pull, self._internal))   # from workers, compositors
        viewer = self.intake.viewer_task = asyncio.create_task(self._start_viewer()) if self.viewer_sockets else None
        self.catalog.warm(await self.catalog.ids())   # in the background: `models` is fast from the start
        # NOTE: serve clients only once the supervisor has told us every worker's state (it does right
        # after our READY); else a restarted frontend would answer `unavailable` for a moment.
        deadline = time.monotonic() + STATE_SYNC_TIMEOUT_S
        while not self.engine.synced() and time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.01)
        readers = [self._read_clients(i, s) for i, s in enumerate(self.clients)]
        readers += [self._watch_connections(i, m) for i, m in enumerate(self.monitors)]
        gauges_at = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(0.1)  # the SIGTERM flag; every real wait is a socket read
            if time.monotonic() >= gauges_at:   # the queue gauges, as of this second
                self._gauges()
                gauges_at = time.monotonic() + GAUGES_S
        # Stop accepting, then let in-flight requests finish up to the shutdown deadline.
        for reader in readers:
            reader.close()
        self.start_draining(time.monotonic())
        while not self.drain_step(time.monotonic()):
            await asyncio.sleep(0.05)
        if viewer is not None:
            viewer.cancel()
        if self.viewer is not None:
            await self.viewer.stop()
        internal.close()

    async def _start_viewer(self) -> None:
        """The WebRTC viewer on the port bound at start: its stack (aiohttp, aiortc: ~0.4 s of imports)
        is loaded in a thread while clients are already served; a webrtc session_open meanwhile waits
        for it (server/intake.py)."""
        def load():
            from frontend.live.viewer import Viewer   # NOTE: aiortc is imported only where a viewer runs
            return Viewer
        viewer = (await asyncio.to_thread(load))(self.config.viewer)
        await viewer.start(self.viewer_sockets)
        self.viewer = viewer
        self.live.attach_viewer(viewer)

    def _read_clients(self, index: int, sock) -> "Reader":
        reader = Reader(sock.FD, lambda: _take(sock, lambda frames: self._request(index, sock, frames)))
        self._readable[sock] = reader
        return reader

    def _request(self, index: int, sock, frames: list) -> None:
        # NOTE: libzmq queues a connection's DISCONNECTED event before it closes the fd, and so
        # before another connection can be accepted on the same number: taking the events first
        # means a reused fd is never mistaken for the closed connection.
        self._connections_closed(index)
        try:
            self.intake.request(index, sock, frames)
        except Exception:  # a bug must not kill the reader
            log.exception("request handling failed")

    def _watch_connections(self, index: int, monitor: zmq.Socket) -> "Reader":
        def take() -> bool:
            self._connections_closed(index)
            return True   # (every event waiting is taken)
        return Reader(monitor.FD, take)

    def _connections_closed(self, index: int) -> None:
        """End the requests of every connection of ROUTER `index` that has closed."""
        monitor = self.monitors[index]
        while monitor.getsockopt(_EVENTS) & _POLLIN:   # (asked before each client message: no exception when none)
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            self.backlogs.closed((index, event["value"]))
            self.live.client_gone((index, event["value"]))
            actions = self.engine.client_gone((index, event["value"]))
            if actions:
                log.info("a client disconnected with request(s) open: ended them")
            self.apply(actions)

    def _internal(self, frames: list) -> None:
        try:
            msg = unpack(frames[0].buffer)
            handle = self._handlers.get(type(msg))
            if handle is not None:
                handle(msg, frames[1:])
        except Exception:
            log.exception("internal message handling failed")

    # -- the engine's actions (the rest: core/shell.py) ------------------------------------------

    def applied(self) -> None:
        self.deadlines.arm(self.engine.next_deadline())

    # -- what live sessions (frontend/live/host.py) and calls (server/calls.py) ask of their host ----

    def submit(self, request: Request, now: Optional[float] = None) -> None:
        self.apply(self.engine.submit(request, time.monotonic() if now is None else now))

    def unpin(self, worker: int, model: str) -> None:
        self.apply(self.engine.unpin(worker, model))

    def compositors(self) -> list:
        return self.engine.compositors

    def close_encoder(self, compositor: int, session: str) -> None:
        self.to_cpu[compositor].send(pack(CloseEncoder(session=session)))

    def send(self, reply_to: ReplyTo, header: bytes, data: list = (), req: int = 0, image_slots=(),
             also: Optional[list] = None) -> bool:
        return self.replies.send(reply_to, header, data, req, image_slots, also)

    def error(self, reply_to: ReplyTo, request_id, code: ErrorCode, message: str,
              retry_after_s: Optional[float] = None) -> None:
        self.replies.error(reply_to, request_id, code, message, retry_after_s)

    def free_images(self, req: int, compositors) -> None:
        self.replies.free_images(req, compositors)

    def render(self, action: Render) -> None:
        r = action.request
        self.to_cpu[action.compositor].send(pack(r.work.message(r)))

    def _on_deadline(self) -> None:
        self.apply(self.engine.tick(time.monotonic()))

    # -- the workers' and compositors' messages (by type) ------------------------------------------

    def _infer_done(self, msg: InferDone, data: list) -> None:
        self._answered(msg.req, "infer")
        metrics = self.metrics
        metrics.of(metrics.latency, "queue").observe(msg.queue_ms)
        if msg.ok:
            metrics.of(metrics.latency, "inference").observe(msg.inference_ms)
        self.apply(self.engine.infer_done(msg))

    def _composite_done(self, msg: CompositeDone, data: list) -> None:
        self._answered(msg.req, "composite")
        self.apply(self.engine.composite_done(msg, self._composited(msg, data)))

    def _answered(self, req: int, what: str) -> None:
        """When an answer arrived: a live speech frame's stages (live/speech.speech_stages)."""
        r = self.engine.table.get(req)
        if r is not None:
            r.answered[what] = time.monotonic()

    def _control_done(self, msg, data: list) -> None:
        self.apply(self.engine.control_done(msg))

    def _step_done(self, msg: StepDone, data: list) -> None:
        worker, m = str(msg.worker), self.metrics
        m.of(m.device_steps, worker, msg.kind).inc()
        frames = m.of(m.device_call_frames, worker)
        for size, held in msg.calls:
            frames.observe(held)
        m.of(m.device_call_rows, worker, "frame").inc(sum(held for _, held in msg.calls))
        m.of(m.device_call_rows, worker, "padding").inc(sum(size - held for size, held in msg.calls))
        m.of(m.device_busy_s, worker).inc(msg.seconds)

    def _model_event(self, msg: ModelEvent, data: list) -> None:
        self.metrics.model_events.labels(msg.event.value).inc()
        if msg.load_ms:
            self.metrics.load_ms.observe(msg.load_ms)
        if msg.frames_per_s:
            self.live.device_capacity(msg.worker, msg.frames_per_s)
            self.metrics.of(self.metrics.device_frames_per_s, str(msg.worker)).set(msg.frames_per_s)
        self.apply(self.engine.model_event(msg))
        self._gauges()

    def _composited(self, msg: CompositeDone, data: list) -> list:
        """The chunk's frames: encoded images as sent, or raw frames as views into the image ring."""
        if msg.ok:
            r = self.engine.table.get(msg.req)
            model = r.model if r is not None and r.kind is not Kind.RENDER else None
            if model is not None:
                metrics = self.metrics
                metrics.of(metrics.latency, "composite").observe(msg.composite_ms)
                metrics.of(metrics.store, model, "hit").inc(msg.hits)
                metrics.of(metrics.store, model, "miss").inc(msg.misses)
                lookups = self.store_lookups.setdefault(model, {"hits": 0, "misses": 0})
                lookups["hits"] += msg.hits
                lookups["misses"] += msg.misses
        if msg.images is None or not 0 <= msg.compositor < len(self.images):
            return list(data)
        frames = self.images[msg.compositor].read(msg.images)
        return [frames[i] for i in range(len(frames))]

    def _process_event(self, msg: ProcessEvent, data: list) -> None:
        self.cpu.track(f"{msg.role.value}{msg.index}", msg.pid if msg.state is ProcState.READY else None)
        procs = self.engine.workers if msg.role == "gpu" else self.engine.compositors
        if 0 <= msg.index < len(procs) and msg.restarts > procs[msg.index].restarts:
            self.metrics.restarts.labels(msg.role.value).inc(msg.restarts - procs[msg.index].restarts)
        if msg.role == "gpu" and msg.device and 0 <= msg.index < len(procs) \
                and not procs[msg.index].device.startswith(msg.device + "="):
            procs[msg.index].device = msg.device   # a GPU host slot found by DNS says which host it is now
        self.apply(self.engine.process_event(msg.role.value, msg.index, msg.state, msg.pid, msg.restarts))
        self._gauges()

    def _gauges(self) -> None:
        """The depth gauges: set every GAUGES_S and on process and model events, on the loop (what
        they read is the loop's own state, not safe to read from the metrics thread)."""
        self.metrics.backlog_bytes.set(self.backlogs.total())
        for w in self.engine.workers:
            label = str(w.index)
            self.metrics.queue_depth.labels(label).set(len(w.active))
            self.metrics.slots_in_use.labels(label).set(self.input_rings[w.index].slots_in_use())
            self.metrics.models_loaded.labels(label).set(len(w.models))
        for i, c in enumerate(self.engine.compositors):
            self.metrics.compositor_depth.labels(str(i)).set(len(c.active))
        for i, n in enumerate(self.live.h264.placed()):
            self.metrics.h264_sessions.labels(str(i)).set(n)


class Reader:
    """Calls `take` (handle what waits on a ZeroMQ socket, without blocking; False when it stopped at its
    limit with more waiting) now and at each wake-up of the socket's fd, straight from the event loop's
    callback (no task to switch to per wake-up). The fd is edge-triggered: each wake-up is drained
    whole, a burst in turns with the rest of the loop."""

    def __init__(self, fd: int, take: Callable[[], bool]):
        self._loop = asyncio.get_running_loop()
        self._fd, self._take = fd, take
        self._turn: Optional[asyncio.Handle] = None   # a burst's next turn, queued behind the rest of the loop
        self._closed = False
        self._loop.add_reader(fd, self.wake)
        self.wake()   # what came before the fd was watched

    def wake(self) -> None:
        """Take what waits (also called after sends, which may have taken the fd's edge); nothing once
        closed (a draining server reads no more requests)."""
        if self._turn is None and not self._closed and not self._take():
            self._turn = self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn = None
        self.wake()

    def close(self) -> None:
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None


def _take(sock: zmq.Socket, handle: Callable[[list], None], most: int = 256) -> bool:
    """Handle the messages waiting on `sock`; False if `most` were taken and more may wait."""
    # NOTE: asking EVENTS costs a third of the zmq.Again a receive raises when none waits (each wake-up's last).
    # A message's parts are taken by each received frame's `more`, not by recv_multipart's RCVMORE
    # socket option per part (a Python-level option lookup each).
    for _ in range(most):
        if not sock.getsockopt(_EVENTS) & _POLLIN:
            return True
        frame = sock.recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame)
        handle(frames)
    return False


def run_frontend_process(config: Config, run: RunSpec, index: int = 0) -> None:
    child_main("frontend", index, run, lambda ctx: Frontend(ctx, config, run, index))

