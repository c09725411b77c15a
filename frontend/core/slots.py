"""Writing a request's tensors into an inference worker's input slot, for both shells (the client
frontend and the GPU host's bridge): the visual input first, the audio after it at AUDIO_ALIGN, as
supervisor sizes the slots (config.geometry.input_slot_bytes)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from config.geometry import audio_offset
from shm.ring import SlotRing, TensorRef


def write_inputs(ring: SlotRing, req: int, visual: Optional[np.ndarray], audio: np.ndarray,
                 audio_shape: Optional[tuple[int, ...]] = None) -> tuple[Optional[TensorRef], TensorRef]:
    """Take a slot for `req` and write its inputs; `audio` is broadcast to `audio_shape` when given (one
    window for every frame). The engine counted a free slot, so none free here is a bug."""
    slot = ring.try_acquire(req)
    if slot is None:
        raise RuntimeError(f"input ring {ring.spec.name} has no free slot, though the engine counted one")
    offset, visual_ref = 0, None
    if visual is not None:
        ring.writable(slot, 0, "float32", visual.shape)[...] = visual
        visual_ref = ring.ref(slot, 0, "float32", visual.shape)
        offset = audio_offset(visual.nbytes)
    shape, dtype = tuple(audio_shape or audio.shape), str(audio.dtype)
    ring.writable(slot, offset, dtype, shape)[...] = audio
    return visual_ref, ring.ref(slot, offset, dtype, shape)
