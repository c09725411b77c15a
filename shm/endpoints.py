"""Every internal socket address of a run, in one frozen struct built by the supervisor, and the one
socket factory that sets linger, high-water marks and limits on every socket.

Long-lived receivers bind a PULL socket; producers connect PUSH sockets to it. Addresses are ipc
paths in a private per-run directory (mode 0700).
"""

from __future__ import annotations

import msgspec
import zmq

from shm.ring import RingSpec


class Endpoints(msgspec.Struct, frozen=True):
    supervisor: str                  # PULL: Ready / Fatal from every child
    frontend: str                    # PULL: results and events for the frontend
    gpu: tuple[str, ...]             # PULL per inference worker
    cpu: tuple[str, ...]             # PULL per compositing process

    @classmethod
    def in_dir(cls, run_dir: str, n_gpu: int, n_cpu: int) -> "Endpoints":
        return cls(f"ipc://{run_dir}/supervisor", f"ipc://{run_dir}/frontend",
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
    input_rings: tuple[RingSpec, ...]    # per inference worker; written by the frontend
    output_rings: tuple[RingSpec, ...]   # per inference worker; written by that worker
    store: StoreSpec
    devices: tuple[str, ...]             # per inference worker: "cpu", "cuda:N" or "remote:<endpoint>"
    image_rings: tuple[RingSpec, ...] = ()   # per compositing process: raw frames; written by it
    supervisor_pid: int = 0                  # children die with this process (shm.child)


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
