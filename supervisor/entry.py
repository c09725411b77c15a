"""What a spawned child runs first: its role's module, imported there and not in the supervisor, so that
the supervisor spawns sooner and no process imports the libraries of a role it does not play (the
frontend no OpenCV or onnxruntime, a GPU worker no PyAV, a compositor no onnxruntime).

Kept apart from tree.py, so that a child does not import the supervisor's own modules to find it.

`mark` is the start-up trace: with LIPSYNC_STARTUP_TRACE=FILE set (`python -m bench startup` sets it),
every process of the server appends `pid step unix-time cpu-seconds` to FILE at each step of its start,
which the bench turns into a table of where the time went (the CPU seconds tell it apart from waiting
for a core on a busy host). Unset, a mark costs one dictionary lookup.
"""

from __future__ import annotations

import importlib
import os
import time

TRACE_ENV = "LIPSYNC_STARTUP_TRACE"

# role -> "module:function", the role's `run_<role>_process(config, run, index)` (shm/child.py)
ENTRIES = {"gpu": "gpu_actor.worker:run_gpu_process", "cpu": "cpu_actor.worker:run_cpu_process",
           "frontend": "frontend.server.process:run_frontend_process",
           "bridge": "frontend.bridge.process:run_bridge_process",
           "remote": "gpu_actor.remote:run_remote_worker_process"}


def mark(step: str, of: int | None = None) -> None:
    """Append `pid step time cpu` to the start-up trace, if one is asked for (LIPSYNC_STARTUP_TRACE), with
    this process's CPU seconds so far, and then those of process `of` (a child, seen by the supervisor)."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = f"{os.getpid()} {step} {time.time():.6f} {time.process_time():.6f}"
    if of is not None:
        import psutil
        try:
            times = psutil.Process(of).cpu_times()
            line += f" {times.user + times.system:.6f}"
        except psutil.Error:
            line += " nan"
    # NOTE: one short write to a file opened for appending: the processes' lines do not interleave.
    with open(path, "a") as f:
        f.write(line + "\n")


# NOTE: this module is the first of the server's that a process imports: the supervisor's __main__ does at
# its top, and a spawned child does to unpickle its target (run_entry), before its config and run spec.
mark("main")


def run_entry(entry: str, config, run, index: int) -> None:
    """A child process's target: import its role's module and run its entry."""
    mark("entry")   # the config and the run spec are unpickled: their modules are imported
    module, _, name = entry.partition(":")
    function = getattr(importlib.import_module(module), name)
    mark("imported")
    function(config, run, index)
