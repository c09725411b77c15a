"""SyncTalk_2D's own compositing math, which the model was trained for, and the encoders.

For frame k with clipped crop box (x1, y1, x2, y2), w = x2 - x1, h = y2 - y1, and mouth P (3x320x320):
  1. C = cv2.resize(background[y1:y2, x1:x2], (328, 328), INTER_CUBIC)      (cached in the store)
  2. Q = C.copy(); Q[4:324, 4:324] = floor(255 * P) as HWC uint8 (truncation, clipped to 0..255)
  3. out = background.copy(); out[y1:y2, x1:x2] = cv2.resize(Q, (w, h), INTER_CUBIC)   (hard paste)
"""

from __future__ import annotations

import functools

import cv2
import numpy as np

from config.geometry import INNER, mouths_to_uint8
from cpu_actor.jpeg import encode_jpeg


@functools.cache
def _fpng():
    """fpng: the one PNG writer within 2x of JPEG here (docs/benchmarks.md); None: cv2 is the fallback.
    Imported with the first PNG frame: 6-8 ms that a compositor's start does not need to pay."""
    try:
        from fpng import fpng_ext
    except ImportError:  # pragma: no cover - fpng ships wheels for x86_64 Linux only
        return None
    return fpng_ext


RAW_LAYOUTS = {"raw-rgb24": cv2.COLOR_BGR2RGB, "raw-rgba": cv2.COLOR_BGR2RGBA}
RAW_I420 = "raw-i420"   # from the store's I420 background, only the face box converted (cpu_actor/h264.py)


def mouth_to_uint8(mouth: np.ndarray) -> np.ndarray:
    """P [3,320,320] float32 in [0,1] -> HWC uint8 (step 2's truncation), contiguous: cv2.merge
    interleaves the planes ~15x faster than pasting a transposed view (0.04 vs 0.38 ms)."""
    planes = mouths_to_uint8(mouth)
    return cv2.merge([planes[0], planes[1], planes[2]])


def paste(background: np.ndarray, crop: np.ndarray, mouth_hwc: np.ndarray, rect) -> np.ndarray:
    """Steps 2 and 3, in place on `background` and `crop` (both the caller's own copies)."""
    x1, y1, x2, y2 = (int(v) for v in rect)
    crop[INNER, INNER] = mouth_hwc
    background[y1:y2, x1:x2] = cv2.resize(crop, (x2 - x1, y2 - y1), interpolation=cv2.INTER_CUBIC)
    return background


def encode_image(image: np.ndarray, fmt: str, quality: int) -> bytes | memoryview:
    """jpeg (libjpeg-turbo, 4:2:0, straight from BGR, a restart marker per MCU row: cpu_actor/jpeg.py),
    png (lossless), or raw HxWx3 BGR bytes."""
    if fmt == "jpeg":
        return encode_jpeg(image, quality)
    if fmt == "png":
        return encode_png(image)
    if fmt == "raw":
        return memoryview(np.ascontiguousarray(image)).cast("B")
    if fmt in RAW_LAYOUTS:   # a live session's raw frames in the layout its client plays (raw-i420: worker.py)
        return memoryview(cv2.cvtColor(image, RAW_LAYOUTS[fmt])).cast("B")
    raise ValueError(f"format must be jpeg, png or raw, got {fmt!r}")


def encode_png(image: np.ndarray) -> bytes:
    rgb = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    fpng = _fpng()
    if fpng is not None:
        return fpng.encode_ndarray(rgb)
    ok, data = cv2.imencode(".png", image, [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_FILTER,
                                            cv2.IMWRITE_PNG_FILTER_UP, cv2.IMWRITE_PNG_STRATEGY,
                                            cv2.IMWRITE_PNG_STRATEGY_HUFFMAN_ONLY])
    return data.tobytes()
