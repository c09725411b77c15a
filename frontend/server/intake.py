"""Client requests into the client-facing process: the envelope, the message's bounds (frames, header
bytes, total bytes) before it is parsed, the header and payload checked against the model's shapes
(server/validate.py), the tenant's models, then one of: an answer at once (health), the catalog read
off the event loop first (a model not read yet, `models`), a session op (frontend/live/), or an engine
request carrying its `Call`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import zmq

from config.assets import frame_index
from frontend.core.request import Inputs, Kind, Request, RequestError
from frontend.server import control
from frontend.server.calls import Call, ReplyTo, Server, Tenant
from frontend.server.catalog import ModelSpec
from frontend.server.validate import check_message, check_pcm, check_request, check_tensors, parse_header
from lipsync_client import protocol as P
from shm.codes import ErrorCode
from shm.requests import tenant_client

log = logging.getLogger(__name__)
VIEWER_START_TIMEOUT_S = 30.0   # a webrtc session_open waits this long at most for the viewer to start
KINDS = {P.Op.INFER: Kind.INFER, P.Op.COMPOSITE: Kind.COMPOSITE, P.Op.LOAD: Kind.LOAD, P.Op.UNLOAD: Kind.UNLOAD,
         P.Op.STATS: Kind.STATS}


class Intake:
    """`tenants`: client key (z85) -> its tenant, None when clients need no key; `live`: the live
    sessions (frontend/live/service.Live); `viewer_task`: the WebRTC viewer's start while it runs."""

    def __init__(self, server: Server, live: Any, tenants: Optional[dict[str, Tenant]]):
        self.server, self.live, self.tenants = server, live, tenants
        self.config, self.catalog, self.metrics = server.config, server.catalog, server.metrics
        self.viewer_task: Optional[asyncio.Task] = None

    def request(self, index: int, sock, frames: list) -> None:
        """A client's message, as it came in on ROUTER `index`."""
        # Envelope: routing id, then frames up to and including the empty delimiter.
        delim = next((i for i, f in enumerate(frames) if not len(f)), None)   # (len: a frame's size)
        if delim is None:  # a DEALER that sent no delimiter: answer in kind
            client, body = ReplyTo(sock, [frames[0]]), frames[1:]
        else:
            client, body = ReplyTo(sock, frames[: delim + 1]), frames[delim + 1:]
        fd = _source_fd(frames[0])
        client.conn = (index, fd) if fd is not None else None
        if not body:
            self.server.error(client, None, ErrorCode.BAD_REQUEST, "empty request: send [header, payload...]")
            return
        if self.tenants is not None:
            client.tenant = self.tenants.get(body[0].get("User-Id"))
        try:
            lim = self.config.limits
            check_message([len(f) for f in body], lim.max_header_bytes, lim.max_message_bytes)
            header = parse_header(body[0].bytes)
            payload = [f.buffer for f in body[1:]]
            check_request(header, payload, lim.max_batch)
            if client.tenant is not None and header.model is not None and not client.tenant.allows(header.model):
                raise RequestError(ErrorCode.FORBIDDEN, f"model {header.model!r} does not belong to tenant "
                                   f"{client.tenant.name}; use one of its models", header.id)
        except RequestError as err:
            self.metrics.count_request("invalid", "", err.code.value)
            self.server.error(client, err.request_id, err.code, err.message)
            return
        call = Call(header, client, time.monotonic(), self.server)
        if header.op is P.Op.HEALTH:
            self.server.send(client, control.health(self.server, call))
            self.metrics.count_request("health", "", "ok")
            return
        if header.op is P.Op.MODELS or (header.model is not None and header.op is not P.Op.STATS
                                        and self.catalog.known(header.model) is None):
            # NOTE: the model's files are read off the event loop; meanwhile other clients are served.
            asyncio.create_task(self._after_catalog(call, payload))
            return
        self._submit(call, payload)

    def _refuse(self, call: Call, err: RequestError) -> None:
        self.metrics.count_request(call.header.op.value, call.label, err.code.value)
        self.server.error(call.reply_to, call.header.id, err.code, err.message, err.retry_after_s)

    def _timeout_s(self, header: P.RequestHeader) -> float:
        return header.timeout_ms / 1000 if header.timeout_ms else self.config.limits.request_timeout_s

    async def _after_catalog(self, call: Call, payload: list) -> None:
        header = call.header
        try:
            budget = self._timeout_s(header) - (time.monotonic() - call.t0)
            if header.op is P.Op.MODELS:
                reply = await asyncio.wait_for(control.models(self.server, call), max(budget, 0.001))
                self.server.send(call.reply_to, reply)
                self.metrics.count_request("models", "", "ok")
                return
            await asyncio.wait_for(self.catalog.get(header.model), max(budget, 0.001))
        except asyncio.TimeoutError:
            self.server.error(call.reply_to, header.id, ErrorCode.TIMEOUT, f"reading the files of model "
                              f"{header.model} took longer than the request's deadline; is its storage slow? "
                              "(timeout_ms)")
            return
        except Exception as err:  # a bug: the client still gets exactly one reply
            log.exception("catalog read failed")
            self.server.error(call.reply_to, header.id, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
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
            self._refuse(call, err)
            return
        now = time.monotonic()
        tenant = call.reply_to.tenant
        self.server.submit(Request(kind, call.spec.id if call.spec else header.model, batch,
                                   deadline=now + self._timeout_s(header), conn=call.reply_to.conn, work=call,
                                   inputs=inputs, client=tenant_client(tenant.name) if tenant else
                                   call.reply_to.conn or call.reply_to.peer),
                           now)

    def _session_op(self, call: Call, payload: list) -> None:
        header = call.header
        if header.op is P.Op.SESSION_OPEN and header.webrtc and self.viewer_task is not None \
                and not self.viewer_task.done():
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
            self._refuse(call, err)
            return
        self.metrics.count_request(header.op.value, call.label, "ok")
        if reply is not None:   # (a session_open is answered by live/ once its session is ready)
            self.server.send(call.reply_to, reply)

    async def _after_viewer(self, call: Call, payload: list) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.viewer_task), VIEWER_START_TIMEOUT_S)
        except Exception as err:
            log.exception("the WebRTC viewer did not start")
            self.metrics.count_request(call.header.op.value, call.label, ErrorCode.UNAVAILABLE.value)
            self.server.error(call.reply_to, call.header.id, ErrorCode.UNAVAILABLE,
                              f"header.webrtc: the WebRTC viewer did not start ({type(err).__name__}: {err}); "
                              "see the server's log")
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


def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The connection a frame came over (ZMQ_SRCFD); None where the transport has none (inproc)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if fd >= 0 else None
