"""H.264 frames for live sessions: backgrounds kept in I420, the mouth pasted in I420, and one libx264
encoder (PyAV) per session.

Converting a whole 720p BGR frame to I420 costs about as much as encoding it, so each background is
converted once, when it enters the shared store (an I420 entry beside its BGR one), and only the
face box is converted per frame:

  speech compositing (the session's own compositor, else any):  the mouth is pasted into the BGR crop
      as for every format (cpu_actor/composite.py), resized to the face box, and the box, widened to
      even coordinates, is converted to I420: a *box* (`pack_box`), about 110 KB for a 270x270 face,
      kept here for the session's encoder (`KeptBoxes`) or, composited elsewhere, sent on with the
      frame's encode request.
  encoding (the session's own compositor, in frame order):  copy the I420 background, write the box
      into its planes, encode. Idle frames are the background as it is.

The box's 1-pixel widening to even coordinates takes those pixels from the I420 background (converted
to BGR and back: a rounding of at most a few levels on that 1-pixel border).

Loop chunks: the avatar's idle loop encoded once, `gop` frames per chunk, each starting with an IDR,
so a silent session can send them instead of encoding (frontend/h264.py decides when).
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from fractions import Fraction
from typing import TYPE_CHECKING, Optional

import cv2
import numpy as np

from config.geometry import INNER
from shm.messages import H264Settings

if TYPE_CHECKING:
    import av   # NOTE: imported where it is used: a compositor opens no encoder until an H.264 session does

_BOX = struct.Struct("<4H")
IDLE_ENCODER_S = 60.0     # an encoder whose session sent nothing for this long is dropped
MAX_SESSION_FPS = 60      # the highest frame rate a session may ask for (header.fps)


def to_i420(bgr: np.ndarray) -> np.ndarray:
    """HxWx3 BGR -> (H*3/2, W) I420 (BT.601 limited range, what H.264 decoders assume untagged)."""
    h, w = bgr.shape[:2]
    if h % 2 or w % 2:
        raise ValueError(f"h264 needs even frame sizes; this avatar's frames are {w}x{h}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420)


def _planes(i420: np.ndarray, width: int, height: int):
    flat = i420.reshape(-1)
    y = flat[: width * height].reshape(height, width)
    q = width * height // 4
    u = flat[width * height: width * height + q].reshape(height // 2, width // 2)
    v = flat[width * height + q: width * height + 2 * q].reshape(height // 2, width // 2)
    return y, u, v


def _even_box(rect, width: int, height: int) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = (int(v) for v in rect)
    return x1 & ~1, y1 & ~1, min((x2 + 1) & ~1, width), min((y2 + 1) & ~1, height)


def pack_box(i420: np.ndarray, width: int, height: int, crop: np.ndarray, mouth_hwc: np.ndarray, rect) -> bytearray:
    """The face box of a speech frame in I420: SyncTalk_2D's paste (cpu_actor/composite.paste) done on
    the crop and box only. `crop` is the caller's own copy (written)."""
    x1, y1, x2, y2 = (int(v) for v in rect)
    crop[INNER, INNER] = mouth_hwc
    patch = cv2.resize(crop, (x2 - x1, y2 - y1), interpolation=cv2.INTER_CUBIC)
    ex1, ey1, ex2, ey2 = _even_box(rect, width, height)
    if (ex1, ey1, ex2, ey2) != (x1, y1, x2, y2):   # widen: the border pixels are the background's
        y, u, v = _planes(i420, width, height)
        region = np.concatenate([y[ey1:ey2, ex1:ex2].reshape(-1), u[ey1 // 2:ey2 // 2, ex1 // 2:ex2 // 2].reshape(-1),
                                 v[ey1 // 2:ey2 // 2, ex1 // 2:ex2 // 2].reshape(-1)])
        bgr = cv2.cvtColor(region.reshape((ey2 - ey1) * 3 // 2, ex2 - ex1), cv2.COLOR_YUV2BGR_I420)
        bgr[y1 - ey1:y2 - ey1, x1 - ex1:x2 - ex1] = patch
        patch = bgr
    h, w = patch.shape[:2]
    box = bytearray(_BOX.size + h * w * 3 // 2)   # converted straight into the message's bytes
    _BOX.pack_into(box, 0, ex1, ey1, ex2, ey2)
    cv2.cvtColor(np.ascontiguousarray(patch), cv2.COLOR_BGR2YUV_I420,
                 dst=np.frombuffer(box, np.uint8, offset=_BOX.size).reshape(h * 3 // 2, w))
    return box


def apply_box(i420: np.ndarray, width: int, height: int, box: bytes) -> None:
    """Write a `pack_box` result into an I420 frame."""
    x1, y1, x2, y2 = _BOX.unpack_from(box)
    w, h = x2 - x1, y2 - y1
    if not (0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height) or len(box) != _BOX.size + w * h * 3 // 2:
        raise ValueError(f"face box {x1, y1, x2, y2} ({len(box)} bytes) does not fit a {width}x{height} frame")
    data = np.frombuffer(box, np.uint8, offset=_BOX.size)
    y, u, v = _planes(i420, width, height)
    q = w * h // 4
    y[y1:y2, x1:x2] = data[: w * h].reshape(h, w)
    u[y1 // 2:y2 // 2, x1 // 2:x2 // 2] = data[w * h: w * h + q].reshape(h // 2, w // 2)
    v[y1 // 2:y2 // 2, x1 // 2:x2 // 2] = data[w * h + q:].reshape(h // 2, w // 2)


def open_encoder(width: int, height: int, settings: H264Settings) -> av.VideoCodecContext:
    """libx264 for live frames: constrained baseline (what browsers decode), no B-frames and no
    look-ahead (zerolatency: one frame in, one access unit out), Annex-B with SPS/PPS before every IDR,
    an IDR every `gop` frames and none from scene cuts, one thread (the process pool is the parallelism)."""
    import av
    fps, bitrate, preset, gop = settings.fps, settings.bitrate, settings.preset, settings.gop
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    rate = Fraction(fps).limit_denominator(1001)
    ctx.time_base, ctx.framerate = 1 / rate, rate
    ctx.bit_rate = bitrate
    ctx.gop_size = gop
    ctx.thread_count = 1
    kbits = max(bitrate // 1000, 1)
    ctx.options = {"preset": preset, "tune": "zerolatency", "profile": "baseline", "forced-idr": "1",
                   "x264-params": f"scenecut=0:min-keyint={gop}:vbv-maxrate={kbits}:vbv-bufsize={kbits}:repeat-headers=1"}
    ctx.open()
    return ctx


def encode_frame(ctx: av.VideoCodecContext, i420: np.ndarray, pts: int, idr: bool) -> bytes:
    import av
    frame = av.VideoFrame.from_numpy_buffer(i420, format="yuv420p")
    frame.pts = pts
    if idr:
        frame.pict_type = av.video.frame.PictureType.I
    packets = ctx.encode(frame)
    if len(packets) != 1:   # zerolatency gives exactly one; anything else would shift the stream
        raise RuntimeError(f"libx264 returned {len(packets)} access units for one frame")
    return bytes(packets[0])


class Encoders:
    """This compositor's session encoders, by session token."""

    def __init__(self):
        self._by_session: OrderedDict[str, tuple[av.VideoCodecContext, tuple, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_session)

    def get(self, session: str, width: int, height: int, settings: H264Settings) -> tuple[av.VideoCodecContext, bool]:
        """(encoder, new): a new session, or new settings, starts a new encoder (its first frame is an IDR)."""
        now = time.monotonic()
        key = (width, height, settings)
        entry = self._by_session.get(session)
        if entry is not None and entry[1] == key:
            self._by_session[session] = (entry[0], key, now)
            self._by_session.move_to_end(session)
            return entry[0], False
        ctx = open_encoder(width, height, settings)
        self._by_session[session] = (ctx, key, now)
        self._by_session.move_to_end(session)
        return ctx, True

    def close(self, session: str) -> None:
        self._by_session.pop(session, None)

    def expire(self) -> None:
        """Drop encoders of sessions that sent nothing for IDLE_ENCODER_S (their close was lost)."""
        cutoff = time.monotonic() - IDLE_ENCODER_S
        while self._by_session and next(iter(self._by_session.values()))[2] < cutoff:
            self._by_session.popitem(last=False)


class KeptBoxes:
    """Face boxes this process composited for its own H.264 sessions (CompositeTask.keep), by session
    and frame index, until the session's encoder takes them: they never cross to the frontend and
    back. A session's frames are decided in order, so taking frame k drops its boxes before k (speech
    that went out idle: late, or cut by an interrupt); the last box taken stays, for a repeated frame."""

    def __init__(self, per_session: int):
        """`per_session`: boxes kept for one session at most (past it the oldest go; the frontend has
        boxes kept only for frames needed within the latency budget)."""
        self.per_session = per_session
        self._boxes: dict[str, dict[int, bytes]] = {}
        self._last: dict[str, tuple[int, bytes]] = {}
        self._touched: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return sum(map(len, self._boxes.values()))

    def put(self, session: str, index: int, box: bytes) -> None:
        boxes = self._boxes.setdefault(session, {})
        boxes[index] = box
        if len(boxes) > self.per_session:
            del boxes[min(boxes)]
        self._touch(session)

    def take(self, session: str, index: int) -> Optional[bytes]:
        """Frame `index`'s box (None: never kept here, or dropped)."""
        boxes = self._boxes.get(session)
        box = boxes.pop(index, None) if boxes is not None else None
        if box is None:
            last = self._last.get(session)
            return last[1] if last is not None and last[0] == index else None
        for k in [k for k in boxes if k < index]:
            del boxes[k]
        self._last[session] = (index, box)
        self._touch(session)
        return box

    def drop(self, session: str) -> None:
        self._boxes.pop(session, None)
        self._last.pop(session, None)
        self._touched.pop(session, None)

    def expire(self) -> None:
        """Drop the boxes of sessions that neither kept nor took one for IDLE_ENCODER_S (their close was lost)."""
        cutoff = time.monotonic() - IDLE_ENCODER_S
        while self._touched and next(iter(self._touched.values())) < cutoff:
            self.drop(next(iter(self._touched)))

    def _touch(self, session: str) -> None:
        self._touched[session] = time.monotonic()
        self._touched.move_to_end(session)
