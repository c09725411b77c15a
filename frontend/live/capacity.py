"""When this host is full: `session_open` answers `busy` (with when to retry) before one more session
would make every session's frames late.

What is measured: the CPU time of the server's own processes on this host (the frontend, the compositing
processes, local inference workers), sampled every SAMPLE_S and taken over the last `window_s`, with the
number of live sessions open over that window. From them, what one session costs: of the host's cores,
and of each process's one core. A session_open is refused while, with one more session at that cost:

- the processes together would use more than `max_load` of the cores this host gives them (the
  process's CPU affinity, and the cgroup's CPU quota in a container), or
- one single-threaded process (the frontend's event loop, a compositor) would use more than
  `max_process_load` of its core: past that it falls behind, whatever the other cores do.

Until the window has seen a session (a fresh server, or one whose sessions all closed and whose cost is
not known yet), at most RAMP sessions per core per window are let in, so that a burst of opens on an idle
host is measured before it is all admitted. Sessions opened since the window's start count at the last known cost.

A window of mostly silent sessions makes a session look cheap: speech is most of its cost (inference,
compositing, encoding). So each process's CPU over the last HISTORY_S is also fitted as a cost per
open session plus a cost per speech frame sent (least squares over the windows, once they have seen
the speech rate vary), and, with `speaking_share` > 0, a session is also refused while all of them,
one more included, speaking `speaking_share` of the time would pass the same limits: the host admits
what it holds when its sessions speak, not what it holds in a quiet moment.

The same fit says how many sessions can speak at once (`speakers_held`): shedding
(live/shedding.py) sheds a session that starts to speak past it, before its speech is late.

Sessions do not take turns: each speaks when its user's conversation has it speak, so at times more of
them speak at once than `speaking_share` says, and a host full on average loses speech in those
bursts. With `burst_share` > 0, a session is also refused while the number of the n sessions speaking
at once that is passed only `burst_share` of the time (each speaking `speaking_share` of the time on
its own: the binomial distribution's upper quantile) would take the processes past `max_burst_load` of
the cores, or one single-threaded process past its core.

The numbers come in through `sample`, so the rule runs on a test's clock with made-up loads.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np

SAMPLE_S = 0.5
RAMP = 8     # sessions admitted per core per window while no session's cost has been measured
HISTORY_S = 60.0   # the windows the speech model is fitted over
BUSY_SHARE = 0.5   # speakers_held: only while the processes use this share of max_burst_load of the cores
MIN_FIT = 8        # ... at least this many, with speech in half of them


@dataclass(frozen=True)
class Busy:
    """Why a session_open is refused, and when to try again."""

    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Load:
    """One window's measurement: CPU used, in cores, by each process, and the sessions open meanwhile."""

    by_process: Mapping[str, float]
    sessions: float

    @property
    def total(self) -> float:
        return sum(self.by_process.values())


class Capacity:
    def __init__(self, cores: float, max_load: float, max_process_load: float, window_s: float = 2.0,
                 single_threaded: Callable[[str], bool] = lambda name: True, speaking_share: float = 0.0,
                 fps: float = 25.0, burst_share: float = 0.0, max_burst_load: float = 1.0):
        self.cores, self.max_load, self.max_process_load = cores, max_load, max_process_load
        self.window_s = window_s
        self._single = single_threaded
        self.speaking_share, self.fps = speaking_share, fps
        self.burst_share, self.max_burst_load = burst_share, max_burst_load
        self._samples: collections.deque = collections.deque()   # (t, {process: cpu seconds}, sessions, speech)
        self.load: Optional[Load] = None
        self.cost: Optional[Load] = None    # one session's share: cores per process, last measured
        self._admitted: collections.deque = collections.deque()  # when sessions were let in unmeasured
        self._history: collections.deque = collections.deque()   # (t, {process: cores}, sessions, speech frames/s)
        # the fitted model, per process: cores per open session, and per speech frame per second
        self.per_session: Optional[dict[str, float]] = None
        self.per_frame: Optional[dict[str, float]] = None

    def sample(self, now: float, cpu_seconds: Mapping[str, float], sessions: int,
               speech_frames: Optional[int] = None) -> None:
        """Record the processes' cumulative CPU seconds, the sessions open at `now`, and the speech
        frames sent so far (cumulative; None: not known)."""
        samples = self._samples
        samples.append((now, dict(cpu_seconds), sessions, speech_frames))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        t0, first, _, first_speech = samples[0]
        if now - t0 < self.window_s / 2:
            return
        span = now - t0
        # a process that restarted (its CPU time went back) or appeared within the window counts from zero
        # a process that (re)started within the window counts from its next sample on
        by_process = {name: (cpu - first[name]) / span if cpu >= first.get(name, float("inf")) else 0.0
                      for name, cpu in cpu_seconds.items()}
        counts = [s[2] for s in list(samples)[1:]]   # at the end of each interval the CPU time covers
        mean_sessions = sum(counts) / len(counts)
        self.load = Load(by_process, mean_sessions)
        if min(counts) >= 1:
            self.cost = Load({name: used / mean_sessions for name, used in by_process.items()}, 1.0)
        if speech_frames is not None and first_speech is not None:
            history = self._history
            history.append((now, by_process, mean_sessions, (speech_frames - first_speech) / span))
            while history and now - history[0][0] > HISTORY_S:
                history.popleft()
            self._fit()

    def _fit(self) -> None:
        """Each process's CPU as (cores per session) x sessions + (cores per speech frame/s) x speech
        frames/s, by least squares over the history; kept as it was while the history cannot tell the
        two apart (too few windows, no speech, or speech always in the same proportion)."""
        windows = [(by_process, sessions, speech) for _, by_process, sessions, speech in self._history
                   if sessions >= 1]
        if len(windows) < MIN_FIT or sum(speech > 0 for _, _, speech in windows) < MIN_FIT // 2:
            return
        x = np.array([(sessions, speech) for _, sessions, speech in windows], np.float64)
        if np.linalg.matrix_rank(x, tol=1e-6 * float(np.abs(x).max())) < 2:
            return
        names = sorted({name for by_process, _, _ in windows for name in by_process})
        used = np.array([[by_process.get(name, 0.0) for name in names] for by_process, _, _ in windows])
        coef = np.clip(np.linalg.lstsq(x, used, rcond=None)[0], 0.0, None)   # [2, processes]
        self.per_session = dict(zip(names, coef[0].tolist()))
        self.per_frame = dict(zip(names, coef[1].tolist()))

    def refuse(self, now: float, sessions: int) -> Optional[Busy]:
        """Busy if one more session than the `sessions` open now would overfill the host; else None."""
        load, cost, retry = self.load, self.cost, self.window_s
        if load is None or cost is None:
            admitted = self._admitted
            while admitted and now - admitted[0] >= self.window_s:
                admitted.popleft()
            if len(admitted) >= max(round(RAMP * self.cores), 1):
                return Busy(f"{len(admitted)} sessions opened in the last {self.window_s:g} s before their cost "
                            "on this server was measured; retry shortly", retry)
            admitted.append(now)
            return None
        extra = sessions + 1 - load.sessions     # sessions the window has not seen, this one included
        total = load.total + cost.total * extra
        if total > self.max_load * self.cores:
            return Busy(f"this server's processes would use {total:.2f} of its {self.cores:g} cores with "
                        f"{sessions + 1} sessions (now {load.total:.2f} with {load.sessions:.0f}; "
                        f"sessions.max_cpu_load {self.max_load:g}); retry later or open on another server", retry)
        for name, used in load.by_process.items():
            if not self._single(name):
                continue
            projected = used + cost.by_process.get(name, 0.0) * extra
            if projected > self.max_process_load:
                return Busy(f"{name} would use {projected:.0%} of its core with {sessions + 1} sessions (now "
                            f"{used:.0%}; sessions.max_process_load {self.max_process_load:g}); retry later or "
                            "open on another server", retry)
        return self._refuse_speaking(sessions + 1, retry)

    def _refuse_speaking(self, n: int, retry: float) -> Optional[Busy]:
        """Busy if n sessions, each speaking `speaking_share` of the time, would overfill the host by the
        fitted model."""
        if self.per_session is None or not self.speaking_share:
            return None
        used = self._speech_load(n, n * self.speaking_share)
        total = sum(used.values())
        why = (f"with {n} sessions, each speaking {self.speaking_share:.0%} of the time (sessions.speaking_share), "
               f"by what speech costs here ({1000 * sum(self.per_frame.values()):.1f} ms of CPU per speech frame)")
        if total > self.max_load * self.cores:
            return Busy(f"this server's processes would use {total:.2f} of its {self.cores:g} cores {why}; "
                        f"sessions.max_cpu_load {self.max_load:g}; retry later or open on another server", retry)
        for name, cores in used.items():
            if self._single(name) and cores > self.max_process_load:
                return Busy(f"{name} would use {cores:.0%} of its core {why}; sessions.max_process_load "
                            f"{self.max_process_load:g}; retry later or open on another server", retry)
        return self._refuse_burst(n, retry)

    def _refuse_burst(self, n: int, retry: float) -> Optional[Busy]:
        """Busy if, when as many of n sessions speak at once as is passed only `burst_share` of the time,
        the processes would pass `max_burst_load` of the cores, or one of them its core."""
        if not self.burst_share:
            return None
        k = speaking_at_once(n, self.speaking_share, self.burst_share)
        used = self._speech_load(n, k)
        why = (f"when {k} of {n} sessions speak at once (more do {self.burst_share:.1%} of the time, "
               f"sessions.burst_share, each speaking {self.speaking_share:.0%} of the time)")
        total = sum(used.values())
        if total > self.max_burst_load * self.cores:
            return Busy(f"this server's processes would use {total:.2f} of its {self.cores:g} cores {why}; "
                        f"sessions.max_burst_load {self.max_burst_load:g}; retry later or open on another server",
                        retry)
        for name, cores in used.items():
            if self._single(name) and cores > 1.0:
                return Busy(f"{name} would need {cores:.0%} of its one core {why}; retry later or open on another "
                            "server", retry)
        return None

    def _speech_load(self, n: int, speaking: float) -> dict[str, float]:
        """Cores each process would use, by the fitted costs, with n sessions open and `speaking` of them
        speaking (an average or a count)."""
        rate = speaking * self.fps
        return {name: n * self.per_session[name] + rate * self.per_frame[name] for name in self.per_session}

    def speakers_held(self, n: int) -> Optional[int]:
        """How many of n open sessions can speak at once within `max_burst_load` of the cores (and each
        single-threaded process within its core), by the fitted costs. None until they are fitted, and
        while the processes use less than BUSY_SHARE of that (measured over the last window): a fit that
        is off must not shed speech on a host with room. Shedding asks it when a session starts to speak
        (live/shedding.py)."""
        if self.per_session is None or self.load is None \
                or self.load.total < BUSY_SHARE * self.max_burst_load * self.cores:
            return None
        held = float(n)
        room = self.max_burst_load * self.cores - n * sum(self.per_session.values())
        per_speaker = self.fps * sum(self.per_frame.values())
        if per_speaker > 0:
            held = min(held, room / per_speaker)
        for name, per_frame in self.per_frame.items():
            if self._single(name) and per_frame > 0:
                held = min(held, (1.0 - n * self.per_session[name]) / (self.fps * per_frame))
        return max(math.floor(held), 0)


def speaking_at_once(n: int, share: float, exceeded: float) -> int:
    """The fewest of n sessions, each speaking `share` of the time on its own, that more speak at once only
    `exceeded` of the time: the smallest k with P(X > k) <= exceeded, X ~ Binomial(n, share)."""
    if n <= 0 or share <= 0:
        return 0
    if share >= 1:
        return n
    log_p, log_q = math.log(share), math.log1p(-share)
    cdf = 0.0
    for k in range(n + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        if 1.0 - cdf <= exceeded:
            return k
    return n


def host_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> float:
    """The cores this process may use: its CPU affinity, capped by its cgroup v2 CPU quota (`cpu_max`: a
    container's CPU limit), which the affinity does not show."""
    cores = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(int(quota) / int(period), 0.01))
    except (OSError, ValueError):
        pass
    return cores


class ProcessCpu:
    """Cumulative CPU seconds of named processes (psutil); a process gone or not yet known is left out."""

    def __init__(self) -> None:
        self._procs: dict[str, object] = {}

    def track(self, name: str, pid: Optional[int]) -> None:
        import psutil
        self._procs.pop(name, None)
        if pid:
            try:
                self._procs[name] = psutil.Process(pid)
            except psutil.Error:
                pass

    def read(self) -> dict[str, float]:
        import psutil
        out = {}
        for name, proc in list(self._procs.items()):
            try:
                times = proc.cpu_times()
            except psutil.Error:
                self._procs.pop(name, None)
                continue
            out[name] = times.user + times.system
        return out
