"""Every internal socket address of a run, in one frozen struct built by the supervisor, and the one
socket factory that sets linger, high-water marks and limits on every socket.

Long-lived receivers bind a PULL socket; producers connect PUSH sockets to it. Addresses are ipc
paths in a private per-run directory (mode 0700).
"""

from __future__ import annotations

import logging
from typing import Sequence

import msgspec
import zmq

from shm.requests import owner_of
from shm.ring import RingSpec

log = logging.getLogger(__name__)


class Endpoints(msgspec.Struct, frozen=True):
    supervisor: str                  # PULL: Ready / Fatal from every child
    frontend: tuple[str, ...]        # PULL per client-facing process (frontend i; a GPU host's bridge)
    gpu: tuple[str, ...]             # PULL per inference worker
    cpu: tuple[str, ...]             # PULL per compositing process

    @classmethod
    def in_dir(cls, run_dir: str, n_gpu: int, n_cpu: int, n_frontends: int = 1) -> "Endpoints":
        return cls(f"ipc://{run_dir}/supervisor", tuple(f"ipc://{run_dir}/frontend{i}" for i in range(n_frontends)),
                   tuple(f"ipc://{run_dir}/gpu{i}" for i in range(n_gpu)),
                   tuple(f"ipc://{run_dir}/cpu{i}" for i in range(n_cpu)))


class StoreSpec(msgspec.Struct, frozen=True):
    """Where the shared background store lives (see shm.store)."""

    index_name: str
    data_name: str
    n_entries: int
    entry_bytes: int
    max_width: int
    max_height: int
    lock_path: str
    eviction: str = "lru"


class RunSpec(msgspec.Struct, frozen=True):
    """What every child process gets besides the config: addresses and shared memory."""

    run_prefix: str
    run_dir: str
    endpoints: Endpoints
    # per client-facing process, then per inference worker ([owner * workers + worker]); each written by
    # its process (shm/requests.py: a request's owner)
    input_rings: tuple[RingSpec, ...]
    output_rings: tuple[RingSpec, ...]   # per inference worker; written by that worker
    store: StoreSpec
    devices: tuple[str, ...]             # per inference worker: "cpu", "cuda:N" or "remote:<endpoint>"
    image_rings: tuple[RingSpec, ...] = ()   # per compositing process: raw frames; written by it
    supervisor_pid: int = 0                  # children die with this process (shm.child)
    board: str = ""                          # the client-facing processes' sessions (shm/board.py); "": none

    def inputs_of(self, owner: int) -> tuple[RingSpec, ...]:
        """Client-facing process `owner`'s input rings, one per inference worker."""
        n = len(self.devices)
        return self.input_rings[owner * n:(owner + 1) * n]

    def inputs_to(self, worker: int) -> tuple[RingSpec, ...]:
        """Inference worker `worker`'s input rings, one per client-facing process."""
        return self.input_rings[worker::len(self.devices)]


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                hwm: int = 0, max_message_bytes: int | None = None) -> zmq.Socket:
    """All internal sockets: linger 0 (shutdown never blocks on a dead peer), unbounded HWM by
    default (internal queues are bounded by shm slots and queue_depth, not by dropping)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


def network_socket(ctx: zmq.Context, kind: int, max_message_bytes: int) -> zmq.Socket:
    """A socket of the bridge (either end): bounded messages, and no work queued for a peer that is
    not connected."""
    sock = make_socket(ctx, kind, max_message_bytes=max_message_bytes)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock


class Owners:
    """A worker's or compositor's PUSH sockets to every client-facing process (Endpoints.frontend): a
    request's answer goes to the process that made it (its id's owner: shm/requests.py), events that
    every process keeps (a model loaded, a process's state) to all, and figures the host counts once
    (a device step's) to the first."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str]):
        self.socks = [make_socket(ctx, zmq.PUSH, connect=a) for a in endpoints]

    def _of(self, req: int):
        owner = owner_of(req)
        if owner < len(self.socks):
            return self.socks[owner]
        log.error("request %d names client-facing process %d of %d; its answer is dropped", req, owner,
                  len(self.socks))
        return None

    def send(self, req: int, data: bytes) -> None:
        sock = self._of(req)
        if sock is not None:
            sock.send(data)

    def send_multipart(self, req: int, parts: list, copy: bool = True) -> None:
        sock = self._of(req)
        if sock is not None:
            sock.send_multipart(parts, copy=copy)

    def broadcast(self, data: bytes) -> None:
        for sock in self.socks:
            sock.send(data)

    def first(self, data: bytes) -> None:
        self.socks[0].send(data)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
