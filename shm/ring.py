"""Fixed-size slot rings in shared memory: the only way tensors move between local processes.

Byte layout of one ring segment (all integers little-endian):

    0                  64                64+8n             64+16n      data_offset (4 KiB aligned)
    +------------------+-----------------+-----------------+-----------+---------+---------+----
    | header           | generation[n]   | request[n]      | (padding) | slot 0  | slot 1  | ...
    | magic "LSRING01" | u64 per slot    | u64 per slot:   |           | slot_bytes each,
    | n_slots u32      | odd = in use,   | request id that |           | 4 KiB aligned
    | (pad) u32        | even = free     | holds the slot  |           |
    | slot_bytes u64   |                 | (diagnostics)   |           |
    | data_offset u64  |                 |                 |           |
    +------------------+-----------------+-----------------+-----------+---------+---------+----

Slot states (kept by the ring's one writer; the generation's parity mirrors them in shared memory):

    FREE --acquire(request)--> WRITING --publish: send a TensorRef--> PUBLISHED --release--> FREE
     gen even                 gen += 1 (odd)                          readers read        gen += 1

A request holds an *extent*: one slot, or a run of adjacent slots taken and freed together, so a
ring whose slots are one frame's room gives a request of 1 frame 1 slot and one of 32 frames 32 (the
input and output rings of inference workers, config.geometry). A handle names the extent's first slot
and may reach past that slot's end into the rest of the extent.

A `TensorRef` (ring, slot, generation, offset, dtype, shape) is all a ZeroMQ message carries.
A reader checks the generation before it hands out a view and again (`verify`) after it has used
the bytes, so a stale handle raises `StaleHandle` and never yields another request's data.
Release comes back to the writer as a ZeroMQ message (which orders memory); every slot is tied to
a request id, so a timeout, abort or disconnect frees it through `release_request`.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Callable, Collection, Sequence
from typing import Optional

import msgspec
import numpy as np

from shm.requests import same_owner_below
from shm.segment import Segment

MAGIC = b"LSRING01"
_HEADER = struct.Struct("<8sII QQ")
_TABLE_OFFSET = 64
PAGE = 4096


def _align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class RingSpec(msgspec.Struct, frozen=True, array_like=True):
    """What a process needs to attach a ring: its segment name and geometry."""

    name: str
    n_slots: int
    slot_bytes: int

    @property
    def data_offset(self) -> int:
        return _align(_TABLE_OFFSET + 16 * self.n_slots)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.n_slots * self.slot_bytes

    @classmethod
    def for_bytes(cls, name: str, n_slots: int, min_slot_bytes: int) -> "RingSpec":
        return cls(name, n_slots, _align(max(min_slot_bytes, 1)))

    @classmethod
    def in_pages(cls, name: str, largest: int, largest_bytes: int, page_bytes: int) -> "RingSpec":
        """A ring of `page_bytes` slots with room for `largest` extents of `largest_bytes` each: a request
        takes as many adjacent slots as its bytes need, so many small requests share the room of a few
        large ones."""
        page = _align(max(page_bytes, 1))
        return cls(name, max(-(-largest * largest_bytes // page), 1), page)


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A handle to one tensor inside a ring slot; valid while the slot's generation holds."""

    ring: str
    slot: int
    generation: int
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape, dtype=np.int64))


class RingError(RuntimeError):
    """Base class of ring errors."""


class RingFull(RingError):
    """No free slot within the timeout: this is backpressure. The message names the setting."""


class StaleHandle(RingError):
    """The slot was released or reused since the handle was made."""


class SlotState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    PUBLISHED = "published"


class SlotRing:
    """One ring, as mapped by one process. Exactly one process per ring is the writer."""

    def __init__(self, spec: RingSpec, segment: Segment):
        self.spec = spec
        self._segment = segment
        buf = segment.buf
        magic, n_slots, _, slot_bytes, data_offset = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC or n_slots != spec.n_slots or slot_bytes != spec.slot_bytes:
            raise RingError(f"segment {spec.name} does not hold the ring described by {spec}")
        n = spec.n_slots
        self._gen = np.ndarray((n,), dtype="<u8", buffer=buf, offset=_TABLE_OFFSET)
        self._req = np.ndarray((n,), dtype="<u8", buffer=buf, offset=_TABLE_OFFSET + 8 * n)
        self._data = np.ndarray((n, slot_bytes), dtype=np.uint8, buffer=buf, offset=data_offset)
        self._flat = self._data.reshape(-1)
        # Writer-side bookkeeping; empty in processes that only read.
        self._state: list[SlotState] = []
        self._extent: dict[int, int] = {}             # first slot of an extent -> its slots
        self._by_request: dict[int, list[int]] = {}   # request -> the first slots of its extents
        self._cursor = 0

    # -- creation and attachment ------------------------------------------------------------

    @classmethod
    def create(cls, spec: RingSpec, populate: bool = True) -> "SlotRing":
        """Create the segment. Only the supervisor calls this, and later `close(unlink=True)`."""
        segment = Segment(spec.name, spec.total_bytes, create=True, populate=populate)
        _HEADER.pack_into(segment.buf, 0, MAGIC, spec.n_slots, 0, spec.slot_bytes, spec.data_offset)
        return cls(spec, segment)

    @classmethod
    def attach(cls, spec: RingSpec, populate: bool = True) -> "SlotRing":
        """Map an existing ring; never unlinks it, never registers it with a resource tracker."""
        try:
            segment = Segment(spec.name, populate=populate)
        except FileNotFoundError:
            raise RingError(f"shared-memory ring {spec.name} does not exist (is the supervisor running?)") from None
        return cls(spec, segment)

    def data(self) -> np.ndarray:
        """Every slot's bytes, [n_slots, slot_bytes] uint8: what a GPU worker pins for the device once.
        NOTE: whoever registers it unregisters it before `close`, which unmaps it."""
        return self._data

    def close(self, unlink: bool = False) -> None:
        self._gen = self._req = self._data = self._flat = None  # drop views before the mapping
        self._segment.close()
        if unlink:
            self._segment.unlink()

    # -- writer side --------------------------------------------------------------------------

    def become_writer(self) -> None:
        """Take the writer role. A restarted writer frees every slot its predecessor held."""
        for slot in range(self.spec.n_slots):
            if self._gen[slot] % 2:
                self._gen[slot] += 1
                self._req[slot] = 0
        self._state = [SlotState.FREE] * self.spec.n_slots
        self._extent.clear()
        self._by_request.clear()
        self._cursor = 0

    def slots_for(self, nbytes: int) -> int:
        """How many adjacent slots `nbytes` take (at least one)."""
        return max(-(-nbytes // self.spec.slot_bytes), 1)

    def try_acquire(self, request_id: int, count: int = 1) -> Optional[int]:
        """The first of `count` adjacent free slots for `request_id` (now WRITING), or None when no such
        run is free."""
        n = self.spec.n_slots
        if not 1 <= count <= n:
            return None
        # Round-robin from the last extent handed out: a released slot is reused as late as possible,
        # which gives a slow reader of a stale handle the most time to notice; requests end roughly in
        # the order they came, so the free slots stay mostly one run.
        state, start, tried = self._state, self._cursor % n, 0
        while tried < n:
            if start + count > n:   # an extent does not wrap around the ring's end
                tried += n - start
                start = 0
                continue
            busy = next((s for s in range(start + count - 1, start - 1, -1) if state[s] is not SlotState.FREE), None)
            if busy is None:
                break
            tried += busy + 1 - start
            start = (busy + 1) % n
        else:
            return None
        self._cursor = start + count
        for slot in range(start, start + count):
            self._gen[slot] += 1
            self._req[slot] = request_id
            state[slot] = SlotState.WRITING
        self._extent[start] = count
        self._by_request.setdefault(request_id, []).append(start)
        return start

    def acquire(self, request_id: int, timeout_s: float, wait: Callable[[float], None],
                setting: str = "shm.slots", count: int = 1) -> int:
        """Acquire `count` adjacent slots, calling `wait(remaining_s)` (which should process release
        messages) until they free up; raise `RingFull` naming `setting` after `timeout_s`."""
        if count > self.spec.n_slots:
            raise RingFull(f"ring {self.spec.name}: {count} slots asked for, the ring has {self.spec.n_slots}; "
                           f"raise {setting}")
        deadline = time.monotonic() + timeout_s
        while (slot := self.try_acquire(request_id, count)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingFull(
                    f"ring {self.spec.name}: {count} adjacent of {self.spec.n_slots} slots did not come free in "
                    f"{timeout_s:.3g}s; raise {setting} or lower the number of requests in flight")
            wait(remaining)
        return slot

    def writable(self, slot: int, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """A writable array inside an extent this writer holds (`slot`: its first)."""
        if not self._state or self._state[slot] is SlotState.FREE or slot not in self._extent:
            raise RingError(f"ring {self.spec.name}: slot {slot} is not held by this writer")
        return self._view(slot, offset, dtype, shape, self._extent[slot])

    def ref(self, slot: int, offset: int, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        """Publish: the handle that a message carries to a reader."""
        for s in range(slot, slot + self._extent.get(slot, 1)):
            self._state[s] = SlotState.PUBLISHED
        return TensorRef(self.spec.name, slot, int(self._gen[slot]), offset, str(np.dtype(dtype)), tuple(shape))

    def release(self, slot: int) -> None:
        """Free the extent that starts at `slot`."""
        if not self._state or self._state[slot] is SlotState.FREE or slot not in self._extent:
            return
        request_id = int(self._req[slot])
        for s in range(slot, slot + self._extent.pop(slot)):
            self._gen[s] += 1
            self._req[s] = 0
            self._state[s] = SlotState.FREE
        slots = self._by_request.get(request_id, [])
        if slot in slots:
            slots.remove(slot)
        if not slots:
            self._by_request.pop(request_id, None)

    def release_request(self, request_id: int) -> int:
        """Free every slot tied to `request_id`; return how many."""
        slots = list(self._by_request.get(request_id, ()))
        for slot in slots:
            self.release(slot)
        return len(slots)

    def release_below(self, floor: int, keep: Collection[int] = ()) -> int:
        """Free every slot tied to a request id of `floor`'s owner below `floor` (a restarted owner's
        predecessor's: shm/messages ResetRequests, shm/requests.py), but those of the requests in `keep`;
        return how many extents."""
        old = [req for req in self._by_request if same_owner_below(req, floor) and req not in keep]
        return sum(self.release_request(req) for req in old)

    def held(self, request_id: int) -> Optional[int]:
        """The first slot of the extent `request_id` holds (its first, where it holds several)."""
        extents = self._by_request.get(request_id)
        return extents[0] if extents else None

    def slots_in_use(self) -> int:
        return sum(state is not SlotState.FREE for state in self._state)

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    # -- reader side --------------------------------------------------------------------------

    def read(self, ref: TensorRef) -> np.ndarray:
        """A read-only view of the tensor; raises `StaleHandle` if the slot moved on."""
        self.verify(ref)
        view = self._view(ref.slot, ref.offset, ref.dtype, ref.shape)
        view.flags.writeable = False
        return view

    def verify(self, ref: TensorRef) -> None:
        """Raise `StaleHandle` unless the slot still holds the generation the handle names.
        Call it after using the bytes too: a slot reused mid-read fails here."""
        if ref.ring != self.spec.name:
            raise RingError(f"handle for ring {ref.ring} used on ring {self.spec.name}")
        current = int(self._gen[ref.slot])
        if current != ref.generation:
            raise StaleHandle(
                f"ring {ref.ring} slot {ref.slot}: handle generation {ref.generation}, slot is at {current} "
                "(released or reused: the request timed out or was cancelled)")

    def _view(self, slot: int, offset: int, dtype: str, shape: tuple[int, ...],
              count: Optional[int] = None) -> np.ndarray:
        """The bytes of a tensor at `offset` into the extent that starts at `slot`: its `count` slots
        (a reader, which does not know the extent, is held to the ring's end)."""
        n = self.spec.n_slots
        if not 0 <= slot < n:
            raise RingError(f"ring {self.spec.name}: slot {slot} out of range 0..{n - 1}")
        dt = np.dtype(dtype)
        nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        room = (count if count is not None else n - slot) * self.spec.slot_bytes
        if offset < 0 or offset + nbytes > room:
            raise RingError(
                f"ring {self.spec.name}: {nbytes} bytes at offset {offset} do not fit {room} bytes held "
                f"({self.spec.slot_bytes} a slot; raise limits.max_batch or limits.max_audio_elements?)")
        start = slot * self.spec.slot_bytes + offset
        return self._flat[start:start + nbytes].view(dt).reshape(shape)


class SlotRings:
    """A reader's rings of several writers (an inference worker's input rings, one per client-facing
    process), by name: a handle reads from the ring it names."""

    def __init__(self, specs: Sequence[RingSpec]):
        self._by_name = {spec.name: SlotRing.attach(spec) for spec in specs}

    def __iter__(self):
        return iter(self._by_name.values())

    def ring(self, ref: TensorRef) -> SlotRing:
        ring = self._by_name.get(ref.ring)
        if ring is None:
            raise RingError(f"handle for ring {ref.ring}, which is not one of this reader's")
        return ring

    def read(self, ref: TensorRef) -> np.ndarray:
        return self.ring(ref).read(ref)

    def verify(self, ref: TensorRef) -> None:
        self.ring(ref).verify(ref)

    def close(self) -> None:
        for ring in self:
            ring.close()
