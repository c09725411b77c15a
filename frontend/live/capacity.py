"""When this host is full: `session_open` answers `busy` (with when to retry) before one more session
would make every session's frames late.

What is measured: the CPU time of the server's own processes on this host (the frontend, the compositing
processes, local inference workers), sampled every SAMPLE_S and taken over the last `window_s`, with the
number of live sessions open over that window and the sessions opened in it. From them, what one session
held costs: of the host's cores, and of each process's one core. A session_open is refused while, with
one more session at that cost:

- the processes together would use more than `max_load` of the cores this host gives them (the
  process's CPU affinity, and the cgroup's CPU quota in a container), or
- one single-threaded process (the frontend's event loop, a compositor) would use more than
  `max_process_load` of its core: past that it falls behind, whatever the other cores do.

Opening a session costs CPU for a moment that holding it does not (its model loaded and warmed up, its
first idle frames rendered): sessions opened and closed in a row would make a window's CPU over the few
sessions held through it look like a held session's cost, and fill the host on paper. So the CPU of each
process is also fitted as a cost per session held plus a cost per session opened (least squares over
the windows of the last HISTORY_S, below), and a window with opens in it measures a session's cost
only with the opens' fitted share taken out; while the history cannot tell the two apart, the last
cost measured stands.

Until a session's cost has been measured (a fresh server, or one whose every window had opens in it),
at most RAMP sessions per core per window are let in (each of a host's client-facing processes lets
in its share) (of those, the ones still open: a session that
closed again costs nothing), and none while the measured load is past `max_load`, so that a burst of
opens on an idle host is measured before it is all admitted. Sessions opened since the window's start
count at the last known cost.

A window of mostly silent sessions makes a session look cheap: speech is most of its cost (inference,
compositing, encoding). So the fit also has a cost per speech frame sent (once the windows have seen
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
HISTORY_S = 60.0   # the windows the costs (per session, speech frame and open) are fitted over
BUSY_SHARE = 0.5   # speakers_held: only while the processes use this share of max_burst_load of the cores
MIN_FIT = 8        # windows a fit takes at least; speech (or opens) in half of them to fit its cost
MAX_COND = 10.0    # opens a term only while its column is this far from the others' (condition number)


@dataclass(frozen=True)
class Busy:
    """Why a session_open is refused, and when to try again."""

    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Load:
    """One window's measurement: CPU used, in cores, by each process, and the sessions open meanwhile
    (as `cost`: one session held's share)."""

    by_process: Mapping[str, float]
    sessions: float

    @property
    def total(self) -> float:
        return sum(self.by_process.values())


class Capacity:
    def __init__(self, cores: float, max_load: float, max_process_load: float, window_s: float = 2.0,
                 single_threaded: Callable[[str], bool] = lambda name: True, speaking_share: float = 0.0,
                 fps: float = 25.0, burst_share: float = 0.0, max_burst_load: float = 1.0, processes: int = 1):
        """`processes`: the host's client-facing processes, each admitting with a Capacity of its own over
        the host's sessions (shm/board.py): each lets in its share of RAMP."""
        self.processes = max(processes, 1)
        self.cores, self.max_load, self.max_process_load = cores, max_load, max_process_load
        self.window_s = window_s
        self._single = single_threaded
        self.speaking_share, self.fps = speaking_share, fps
        self.burst_share, self.max_burst_load = burst_share, max_burst_load
        # (t, {process: cpu seconds}, sessions, speech frames, sessions opened)
        self._samples: collections.deque = collections.deque()
        self.load: Optional[Load] = None
        self.cost: Optional[Load] = None    # one session held's share: cores per process, last measured
        self._admitted: collections.deque = collections.deque()  # when sessions were let in unmeasured
        # (t, {process: cores}, sessions, speech frames/s, opens/s)
        self._history: collections.deque = collections.deque()
        # the fitted model, per process: cores per session held, and per speech frame per second (both
        # fitted only together), and core-seconds per session opened
        self.per_session: Optional[dict[str, float]] = None
        self.per_frame: Optional[dict[str, float]] = None
        self.per_open: Optional[dict[str, float]] = None
        # GPU workers: the frames a second each one's device runs with the models it holds (measured per
        # prepared size); their inference is not in the host's CPU, so it is a limit of its own
        self.inference: dict[int, float] = {}

    def device(self, worker: int, frames_per_s: float) -> None:
        """A GPU worker's device runs `frames_per_s` with the models it holds now (it says so with each
        model event): lower once several avatars of an architecture share its steps, higher again when
        they go or its N-model form is ready."""
        if frames_per_s > 0:
            self.inference[worker] = frames_per_s

    def sample(self, now: float, cpu_seconds: Mapping[str, float], sessions: int,
               speech_frames: Optional[int] = None, opened: Optional[int] = None) -> None:
        """Record the processes' cumulative CPU seconds, the sessions open at `now`, the speech frames sent
        so far and the sessions opened so far (both cumulative; None: not known)."""
        samples = self._samples
        samples.append((now, dict(cpu_seconds), sessions, speech_frames, opened))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        t0, first, _, first_speech, first_opened = samples[0]
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
        # per second over the window; None: not known
        speech = None if speech_frames is None or first_speech is None else (speech_frames - first_speech) / span
        opens = None if opened is None or first_opened is None else (opened - first_opened) / span
        if speech is not None or opens is not None:
            history = self._history
            history.append((now, by_process, mean_sessions, speech or 0.0, opens or 0.0))
            while history and now - history[0][0] > HISTORY_S:
                history.popleft()
            self._fit()
        opens = opens or 0.0   # (not known: none)
        if min(counts) >= 1 and (not opens or self.per_open is not None):
            # NOTE: after the fit, which has this window in it: the opens' share taken out by it
            per_open = self.per_open or {}
            self.cost = Load({name: max(used - opens * per_open.get(name, 0.0), 0.0) / mean_sessions
                              for name, used in by_process.items()}, 1.0)

    def _fit(self) -> None:
        """Each process's CPU as (cores per session) x sessions + (cores per speech frame/s) x speech
        frames/s + (core-seconds per open) x opens/s, by least squares over the history's windows with a
        session open, with the terms seen in at least half of MIN_FIT windows. Opens are a term only while
        the history tells them apart from the rest (MAX_COND: not always in the same proportion);
        otherwise speech is fitted as before, opens left in the cost per session. What a fit leaves out
        is kept as it was, and so is all of it while the history cannot tell speech apart either (no
        speech, or speech always in the same proportion)."""
        windows = [(by_process, (sessions, speech, opens)) for _, by_process, sessions, speech, opens in self._history
                   if sessions >= 1]
        if len(windows) < MIN_FIT:
            return
        x = np.array([terms for _, terms in windows], np.float64)   # [windows, (sessions, speech, opens)]
        speech, opens = ((x[:, 1:] > 0).sum(axis=0) >= MIN_FIT // 2).tolist()
        terms = (0, 1, 2) if speech else (0, 2)
        if not (opens and _told_apart(x[:, terms])):
            terms = (0, 1)
            if not speech or np.linalg.matrix_rank(x[:, terms], tol=1e-6 * float(np.abs(x[:, terms]).max())) < 2:
                return
        names = sorted({name for by_process, _ in windows for name in by_process})
        used = np.array([[by_process.get(name, 0.0) for name in names] for by_process, _ in windows])
        coef = np.clip(np.linalg.lstsq(x[:, terms], used, rcond=None)[0], 0.0, None)   # [terms, processes]
        fitted = {term: dict(zip(names, row.tolist())) for term, row in zip(terms, coef)}
        if 1 in fitted:
            self.per_session, self.per_frame = fitted[0], fitted[1]
        if 2 in fitted:
            self.per_open = fitted[2]

    def refuse(self, now: float, sessions: int) -> Optional[Busy]:
        """Busy if one more session than the `sessions` open now would overfill the host; else None."""
        load, cost, retry = self.load, self.cost, self.window_s
        busy = self._refuse_device(sessions + 1, retry)
        if busy is not None:
            return busy
        if load is None or cost is None:
            return self._ramp(now, sessions, load, retry)
        extra = sessions + 1 - load.sessions     # sessions the window has not seen, this one included
        total = load.total + cost.total * extra
        if total > self.max_load * self.cores:
            return self._full(total, sessions + 1, load, retry)
        for name, used in load.by_process.items():
            if not self._single(name):
                continue
            projected = used + cost.by_process.get(name, 0.0) * extra
            if projected > self.max_process_load:
                return Busy(f"{name} would use {projected:.0%} of its core with {sessions + 1} sessions (now "
                            f"{used:.0%}; sessions.max_process_load {self.max_process_load:g}); retry later or "
                            "open on another server", retry)
        return self._refuse_speaking(sessions + 1, retry)

    def _ramp(self, now: float, sessions: int, load: Optional[Load], retry: float) -> Optional[Busy]:
        """Busy past RAMP sessions per core let in over the last window and still open, while what a session
        costs is not measured; or while the load measured is past max_load already."""
        if load is not None and load.total > self.max_load * self.cores:
            return self._full(load.total, sessions + 1, load, retry)
        admitted = self._admitted
        while admitted and now - admitted[0] >= self.window_s:
            admitted.popleft()
        unmeasured = min(len(admitted), sessions)   # at most all the sessions open now: some closed again
        if unmeasured >= max(round(RAMP * self.cores / self.processes), 1):
            return Busy(f"{unmeasured} sessions opened in the last {self.window_s:g} s before their cost "
                        "on this server was measured; retry shortly", retry)
        admitted.append(now)
        return None

    def _full(self, total: float, n: int, load: Load, retry: float) -> Busy:
        return Busy(f"this server's processes would use {total:.2f} of its {self.cores:g} cores with {n} sessions "
                    f"(now {load.total:.2f} with {load.sessions:.0f}; sessions.max_cpu_load {self.max_load:g}); "
                    "retry later or open on another server", retry)

    def _refuse_speaking(self, n: int, retry: float) -> Optional[Busy]:
        """Busy if n sessions, each speaking `speaking_share` of the time, would overfill the host by the
        fitted model."""
        if self.per_frame is None or not self.speaking_share:
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

    def _refuse_device(self, n: int, retry: float) -> Optional[Busy]:
        """Busy if n sessions' speech would need more frames a second than the GPU workers measured they run:
        on average (each speaking `speaking_share` of the time) past `max_load` of it, or in a burst (as many
        speaking at once as is passed only `burst_share` of the time) past `max_burst_load` of it."""
        if not self.inference or not self.speaking_share:
            return None
        capacity = sum(self.inference.values())
        checks = [(n * self.speaking_share, self.max_load, "sessions.max_cpu_load",
                   f"each speaking {self.speaking_share:.0%} of the time (sessions.speaking_share)")]
        if self.burst_share:
            k = speaking_at_once(n, self.speaking_share, self.burst_share)
            checks.append((k, self.max_burst_load, "sessions.max_burst_load",
                           f"when {k} speak at once (more do {self.burst_share:.1%} of the time, sessions.burst_share)"))
        for speaking, share, key, why in checks:
            need = speaking * self.fps
            if need > share * capacity:
                return Busy(f"the GPU workers would run {need:.0f} frames/s of speech with {n} sessions {why}, past "
                            f"{share:g} of the {capacity:.0f} frames/s they measured ({key}); retry later or open on "
                            "another server", retry)
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
        if self.per_frame is None or self.load is None \
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


def _told_apart(columns: np.ndarray) -> bool:
    """Whether least squares can tell these terms' costs apart: no column all zero, and no two (nor one
    and a mix of the others) nearly in the same proportion over the windows."""
    norms = np.linalg.norm(columns, axis=0)
    return bool(norms.all()) and float(np.linalg.cond(columns / norms)) <= MAX_COND


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

    def follow(self, name: str, pid: int) -> None:
        """Track `name` as `pid` unless it is tracked as that pid already (a pid read again and again)."""
        proc = self._procs.get(name)
        if proc is None or proc.pid != pid:
            self.track(name, pid)

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
