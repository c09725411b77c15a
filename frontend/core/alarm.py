"""One asyncio timer for the earliest of many deadlines (the engine's request deadlines, the sessions'
next due frames): re-armed only when an earlier deadline comes up, so arming it is cheap."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional


class Alarm:
    def __init__(self, ring: Callable[[], None]):
        self._ring = ring
        self._handle: Optional[asyncio.TimerHandle] = None
        self._at = float("inf")

    def arm(self, when: Optional[float]) -> None:
        """Ring at `when` (time.monotonic()) unless it is already set to ring earlier."""
        if when is None or when >= self._at:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = when
        self._handle = asyncio.get_running_loop().call_later(max(when - time.monotonic(), 0), self._fire)

    def _fire(self) -> None:
        self._handle, self._at = None, float("inf")
        self._ring()
