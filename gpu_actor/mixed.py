"""Steps that hold frames of several avatars of one architecture: one call of the architecture's N-model
form (gpu_actor/grouped.py), frame i with its own model's weights, instead of a call per avatar.

`GroupedCalls` belongs to a prepared architecture (gpu_actor/shared.Prepared): a session of the N-model
form per prepared size of 2 or more, made and warmed on the load thread with the plain sizes, and one
stacked buffer per weight at the largest size ([largest, *shape]: a call at size s binds its first s
rows, contiguous). A step copies its rows' models' weights into the stacked buffers (one copy per weight
for all rows, skipped when the rows hold the same models as the last call), stages its inputs in the
architecture's staging buffers and runs once. Its measured seconds per size (`call_s`) against the plain
calls' let a worker choose per step (`inference.mixed_steps: auto`).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, Optional

from gpu_actor.onnx_sessions import out_of_memory, short
from gpu_actor.weights import Weights

log = logging.getLogger(__name__)


class GroupedCalls:
    """An architecture's N-model form on a device at `sizes` (made on the load thread; `run` on the main
    thread). `session` makes a session of a serialized graph; `bind` binds the staging buffers at a size."""

    def __init__(self, prepared, sizes: tuple[int, ...], session: Callable[[bytes], object]):
        from gpu_actor.grouped import grouped_graph   # NOTE: here: it imports onnx, which READY does not need
        architecture, device = prepared.architecture, prepared.device
        self.prepared, self.device = prepared, device
        largest = max(sizes)
        with device.lock:
            self.stacked = [device.empty((largest, *shape), dtype)
                            for shape, dtype in zip(architecture.shapes, architecture.dtypes)]
        self.sessions = {size: session(grouped_graph(architecture, size)) for size in sizes}
        self._bindings: dict[int, object] = {}
        self._owners: list[Optional[weakref.ref]] = [None] * largest   # the Weights each stacked row holds
        self.call_s: dict[int, float] = {}

    def binding(self, size: int):
        binding = self._bindings.get(size)
        if binding is None:
            p, device = self.prepared, self.device
            binding = self.sessions[size].io_binding()
            for name, stacked in zip(p.architecture.weights, self.stacked):
                device.bind(binding, name, stacked[:size])
            device.bind(binding, p.io.visual, p.visual[:size])
            device.bind(binding, p.io.audio, p.audio[:size])
            device.bind(binding, p.io.output, p.out[:size], output=True)
            self._bindings[size] = binding
        return binding

    def load(self, rows: list[Weights]) -> None:
        """Make the stacked buffers' first len(rows) rows hold these models' weights, unless they do."""
        if all(owner is not None and owner() is w for owner, w in zip(self._owners, rows)):
            return
        for k, stacked in enumerate(self.stacked):
            self.device.stack(stacked[:len(rows)], [w.views[k] for w in rows])
        self._owners[:len(rows)] = [weakref.ref(w) for w in rows]

    def warm(self, weights: Weights) -> None:
        """(The load thread, no request running this architecture) every size twice, largest first: the
        first call pays the device's per-shape preparation, the second is the size's steady cost. A size
        the device has no memory for, or that fails to run, is dropped (its steps run as sub-calls)."""
        for size in sorted(self.sessions, reverse=True):
            try:
                with self.device.lock:
                    self.load([weights] * size)
                    binding = self.binding(size)
                    self.device.run(self.sessions[size], binding, size, graphs=False)
                    t0 = time.perf_counter()
                    self.device.run(self.sessions[size], binding, size, graphs=False)
                    self.call_s[size] = time.perf_counter() - t0
            except Exception as err:   # onnxruntime's own errors
                log.warning("architecture %s: its N-model form fails at batch %d (%s: %s); such steps run one "
                            "call per model", self.prepared.architecture.key, size,
                            "out of memory" if out_of_memory(err) else "error", short(err))
                with self.device.lock:
                    self._bindings.pop(size, None)
                    del self.sessions[size]
        self._owners = [None] * len(self._owners)

    def run(self, size: int, rows: list[Weights]) -> None:
        """(The main thread) one call at `size` whose row i runs with rows[i] (padding rows: any model's)."""
        rows = rows + [rows[0]] * (size - len(rows))
        self.load(rows)
        self.device.run(self.sessions[size], self.binding(size), size, graphs=False)
