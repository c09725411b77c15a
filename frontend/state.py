"""What the frontend keeps per client, per request and per process."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from frontend import protocol as P
from frontend.catalog import ModelSpec
from frontend.validate import Tensors
from shm.ring import SlotRing


@dataclass(frozen=True)
class Tenant:
    name: str
    models: Optional[frozenset]    # None: every model

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass
class Client:
    sock: Any                      # the ROUTER socket the request came in on
    envelope: list                 # routing id(s) + empty delimiter, sent back as is
    tenant: Optional["Tenant"] = None
    conn: Optional[tuple] = None   # (ROUTER index, connection fd): what a disconnect names
    gone: bool = False             # the connection closed: nothing is sent to it any more


@dataclass
class Pending:
    req: int
    op: P.Op
    header: P.RequestHeader
    client: Client
    t0: float
    timer: Optional[asyncio.TimerHandle] = None
    worker: Optional[int] = None
    spec: Optional[ModelSpec] = None
    tensors: Optional[Tensors] = None
    frames: list[int] = field(default_factory=list)
    in_slot: bool = False          # holds an input slot of its worker
    dispatched: float = 0.0
    chunks: dict[int, int] = field(default_factory=dict)   # chunk start -> compositor, until done
    images: dict[int, list] = field(default_factory=dict)  # chunk start -> encoded frames
    timing: dict[str, float] = field(default_factory=dict)
    width: int = 0
    height: int = 0
    waiting_on: set[int] = field(default_factory=set)      # workers a multi-worker op still waits for
    image_slots: set[int] = field(default_factory=set)     # compositors holding raw frames for it
    results: list = field(default_factory=list)


@dataclass
class Worker:
    index: int
    device: str
    ring: SlotRing
    sock: Any
    state: str = "starting"
    pid: Optional[int] = None
    restarts: int = 0
    queue: deque = field(default_factory=deque)   # Pending waiting for an input slot
    active: set[int] = field(default_factory=set) # requests assigned here and not finished
    models: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass
class Proc:
    state: str = "starting"
    pid: Optional[int] = None
    restarts: int = 0
    active: set[int] = field(default_factory=set)
