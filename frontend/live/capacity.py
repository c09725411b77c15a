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
The numbers come in through `sample`, so the rule runs on a test's clock with made-up loads.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

SAMPLE_S = 0.5
RAMP = 8     # sessions admitted per core per window while no session's cost has been measured


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
                 single_threaded: Callable[[str], bool] = lambda name: True):
        self.cores, self.max_load, self.max_process_load = cores, max_load, max_process_load
        self.window_s = window_s
        self._single = single_threaded
        self._samples: collections.deque = collections.deque()   # (t, {process: cpu seconds}, sessions)
        self.load: Optional[Load] = None
        self.cost: Optional[Load] = None    # one session's share: cores per process, last measured
        self._admitted: collections.deque = collections.deque()  # when sessions were let in unmeasured

    def sample(self, now: float, cpu_seconds: Mapping[str, float], sessions: int) -> None:
        """Record the processes' cumulative CPU seconds and the sessions open at `now`."""
        samples = self._samples
        samples.append((now, dict(cpu_seconds), sessions))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        t0, first, _ = samples[0]
        if now - t0 < self.window_s / 2:
            return
        span = now - t0
        # a process that restarted (its CPU time went back) or appeared within the window counts from zero
        # a process that (re)started within the window counts from its next sample on
        by_process = {name: (cpu - first[name]) / span if cpu >= first.get(name, float("inf")) else 0.0
                      for name, cpu in cpu_seconds.items()}
        counts = [s for _, _, s in list(samples)[1:]]   # at the end of each interval the CPU time covers
        mean_sessions = sum(counts) / len(counts)
        self.load = Load(by_process, mean_sessions)
        if min(counts) >= 1:
            self.cost = Load({name: used / mean_sessions for name, used in by_process.items()}, 1.0)

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
        return None


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
