"""One H.264 session's stream (`H264Stream`), with no sockets: which frames the session encodes, which
it takes from its avatar's pre-encoded idle loop, and the order its access units go out in
(live/h264_sessions.py is its shell).

A session's frames are decided `ENCODE_AHEAD_FRAMES` before they are due (speech if its face box is
ready, else idle) and encoded in order by the session's own compositing process, which keeps its
libx264 encoder; each access unit goes out when its frame is due, never before the one ahead of it.

Silence costs nearly nothing: the avatar's idle loop (its background frames in stream order, 2n
frames for `mirror`, n for `loop`) is encoded once per avatar and encoder settings, in chunks of
`chunk` frames (sessions.h264.loop_chunk) that each start with an IDR. A silent session joins the loop
at the next chunk start (until then its own encoder encodes the background: at most chunk - 1
frames after an utterance) and from there sends the loop's access units as they are. Its next speech frame, or a keyframe request, starts a new GOP of its own encoder with
an IDR, since the decoder's last pictures are then the loop's, not the encoder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from frontend.live.timeline import Outgoing

ENCODE_AHEAD_FRAMES = 2   # a frame is decided (and its encoding starts) this many frame periods before due


@dataclass
class Unit:
    """A decided frame: its access unit once encoded (or taken from the loop)."""
    frame: Outgoing
    au: Optional[bytes] = None
    keyframe: bool = False
    lost: bool = False     # its encoding failed (a compositor died): it is skipped, the next frame is an IDR


@dataclass(frozen=True)
class Kept:
    """A speech frame's face box that stayed in compositing process `compositor` (the one keeping the
    session's encoder when its batch was planned), kept there for the session's frame `index`."""
    compositor: int
    index: int


@dataclass(frozen=True)
class Encode:
    """A frame for the session's encoder."""
    index: int
    background: int
    idr: bool
    box: Any               # speech: the face box in I420, or where it was kept (Kept); b"": the background as it is


class H264Stream:
    """One session's encoded stream."""

    def __init__(self, compositor: int, start_frame: int, period: int, chunk: int):
        self.compositor = compositor
        self.start_frame, self.period, self.chunk = start_frame, period, chunk
        self.need_idr = True       # the next frame must be an IDR (first frame, keyframe request, a loss)
        self.in_loop = False       # the decoder's pictures are the idle loop's
        self.broken = False        # a frame was lost: nothing goes out until the next IDR
        self.units: dict[int, Unit] = {}   # decided, not yet sent
        self.next_send = 0
        self.loop_keys: list = []  # the idle loop chunks' cache keys, by start // chunk (set by live/h264_sessions.py)

    def chunk_of(self, k: int) -> tuple[int, int]:
        """(loop chunk start, offset in it) of frame k."""
        p = (self.start_frame + k) % self.period
        return p - p % self.chunk, p % self.chunk

    def decide(self, frame: Outgoing, chunk: Optional[list[bytes]]) -> Optional[Encode]:
        """Frame `frame` (decided by the session's timeline) with `chunk`, the loop chunk it falls in
        (None: not encoded yet). Returns what the encoder must encode, or None (taken from the loop)."""
        _, offset = self.chunk_of(frame.index)
        joinable = offset == 0 or (self.in_loop and not self.need_idr)
        if frame.kind == "idle" and chunk is not None and joinable:
            self.in_loop, self.need_idr = True, False
            self.units[frame.index] = Unit(frame, chunk[offset], keyframe=offset == 0)
            return None
        idr = self.need_idr or self.in_loop
        self.in_loop = self.need_idr = False
        self.units[frame.index] = Unit(frame, keyframe=idr)
        box = frame.image if frame.kind == "speech" else b""
        return Encode(frame.index, frame.background, idr, box)

    def encoded(self, index: int, au: bytes) -> Optional[Unit]:
        unit = self.units.get(index)
        if unit is not None:
            unit.au = au
        return unit

    def lost(self, index: int) -> None:
        """Frame `index` will not be sent. The frames after it may refer to it: they are not sent
        either until an IDR (and the next frame decided is one)."""
        unit = self.units.get(index)
        if unit is not None:
            unit.lost = True
        self.need_idr = self.broken = True

    def sendable(self, now: float) -> list[Unit]:
        """Units to send now, in order: due, and encoded (or lost: skipped)."""
        out = []
        while True:
            unit = self.units.get(self.next_send)
            if unit is None or unit.frame.due > now or (unit.au is None and not unit.lost):
                return out
            del self.units[self.next_send]
            self.next_send += 1
            if unit.keyframe and not unit.lost:
                self.broken = False
            elif self.broken:
                unit.lost = True   # it refers to a picture the receiver never got
            out.append(unit)

    def waiting_due(self) -> Optional[float]:
        """When the next unit to send is due, if it is encoded and waiting for that time."""
        unit = self.units.get(self.next_send)
        return unit.frame.due if unit is not None and (unit.au is not None or unit.lost) else None
