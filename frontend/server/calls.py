"""A client's request as the client-facing process keeps it (`Call`: the engine's `Request.work` for
the requests it submits), where its reply goes, the tenant it belongs to, and how it ends: a `Call`
builds and sends its own reply (infer, composite, load, unload, stats) or error. Requests themselves
live in the engine (frontend/core/)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, Protocol, Sequence, Union

from config.audio import frame_audio
from frontend.core.request import CLIENT_GONE, Kind, Request
from frontend.server import control
from lipsync_client import protocol as P
from shm.codes import ErrorCode
from shm.ring import StaleHandle


@dataclass(frozen=True)
class Tenant:
    name: str
    models: Optional[frozenset]    # None: every model

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass
class ReplyTo:
    """Where a request's reply (and a live session's frames) go."""

    sock: Any                      # the ROUTER socket the request came in on
    envelope: list                 # routing id(s) + empty delimiter, sent back as is
    tenant: Optional[Tenant] = None
    conn: Optional[tuple] = None   # (ROUTER index, connection fd): what a disconnect names

    @cached_property
    def peer(self) -> tuple:
        """Who sent it: the socket and the routing ids (unique per connection, inproc included); the
        ids as bytes are also what a reply is addressed with."""
        return id(self.sock), tuple(getattr(f, "bytes", f) for f in self.envelope)


class Server(Protocol):
    """What a call, its intake (server/intake.py) and the control ops' replies (server/control.py) need
    of the process that took it (server/process.py's Frontend)."""

    config: Any
    metrics: Any
    catalog: Any                   # server/catalog.py
    engine: Any                    # the core Scheduler: its workers, what is loaded
    outputs: Sequence              # each worker's output ring: an `infer` reply is read from it
    store_lookups: dict            # model -> the shared store's hits and misses (the `stats` reply)

    def submit(self, request: Request, now: Optional[float] = None) -> None:
        """Hand a request to the engine."""

    def send(self, reply_to: ReplyTo, header: bytes, data: list = (), req: int = 0, image_slots=()) -> bool:
        """Send a reply (server/replies.py); False if it was dropped."""

    def error(self, reply_to: ReplyTo, request_id, code: ErrorCode, message: str,
              retry_after_s: Optional[float] = None) -> None:
        """Send an error reply (with when to retry, for busy)."""

    def readiness(self) -> tuple[str, Optional[str]]:
        """/readyz's answer (frontend/probes.py), which the `health` op shares."""


@dataclass
class Call:
    """A client's request as this process keeps it."""

    header: P.RequestHeader
    reply_to: ReplyTo
    t0: float
    server: Server = field(repr=False)
    spec: Any = None                   # the model's ModelSpec (server/catalog.py), once known
    frames: list[int] = field(default_factory=list)
    pcm: Optional[bytes] = None        # return_audio: the PCM sent, sliced per frame into the reply

    @property
    def label(self) -> str:
        """The model's metrics label: only models the catalog knows get their own (a client sending
        random ids must not grow the label set without bound)."""
        return self.spec.id if self.spec is not None else ("" if self.header.model is None else "_other")

    # -- how its request ends (core.request.Work) --------------------------------------------------

    def done(self, r: Request) -> None:
        if r.kind is Kind.INFER:
            header, data = self._infer_reply(r)
            if header is None:
                return
        elif r.kind is Kind.COMPOSITE:
            header, data = self._composite_reply(r)
        else:
            header, data = control.reply(self.server, r), []
        sent = self.server.send(self.reply_to, header, data, r.req, r.image_slots)
        self._outcome("ok" if sent else "dropped")

    def failed(self, r: Request, code: Union[ErrorCode, str], message: str) -> None:
        self._outcome(str(getattr(code, "value", code)))
        if code == CLIENT_GONE:
            return
        if code is ErrorCode.TIMEOUT:
            limit = self.header.timeout_ms or int(self.server.config.limits.request_timeout_s * 1000)
            message += f"; the deadline was {limit} ms: raise timeout_ms or limits.request_timeout_s, or send less " \
                       "work at once"
        self.server.error(self.reply_to, self.header.id, code, message)

    def _outcome(self, outcome: str) -> None:
        metrics = self.server.metrics
        metrics.count_request(self.header.op.value, self.label, outcome)
        metrics.of(metrics.latency, "total").observe((time.monotonic() - self.t0) * 1000)

    def _timing(self, r: Request) -> P.Timing:
        return P.Timing(**r.timing, total_ms=(time.monotonic() - self.t0) * 1000)

    def _worker_info(self, r: Request) -> P.WorkerInfo:
        return P.WorkerInfo(device=self.server.engine.workers[r.worker].device, index=r.worker)

    def _infer_reply(self, r: Request):
        # Read the mouths straight from the worker's output ring, copied into the reply frames.
        # NOTE: the engine releases the output slot only after this reply is built.
        ring = self.server.outputs[r.worker]
        try:
            mouths = ring.read(r.output)
            data = [mouths[i].tobytes() for i in range(r.batch)]
            ring.verify(r.output)
        except StaleHandle as err:
            self._outcome("unavailable")
            self.server.error(self.reply_to, self.header.id, ErrorCode.UNAVAILABLE,
                              f"the worker restarted while the reply was read ({err})")
            return None, None
        self.server.metrics.of(self.server.metrics.frames, self.label).inc(r.batch)
        return P.encode(P.InferReply(id=self.header.id, batch=r.batch, timing=self._timing(r),
                                     worker=self._worker_info(r))), data + self._audio_out(r.batch)

    def _composite_reply(self, r: Request):
        width, height = r.size
        header = P.encode(P.CompositeReply(
            id=self.header.id, batch=r.batch, format=self.header.format or self.server.config.output.format,
            width=width, height=height, frames=self.frames, timing=self._timing(r), worker=self._worker_info(r)))
        self.server.metrics.of(self.server.metrics.frames, self.label).inc(r.batch)
        return header, [img for start in sorted(r.images) for img in r.images[start]] + self._audio_out(r.batch)

    def _audio_out(self, batch: int) -> list:
        """return_audio: each frame's 40 ms of the PCM sent, after the frames."""
        return frame_audio(self.pcm, batch) if self.pcm is not None else []
