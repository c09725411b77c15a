"""Time as an input: the `Clock` that whatever paces or expires things reads and schedules on (the
running asyncio loop's in a process, a virtual one in tests), and one timer for the earliest of many
deadlines (the engine's request deadlines, the sessions' next due frames): re-armed only when an
earlier deadline comes up, so arming it is cheap."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` once `now()` reaches `when`."""


class LoopClock:
    """time.monotonic(), and the running asyncio loop's timers."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def call_at(when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(when - time.monotonic(), 0), callback)


LOOP_CLOCK = LoopClock()


class Alarm:
    def __init__(self, ring: Callable[[], None], clock: Clock = LOOP_CLOCK):
        self._ring, self._clock = ring, clock
        self._handle: Optional[Timer] = None
        self._at = float("inf")

    def arm(self, when: Optional[float]) -> None:
        """Ring at `when` (the clock's time) unless it is already set to ring earlier."""
        if when is None or when >= self._at:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = when
        self._handle = self._clock.call_at(when, self._fire)

    @property
    def at(self) -> Optional[float]:
        """When it rings next (None: not armed)."""
        return self._at if self._handle is not None else None

    def _fire(self) -> None:
        self._handle, self._at = None, float("inf")
        self._ring()
