"""Writing a request's tensors into an inference worker's input slots, for both shells (the client
frontend and the GPU host's bridge): the visual input first, the audio after it at AUDIO_ALIGN, in as
many adjacent slots of one frame's room as they take (config.geometry.input_page_bytes)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from config.geometry import audio_offset
from frontend.core.request import Request
from frontend.core.scheduler import clients_room
from shm.ring import RingError, RingSpec, SlotRing, TensorRef


class RingRoom:
    """The engine's room (core/scheduler.Room) in the workers' input rings: a request holds the adjacent
    slots its inputs take, and a worker holds at most as many frames in flight as its output ring has
    slots (`outputs`: their specs; a slot a frame), so a burst of small-input requests waits here, where
    limits.queue_depth bounds it, not in the worker. One that can never fit is let through:
    `write_inputs` fails it, naming the setting."""

    def __init__(self, rings: Sequence[SlotRing], outputs: Sequence[RingSpec], share: int = 1):
        """`share`: the client-facing processes whose requests the workers' output rings hold; each
        holds its share of their slots in flight."""
        self.rings = rings
        self.frames = [max(spec.n_slots // share, 1) for spec in outputs]
        self.held: list[dict[int, int]] = [{} for _ in rings]   # per worker: request -> its frames
        self._in_flight = [0] * len(rings)                      # per worker: their sum

    def take(self, worker: int, r: Request, reserve: bool = False) -> bool:
        ring, held, frames = self.rings[worker], self.held[worker], self.frames[worker]
        if held and self._in_flight[worker] + r.batch > clients_room(frames, reserve):
            return False
        count = ring.slots_for(r.inputs.nbytes(r.batch))
        if count <= ring.spec.n_slots and ring.try_acquire(r.req, count) is None:
            return False
        held[r.req] = r.batch
        self._in_flight[worker] += r.batch
        return True

    def share_full(self, worker: int, r: Request, mine: list[Request], reserve: bool = False) -> bool:
        held, share = self.held[worker], clients_room(self.frames[worker], reserve) // 2
        return bool(mine) and sum(held.get(q.req, 0) for q in mine) + r.batch > share

    def free(self, worker: int, req: int) -> None:
        self._in_flight[worker] -= self.held[worker].pop(req, 0)
        self.rings[worker].release_request(req)

    def reset(self, worker: int) -> None:
        self.held[worker].clear()
        self._in_flight[worker] = 0
        self.rings[worker].become_writer()


def write_inputs(ring: SlotRing, req: int, visual: Optional[np.ndarray], audio: np.ndarray,
                 audio_shape: Optional[tuple[int, ...]] = None) -> tuple[Optional[TensorRef], TensorRef]:
    """Write `req`'s inputs into the slots it holds (`RingRoom.take`); `audio` is broadcast to `audio_shape`
    when given (one window for every frame)."""
    slot = ring.held(req)
    if slot is None:
        nbytes = (0 if visual is None else audio_offset(visual.nbytes)) + \
            audio.dtype.itemsize * int(np.prod(audio_shape or audio.shape))
        raise RingError(f"input ring {ring.spec.name}: {nbytes} bytes of inputs need {ring.slots_for(nbytes)} "
                        f"slots of {ring.spec.slot_bytes} bytes, the ring has {ring.spec.n_slots}: raise shm.slots")
    offset, visual_ref = 0, None
    if visual is not None:
        ring.writable(slot, 0, "float32", visual.shape)[...] = visual
        visual_ref = ring.ref(slot, 0, "float32", visual.shape)
        offset = audio_offset(visual.nbytes)
    shape, dtype = tuple(audio_shape or audio.shape), str(audio.dtype)
    ring.writable(slot, offset, dtype, shape)[...] = audio
    return visual_ref, ring.ref(slot, offset, dtype, shape)
