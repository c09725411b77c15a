"""Start-up: seconds from launching `python -m supervisor` to its `serving on` line (every process READY)
and to `health` saying "ready", on the CPU config (the embedded default with the demo avatar already
built, inference.devices: cpu, the viewer and the probes on), the median of a few runs, also over a
models_dir of many model directories; the CPU seconds all its processes spent until then (on a busy
host, the figure that moves least); where that time went, step by step in each process (the server's
start-up trace, LIPSYNC_STARTUP_TRACE: supervisor/entry.py); and the import time of each process role,
each in a fresh interpreter, with the packages that cost the most.

Every Python the bench starts finds the bytecode of what it imports compiled, as in an installed wheel
(pip compiles it) or the images: the bench compiles it once into a cache of its own
(PYTHONPYCACHEPREFIX, nothing is written into the tree), even where PYTHONDONTWRITEBYTECODE is set;
without it each process of the server would compile the project's modules at every start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
# What each process imports before it can report READY, as (imported first, untimed; timed). A spawned
# child of `python -m supervisor` does not run supervisor/__main__.py again (multiprocessing skips a
# package's __main__): it unpickles its target (supervisor.entry) and its config and run spec (their
# modules: config.schema, shm.endpoints), then imports its role's module.
SPAWN = "multiprocessing.spawn"
CHILD = "supervisor.entry, config.schema, shm.endpoints"
ROLES = {"supervisor": ("", "supervisor.__main__, config.loader, supervisor.tree"),
         "frontend": (SPAWN, f"{CHILD}, frontend.server.process"),
         "gpu worker": (SPAWN, f"{CHILD}, gpu_actor.worker"),
         "compositor": (SPAWN, f"{CHILD}, cpu_actor.worker"),
         "the viewer's stack, in the frontend": (f"{SPAWN}, {CHILD}, frontend.server.process",
                                                 "frontend.live.viewer")}
# The supervisor's steps, as (trace mark that ends it, what happened since the previous mark).
SUPERVISOR_STEPS = [("main", "interpreter start, up to its first module"),
                    ("checked", "the packages' ownership check"),
                    ("configured", "arguments, logging, the config read and checked"),
                    ("imported", "supervisor.tree's imports"),
                    ("created", "shared memory created, sockets"),
                    ("spawned", "spawning the children"),
                    ("populated", "the slot rings faulted in"),
                    ("ready", "waiting for the last READY"),
                    ("serving", "the `serving on` summary")]
# A child's steps: (trace mark that ends it, what happened since the previous one); "ready" is the
# supervisor's receipt of its READY.
CHILD_STEPS = [("main", "interpreter + spawn bootstrap"), ("entry", "unpickling config, run spec (their imports)"),
               ("imported", "its role's imports"), ("ready", "setup (sockets, shm attach) until READY")]


def _env(directory: Path, **extra: str) -> dict[str, str]:
    """The environment of every Python the bench starts: its own bytecode cache in `directory`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(directory / "pycache"), **extra}


def _compile(directory: Path) -> None:
    """Fill the bytecode cache with what every role imports, the viewer's stack included."""
    modules = ", ".join(dict.fromkeys(m.strip() for before, timed in ROLES.values()
                                      for m in f"{before}, {timed}".split(",") if m.strip()))
    subprocess.run([sys.executable, "-c", f"import {modules}"], cwd=ROOT, env=_env(directory), check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(models_dir: str, directory: Path) -> tuple[Path, str]:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    cfg = {"models_dir": models_dir, "inference": {"devices": "cpu"}, "frontend": {"bind": [endpoint]},
           "metrics": {"port": _free_port()}, "viewer": {"port": _free_port()}}
    path = directory / f"startup-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, endpoint


def _cpu_seconds(pid: int) -> float:
    """user + system seconds of a process and all its descendants, so far."""
    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _phases(trace: Path, launched: float, supervisor_pid: int) -> dict[str, float]:
    """The start-up trace (lines `pid step unix-time cpu-seconds [child's cpu-seconds]`) as seconds per step, keyed
    "process: step" (wall) and "process: step cpu" (CPU seconds of that process in it), plus
    "process: at" (when a child was spawned, from launch) and "process: ready at"."""
    marks: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
    names = {supervisor_pid: "supervisor"}
    for line in trace.read_text().splitlines():
        pid, step, t, cpu, *child_cpu = line.split()
        pid, at = int(pid), (float(t), float(cpu))
        if step.startswith("spawned:"):
            _, name, child = step.split(":")
            names[int(child)] = name
            marks[int(child)]["spawned"] = (at[0], 0.0)
            marks[pid]["spawned"] = at    # the supervisor's: when the last child was spawned
        elif step.startswith("ready:"):
            child = next(p for p, n in names.items() if n == step.split(":")[1])
            marks[child]["ready"] = (at[0], float(child_cpu[0]))   # read by the supervisor at READY
            marks[pid]["ready"] = at
        else:
            marks[pid].setdefault(step, at)
    out: dict[str, float] = {}
    previous = (launched, 0.0)
    for step, _ in SUPERVISOR_STEPS:
        now = marks[supervisor_pid][step]
        out[f"supervisor: {step}"], out[f"supervisor: {step} cpu"] = now[0] - previous[0], now[1] - previous[1]
        previous = now
    for pid, name in names.items():
        if pid == supervisor_pid:
            continue
        previous = marks[pid]["spawned"]
        out[f"{name}: at"] = previous[0] - launched
        for step, _ in CHILD_STEPS:
            now = marks[pid][step]
            out[f"{name}: {step}"], out[f"{name}: {step} cpu"] = now[0] - previous[0], now[1] - previous[1]
            previous = now
        out[f"{name}: ready at"] = previous[0] - launched
    return out


def _health_ready(endpoint: str, t0: float, out: dict, stop: threading.Event) -> None:
    """(A thread) polls `health` until it says ready: out["ready_s"], seconds since t0."""
    import zmq
    from lipsync_client import Client, ClientTimeout
    # NOTE: the client connects before the server binds; libzmq retries every RECONNECT_IVL (100 ms by
    # default), which would round every figure up to a tenth of a second.
    zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, 5)
    with Client(endpoint, timeout_s=1.0) as client:
        while not stop.is_set():
            try:
                if client.health()["status"] == "ready":
                    out["ready_s"] = time.monotonic() - t0
                    return
            except ClientTimeout:
                continue
            time.sleep(0.01)


def launch_to_ready(models_dir: str, directory: Path, timeout_s: float = 60.0) -> dict:
    """One launch, then SIGTERM: seconds until the `serving on` line (from the start-up trace, or when the
    line was seen in the log for a server without one) and until `health` says ready, CPU seconds spent
    by then, and the start-up trace's steps (_phases; empty without a trace)."""
    path, endpoint = _config(models_dir, directory)
    log, trace = path.with_suffix(".log"), path.with_suffix(".trace")
    env = _env(directory, LIPSYNC_STARTUP_TRACE=str(trace))
    health: dict = {}
    stop = threading.Event()
    with open(log, "w") as out:
        launched, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--config", str(path)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    poller = threading.Thread(target=_health_ready, args=(endpoint, t0, health, stop), daemon=True)
    poller.start()
    try:
        seen = None
        while seen is None or "ready_s" not in health:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not ready within {timeout_s:g}s: {log.read_text()[-2000:]}")
            if seen is None and "serving on" in log.read_text():
                seen = time.monotonic() - t0
            time.sleep(0.005)
        cpu = _cpu_seconds(proc.pid)
        phases = _phases(trace, launched, proc.pid) if trace.exists() else {}
        serving = sum(phases[f"supervisor: {step}"] for step, _ in SUPERVISOR_STEPS) if phases else seen
        return {"serving_s": serving, "ready_s": health["ready_s"], "cpu_s": cpu, "phases": phases}
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        poller.join(5)


def import_seconds(directory: Path, before: str, modules: str, runs: int = 3) -> float:
    """Median seconds to import `modules` (comma-separated) in a fresh interpreter that imported `before`
    first; the interpreter's own start is not counted."""
    code = (f"import time{', ' + before if before else ''}; t = time.perf_counter(); import {modules}; "
            "print(time.perf_counter() - t)")
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(directory),
                                                  check=True, capture_output=True, text=True).stdout)
                             for _ in range(runs))


def costliest_imports(directory: Path, before: str, modules: str, top: int = 6, runs: int = 3) -> list[tuple[str, float]]:
    """The top-level packages that importing `modules` (after `before`) spent the most seconds in: the
    self time of each module `python -X importtime` reports, summed per top-level package (the median of
    `runs` fresh interpreters)."""
    code = f"import {before + ', ' if before else ''}sys; sys.stderr.write('---\\n'); import {modules}"
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0] * runs)
    for run in range(runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, env=_env(directory),
                             check=True, capture_output=True, text=True).stderr
        for line in err.split("---\n", 1)[-1].splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s+(\S+)", line)
            if m:
                totals[m.group(2).split(".")[0]][run] += int(m.group(1)) / 1e6
    medians = {name: statistics.median(seconds) for name, seconds in totals.items()}
    return sorted(medians.items(), key=lambda kv: -kv[1])[:top]


def _launches(models_dir: str, directory: Path, runs: int) -> dict:
    launch_to_ready(models_dir, directory)   # warm the page cache: the runs below are all alike
    results = [launch_to_ready(models_dir, directory) for _ in range(runs)]
    phases = {key: statistics.median(r["phases"][key] for r in results) for key in results[0]["phases"]}
    return {"serving_s": statistics.median(r["serving_s"] for r in results), "runs_s": [r["serving_s"] for r in results],
            "ready_s": statistics.median(r["ready_s"] for r in results),
            "cpu_s": statistics.median(r["cpu_s"] for r in results), "phases": phases}


def _print_phases(name: str, phases: dict[str, float]) -> None:
    ms = {k: v * 1000 for k, v in phases.items()}
    print(f"  where the time went, {name} (medians, ms: wall / CPU of that process):")
    at = 0.0
    for step, what in SUPERVISOR_STEPS:
        at += ms[f"supervisor: {step}"]
        print(f"    supervisor  {what:<50} {ms[f'supervisor: {step}']:5.0f} / {ms[f'supervisor: {step} cpu']:4.0f}"
              f"   (at {at:5.0f})")
    children = sorted({k.split(":")[0] for k in ms} - {"supervisor"}, key=lambda c: ms[f"{c}: at"])
    for child in children:
        print(f"    {child:<11} spawned at {ms[f'{child}: at']:.0f}; READY at {ms[f'{child}: ready at']:.0f}")
        for step, what in CHILD_STEPS:
            print(f"    {'':<11} {what:<50} {ms[f'{child}: {step}']:5.0f} / {ms[f'{child}: {step} cpu']:4.0f}")


def run(models_dir: str, runs: int = 5, many: int = 10_000) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="lsync-startup-"))
    try:
        _compile(directory)
        out = {"demo": _launches(models_dir, directory, runs)}
        if many:
            from bench.catalog import _models_dir
            catalog = directory / "models"
            _models_dir(catalog, many)
            out[f"{many}_models"] = _launches(str(catalog), directory, max(3, runs // 2))
        launches = list(out)
        out["imports_s"] = {role: import_seconds(directory, *modules) for role, modules in ROLES.items()}
        out["costliest_imports_s"] = {role: costliest_imports(directory, *modules) for role, modules in ROLES.items()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"start-up, CPU config (inference.devices: cpu, viewer and probes on), {os.cpu_count()} cores: "
          "launch -> `serving on` (health ready)")
    for name in launches:
        r = out[name]
        print(f"  {name.replace('_', ' '):>14}: {r['serving_s']:.2f} s ({r['ready_s']:.2f}), median of "
              f"{', '.join(f'{t:.2f}' for t in r['runs_s'])}; {r['cpu_s']:.2f} CPU-s in all its processes by ready")
    for name in launches:
        if out[name]["phases"]:
            _print_phases(name.replace("_", " "), out[name]["phases"])
    print("  imports, each in a fresh interpreter: " + ", ".join(f"{role} {s * 1000:.0f} ms"
                                                                 for role, s in out["imports_s"].items()))
    for role, costs in out["costliest_imports_s"].items():
        print(f"    {role}: " + ", ".join(f"{name} {s * 1000:.0f}" for name, s in costs) + " ms")
    return out
