"""The client-facing frontend process: asyncio (uvloop) + ZeroMQ ROUTER, speaking docs/protocol.md.

Per request: validate -> pick an inference worker (affinity, least loaded, or round robin) -> wait in
that worker's bounded queue for a free input slot (`overloaded` when the queue is full) -> copy the
tensors into the slot -> InferTask. InferDone frees the input slot; `infer` replies with the mouths,
`composite` waits for one CompositeDone per chunk of the batch. Any end (reply, error, deadline,
a dead process) frees the request's slots: `ReleaseTask` tells the worker to free its output slot.
Every request gets exactly one reply.

A client whose connection closes leaves nothing behind: a monitor on each ROUTER reports the
connection's file descriptor, which libzmq also stamps on every frame it received (ZMQ_SRCFD), so the
requests that came over it end at once (queued ones never reach a worker), with no reply to send.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Optional

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from config import Config, resolve_path
from config.assets import frame_index
from config.geometry import VISUAL_BYTES, VISUAL_SHAPE, audio_offset
from frontend import control
from frontend import protocol as P
from frontend.catalog import Catalog, CatalogError, ModelSpec
from frontend.metrics import Metrics
from frontend.state import Client, Pending, Proc, Tenant, Worker
from frontend.validate import RequestError, check_message, check_request, check_tensors, parse_header
from shm.child import child_main
from shm.curve import load_public, make_server, start_authenticator
from shm.endpoints import RunSpec, make_socket
from shm.messages import (Chunk, CompositeDone, InferDone, InferTask, LoadDone, ModelEvent, ProcessEvent,
                          ReleaseImages, ReleaseTask, StatsReport, decode, encode)
from shm.ring import SlotRing, StaleHandle

log = logging.getLogger(__name__)
STATE_SYNC_TIMEOUT_S = 5.0
TRACKER_POLL_S = 0.002


class Frontend:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec):
        self.config, self.run_spec = config, run
        self.device = "cpu"
        self.ctx = zmq.asyncio.Context.shadow(ctx)
        self.catalog = Catalog(config)
        self.metrics = Metrics()
        self.requests: dict[int, Pending] = {}
        self.store_lookups: dict[str, dict[str, int]] = {}   # model -> {"hits", "misses"}
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._stopping = False
        lim = config.limits
        self.tenants = self._tenants(ctx)
        self.clients = []
        for endpoint in config.frontend.bind:
            network = not endpoint.startswith(("ipc://", "inproc://"))
            sock = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=lim.max_message_bytes if network else None)
            if config.frontend.curve is not None:
                make_server(sock, resolve_path(config, config.frontend.curve.secret_key),
                            "frontend.curve.secret_key")
            sock.bind(endpoint)
            self.clients.append(sock)
        # One monitor per ROUTER, read without blocking (see _connections_closed).
        self.monitors = []
        for i, sock in enumerate(self.clients):
            address = f"inproc://frontend-monitor-{i}"
            sock.monitor(address, zmq.EVENT_DISCONNECTED)
            monitor = ctx.socket(zmq.PAIR)
            monitor.connect(address)
            self.monitors.append(monitor)
        self.connections: dict[tuple, set[int]] = {}   # (ROUTER index, fd) -> requests that came over it
        self.pull = make_socket(self.ctx, zmq.PULL, bind=run.endpoints.frontend)
        self.workers = []
        for i, (addr, spec) in enumerate(zip(run.endpoints.gpu, run.input_rings)):
            ring = SlotRing.attach(spec)
            ring.become_writer()   # the frontend is the one writer of every input ring
            self.workers.append(Worker(i, run.devices[i], ring, make_socket(self.ctx, zmq.PUSH, connect=addr)))
        self.compositors = [Proc() for _ in run.endpoints.cpu]
        self.outputs = [SlotRing.attach(s) for s in run.output_rings]   # read for `infer` replies
        self.images = [SlotRing.attach(s, populate=False) for s in run.image_rings]   # raw frames
        self.to_cpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in run.endpoints.cpu]
        self.metrics.serve(config.metrics.host, config.metrics.port)

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
        for ring in self.images:
            ring.close()
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        # NOTE: these sockets belong to an asyncio shadow of the process context, whose destroy()
        # does not know them: close each here, or the context's term() blocks forever.
        for sock, monitor in zip(self.clients, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=1000)  # let the last replies leave
        for sock in [self.pull, *(w.sock for w in self.workers), *self.to_cpu]:
            sock.close(linger=0)
        for worker in self.workers:
            worker.ring.close()
        for ring in self.outputs:
            ring.close()

    async def _main(self) -> None:
        internal = asyncio.create_task(self._read_internal())
        # NOTE: serve clients only once the supervisor has told us every worker's state (it does right
        # after our READY); else a restarted frontend would answer `unavailable` for a moment.
        deadline = time.monotonic() + STATE_SYNC_TIMEOUT_S
        while not self._synced() and time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.01)
        readers = [asyncio.create_task(self._read_clients(i, s)) for i, s in enumerate(self.clients)]
        readers += [asyncio.create_task(self._watch_connections(i, m)) for i, m in enumerate(self.monitors)]
        readers.append(internal)
        while not self._stopping:
            await asyncio.sleep(0.1)  # the SIGTERM flag; every real wait is a socket read
        # Stop accepting, then let in-flight requests finish up to the shutdown deadline.
        for task in readers[:-1]:
            task.cancel()
        deadline = time.monotonic() + self.config.supervisor.shutdown_timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in list(self.requests.values()):
            self.finish(p, code="unavailable", message="the server is shutting down; retry on another server")
        readers[-1].cancel()

    async def _read_clients(self, index: int, sock) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            # NOTE: libzmq queues a connection's DISCONNECTED event before it closes the fd, and so
            # before another connection can be accepted on the same number: taking the events first
            # means a reused fd is never mistaken for the closed connection.
            self._connections_closed(index)
            try:
                await self._on_request(index, sock, frames)
            except Exception:  # a bug must not kill the reader; the client still gets a reply
                log.exception("request handling failed")

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
            reqs = self.connections.pop((index, event["value"]), ())
            for req in list(reqs):
                p = self.requests.get(req)
                if p is not None:
                    p.client.gone = True
                    self.finish(p, code="client_gone", message="")
            if reqs:
                log.info("a client disconnected with %d request(s) open: ended them", len(reqs))

    async def _read_internal(self) -> None:
        while True:
            frames = await self.pull.recv_multipart(copy=False)
            try:
                self._on_internal(decode(frames[0].buffer), frames[1:])
            except Exception:
                log.exception("internal message handling failed")

    # -- replies ----------------------------------------------------------------------------

    def _send(self, client: Client, header: bytes, data: list = (), track: bool = False):
        envelope = client.envelope
        if track:  # NOTE: pyzmq cannot track a message that resends received (untracked) frames
            envelope = [f.bytes if isinstance(f, zmq.Frame) else f for f in envelope]
        return client.sock.send_multipart([*envelope, header, *data], copy=False, track=track)

    def _release_images(self, req: int, compositors) -> None:
        for j in compositors:
            self.to_cpu[j].send(encode(ReleaseImages(req=req)))

    def _release_when_sent(self, sent, req: int, compositors: set[int]) -> None:
        """Raw frames leave straight from the compositors' image rings: free the slots once ZeroMQ
        has let go of the bytes (its MessageTracker), not before."""
        loop = asyncio.get_running_loop()

        def check(tracker) -> None:
            if tracker.done:
                self._release_images(req, compositors)
            else:
                loop.call_later(TRACKER_POLL_S, check, tracker)

        def on_sent(future) -> None:
            if future.cancelled() or future.exception() is not None:
                if not future.cancelled():
                    log.error("sending raw frames of request %d failed: %r", req, future.exception())
                self._release_images(req, compositors)
            else:
                check(future.result())

        sent.add_done_callback(on_sent)

    def _error(self, client: Client, request_id, code: P.ErrorCode | str, message: str) -> None:
        self._send(client, P.error_reply(request_id, P.ErrorCode(code), message))

    def finish(self, p: Pending, header: Optional[bytes] = None, data: list = (), *,
                code: Optional[str] = None, message: str = "") -> None:
        """The one exit of every request: reply once, free everything it holds."""
        if self.requests.pop(p.req, None) is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        open_reqs = self.connections.get(p.client.conn)
        if open_reqs is not None:
            open_reqs.discard(p.req)
            if not open_reqs:
                del self.connections[p.client.conn]
        if p.client.gone:
            self._release_images(p.req, p.image_slots)
        elif code is not None:
            self._error(p.client, p.header.id, code, message)
            self._release_images(p.req, p.image_slots)
        elif p.image_slots:
            self._release_when_sent(self._send(p.client, header, data, track=True), p.req, p.image_slots)
        else:
            self._send(p.client, header, data)
        self.metrics.requests.labels(p.op.value, p.header.model or "", code or "ok").inc()
        total_ms = (time.monotonic() - p.t0) * 1000
        self.metrics.latency.labels("total").observe(total_ms)
        for proc in self.compositors:
            proc.active.discard(p.req)
        if p.worker is not None:
            worker = self.workers[p.worker]
            worker.active.discard(p.req)
            if p in worker.queue:
                worker.queue.remove(p)
            if p.in_slot:
                worker.ring.release_request(p.req)
            if p.dispatched:
                worker.sock.send(encode(ReleaseTask(req=p.req)))
            self._gauges(worker)
            self._pump(worker)

    def _synced(self) -> bool:
        return all(proc.pid is not None for proc in [*self.workers, *self.compositors])

    def _gauges(self, worker: Worker) -> None:
        label = str(worker.index)
        self.metrics.queue_depth.labels(label).set(len(worker.active))
        self.metrics.slots_in_use.labels(label).set(worker.ring.slots_in_use())
        self.metrics.models_loaded.labels(label).set(len(worker.models))

    # -- requests ---------------------------------------------------------------------------

    async def _on_request(self, index: int, sock, frames: list) -> None:
        # Envelope: routing id, then frames up to and including the empty delimiter.
        delim = next((i for i, f in enumerate(frames) if len(f.buffer) == 0), None)
        if delim is None:  # a DEALER that sent no delimiter: answer in kind
            client, body = Client(sock, [frames[0]]), frames[1:]
        else:
            client, body = Client(sock, frames[: delim + 1]), frames[delim + 1:]
        if not body:
            self._error(client, None, P.ErrorCode.BAD_REQUEST, "empty request: send [header, payload...]")
            return
        if self.tenants is not None:
            client.tenant = self.tenants.get(body[0].get("User-Id"))
        try:
            lim = self.config.limits
            check_message([len(f.buffer) for f in body], lim.max_header_bytes, lim.max_message_bytes)
            header = parse_header(body[0].bytes)
            payload = [f.buffer for f in body[1:]]
            check_request(header, payload, self.config.limits.max_batch)
            if client.tenant is not None and header.model is not None and not client.tenant.allows(header.model):
                raise RequestError(P.ErrorCode.FORBIDDEN, f"model {header.model!r} does not belong to tenant "
                                   f"{client.tenant.name}; use one of its models", header.id)
        except RequestError as err:
            self.metrics.requests.labels("invalid", "", err.code.value).inc()
            self._error(client, err.request_id, err.code, err.message)
            return
        p = Pending(next(self._ids), header.op, header, client, time.monotonic())
        self.requests[p.req] = p
        fd = _source_fd(body[0])
        if fd is not None:
            client.conn = (index, fd)
            self.connections.setdefault(client.conn, set()).add(p.req)
        timeout_s = header.timeout_ms / 1000 if header.timeout_ms else self.config.limits.request_timeout_s
        p.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, p.req)
        handler = {
            P.Op.HEALTH: control.health, P.Op.MODELS: control.models, P.Op.LOAD: control.load,
            P.Op.UNLOAD: control.unload, P.Op.STATS: control.stats,
        }.get(header.op)
        try:
            if handler is None:
                await self._tensor_op(p, payload)
            else:
                await handler(self, p, payload)
        except RequestError as err:
            self.finish(p, code=err.code.value, message=err.message)
        except Exception as err:  # a bug: the client still gets exactly one reply
            log.exception("op %s failed", header.op.value)
            self.finish(p, code="internal", message=f"{type(err).__name__}: {err}")

    def _expire(self, req: int) -> None:
        p = self.requests.get(req)
        if p is None:
            return
        where = "in the queue" if p.worker is not None and p in self.workers[p.worker].queue else "in flight"
        limit = p.header.timeout_ms or int(self.config.limits.request_timeout_s * 1000)
        self.finish(p, code="timeout", message=f"no result within {limit} ms (request was {where}); raise "
                     "timeout_ms or limits.request_timeout_s, or send less work at once")

    async def model_spec(self, p: Pending) -> ModelSpec:
        spec = await self.catalog.get(p.header.model)
        if isinstance(spec, CatalogError):
            raise RequestError(P.ErrorCode(spec.code), spec.message, p.header.id)
        return spec

    def no_worker_message(self) -> str:
        states = ", ".join(f"worker {w.index} ({w.device}) is {w.state}" for w in self.workers)
        return f"no inference worker is ready: {states}; retry shortly"

    def pick_worker(self, model: str) -> Optional[Worker]:
        ready = [w for w in self.workers if w.ready]
        if not ready:
            return None
        policy = self.config.frontend.routing
        if policy == "round_robin":
            return ready[next(self._rr) % len(ready)]
        if policy == "affinity":
            warm = [w for w in ready if model in w.models]
            if warm:
                ready = warm
        return min(ready, key=lambda w: (len(w.active), w.index))

    async def _tensor_op(self, p: Pending, payload: list) -> None:
        spec = p.spec = await self.model_spec(p)
        p.tensors = check_tensors(p.header, payload, spec.audio_shape)
        if p.op is P.Op.COMPOSITE:
            p.frames = [frame_index(p.header.start_frame + i, spec.frames, spec.order) for i in range(p.header.batch)]
            p.width, p.height = spec.width, spec.height
        if p.req not in self.requests:
            return  # expired while the catalog read the model's files
        worker = self.pick_worker(spec.id)
        if worker is None:
            raise RequestError(P.ErrorCode.UNAVAILABLE, self.no_worker_message(), p.header.id)
        if len(worker.queue) >= self.config.limits.queue_depth:
            raise RequestError(P.ErrorCode.OVERLOADED, f"inference worker {worker.index} has "
                               f"{len(worker.queue)} requests queued (limits.queue_depth); retry later",
                               p.header.id)
        p.worker = worker.index
        worker.active.add(p.req)
        worker.queue.append(p)
        self._pump(worker)

    def _pump(self, worker: Worker) -> None:
        """Move queued requests into free input slots and hand them to the worker."""
        while worker.queue and worker.ready:
            p = worker.queue[0]
            slot = worker.ring.try_acquire(p.req)
            if slot is None:
                break
            worker.queue.popleft()
            p.in_slot = True
            try:
                task = self._write_inputs(p, worker, slot)
            except RequestError as err:
                self.finish(p, code=err.code.value, message=err.message)
                continue
            except Exception as err:  # a bug: answer, free the slot, keep serving
                log.exception("writing inputs failed")
                self.finish(p, code="internal", message=f"{type(err).__name__}: {err}")
                continue
            p.dispatched = time.monotonic()
            p.tensors = None  # the client's frames are no longer needed
            worker.sock.send(encode(task))
        self._gauges(worker)

    def _write_inputs(self, p: Pending, worker: Worker, slot: int) -> InferTask:
        batch, t = p.header.batch, p.tensors
        ring, offset, visual_ref = worker.ring, 0, None
        if t.visual is not None:
            shape = (batch, *VISUAL_SHAPE)
            ring.writable(slot, 0, "float32", shape)[...] = np.frombuffer(t.visual, "<f4").reshape(shape)
            visual_ref = ring.ref(slot, 0, "float32", shape)
            offset = audio_offset(batch * VISUAL_BYTES)
        a_shape = (batch, *p.spec.audio_shape)
        audio = np.frombuffer(t.audio, "<f4")
        ring.writable(slot, offset, "float32", a_shape)[...] = audio.reshape(a_shape if t.audio_per_frame
                                                                             else p.spec.audio_shape)
        audio_ref = ring.ref(slot, offset, "float32", a_shape)
        plan = self._plan(p) if p.op is P.Op.COMPOSITE else []
        fmt = p.header.format or self.config.output.format
        quality = p.header.quality or self.config.output.quality
        deadline = time.monotonic() + (p.timer.when() - asyncio.get_running_loop().time())
        return InferTask(req=p.req, model=p.spec.id, batch=batch, audio=audio_ref, visual=visual_ref,
                         frames=p.frames or list(range(batch)), plan=plan, format=fmt, quality=quality,
                         deadline=deadline, enqueued=p.t0, version=p.spec.version)

    def _plan(self, p: Pending) -> list[Chunk]:
        """Split the batch over the ready compositing processes, least busy first."""
        ready = [i for i, c in enumerate(self.compositors) if c.state == "ready"]
        if not ready:
            raise RequestError(P.ErrorCode.UNAVAILABLE, "no compositing process is ready (restarting); retry "
                               "shortly", p.header.id)
        batch = p.header.batch
        n = min(batch, len(ready))
        # Least busy first; ties rotate so that equal processes share the work.
        turn = next(self._rr)
        ready.sort(key=lambda i: (len(self.compositors[i].active), (i + turn) % len(self.compositors)))
        bounds = np.linspace(0, batch, n + 1).astype(int)
        plan = [Chunk(ready[k], int(bounds[k]), int(bounds[k + 1])) for k in range(n)]
        for chunk in plan:
            p.chunks[chunk.start] = chunk.compositor
            self.compositors[chunk.compositor].active.add(p.req)
        return plan

    # -- internal messages ------------------------------------------------------------------

    def _on_internal(self, msg, data: list) -> None:
        if isinstance(msg, InferDone):
            self._infer_done(msg)
        elif isinstance(msg, CompositeDone):
            self._composite_done(msg, data)
        elif isinstance(msg, (LoadDone, StatsReport)):
            control.gathered(self, msg)
        elif isinstance(msg, ModelEvent):
            self._model_event(msg)
        elif isinstance(msg, ProcessEvent):
            self._process_event(msg)

    def _infer_done(self, msg: InferDone) -> None:
        p = self.requests.get(msg.req)
        worker = self.workers[msg.worker]
        if p is None or p.worker != msg.worker:
            # The request ended first (deadline, dead process): make sure its output slot is freed.
            worker.sock.send(encode(ReleaseTask(req=msg.req)))
            return
        worker.ring.release_request(p.req)
        p.in_slot = False
        self._pump(worker)
        p.timing.update(queue_ms=msg.queue_ms, input_ms=msg.input_ms, inference_ms=msg.inference_ms)
        self.metrics.latency.labels("queue").observe(msg.queue_ms)
        if not msg.ok:
            self.finish(p, code=msg.code, message=msg.message)
            return
        self.metrics.latency.labels("inference").observe(msg.inference_ms)
        if p.op is P.Op.INFER:
            self._reply_infer(p, worker, msg)

    def _reply_infer(self, p: Pending, worker: Worker, msg: InferDone) -> None:
        # Read the mouths straight from the worker's output ring; copied into the reply frames.
        ring = self.outputs[worker.index]
        try:
            mouths = ring.read(msg.output)
            data = [mouths[i].tobytes() for i in range(p.header.batch)]
            ring.verify(msg.output)
        except StaleHandle as err:
            self.finish(p, code="unavailable", message=f"the worker restarted while the reply was read ({err})")
            return
        p.timing["total_ms"] = (time.monotonic() - p.t0) * 1000
        header = P.encode(P.InferReply(id=p.header.id, batch=p.header.batch, timing=P.Timing(**p.timing),
                                       worker=P.WorkerInfo(device=worker.device, index=worker.index)))
        self.metrics.frames.labels(p.spec.id).inc(p.header.batch)
        self.finish(p, header, data)

    def _composite_done(self, msg: CompositeDone, data: list) -> None:
        p = self.requests.get(msg.req)
        if p is None or msg.start not in p.chunks:
            if msg.images is not None:  # the request ended first: its raw frames are not wanted
                self._release_images(msg.req, [msg.compositor])
            return
        del p.chunks[msg.start]
        if msg.images is not None:
            p.image_slots.add(msg.compositor)
            frames = self.images[msg.compositor].read(msg.images)
            data = [frames[i] for i in range(len(frames))]
        if not msg.ok:
            self.finish(p, code=msg.code, message=msg.message)
            return
        p.images[msg.start] = data
        p.timing["composite_ms"] = max(p.timing.get("composite_ms", 0.0), msg.composite_ms)
        self.metrics.latency.labels("composite").observe(msg.composite_ms)
        self.metrics.store.labels(p.spec.id, "hit").inc(msg.hits)
        self.metrics.store.labels(p.spec.id, "miss").inc(msg.misses)
        lookups = self.store_lookups.setdefault(p.spec.id, {"hits": 0, "misses": 0})
        lookups["hits"] += msg.hits
        lookups["misses"] += msg.misses
        if p.chunks:
            return
        worker = self.workers[p.worker]
        p.timing["total_ms"] = (time.monotonic() - p.t0) * 1000
        header = P.encode(P.CompositeReply(
            id=p.header.id, batch=p.header.batch, format=p.header.format or self.config.output.format,
            width=msg.width, height=msg.height, frames=p.frames, timing=P.Timing(**p.timing),
            worker=P.WorkerInfo(device=worker.device, index=worker.index)))
        images = [img for start in sorted(p.images) for img in p.images[start]]
        self.metrics.frames.labels(p.spec.id).inc(p.header.batch)
        self.finish(p, header, images)

    def _model_event(self, msg: ModelEvent) -> None:
        worker = self.workers[msg.worker]
        if msg.event == "loaded":
            worker.models.add(msg.model)
            self.metrics.load_ms.observe(msg.load_ms)
        else:
            worker.models.discard(msg.model)
        self.metrics.model_events.labels(msg.event).inc()
        self._gauges(worker)

    def _process_event(self, msg: ProcessEvent) -> None:
        if msg.role == "gpu":
            proc = self.workers[msg.index]
        elif msg.role == "cpu":
            proc = self.compositors[msg.index]
        else:
            return
        was_ready = proc.state == "ready"
        if msg.restarts > proc.restarts:
            self.metrics.restarts.labels(msg.role).inc(msg.restarts - proc.restarts)
        proc.state, proc.pid, proc.restarts = msg.state, msg.pid, msg.restarts
        if msg.state == "ready":
            if isinstance(proc, Worker):
                self._pump(proc)
            return
        if not was_ready and msg.state != "died":
            return
        # The process is gone: everything it held gets `unavailable` now, never silence.
        what = f"{'inference worker' if msg.role == 'gpu' else 'compositing process'} {msg.index}"
        device = proc.device if isinstance(proc, Worker) else "cpu"
        reason = {"unreachable": f"{what} ({device}) is unreachable; retry",
                  "starting": f"{what} ({device}) has no ready inference worker on its host; retry",
                  }.get(msg.state, f"{what} died and is restarting; retry")
        for req in list(proc.active):
            p = self.requests.get(req)
            if p is not None:
                self.finish(p, code="unavailable", message=reason)
        proc.active.clear()
        if isinstance(proc, Worker):
            proc.models.clear()
            for p in list(proc.queue):
                self.finish(p, code="unavailable", message=reason)
            proc.ring.become_writer()

def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The connection a frame came over (ZMQ_SRCFD); None where the transport has none (inproc)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if fd >= 0 else None


def run_frontend_process(config: Config, run: RunSpec, index: int = 0) -> None:
    child_main("frontend", index, run, lambda ctx: Frontend(ctx, config, run))
