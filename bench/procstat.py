"""Where a load saturates: each server process's CPU against one core, and each stage's queue over time,
sampled from outside the server while a bench level runs.

`CpuSampler` reads every thread's run and run-queue wait times (/proc/<pid>/task/<tid>/schedstat, in
ns, so even a short run is exact) every `interval_s`: a process whose busiest thread runs >= 90 % of
the wall time is saturated (one thread cannot use a second core), and wait time says it was runnable
but found no free core (the machine, not the process, is then the limit).

`DepthSampler` reads, on the same beat, what the server exposes of its queues: the inference workers'
own queues (the `stats` op), the Prometheus gauges on `metrics.port`, the live session frame counters
(missed speech per interval), the frontend's loop lag (a `health` op's round trip: the op is answered
inline by the reader, so its wait is the time the event loop takes to come back to its sockets), and
the bytes sent to the bench's client connections that the client has not read yet (the kernel's
receive queues of those TCP sockets, /proc/net/tcp).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from typing import Optional

from lipsync_client import Client

SATURATED = 90.0   # % of one core: a thread this busy has no headroom left


def server_pids(srv) -> dict[str, int]:
    """A running server's processes by role and index ("frontend0", "gpu0", "cpu1", ...): their pids. With
    several client-facing processes (frontend.processes) a health answer names the one that gave it: the
    others are found by their process names."""
    import psutil
    pids = {f"{p['role']}{p['index']}": p["pid"] for p in srv.health()["processes"]}
    for child in psutil.Process(srv.proc.pid).children():
        try:
            name = child.name()
        except psutil.Error:
            continue
        if name.startswith("lsync-frontend"):
            pids[name.removeprefix("lsync-")] = child.pid
    return pids


def _schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (ns on a CPU, ns runnable waiting for one) of every thread of `pid`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue   # the thread ended meanwhile
        out[int(tid)] = (int(run), int(wait))
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds each thread of `pid` has run so far, keyed "name-tid"."""
    return {f"{_thread_name(pid, tid)}-{tid}": run / 1e9 for tid, (run, _) in _schedstat(pid).items()}


def _machine_busy_ns() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]   # idle + iowait
    return (sum(fields[:8]) - idle) * 10 ** 9 // os.sysconf("SC_CLK_TCK")


class _Beat(threading.Thread):
    """Calls `sample()` every `interval_s` from start() to stop()."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        tick = 0
        while True:
            self.sample(time.monotonic())
            tick += 1
            if self._stop_event.wait(max(t0 + tick * self.interval_s - time.monotonic(), 0)):
                self.sample(time.monotonic())
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sample(self, now: float) -> None:
        raise NotImplementedError


class CpuSampler(_Beat):
    def __init__(self, procs: dict[str, int], interval_s: float = 0.25):
        super().__init__(interval_s)
        self.procs = procs
        self.samples: list[tuple[float, dict[str, dict[int, tuple[int, int]]], int]] = []
        self.names: dict[int, str] = {}   # tid -> thread name, read when first seen (it may end before the result)

    def sample(self, now: float) -> None:
        threads = {name: _schedstat(pid) for name, pid in self.procs.items()}
        for name, tids in threads.items():
            for tid in tids.keys() - self.names.keys():
                self.names[tid] = _thread_name(self.procs[name], tid)
        self.samples.append((now, threads, _machine_busy_ns()))

    def result(self, window_s: float = 1.0) -> dict:
        """Per process: `cpu` (% of one core over the run), `cpu_max` (the busiest `window_s`), `thread`
        (its busiest thread: name and % of one core), `main_cpu` (its main thread's), `wait` (% of the run its threads were runnable
        with no free core, all threads together), `saturated`, and `saturated_at` (seconds into the
        run when a `window_s` window first found its busiest thread >= SATURATED); `machine`: % of
        all cores busy, and `others` of it: what ran beside the processes sampled."""
        (t0, first, busy0), (t1, last, busy1) = self.samples[0], self.samples[-1]
        wall_ns = (t1 - t0) * 1e9
        out: dict = {}
        for name in self.procs:
            a, b = first[name], last[name]
            run = {tid: b[tid][0] - a.get(tid, (0, 0))[0] for tid in b}
            wait = sum(b[tid][1] - a.get(tid, (0, 0))[1] for tid in b)
            top = max(run, key=run.get, default=None)
            windows = self._windows(name, window_s)
            out[name] = {
                "cpu": round(100 * sum(run.values()) / wall_ns, 1),
                "cpu_max": round(max((w[1] for w in windows), default=0.0), 1),
                "thread": self.names.get(top, str(top)) if top is not None else "",
                "thread_cpu": round(100 * run[top] / wall_ns, 1) if top is not None else 0.0,
                "main_cpu": round(100 * run.get(self.procs[name], 0) / wall_ns, 1),   # (its tid is its pid)
                "wait": round(100 * wait / wall_ns, 1),
                "saturated_at": next((round(w[0], 1) for w in windows if w[2] >= SATURATED), None),
                "series": [round(w[1]) for w in windows],
            }
            out[name]["saturated"] = out[name]["thread_cpu"] >= SATURATED or out[name]["cpu"] >= SATURATED
        machine = 100 * (busy1 - busy0) / wall_ns
        ours = sum(v["cpu"] for v in out.values())
        # NOTE: anything else running on the machine meanwhile skews every figure: say how much there was
        out["machine"] = {"cpu": round(machine, 1), "cores": os.cpu_count(), "others": round(max(machine - ours, 0), 1),
                          "series": [round(w) for w in self._machine_windows(window_s)]}
        return out

    def _machine_windows(self, window_s: float) -> list[float]:
        """% of one core the whole machine was busy, per `window_s` (as `_windows` cuts them)."""
        out, i = [], 0
        while i < len(self.samples) - 1:
            j = i
            while j < len(self.samples) - 1 and self.samples[j][0] - self.samples[i][0] < window_s - 1e-3:
                j += 1
            (ta, _, a), (tb, _, b) = self.samples[i], self.samples[j]
            if tb <= ta:
                break
            out.append(100 * (b - a) / ((tb - ta) * 1e9))
            i = j
        return out

    def _windows(self, name: str, window_s: float) -> list[tuple[float, float, float]]:
        """(start s into the run, process % of one core, its busiest thread's %) per `window_s`."""
        t_start = self.samples[0][0]
        out, i = [], 0
        while i < len(self.samples) - 1:
            j = i
            while j < len(self.samples) - 1 and self.samples[j][0] - self.samples[i][0] < window_s - 1e-3:
                j += 1
            (ta, a, _), (tb, b, _) = self.samples[i], self.samples[j]
            ns = (tb - ta) * 1e9
            if ns <= 0:
                break
            runs = [b[name][tid][0] - a[name].get(tid, (0, 0))[0] for tid in b[name]]
            out.append((ta - t_start, 100 * sum(runs) / ns, 100 * max(runs, default=0) / ns))
            i = j
        return out


def _tcp_unread(port: int) -> tuple[int, int]:
    """(bytes received on connections to `port` that their reader has not read, bytes sent from `port`
    not yet acknowledged): the receive queues of the clients' sockets, the send queues of the server's."""
    unread = unacked = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            tx, rx = (int(v, 16) for v in queues.split(":"))
            if int(remote.rsplit(":", 1)[1], 16) == port:
                unread += rx
            elif int(local.rsplit(":", 1)[1], 16) == port:
                unacked += tx
    return unread, unacked


def _parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


# The gauges the frontend exposes for queues (frontend/metrics.py), and the counters read per interval.
GAUGES = ("lipsync_queue_depth", "lipsync_shm_slots_in_use", "lipsync_client_backlog_bytes", "lipsync_sessions_open")
COUNTED = ('lipsync_session_frames_total{kind="missed"}', 'lipsync_session_frames_total{kind="speech"}',
           'lipsync_session_frames_total{kind="dropped"}', 'lipsync_session_frames_total{kind="skipped"}')


class DepthSampler(_Beat):
    """The queues once a second: the frontend sets its depth gauges once a second (GAUGES_S), and each
    sample costs the server what the bench measures (a `health` and a `stats` request, the latter on
    every worker, and a /metrics scrape): four a second were a few us of every frame's CPU at 40
    silent sessions."""

    def __init__(self, endpoint: str, metrics_port: Optional[int], interval_s: float = 1.0):
        super().__init__(interval_s)
        self.endpoint, self.metrics_port = endpoint, metrics_port
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.rows: list[dict] = []
        self._client: Optional[Client] = None

    def run(self) -> None:
        self._client = Client(self.endpoint, timeout_s=10)
        try:
            super().run()
        finally:
            self._client.close()

    def sample(self, now: float) -> None:
        row: dict = {"t": now}
        t = time.monotonic()
        self._client.health()
        row["loop_lag_ms"] = (time.monotonic() - t) * 1000
        for w in self._client.stats().get("workers", []):
            if "queue" in w:
                row[f"worker{w['index']} queue"] = w["queue"]
        row["client unread KB"], row["server unacked KB"] = (v / 1024 for v in _tcp_unread(self.port))
        if self.metrics_port:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                metrics = _parse_metrics(r.read().decode())
            for key, value in metrics.items():
                if key.split("{")[0] in GAUGES:
                    row[key] = value
            for key in COUNTED:
                row[key] = metrics.get(key, 0.0)
        self.rows.append(row)

    def result(self) -> dict:
        """Per queue: mean and max over the run; counters: per second, second by second."""
        rows = self.rows
        if len(rows) < 2:
            return {}
        queues: dict = {}
        for key in rows[0]:
            if key == "t" or key in COUNTED:
                continue
            values = [r[key] for r in rows if key in r]
            queues[key] = {"mean": round(sum(values) / len(values), 2), "max": round(max(values), 2)}
        per_s: dict = {}
        for key in COUNTED:
            if key not in rows[0]:
                continue
            series, i = [], 0
            while i < len(rows) - 1:   # one value per second of the run
                j = i
                while j < len(rows) - 1 and rows[j]["t"] - rows[i]["t"] < 1.0 - 1e-3:
                    j += 1
                series.append(round((rows[j][key] - rows[i][key]) / (rows[j]["t"] - rows[i]["t"])))
                i = j
            per_s[key.split('"')[1]] = series
        return {"queues": queues, "per_second": per_s, "samples": len(rows)}
