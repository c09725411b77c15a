"""The client-facing frontend process: asyncio (uvloop) + ZeroMQ ROUTER, speaking docs/protocol.md.

A `Shell` over the request engine (frontend/core/): it validates what clients send, reads model specs
from the catalog off the event loop, turns messages into engine events and carries out the engine's
actions (core/shell.py carries out those that touch the workers; each request ends through the work it
carries, `Request.work`: a client's `Call`, server/calls.py, or one of live/'s). It hosts live
sessions (frontend/live/) through the small `Host` interface they are handed.

A client whose connection closes leaves nothing behind: a monitor on each ROUTER reports the
connection's file descriptor, which libzmq also stamps on every frame it received (ZMQ_SRCFD), so the
requests that came over it end at once (queued ones never reach a worker), with no reply to send.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from config import Config, resolve_path
from config.assets import frame_index
from config.keys import load_public, make_server, start_authenticator
from frontend import probes
from lipsync_client import protocol as P
from frontend.core.alarm import Alarm
from frontend.core.backlog import Backlogs
from frontend.core.request import Inputs, Kind, Request, RequestError
from frontend.core.scheduler import Render, Scheduler
from frontend.core.shell import Shell
from frontend.live.service import Live
from frontend.metrics import Metrics
from frontend.server import control
from frontend.server.calls import Call, ReplyTo, Tenant
from frontend.server.catalog import Catalog, ModelSpec
from frontend.server.validate import check_message, check_pcm, check_request, check_tensors, parse_header
from shm.child import bind_endpoint, child_main, listen_tcp
from shm.codes import ErrorCode
from shm.endpoints import RunSpec, make_socket
from shm.messages import (CloseEncoder, CompositeDone, InferDone, LoadDone, ModelEvent, ProcessEvent, ReleaseImages,
                          StatsReport, decode, encode)
from shm.ring import SlotRing

log = logging.getLogger(__name__)
STATE_SYNC_TIMEOUT_S = 5.0
VIEWER_START_TIMEOUT_S = 30.0   # a webrtc session_open waits this long at most for the viewer to start
TRACKER_POLL_S = 0.002
SENT = type("Sent", (), {"done": True})()   # the tracker of a message that has left (copied) or failed
ZERO_COPY_BYTES = 64 * 1024   # smaller message parts are copied (pyzmq's own threshold)
KINDS = {P.Op.INFER: Kind.INFER, P.Op.COMPOSITE: Kind.COMPOSITE, P.Op.LOAD: Kind.LOAD, P.Op.UNLOAD: Kind.UNLOAD,
         P.Op.STATS: Kind.STATS}


class Frontend(Shell):
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec):
        self.config, self.run_spec = config, run
        self.device = "cpu"
        self.ctx = zmq.asyncio.Context.shadow(ctx)
        self.catalog = Catalog(config)
        self.metrics = Metrics()
        self.store_lookups: dict[str, dict[str, int]] = {}   # model -> {"hits", "misses"}
        self._stopping = False
        lim = config.limits
        engine = Scheduler(list(run.devices), len(run.endpoints.cpu), config.shm.slots, lim.queue_depth,
                           config.frontend.routing)
        self.auth = None
        self.tenants = self._tenants(ctx)
        self.clients = []
        self._readable: dict = {}   # client ROUTER -> the asyncio.Event its reader waits on
        self._recheck_due = False
        for endpoint in config.frontend.bind:
            network = not endpoint.startswith(("ipc://", "inproc://"))
            # NOTE: plain (not asyncio) sockets: replies and frames leave with one non-blocking send each,
            # no future per message; the readers wait on the socket's fd (_read_clients).
            sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=lim.max_message_bytes if network else None)
            if config.frontend.curve is not None:
                make_server(sock, resolve_path(config, config.frontend.curve.secret_key),
                            "frontend.curve.secret_key")
            bind_endpoint(sock, endpoint, "frontend.bind")
            self.clients.append(sock)
        # One monitor per ROUTER, read without blocking (see _connections_closed).
        self.monitors = []
        for i, sock in enumerate(self.clients):
            address = f"inproc://frontend-monitor-{i}"
            sock.monitor(address, zmq.EVENT_DISCONNECTED)
            monitor = ctx.socket(zmq.PAIR)
            monitor.connect(address)
            self.monitors.append(monitor)
        self.pull = make_socket(self.ctx, zmq.PULL, bind=run.endpoints.frontend)
        inputs = [SlotRing.attach(spec) for spec in run.input_rings]
        for ring in inputs:
            ring.become_writer()   # the frontend is the one writer of every input ring
        to_gpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in run.endpoints.gpu]
        Shell.__init__(self, engine, to_gpu, inputs, config.supervisor.shutdown_timeout_s)
        self.outputs = [SlotRing.attach(s) for s in run.output_rings]   # read for `infer` replies
        self.images = [SlotRing.attach(s, populate=False) for s in run.image_rings]   # raw frames
        self.to_cpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in run.endpoints.cpu]
        self.backlogs = Backlogs(lim.max_client_backlog_bytes, lim.max_backlog_bytes)
        # The WebRTC viewer: its port bound here, so that a taken port ends the start; its stack (aiohttp,
        # aiortc: ~0.4 s of imports) loaded and served after READY (_main). Live sessions get it there.
        self.viewer = None
        self.viewer_sockets = (listen_tcp(config.viewer.host, config.viewer.port, "viewer.port", "(0: no viewer)")
                               if config.viewer.port else [])
        self.live = Live(self, config, self.metrics)
        self._viewer_task: Optional[asyncio.Task] = None
        self.deadlines = Alarm(self._on_deadline)
        self.metrics.serve(config.metrics.host, config.metrics.port, self.readiness)

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
        self.catalog.close()
        for ring in self.images:
            ring.close()
        if self.auth is not None:
            self.auth.stop()
        # NOTE: these sockets belong to an asyncio shadow of the process context, whose destroy()
        # does not know them: close each here, or the context's term() blocks forever.
        for sock, monitor in zip(self.clients, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=1000)  # let the last replies leave
        for sock in [self.pull, *self.to_gpu, *self.to_cpu]:
            sock.close(linger=0)
        for ring in [*self.input_rings, *self.outputs]:
            ring.close()

    async def _main(self) -> None:
        internal = asyncio.create_task(self._read_internal())
        viewer = self._viewer_task = asyncio.create_task(self._start_viewer()) if self.viewer_sockets else None
        self.catalog.warm(await self.catalog.ids())   # in the background: `models` is fast from the start
        # NOTE: serve clients only once the supervisor has told us every worker's state (it does right
        # after our READY); else a restarted frontend would answer `unavailable` for a moment.
        deadline = time.monotonic() + STATE_SYNC_TIMEOUT_S
        while not self.engine.synced() and time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.01)
        readers = [asyncio.create_task(self._read_clients(i, s)) for i, s in enumerate(self.clients)]
        readers += [asyncio.create_task(self._watch_connections(i, m)) for i, m in enumerate(self.monitors)]
        while not self._stopping:
            await asyncio.sleep(0.1)  # the SIGTERM flag; every real wait is a socket read
        # Stop accepting, then let in-flight requests finish up to the shutdown deadline.
        for task in readers:
            task.cancel()
        self.start_draining(time.monotonic())
        while not self.drain_step(time.monotonic()):
            await asyncio.sleep(0.05)
        if viewer is not None:
            viewer.cancel()
        if self.viewer is not None:
            await self.viewer.stop()
        internal.cancel()

    async def _start_viewer(self) -> None:
        """The WebRTC viewer on the port bound at start: its stack (aiohttp, aiortc: ~0.4 s of imports)
        is loaded in a thread while clients are already served; a webrtc session_open meanwhile waits
        for it (_after_viewer)."""
        def load():
            from frontend.live.viewer import Viewer   # NOTE: aiortc is imported only where a viewer runs
            return Viewer
        viewer = (await asyncio.to_thread(load))(self.config.viewer)
        await viewer.start(self.viewer_sockets)
        self.viewer = viewer
        self.live.attach_viewer(viewer)

    async def _read_clients(self, index: int, sock) -> None:
        loop = asyncio.get_running_loop()
        ready = self._readable[sock] = asyncio.Event()
        loop.add_reader(sock.FD, ready.set)   # edge-triggered: always drain after a wake-up
        try:
            while True:
                if not self._take_requests(index, sock):
                    await asyncio.sleep(0)   # a burst: let the rest of the loop run, then go on
                    continue
                await ready.wait()
                ready.clear()
        finally:
            loop.remove_reader(sock.FD)

    def _take_requests(self, index: int, sock, most: int = 256) -> bool:
        """Handle the requests waiting on a client socket; False if `most` were taken and more may wait."""
        for _ in range(most):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            # NOTE: libzmq queues a connection's DISCONNECTED event before it closes the fd, and so
            # before another connection can be accepted on the same number: taking the events first
            # means a reused fd is never mistaken for the closed connection.
            self._connections_closed(index)
            try:
                self._on_request(index, sock, frames)
            except Exception:  # a bug must not kill the reader
                log.exception("request handling failed")
        return False

    async def _watch_connections(self, index: int, monitor: zmq.Socket) -> None:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(monitor.FD, ready.set)   # edge-triggered: always drain after a wake-up
        try:
            while True:
                self._connections_closed(index)
                await ready.wait()
                ready.clear()
        finally:
            loop.remove_reader(monitor.FD)

    def _connections_closed(self, index: int) -> None:
        """End the requests of every connection of ROUTER `index` that has closed."""
        monitor = self.monitors[index]
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self.backlogs.closed((index, event["value"]))
            self.live.client_gone((index, event["value"]))
            actions = self.engine.client_gone((index, event["value"]))
            if actions:
                log.info("a client disconnected with request(s) open: ended them")
            self.apply(actions)

    async def _read_internal(self) -> None:
        while True:
            frames = await self.pull.recv_multipart(copy=False)
            try:
                self._on_internal(decode(frames[0].buffer), frames[1:])
            except Exception:
                log.exception("internal message handling failed")

    # -- requests ---------------------------------------------------------------------------

    def _on_request(self, index: int, sock, frames: list) -> None:
        # Envelope: routing id, then frames up to and including the empty delimiter.
        delim = next((i for i, f in enumerate(frames) if len(f.buffer) == 0), None)
        if delim is None:  # a DEALER that sent no delimiter: answer in kind
            client, body = ReplyTo(sock, [frames[0]]), frames[1:]
        else:
            client, body = ReplyTo(sock, frames[: delim + 1]), frames[delim + 1:]
        fd = _source_fd(frames[0])
        client.conn = (index, fd) if fd is not None else None
        if not body:
            self.error(client, None, ErrorCode.BAD_REQUEST, "empty request: send [header, payload...]")
            return
        if self.tenants is not None:
            client.tenant = self.tenants.get(body[0].get("User-Id"))
        try:
            lim = self.config.limits
            check_message([len(f.buffer) for f in body], lim.max_header_bytes, lim.max_message_bytes)
            header = parse_header(body[0].bytes)
            payload = [f.buffer for f in body[1:]]
            check_request(header, payload, lim.max_batch)
            if client.tenant is not None and header.model is not None and not client.tenant.allows(header.model):
                raise RequestError(ErrorCode.FORBIDDEN, f"model {header.model!r} does not belong to tenant "
                                   f"{client.tenant.name}; use one of its models", header.id)
        except RequestError as err:
            self.metrics.requests.labels("invalid", "", err.code.value).inc()
            self.error(client, err.request_id, err.code, err.message)
            return
        call = Call(header, client, time.monotonic(), self)
        if header.op is P.Op.HEALTH:
            self.send(client, control.health(self, call))
            self.metrics.requests.labels("health", "", "ok").inc()
            return
        if header.op is P.Op.MODELS or (header.model is not None and header.op is not P.Op.STATS
                                        and self.catalog.known(header.model) is None):
            # NOTE: the model's files are read off the event loop; meanwhile other clients are served.
            asyncio.create_task(self._after_catalog(call, payload))
            return
        self._submit(call, payload)

    def _timeout_s(self, header: P.RequestHeader) -> float:
        return header.timeout_ms / 1000 if header.timeout_ms else self.config.limits.request_timeout_s

    async def _after_catalog(self, call: Call, payload: list) -> None:
        header = call.header
        try:
            budget = self._timeout_s(header) - (time.monotonic() - call.t0)
            if header.op is P.Op.MODELS:
                reply = await asyncio.wait_for(control.models(self, call), max(budget, 0.001))
                self.send(call.reply_to, reply)
                self.metrics.requests.labels("models", "", "ok").inc()
                return
            await asyncio.wait_for(self.catalog.get(header.model), max(budget, 0.001))
        except asyncio.TimeoutError:
            self.error(call.reply_to, header.id, ErrorCode.TIMEOUT, f"reading the files of model {header.model} "
                        "took longer than the request's deadline; is its storage slow? (timeout_ms)")
            return
        except Exception as err:  # a bug: the client still gets exactly one reply
            log.exception("catalog read failed")
            self.error(call.reply_to, header.id, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
            return
        self._submit(call, payload)

    def _submit(self, call: Call, payload: list) -> None:
        header = call.header
        if header.op not in KINDS:
            self._session_op(call, payload)
            return
        kind = KINDS[header.op]
        batch, inputs = 0, None
        try:
            if header.model is not None and kind is not Kind.STATS:
                call.spec = self._spec(header)
            if kind in (Kind.INFER, Kind.COMPOSITE):
                spec = call.spec
                if header.audio_format == "pcm16":
                    t = check_pcm(header, payload, spec.audio_shape, spec.encoder, self.config.limits.max_batch)
                else:
                    t = check_tensors(header, payload, spec.audio_shape)
                batch = t.batch
                if header.return_audio:
                    call.pcm = bytes(t.audio)
                call.frames = [frame_index(header.start_frame + i, spec.frames, spec.order)
                               for i in range(batch)] if kind is Kind.COMPOSITE else list(range(batch))
                layout = "pcm" if t.pcm else ("windows" if t.audio_per_frame else "window")
                inputs = Inputs(spec.id, spec.version, call.frames, t.audio, layout, tuple(spec.audio_shape),
                                t.visual, format=header.format or self.config.output.format,
                                quality=header.quality or self.config.output.quality, enqueued=call.t0)
            if kind is Kind.UNLOAD:
                self.catalog.forget(header.model)
        except RequestError as err:
            self.metrics.requests.labels(header.op.value, call.label, err.code.value).inc()
            self.error(call.reply_to, header.id, err.code, err.message)
            return
        now = time.monotonic()
        request = Request(kind, call.spec.id if call.spec else header.model, batch,
                          deadline=now + self._timeout_s(header), conn=call.reply_to.conn, work=call, inputs=inputs)
        self.apply(self.engine.submit(request, now))

    def _session_op(self, call: Call, payload: list) -> None:
        header = call.header
        if header.op is P.Op.SESSION_OPEN and header.webrtc and self._viewer_task is not None \
                and not self._viewer_task.done():
            asyncio.create_task(self._after_viewer(call, payload))   # it is a moment away: wait, not refuse
            return
        self._session_op_now(call, payload)

    def _session_op_now(self, call: Call, payload: list) -> None:
        header = call.header
        try:
            if header.op is P.Op.SESSION_OPEN:
                call.spec = self._spec(header)
            reply = self.live.handle(call, payload)
        except RequestError as err:
            self.metrics.requests.labels(header.op.value, call.label, err.code.value).inc()
            self.error(call.reply_to, header.id, err.code, err.message)
            return
        self.metrics.requests.labels(header.op.value, call.label, "ok").inc()
        if reply is not None:   # (a session_open is answered by live/ once its session is ready)
            self.send(call.reply_to, reply)

    async def _after_viewer(self, call: Call, payload: list) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._viewer_task), VIEWER_START_TIMEOUT_S)
        except Exception as err:
            log.exception("the WebRTC viewer did not start")
            self.metrics.requests.labels(call.header.op.value, call.label, ErrorCode.UNAVAILABLE.value).inc()
            self.error(call.reply_to, call.header.id, ErrorCode.UNAVAILABLE,
                        f"header.webrtc: the WebRTC viewer did not start ({type(err).__name__}: {err}); see the "
                        "server's log")
            return
        self._session_op_now(call, payload)

    def _spec(self, header: P.RequestHeader) -> Optional[ModelSpec]:
        known = self.catalog.known(header.model)
        if isinstance(known, ModelSpec):
            return known
        if known is None:   # forgotten by an `unload` while its files were read
            raise RequestError(ErrorCode.UNAVAILABLE, f"model {header.model} was unloaded meanwhile; retry", header.id)
        if header.op is P.Op.UNLOAD and known.code != ErrorCode.UNKNOWN_MODEL:
            return None     # a model whose files broke can still be unloaded
        raise RequestError(ErrorCode(known.code), known.message, header.id)

    # -- the engine's actions (the rest: core/shell.py) ------------------------------------------

    def applied(self) -> None:
        self.deadlines.arm(self.engine.next_deadline())

    # -- what live sessions may ask of their host (frontend/live/host.py) -------------------------

    def submit(self, request: Request, now: Optional[float] = None) -> None:
        self.apply(self.engine.submit(request, time.monotonic() if now is None else now))

    def unpin(self, worker: int, model: str) -> None:
        self.apply(self.engine.unpin(worker, model))

    def compositors(self) -> list:
        return self.engine.compositors

    def close_encoder(self, compositor: int, session: str) -> None:
        self.to_cpu[compositor].send(encode(CloseEncoder(session=session)))

    def render(self, action: Render) -> None:
        r = action.request
        self.to_cpu[action.compositor].send(encode(r.work.message(r)))

    def _on_deadline(self) -> None:
        self.apply(self.engine.tick(time.monotonic()))

    # -- replies ----------------------------------------------------------------------------

    def send(self, reply_to: ReplyTo, header: bytes, data: list = (), req: int = 0, image_slots=(),
              also: Optional[list] = None) -> bool:
        """Send a reply unless the connection's unread backlog is full (then drop it and return False).
        Raw frames leave from the image ring without a copy, except to a connection with a backlog:
        those are copied first, so a client that stops reading pins no image slot for long."""
        nbytes = len(header) + sum(memoryview(d).nbytes for d in data)
        entry = self.backlogs.admit(reply_to.conn, nbytes)
        if entry is None:
            self.metrics.replies_dropped.inc()
            log.warning("dropped a reply of %d bytes: the client has %d bytes unread (limits.max_client_backlog_bytes), "
                        "all clients %d (limits.max_backlog_bytes)", nbytes, self.backlogs.queued(reply_to.conn),
                        self.backlogs.total())
            self.metrics.backlog_bytes.set(self.backlogs.total())
            self.free_images(req, image_slots)
            return False
        if image_slots and self.backlogs.queued(reply_to.conn) > nbytes:   # it was not idle
            data = [bytes(d) for d in data]
            self.free_images(req, image_slots)
            image_slots = ()
        sock = reply_to.sock
        try:
            tracker = _send_parts(sock, (*reply_to.peer[1], header, *data))
        except zmq.ZMQError as err:
            log.error("sending a reply failed: %s", err)
            tracker = SENT
        entry[0] = tracker
        if also is not None:   # another bound counts this message too (a session's queued frames)
            also[0] = tracker
        if image_slots:
            self._release_when_sent(tracker, req, set(image_slots))
        # NOTE: a send may take the socket's edge-triggered fd event for a request that came in
        # meanwhile: look once more after this pass of sends, so that its reader is not left waiting.
        if not self._recheck_due:
            self._recheck_due = True
            asyncio.get_running_loop().call_soon(self._recheck_reads)
        return True

    def _recheck_reads(self) -> None:
        self._recheck_due = False
        for sock, ready in self._readable.items():
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                ready.set()

    def error(self, reply_to: ReplyTo, request_id, code: ErrorCode, message: str) -> None:
        self.send(reply_to, P.error_reply(request_id, ErrorCode(code), message))

    def free_images(self, req: int, compositors) -> None:
        for j in compositors:
            self.to_cpu[j].send(encode(ReleaseImages(req=req)))

    def _release_when_sent(self, tracker, req: int, compositors: set[int]) -> None:
        """Raw frames leave straight from the compositors' image rings: free the slots once ZeroMQ
        has let go of the bytes (its MessageTracker), not before."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if tracker.done:
                self.free_images(req, compositors)
            else:
                loop.call_later(TRACKER_POLL_S, check)

        check()

    # -- internal messages ------------------------------------------------------------------

    def _on_internal(self, msg, data: list) -> None:
        if isinstance(msg, (InferDone, CompositeDone)):   # when answers arrive: live frames' stages
            r = self.engine.table.get(msg.req)
            if r is not None:
                r.answered["infer" if isinstance(msg, InferDone) else "composite"] = time.monotonic()
        if isinstance(msg, InferDone):
            self.metrics.latency.labels("queue").observe(msg.queue_ms)
            if msg.ok:
                self.metrics.latency.labels("inference").observe(msg.inference_ms)
            self.apply(self.engine.infer_done(msg))
        elif isinstance(msg, CompositeDone):
            self.apply(self.engine.composite_done(msg, self._composited(msg, data)))
        elif isinstance(msg, (LoadDone, StatsReport)):
            self.apply(self.engine.control_done(msg))
        elif isinstance(msg, ModelEvent):
            self.metrics.model_events.labels(msg.event.value).inc()
            if msg.load_ms:
                self.metrics.load_ms.observe(msg.load_ms)
            self.apply(self.engine.model_event(msg))
            self._gauges()
        elif isinstance(msg, ProcessEvent):
            self._process_event(msg)

    def _composited(self, msg: CompositeDone, data: list) -> list:
        """The chunk's frames: encoded images as sent, or raw frames as views into the image ring."""
        if msg.ok:
            r = self.engine.table.get(msg.req)
            model = r.model if r is not None and r.kind is not Kind.RENDER else None
            if model is not None:
                self.metrics.latency.labels("composite").observe(msg.composite_ms)
                self.metrics.store.labels(model, "hit").inc(msg.hits)
                self.metrics.store.labels(model, "miss").inc(msg.misses)
                lookups = self.store_lookups.setdefault(model, {"hits": 0, "misses": 0})
                lookups["hits"] += msg.hits
                lookups["misses"] += msg.misses
        if msg.images is None or not 0 <= msg.compositor < len(self.images):
            return list(data)
        frames = self.images[msg.compositor].read(msg.images)
        return [frames[i] for i in range(len(frames))]

    def _process_event(self, msg: ProcessEvent) -> None:
        procs = self.engine.workers if msg.role == "gpu" else self.engine.compositors
        if 0 <= msg.index < len(procs) and msg.restarts > procs[msg.index].restarts:
            self.metrics.restarts.labels(msg.role.value).inc(msg.restarts - procs[msg.index].restarts)
        if msg.role == "gpu" and msg.device and 0 <= msg.index < len(procs) \
                and not procs[msg.index].device.startswith(msg.device + "="):
            procs[msg.index].device = msg.device   # a GPU host slot found by DNS says which host it is now
        self.apply(self.engine.process_event(msg.role.value, msg.index, msg.state, msg.pid, msg.restarts))
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.backlog_bytes.set(self.backlogs.total())
        for w in self.engine.workers:
            label = str(w.index)
            self.metrics.queue_depth.labels(label).set(len(w.active))
            self.metrics.slots_in_use.labels(label).set(w.slots - w.free_slots)
            self.metrics.models_loaded.labels(label).set(len(w.models))


_MORE, _LAST = int(zmq.NOBLOCK) | int(zmq.SNDMORE), int(zmq.NOBLOCK)   # ints: no enum arithmetic per part


def _send_parts(sock: zmq.Socket, parts: tuple):
    """Send one message without blocking (a ROUTER never blocks: a peer past its high-water mark loses
    it). Small parts are copied; large ones leave without a copy, and the returned tracker covers
    every one of them (send_multipart tracks the last part only, which may be a small one)."""
    trackers = []
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = _MORE if i < last else _LAST
        if isinstance(part, zmq.Frame):
            # NOTE: pyzmq cannot track a received (untracked) frame: send its buffer instead (still no
            # copy; the memoryview keeps the received frame alive)
            part = part.buffer
        if memoryview(part).nbytes < ZERO_COPY_BYTES:
            sock.send(part, flags, copy=True)
        else:
            trackers.append(sock.send(part, flags, copy=False, track=True))
    if not trackers:
        return SENT
    return trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers)


def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The connection a frame came over (ZMQ_SRCFD); None where the transport has none (inproc)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if fd >= 0 else None


def run_frontend_process(config: Config, run: RunSpec, index: int = 0) -> None:
    child_main("frontend", index, run, lambda ctx: Frontend(ctx, config, run))

