"""The model's contract, defined once: tensor shapes, SyncTalk_2D's crop geometry, the mouth's uint8
quantization, model ids, and how a request's slots lay out a batch's inputs.

    visual [B, 6, 320, 320] float32   unmasked face crop (BGR / 255), then the masked one, CHW
    audio  [B, *A] float32            A read from the model file ([32, 16, 16] for "ave" features)
    mouth  [B, 3, 320, 320] float32   BGR in [0, 1], CHW

The face crop is resized to 328x328 (bicubic); the model sees and produces its centre 320x320.
"""

from __future__ import annotations

import re

import numpy as np

# NOTE: the shapes and the id pattern are the wire's, defined once in the client's contract
from lipsync_client.contract import MODEL_ID_PATTERN, MOUTH_SHAPE, VISUAL_SHAPE

CROP_SIZE = 328
INNER = slice(4, 324)                  # the centre 320x320 of a 328x328 crop
VISUAL_BYTES = 4 * VISUAL_SHAPE[0] * VISUAL_SHAPE[1] * VISUAL_SHAPE[2]
MOUTH_BYTES = 4 * MOUTH_SHAPE[0] * MOUTH_SHAPE[1] * MOUTH_SHAPE[2]
CROP_BYTES = CROP_SIZE * CROP_SIZE * 3
AUDIO_ALIGN = 64                       # audio follows the visual input in a slot at this alignment

_MODEL_ID = re.compile(MODEL_ID_PATTERN)


def valid_model_id(model_id: object) -> bool:
    return isinstance(model_id, str) and _MODEL_ID.match(model_id) is not None


def audio_offset(visual_bytes: int) -> int:
    """Where the audio starts in an input slot that holds `visual_bytes` of visual input first."""
    return (visual_bytes + AUDIO_ALIGN - 1) // AUDIO_ALIGN * AUDIO_ALIGN


def input_slot_bytes(max_batch: int, max_audio_elements: int) -> int:
    """The input room of a request of `max_batch` frames: its visual input, then its audio."""
    return audio_offset(max_batch * VISUAL_BYTES) + max_batch * max_audio_elements * 4


def input_page_bytes(max_audio_elements: int) -> int:
    """One frame's input room: an input ring's slot (a request takes as many adjacent ones as it needs;
    a live session's, whose visual input is built by the worker, one)."""
    return VISUAL_BYTES + max_audio_elements * 4


def mouths_to_uint8(mouths: np.ndarray) -> np.ndarray:
    """SyncTalk_2D's `np.uint8(P * 255)`: floor(255 * P) clipped to 0..255, layout kept (CHW).
    The compositor and the bridge both use it, so pixels match wherever the conversion runs."""
    scaled = np.multiply(mouths, np.float32(255), dtype=np.float32)
    np.clip(scaled, 0, 255, out=scaled)
    return scaled.astype(np.uint8)


def mouths_from_uint8(mouths_u8: np.ndarray, out: np.ndarray) -> None:
    """float32 values whose floor(255 * P) is exactly the given uint8: (u + 0.5) / 255."""
    np.add(mouths_u8, np.float32(0.5), out=out, dtype=np.float32)
    np.divide(out, np.float32(255), out=out)


def crop_328(background: np.ndarray, rect) -> np.ndarray:
    """Step 1 of SyncTalk_2D's compositing, and the source of the visual input: the clipped crop box
    resized to 328x328, bicubic."""
    x1, y1, x2, y2 = (int(v) for v in rect)
    import cv2   # NOTE: here, not at the top: the frontend and the client need this module, not OpenCV
    return cv2.resize(background[y1:y2, x1:x2], (CROP_SIZE, CROP_SIZE), interpolation=cv2.INTER_CUBIC)
