"""What a spawned child runs first: its role's module, imported there and not in the supervisor, so that
the supervisor spawns sooner and no process imports the libraries of a role it does not play (the
frontend no OpenCV or onnxruntime, a GPU worker no PyAV, a compositor no onnxruntime).

Kept apart from tree.py, so that a child does not import the supervisor's own modules to find it.
"""

from __future__ import annotations

import importlib

# role -> "module:function", the role's `run_<role>_process(config, run, index)` (shm/child.py)
ENTRIES = {"gpu": "gpu_actor.worker:run_gpu_process", "cpu": "cpu_actor.worker:run_cpu_process",
           "frontend": "frontend.server.process:run_frontend_process",
           "bridge": "frontend.bridge.process:run_bridge_process",
           "remote": "gpu_actor.remote:run_remote_worker_process"}


def run_entry(entry: str, config, run, index: int) -> None:
    """A child process's target: import its role's module and run its entry."""
    module, _, name = entry.partition(":")
    getattr(importlib.import_module(module), name)(config, run, index)
