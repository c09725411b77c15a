"""Start-up: seconds from launching `python -m supervisor` to `health` saying "ready", on the CPU config
(the embedded default with the demo avatar already built, inference.devices: cpu, the viewer and the
probes on), the median of a few runs, also over a models_dir of many model directories; the CPU
seconds all its processes spent until then (on a busy host, the figure that moves least); and the
import time of each process role, each in a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
# What each process imports before it can report READY, as (imported first, untimed; timed): a spawned
# child runs supervisor/__main__.py again (as __mp_main__), then imports its role's module.
ROLES = {"supervisor": ("", "supervisor.__main__, supervisor.tree"),
         "frontend": ("", "supervisor.__main__, frontend.server.process"),
         "gpu worker": ("", "supervisor.__main__, gpu_actor.worker"),
         "compositor": ("", "supervisor.__main__, cpu_actor.worker"),
         "the viewer's stack, in the frontend": ("supervisor.__main__, frontend.server.process",
                                                 "frontend.live.viewer")}


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


def launch_to_ready(models_dir: str, directory: Path, timeout_s: float = 60.0) -> tuple[float, float]:
    """One launch: (seconds until `health` says ready, CPU seconds spent by then); then SIGTERM."""
    import zmq
    from lipsync_client import Client, ClientTimeout
    path, endpoint = _config(models_dir, directory)
    # NOTE: the client connects before the server binds; libzmq retries every RECONNECT_IVL (100 ms by
    # default), which would round every figure up to a tenth of a second.
    zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, 5)
    log = path.with_suffix(".log")
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--config", str(path)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        with Client(endpoint, timeout_s=1.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"not ready within {timeout_s:g}s: {log.read_text()[-2000:]}")
                try:
                    if client.health()["status"] == "ready":
                        return time.monotonic() - t0, _cpu_seconds(proc.pid)
                except ClientTimeout:
                    continue
                time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def import_seconds(before: str, modules: str, runs: int = 3) -> float:
    """Median seconds to import `modules` (comma-separated) in a fresh interpreter that imported `before`
    first; the interpreter's own start is not counted."""
    code = (f"import time{', ' + before if before else ''}; t = time.perf_counter(); import {modules}; "
            "print(time.perf_counter() - t)")
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                                                  capture_output=True, text=True).stdout) for _ in range(runs))


def _launches(models_dir: str, directory: Path, runs: int) -> dict:
    launch_to_ready(models_dir, directory)   # warm the page cache: the runs below are all alike
    results = [launch_to_ready(models_dir, directory) for _ in range(runs)]
    return {"launch_to_ready_s": statistics.median(r[0] for r in results), "runs_s": [r[0] for r in results],
            "cpu_s": statistics.median(r[1] for r in results)}


def run(models_dir: str, runs: int = 5, many: int = 10_000) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="lsync-startup-"))
    try:
        out = {"demo": _launches(models_dir, directory, runs)}
        if many:
            from bench.catalog import _models_dir
            catalog = directory / "models"
            _models_dir(catalog, many)
            out[f"{many}_models"] = _launches(str(catalog), directory, max(3, runs // 2))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out["imports_s"] = {role: import_seconds(*modules) for role, modules in ROLES.items()}
    print(f"start-up, CPU config (inference.devices: cpu, viewer and probes on), {os.cpu_count()} cores: "
          "launch -> health ready")
    for name, r in out.items():
        if name != "imports_s":
            print(f"  {name.replace('_', ' '):>14}: {r['launch_to_ready_s']:.2f} s, median of "
                  f"{', '.join(f'{t:.2f}' for t in r['runs_s'])}; {r['cpu_s']:.2f} CPU-s in all its processes by then")
    print("  imports, each in a fresh interpreter: " + ", ".join(f"{role} {s * 1000:.0f} ms"
                                                                 for role, s in out["imports_s"].items()))
    return out
