"""Models on prepared architectures (gpu_actor/prepared.py), for devices whose `shared_weights` is set.

A `PreparedRunner` is one model: its weights resident on the device and, per batch size, an IO binding
made once (weights, staging buffers; with CUDA graphs the architecture's one weight slot instead:
gpu_actor/cuda_graphs.py), so a call binds nothing: copy the rows in, run, copy the mouths out.
`Architectures` keeps a worker's prepared architectures by key: a model's load is reading its file and
uploading its weights (`Architectures.load`); a new architecture (the first model of it, or a graph like
no other) is prepared on the load thread before its model counts as loaded, never on the path of running
models' batches.
"""

from __future__ import annotations

import logging
import threading
import traceback
import weakref
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from gpu_actor.model_split import Architecture, Split, check_convolutions, split_model
from gpu_actor.prepared import Prepared
from gpu_actor.runner import Part, check_audio
from gpu_actor.weights import Weights

log = logging.getLogger(__name__)
IDLE_ARCHITECTURES = 4   # prepared architectures kept while no model uses them (the next avatar's is ready)


class PreparedRunner:
    """A model on a prepared architecture (gpu_actor/runner.Runner)."""

    def __init__(self, prepared: Prepared, weights: Weights, path: Path):
        self.prepared, self.weights, self.path = prepared, weights, path
        self.io = prepared.io
        self.nbytes = weights.nbytes
        self._bindings: dict[int, object] = {}
        prepared.users.add(self)

    @property
    def frames_per_s(self) -> float:
        return self.prepared.frames_per_s()

    @property
    def group(self) -> Prepared:
        return self.prepared

    @property
    def step_rows(self) -> int:
        return self.prepared.shapes.largest

    def end_step(self, kind: str) -> list[tuple[int, int]]:
        return self.prepared.end_step(kind)

    def run(self, visual: Union[np.ndarray, Callable[[int, int], np.ndarray]], audio: np.ndarray,
            out: np.ndarray) -> None:
        """visual [B,6,320,320] (or the avatar's crops, `VisualFrames`), audio [B,*A], out [B,3,320,320]:
        float32, C-contiguous; run as calls at prepared sizes."""
        self.run_parts([Part(visual, audio, out)])

    def run_parts(self, parts: list[Part]) -> None:
        """Several requests' rows as one batch (a worker's step): their rows fill calls at prepared sizes
        together, each part's mouths land in its own `out`."""
        for part in parts:
            check_audio(self.path, self.io, part.audio, len(part.out))
        p = self.prepared
        for step in p.shapes.plan(sum(len(part.out) for part in parts)):
            pieces = p.stage(parts, step)
            p.call(step.size, p.binding(self.weights, step.size, self._bindings))
            p.unstage(pieces, step)


class Architectures:
    """A worker's prepared architectures, by key; `load` (the load thread) gives a model's runner."""

    def __init__(self, device, max_batch: int, threads: int, spin: bool, precision: str = "fp32",
                 graphs: bool = False, mixed: str = "auto"):
        self.device, self.max_batch, self.precision, self.graphs = device, max_batch, precision, graphs
        self.mixed = mixed
        self._options = (threads, spin)
        self.prepared: dict[str, Prepared] = {}
        self._lock = threading.Lock()

    def load(self, path: Path, model: str = "") -> PreparedRunner:
        """(The load thread) a model's runner: its weights uploaded, its architecture prepared first if new."""
        split = split_model(path)
        # NOTE: here, not where a model is evicted: cudaFree waits for the whole device, and the main
        # thread must not wait for a load; before the load (evicted models' weights, for this one's
        # and onnxruntime's allocations) and after it (its warm-up buffers)
        with self.device.lock:
            self.device.release()
        try:
            return self._load(path, model, split)
        except BaseException as err:
            with self.device.lock:
                # NOTE: what the failed load made (sessions, buffers) goes now, under the lock, not
                # whenever the error's frames are dropped
                traceback.clear_frames(err.__traceback__)
            raise
        finally:
            with self.device.lock:
                self.device.release()

    def _weights(self, architecture: Architecture, model: str, split: Split) -> Weights:
        arrays = architecture.weights_of(model, split)
        with self.device.lock:
            return Weights(self.device, architecture, arrays)

    def _load(self, path: Path, model: str, split: Split) -> PreparedRunner:
        key = split.architecture.key   # NOTE: fp32's key also for fp16: every model of it converts alike
        with self._lock:
            prepared = self.prepared.get(key)
        if prepared is None:
            check_convolutions(split.architecture, path)
            architecture = split.architecture
            if self.precision == "fp16":
                from gpu_actor.precision import fp16_architecture   # NOTE: here: it imports onnx
                architecture = fp16_architecture(path, split, self.device, *self._options)
            prepared = Prepared(architecture, self.device, self.max_batch, *self._options, graphs=self.graphs,
                                mixed=self.mixed)
            weights = self._weights(architecture, str(path), split)
            prepared.prepare(weights)
            log.info("architecture %s (from %s) prepared at batch sizes %s: %.0f frames/s at best, %.1f MB a frame",
                     key, path, prepared.shapes.sizes, prepared.frames_per_s(), prepared.frame_bytes / 1e6)
            with self._lock:
                self._forget_idle()
                self.prepared[key] = prepared
        else:
            weights = self._weights(prepared.architecture, str(path), split)
        return PreparedRunner(prepared, weights, path)

    def prepare_more(self, runner: Callable[[], Optional[PreparedRunner]]) -> bool:
        """(A thread beside the load thread, after the model of `runner`, a weak reference, counts as loaded)
        its architecture's N-model form, once a second model of it is loaded (Prepared.prepare_grouped);
        the model is not held meanwhile: an eviction frees it at once."""
        model = runner()
        if model is None:
            return False
        prepared, weights = model.prepared, weakref.ref(model.weights)
        del model
        if prepared.grouped_tried or len(prepared.users) < 2:
            return False
        try:
            prepared.prepare_grouped(weights)
        finally:
            with self.device.lock:
                self.device.release()   # (its warm-up buffers)
        return prepared.grouped is not None

    def _forget_idle(self) -> None:
        idle = [key for key, p in self.prepared.items() if not p.users]
        for key in idle[: max(len(idle) - IDLE_ARCHITECTURES + 1, 0)]:
            del self.prepared[key]

    def describe(self) -> dict[str, dict]:
        """Each prepared architecture: its sizes, its measured frames/s, the models loaded on it (stats)."""
        with self._lock:
            return {key: {"sizes": list(p.shapes.sizes), "frames_per_s": round(p.frames_per_s(), 1),
                          "models": len(p.users), "cuda_graphs": p.graph_slot is not None,
                          "grouped_ms": {str(s): round(t * 1000, 3) for s, t in p.grouped.call_s.items()}
                          if p.grouped else {}, "grouped_pointwise": p.grouped.pointwise if p.grouped else None,
                          **p.call_stats()}
                    for key, p in self.prepared.items()}
