"""What the client-facing process keeps of a client's request (the engine's Request.data), where its
reply goes, and the tenant it belongs to. Requests themselves live in the engine (frontend/core/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

from lipsync_client import protocol as P


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


@dataclass
class Call:
    """A client's request as this process keeps it."""

    header: P.RequestHeader
    reply_to: ReplyTo
    t0: float
    spec: Any = None                   # the model's ModelSpec (server/catalog.py), once known
    frames: list[int] = field(default_factory=list)
    pcm: Optional[bytes] = None        # return_audio: the PCM sent, sliced per frame into the reply

    @property
    def label(self) -> str:
        """The model's metrics label: only models the catalog knows get their own (a client sending
        random ids must not grow the label set without bound)."""
        return self.spec.id if self.spec is not None else ("" if self.header.model is None else "_other")
