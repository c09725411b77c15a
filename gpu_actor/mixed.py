"""Steps that hold frames of several avatars of one architecture: one call of the architecture's N-model
form (gpu_actor/grouped.py), frame i with its own model's weights, instead of a call per avatar.

`GroupedCalls` belongs to a prepared architecture (gpu_actor/prepared.Prepared): a session of the N-model
form per prepared size of 2 or more, made and warmed on the load thread with the plain sizes, and the
rows' weights at the largest size (a call at size s binds the first s rows, contiguous). Where every
weight has one dtype (fp32), the rows are whole weight buffers, one input the graph slices each weight
out of (`grouped.packed_graph`): a step copies a row with one device copy of the model's buffer, and
only the rows whose model changed since the last call. Otherwise one stacked buffer per weight
([largest, *shape]) and one copy per weight for all rows (on a card, a call into cupy per tensor: 186 for
unet_328, milliseconds of the worker's thread; measured on an H200, docs/benchmarks.md). The step stages
its inputs in the architecture's staging buffers and runs once. Its 1x1 convolutions run as grouped
convolutions or as batched MatMuls, whichever was faster at the largest size on the device. Its measured
seconds per size (`call_s`: copying every row's weights, then the call) against the plain calls' let a
worker choose per step (`inference.mixed_steps: auto`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import numpy as np

from gpu_actor.onnx_sessions import least_time, out_of_memory, short
from gpu_actor.weights import Weights

log = logging.getLogger(__name__)

POINTWISE = ("conv", "matmul")   # the N-model form's 1x1 convolutions (gpu_actor/grouped.py): both measured


class GroupedCalls:
    """An architecture's N-model form on a device at `sizes` (made on the load thread; `run` on the main
    thread). `session` makes a session of a serialized graph; `bind` binds the staging buffers at a size."""

    def __init__(self, prepared, sizes: tuple[int, ...], session: Callable[[bytes], object]):
        # NOTE: here: it imports onnx, which READY does not need
        from gpu_actor.grouped import PACKED, grouped_graph, packed_graph
        from gpu_actor.weights import layout
        architecture, device = prepared.architecture, prepared.device
        self.prepared, self.device = prepared, device
        largest = max(sizes)
        dtypes = {np.dtype(d) for d in architecture.dtypes}
        self.packed = len(dtypes) == 1   # one dtype: whole buffers in one input (module docstring)

        def graph(size: int, pointwise: str) -> bytes:
            grouped = grouped_graph(architecture, size, pointwise)
            return packed_graph(grouped, architecture, size) if self.packed else grouped

        with device.lock:
            if self.packed:
                self.rows = device.empty((largest, layout(architecture.shapes, architecture.dtypes)[1]), np.uint8)
                self._inputs = [(PACKED, self.rows.view(next(iter(dtypes))))]
            else:
                self.stacked = [device.empty((largest, *shape), dtype)
                                for shape, dtype in zip(architecture.shapes, architecture.dtypes)]
                self._inputs = list(zip(architecture.weights, self.stacked))
        self._graph, self._session, self.sizes = graph, session, tuple(sorted(sizes, reverse=True))
        # the largest size in each way of running 1x1 convolutions; `warm` keeps the faster and makes the
        # other sizes in it
        self._candidates = {mode: session(graph(largest, mode)) for mode in POINTWISE}
        self.pointwise: Optional[str] = None
        self.pointwise_s: dict[str, float] = {}   # each way's call at the largest size, as measured
        self.sessions: dict[int, object] = {}
        self._bindings: dict[int, object] = {}
        self._owners: list[Optional[weakref.ref]] = [None] * largest   # the Weights each stacked row holds
        self.call_s: dict[int, float] = {}

    def binding(self, size: int, staging: Optional[tuple] = None):
        """The call's binding at `size`: the weight rows and the architecture's staging buffers (made once;
        the device thread's), or `staging`, buffers of the warm-up's own (visual, audio, out)."""
        binding = self._bindings.get(size) if staging is None else None
        if binding is None:
            p, device = self.prepared, self.device
            visual, audio, out = staging or (p.visual, p.audio, p.out)
            binding = self.sessions[size].io_binding()
            for name, rows in self._inputs:
                device.bind(binding, name, rows[:size])
            device.bind(binding, p.io.visual, visual[:size])
            device.bind(binding, p.io.audio, audio[:size])
            device.bind(binding, p.io.output, out[:size], output=True)
            if staging is None:
                self._bindings[size] = binding
        return binding

    def load(self, rows: list[Weights]) -> None:
        """Make the stacked buffers' first len(rows) rows hold these models' weights, unless they do."""
        held = [owner is not None and owner() is w for owner, w in zip(self._owners, rows)]
        if all(held):
            return
        if self.packed:   # a copy per row whose model changed
            for i, w in enumerate(rows):
                if not held[i]:
                    self.device.copy(self.rows[i], w.flat)
        else:
            for k, stacked in enumerate(self.stacked):
                self.device.stack(stacked[:len(rows)], [w.views[k] for w in rows])
        self._owners[:len(rows)] = [weakref.ref(w) for w in rows]

    def warm(self, model_weights: Callable[[], Optional[Weights]]) -> bool:
        """(The load thread, while the device thread may run the architecture's models: buffers of its own)
        every size, largest first: the first call pays the device's per-shape preparation, the least of
        TIMED_CALLS more is the size's steady cost (each copying every row's weights). The largest size
        runs both ways of the 1x1 convolutions (POINTWISE) and the faster is made at every other size (an
        H200 at 16 frames: batched MatMuls 14.1 ms, grouped convolutions 29.6 ms; the CPU provider: the
        convolutions 5-8% faster). A size the device has no memory for, or that fails to run, is dropped
        (its steps run as sub-calls)."""
        p, device = self.prepared, self.device
        largest = self.sizes[0]
        weights = model_weights()
        if weights is None:   # its model is gone already
            return False
        # NOTE: every row holds the model's weights from here on, and the warm-up copies rows from the first:
        # the model itself is not held meanwhile (an eviction frees its memory at once)
        with device.lock:
            self.load([weights] * largest)
            del weights
            staging = (device.empty((largest, *p.visual.shape[1:])), device.empty((largest, *p.audio.shape[1:])),
                       device.empty((largest, *p.out.shape[1:])))
            first = _FirstRow(self, largest)
        timed: dict[str, float] = {}
        for mode, candidate in self._candidates.items():
            self.sessions[largest] = candidate
            if self._time(largest, staging, first, mode):
                timed[mode] = self.call_s[largest]
        self.pointwise_s = timed
        if timed:
            self.pointwise = min(timed, key=timed.get)
            self.sessions[largest], self.call_s[largest] = self._candidates[self.pointwise], timed[self.pointwise]
            log.info("architecture %s: the N-model form's 1x1 convolutions run as %s (%s ms a call at %d)",
                     self.prepared.architecture.key, self.pointwise,
                     ", ".join(f"{mode} {t * 1000:.1f}" for mode, t in timed.items()), largest)
        with device.lock:
            self._candidates.clear()   # NOTE: the other way's session goes now, its arena with it
            if not timed:
                self.sessions.clear()
        if self.pointwise is not None:
            for size in self.sizes[1:]:
                try:
                    self.sessions[size] = self._session(self._graph(size, self.pointwise))
                except Exception as err:   # onnxruntime's own errors
                    self._failed(size, err)
                    continue
                self._time(size, staging, first, self.pointwise)
        self.sessions, self.call_s = dict(sorted(self.sessions.items())), dict(sorted(self.call_s.items()))
        self._owners = [None] * len(self._owners)
        return bool(self.sessions)

    def _time(self, size: int, staging: tuple, first: "_FirstRow", mode: str) -> bool:
        """(warm) the first call at `size`, then its steady cost into call_s; a failure drops the size."""
        try:
            with self.device.lock:
                binding = self.binding(size, staging)
                self.device.run(self.sessions[size], binding, size, graphs=False)

            def call() -> None:
                self._owners = [None] * len(self._owners)   # NOTE: timed with every row copied again
                self.load([first] * size)
                self.device.run(self.sessions[size], binding, size, graphs=False)
            self.call_s[size] = least_time(self.device.lock, call)
            return True
        except Exception as err:   # onnxruntime's own errors
            self._failed(size, err, mode)
            return False

    def _failed(self, size: int, err: Exception, mode: str = "") -> None:
        log.warning("architecture %s: its N-model form%s fails at batch %d (%s: %s); such steps run one call "
                    "per model", self.prepared.architecture.key, f" ({mode})" if mode else "", size,
                    "out of memory" if out_of_memory(err) else "error", short(err))
        with self.device.lock:
            self._bindings.pop(size, None)
            self.sessions.pop(size, None)
            self.call_s.pop(size, None)

    def run(self, size: int, rows: list[Weights]) -> None:
        """(The device thread) one call at `size` whose row i runs with rows[i] (padding rows: any model's)."""
        rows = rows + [rows[0]] * (size - len(rows))
        self.load(rows)
        self.device.run(self.sessions[size], self.binding(size), size, graphs=False)


class _FirstRow:
    """The weights the rows hold after a warm-up's first copy, as a source to copy every row from again
    (its own copy of the first row: never a copy onto itself)."""

    def __init__(self, grouped: GroupedCalls, largest: int):
        if grouped.packed:
            self.flat = grouped.rows[0].copy()
        else:
            self.views = [stacked[0].copy() for stacked in grouped.stacked]
