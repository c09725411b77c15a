"""CUDA graphs on a prepared architecture (`inference.cuda_graphs`): the one weight slot its graphs
replay, with one owner.

A CUDA graph replays the device addresses it captured, so with graphs every call of a prepared
architecture (gpu_actor/prepared.py) binds one weight buffer, the slot: a model's call first copies its
weights in, unless the slot holds them already. `GraphSlot` owns the slot, which model's weights it holds,
the one binding per size (the slot and the architecture's staging buffers), and each size's capture:
onnxruntime captures inside a thread's first runs of a session (two plain runs, then the capture), and
keeps a graph per thread, so the device thread's first CAPTURE_RUNS calls at a size hold the device's lock
(the load thread's calls into the device wait meanwhile). A size whose capture fails runs without graphs
from then on.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

from gpu_actor.onnx_sessions import short
from gpu_actor.weights import Weights

log = logging.getLogger(__name__)

CAPTURE_RUNS = 3         # the device thread's calls per size held under the device's lock (onnxruntime 1.31
                         # captures inside a thread's first run: two plain runs, then the capture)


class GraphSlot:
    """The weight slot of one prepared architecture and its captures (module docstring). Made and used
    under the device's lock on the load thread (warm-up); the device thread's calls go through `run`."""

    def __init__(self, device, architecture, sizes: tuple[int, ...],
                 bind: Callable[[object, Weights, int], None]):
        self.device, self.key = device, architecture.key
        self.weights = Weights(device, architecture)   # (the caller holds the device's lock)
        self._bind = bind                   # (binding, weights, size): the weights and the staging buffers
        self._holds: Callable[[], Optional[Weights]] = lambda: None
        self._bindings: dict[int, object] = {}
        self.runs = dict.fromkeys(sizes, 0)   # the device thread's calls per size (its captures)
        self.plain: set[int] = set()          # sizes whose capture failed: they run without graphs

    def holds(self) -> Optional[Weights]:
        """The weights the slot holds now (None: none, or their model is gone)."""
        return self._holds()

    def binding(self, session, weights: Weights, size: int):
        """The binding a call at `size` of `session` uses, the slot holding `weights` (copied in unless it
        does): made once per size, since a graph replays the addresses it captured."""
        if self._holds() is not weights:
            self.weights.copy_from(weights)
            self._holds = weakref.ref(weights)
        binding = self._bindings.get(size)
        if binding is None:
            binding = session.io_binding()
            self._bind(binding, self.weights, size)
            self._bindings[size] = binding
        return binding

    def drop(self, size: int) -> None:
        """A size the architecture no longer runs (no device memory for it): its binding goes with its
        session. (The caller holds the device's lock.)"""
        self._bindings.pop(size, None)
        self.runs.pop(size, None)

    def run(self, session, binding, size: int) -> None:
        """(The device thread) one call at `size`: captured at its first calls, holding the device's lock
        exclusively, replayed after; a size whose capture fails runs without graphs from then on, this call included."""
        if self.runs[size] >= CAPTURE_RUNS:
            self.device.run(session, binding, size, graphs=size not in self.plain)
            return
        with self.device.lock.exclusive():
            try:
                self.device.run(session, binding, size, graphs=size not in self.plain)
            except Exception as err:   # onnxruntime's own errors: a graph it runs but cannot capture
                if size in self.plain:
                    raise
                log.warning("architecture %s: CUDA graph capture at batch %d failed (%s); that size runs without "
                            "graphs", self.key, size, short(err))
                self.plain.add(size)
                self.device.run(session, binding, size, graphs=False)
        self.runs[size] += 1
