"""The visual input of an audio-only request, built from the avatar's own crops, as SyncTalk_2D does:

    R = C[4:324, 4:324]                      (C: the frame's 328x328 bicubic face crop, uint8 BGR)
    M = R with M[5:310, 5:315] = 0           (cv2.rectangle((5, 5, 310, 305)) filled black)
    visual = concat(R / 255, M / 255) in CHW, unmasked first, float32

One write per frame into a buffer allocated once per worker.
"""

from __future__ import annotations

import numpy as np

from config.geometry import INNER

MASK_ROWS, MASK_COLS = slice(5, 310), slice(5, 315)
_255 = np.float32(255)


def build_visual(crops: list[np.ndarray], out: np.ndarray) -> None:
    """crops: 328x328x3 uint8 each; out: [len(crops), 6, 320, 320] float32."""
    for i, crop in enumerate(crops):
        np.divide(crop[INNER, INNER].transpose(2, 0, 1), _255, out=out[i, :3], dtype=np.float32)
        out[i, 3:] = out[i, :3]
        out[i, 3:, MASK_ROWS, MASK_COLS] = 0
