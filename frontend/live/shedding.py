"""When the host is full after all: speech is shed session by session, the newest first, so that the
sessions that were there before keep every speech frame.

Admission (live/capacity.py) keeps a host from taking more sessions than it holds; past it (a burst of
sessions that all start speaking, a process restarting, `sessions.max_cpu_load: 0`) speech frames
would come back too late for all of them alike. Instead, twice a second (`WINDOW_S`) the frontend
looks at the speech frames that went out: when any was missed, any frame went out more than a frame
period late, or more than `TIGHT_SHARE` of them were ready with less than one frame period to spare,
the newest sessions that are speaking give up a step each, as many as the share of speech frames in
trouble says of the sessions speaking, one at least (and not in the window right after a step: speech
already in flight is still late there); never the oldest one speaking (one session alone
keeps all of its speech). The steps:

- `HALF`: every other speech frame is rendered; the frame between repeats the one before (half the
  inference and compositing). Not for H.264 sessions: they would still encode every frame, the larger
  part of their cost, so they go to NONE at once;
- `NONE`: its speech goes out as the avatar's idle frames, its audio still with them (no inference,
  no compositing; an H.264 session joins its avatar's pre-encoded idle loop).

After `CALM_WINDOWS` windows with nothing missed, late or tight, the last step taken is given back,
then one more each window while it stays calm (a quick step down, a slow one up, as TCP's
congestion window).

That reacts to speech already late. Where the host's costs are known (live/capacity.py fits a cost per
speech frame), the host also knows how many sessions it holds speaking at once
(`Capacity.speakers_held`): when a session starts to speak past that number, the newest speaking
sessions past it give up their speech at once (`crowd`: to NONE), before any frame is late; and no
step is given back without room for one more speaking session.

The rule is pure: counts and a session list in, the sessions' levels out (tests/test_shedding.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

WINDOW_S = 0.5
CALM_WINDOWS = 6       # windows without pressure before one step is given back
TIGHT_SHARE = 0.1      # ... of the window's speech frames ready with less than a frame period to spare
MIN_TIGHT_FRAMES = 10  # the tight share is judged over at least this many speech frames
FULL, HALF, NONE = 0, 1, 2
LEVELS = ("full", "half", "none")


@dataclass
class Meter:
    """One session's speech frames in the current window."""
    speech: int = 0     # rendered speech frames that went out (or were decided, h264)
    tight: int = 0      # ... ready less than a frame period before they had to go
    missed: int = 0     # speech placed, not ready when due
    late: int = 0       # frames sent more than a frame period after due

    def clear(self) -> None:
        self.speech = self.tight = self.missed = self.late = 0


@dataclass(frozen=True)
class Change:
    token: str
    level: int
    full: bool          # True: a step given up (the host is full); False: one given back


class Shed(Protocol):
    token: str
    shed: int
    meter: Meter
    shed_whole: bool    # no HALF step: an H.264 session encodes every frame it renders or repeats


class Shedder:
    """The shedding rule over the open sessions, given oldest first."""

    def __init__(self) -> None:
        self.steps: list[str] = []   # the tokens that gave up a step, in order (a token once per step)
        self.calm = 0
        self.settling = False          # steps were taken last window: their effect is not measured yet

    def crowd(self, speaking: list[Shed], held: int, others: int = 0) -> list[Change]:
        """`speaking`: the sessions speaking once one more starts (oldest first, none shed to NONE); past
        the `held` the host can hold speaking at once, the newest give up their speech now. `others`: the
        sessions speaking on the host's other client-facing processes, which hold their share of `held`.
        Never the host's oldest one speaking (this process's oldest, while no other process has one)."""
        keep = 0 if others else 1
        over = len(speaking) - max(held - others, keep)
        victims = list(reversed(speaking[keep:]))[:max(over, 0)]
        for victim in victims:   # every level it gives up is a step to give back
            self.steps += [victim.token] * (1 if victim.shed_whole else NONE - victim.shed)
            victim.shed = NONE
        return [Change(v.token, NONE, full=True) for v in victims]

    def window(self, sessions: Iterable[Shed], room: Optional[int] = None) -> list[Change]:
        """One window's verdict: the sessions whose level changes. Clears every session's meter. `room`:
        how many more sessions the host can hold speaking at once (None: not known); no step is given
        back without room for it."""
        sessions = list(sessions)
        speech = sum(s.meter.speech for s in sessions)
        missed = sum(s.meter.missed + s.meter.late for s in sessions)
        tight = sum(s.meter.tight for s in sessions)
        over = missed + (max(tight - TIGHT_SHARE * speech, 0) if speech >= MIN_TIGHT_FRAMES else 0)
        speaking = [s for s in sessions if s.meter.speech or s.meter.missed]
        for s in sessions:
            s.meter.clear()
        by_token = {s.token: s for s in sessions}
        self.steps = [t for t in self.steps if t in by_token]   # closed sessions' steps are gone
        if over:
            self.calm = 0
            # NOTE: a step acts on speech placed after it; what was in flight still comes back late in
            # the next window. Stepping again on that would shed far more than the host needs.
            if self.settling:
                self.settling = False
                return []
            # As many sessions give up a step as the share of speech that was in trouble says (one at
            # least), the newest speaking first. NOTE: never the oldest speaking session: shedding
            # protects the sessions that came before, and a host too slow for one session gains
            # nothing from cutting that one's speech.
            n = max(1, math.ceil(len(speaking) * min(over / max(speech + missed, 1), 1)))
            victims = [s for s in reversed(speaking[1:]) if s.shed < NONE][:n]
            for victim in victims:
                victim.shed = NONE if victim.shed_whole else victim.shed + 1
                self.steps.append(victim.token)
            self.settling = bool(victims)
            return [Change(v.token, v.shed, full=True) for v in victims]
        self.settling = False
        if tight:
            self.calm = 0
            return []
        self.calm += 1
        if self.calm < CALM_WINDOWS or not self.steps or (room is not None and room < 1):
            return []
        # calm long enough: one step back per window while it stays calm, the last taken first
        session = by_token[self.steps.pop()]
        session.shed = FULL if session.shed_whole else session.shed - 1
        return [Change(session.token, session.shed, full=False)]
