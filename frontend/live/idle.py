"""Encoded frames live/ keeps: the cache of idle frames (and H.264 idle loop chunks), shared by every
session on an avatar, and `frame_bytes`, a received frame as bytes that outlive the message."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class IdleCache:
    """Encoded background frames by (model, version, frame, format, quality), least recently used out."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._frames: OrderedDict[tuple, bytes] = OrderedDict()
        self.rendering: set[tuple] = set()

    def get(self, key: tuple) -> Optional[bytes]:
        entry = self._frames.get(key)
        if entry is None:
            return None
        self._frames.move_to_end(key)
        return entry[0]

    def put(self, key: tuple, image, size: Optional[int] = None) -> None:
        """`image`: bytes, or any value with its `size` in bytes (an H.264 idle loop chunk)."""
        if key in self._frames:
            return
        self._frames[key] = (image, len(image) if size is None else size)
        self.bytes += self._frames[key][1]
        while self.bytes > self.max_bytes and len(self._frames) > 1:
            _, (_, old) = self._frames.popitem(last=False)
            self.bytes -= old


def frame_bytes(frame) -> bytes:
    """A received ZeroMQ frame (or any buffer) as bytes the frontend can keep."""
    kept = getattr(frame, "bytes", None)   # a zmq.Frame's own copy; any other buffer is copied here
    return kept if isinstance(kept, bytes) else bytes(frame)
