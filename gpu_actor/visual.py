"""The visual input of an audio-only request, built from the avatar's own crops, as SyncTalk_2D does:

    R = C[4:324, 4:324]                      (C: the frame's 328x328 bicubic face crop, uint8 BGR)
    M = R with M[5:310, 5:315] = 0           (cv2.rectangle((5, 5, 310, 305)) filled black)
    visual = concat(R / 255, M / 255) in CHW, unmasked first, float32

One write per frame into a buffer allocated once per worker, a call's frames at a time (`VisualFrames`),
just before the model's call reads them.
"""

from __future__ import annotations

import time

import numpy as np

from config.geometry import INNER

MASK_ROWS, MASK_COLS = slice(5, 310), slice(5, 315)
_255 = np.float32(255)


def build_visual(crops: list[np.ndarray], out: np.ndarray) -> None:
    """crops: 328x328x3 uint8 each; out: [len(crops), 6, 320, 320] float32."""
    import cv2   # NOTE: here, not at the top, as config/geometry.crop_328: a worker's start does not need it
    for i, crop in enumerate(crops):
        # NOTE: planes split first (contiguous), then divided: dividing the HWC crop through a transposed
        # view takes numpy's strided loop, and the masked copy needs only what the mask leaves: 167 -> 101 us
        for c, plane in enumerate(cv2.split(crop[INNER, INNER])):
            np.divide(plane, _255, out=out[i, c], dtype=np.float32)
        reference, masked = out[i, :3], out[i, 3:]
        masked[:, :MASK_ROWS.start] = reference[:, :MASK_ROWS.start]
        masked[:, MASK_ROWS.stop:] = reference[:, MASK_ROWS.stop:]
        masked[:, MASK_ROWS, :MASK_COLS.start] = reference[:, MASK_ROWS, :MASK_COLS.start]
        masked[:, MASK_ROWS, MASK_COLS.stop:] = reference[:, MASK_ROWS, MASK_COLS.stop:]
        masked[:, MASK_ROWS, MASK_COLS] = 0


class VisualFrames:
    """A batch's visual input, built on demand: `frames(start, end)` builds frames [start, end) into the
    buffer's first rows and returns them (gpu_actor/own_session.OwnSessionRunner.run calls it per onnxruntime call,
    so they are read while still in the cache); `spent_s` is the time building took."""

    def __init__(self, crops: list[np.ndarray], buffer: np.ndarray):
        self.crops, self.buffer = crops, buffer
        self.spent_s = 0.0

    def __call__(self, start: int, end: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.buffer[: end - start]
        build_visual(self.crops[start:end], out)
        self.spent_s += time.perf_counter() - t0
        return out
