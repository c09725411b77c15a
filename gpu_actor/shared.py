"""One prepared graph per architecture, each model's weights bound per call (devices whose
`shared_weights` is set: a GPU, and the stand-in device that behaves like one).

A `Prepared` architecture holds an onnxruntime session per prepared batch size (cuDNN rebuilds a
session's plans when its input shape changes, so calls that alternate sizes would pay again in one
session), each warmed once, largest first, before any model of the architecture is ready: after that
no call ever meets a new shape. Its staging buffers (visual, audio, output at the largest size) are
allocated once on the device and never move.

A `SharedRunner` is one model: its weights resident on the device and, per batch size, an IO binding
made once (weights, staging buffers), so a call binds nothing: copy the rows in, run, copy the mouths out.
A model's load is reading its file and uploading its weights (`Architectures.load`); a new architecture
(the first model of it, or a graph like no other) is prepared on the load thread before its model
counts as loaded, never on the path of running models' batches.
"""

from __future__ import annotations

import logging
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from config.assets import AssetError, ModelIO, classify_io
from config.geometry import MOUTH_SHAPE, VISUAL_SHAPE
from gpu_actor.graphs import Architecture, check_convolutions, split_model
from gpu_actor.runner import dims, require_provider, session_options
from gpu_actor.shapes import BatchShapes

log = logging.getLogger(__name__)
IDLE_ARCHITECTURES = 4   # prepared architectures kept while no model uses them (the next avatar's is ready)


class Prepared:
    """One architecture on one device, prepared at every batch size."""

    def __init__(self, architecture: Architecture, device, max_batch: int, threads: int, tensorrt: bool, spin: bool):
        import onnxruntime as ort
        self.architecture, self.device = architecture, device
        options = session_options(threads, spin)
        try:
            first = ort.InferenceSession(architecture.graph, options, providers=device.providers(tensorrt))
        except Exception as err:  # onnxruntime raises its own exception types for graphs it cannot run
            raise AssetError(f"onnxruntime cannot load the model's graph: {str(err).splitlines()[0][:300]}") from None
        require_provider(first, device.name)
        weights = set(architecture.weights)
        self.io: ModelIO = classify_io(
            [(i.name, dims(i.shape)) for i in first.get_inputs() if i.name not in weights],
            [(o.name, dims(o.shape)) for o in first.get_outputs()], f"architecture {architecture.key}")
        self.shapes = BatchShapes(device.sizes(max_batch, self.io.batch))
        self.sessions = {size: first if size == self.shapes.largest else
                         ort.InferenceSession(architecture.graph, options, providers=device.providers(tensorrt))
                         for size in self.shapes.sizes}
        largest = self.shapes.largest
        self.visual = device.empty((largest, *VISUAL_SHAPE))
        self.audio = device.empty((largest, *self.io.audio_shape))
        self.out = device.empty((largest, *MOUTH_SHAPE))
        self.users: weakref.WeakSet = weakref.WeakSet()   # its SharedRunners: in use while any lives

    def prepare(self, weights: list) -> None:
        """Run every size once, largest first (the first call pays the device's per-shape preparation;
        the largest grows the memory pool once for all), with buffers of its own: the main thread may be
        running other architectures meanwhile."""
        device = self.device
        for size in sorted(self.shapes.sizes, reverse=True):
            session = self.sessions[size]
            binding = session.io_binding()
            for name, array in zip(self.architecture.weights, weights):
                device.bind(binding, name, array)
            # NOTE: a binding holds addresses, not the arrays: these names keep them alive through the run
            visual, audio = device.empty((size, *VISUAL_SHAPE)), device.empty((size, *self.io.audio_shape))
            out = device.empty((size, *MOUTH_SHAPE))
            device.bind(binding, self.io.visual, visual)
            device.bind(binding, self.io.audio, audio)
            device.bind(binding, self.io.output, out, output=True)
            try:
                device.run(session, binding, size)
            except Exception as err:   # onnxruntime's own errors: a graph it loads but cannot run
                raise AssetError(f"the model's graph fails to run at batch {size}: "
                                 f"{str(err).splitlines()[0][:300] if str(err) else type(err).__name__}") from None
            del visual, audio, out, binding


class SharedRunner:
    """A model on a prepared architecture: `run` as gpu_actor/runner.ModelRunner's."""

    def __init__(self, prepared: Prepared, weights: list, path: Path):
        self.prepared, self.weights, self.path = prepared, weights, path
        self.io = prepared.io
        self.nbytes = prepared.architecture.nbytes
        self._bindings: dict[int, object] = {}
        prepared.users.add(self)

    def _binding(self, size: int):
        binding = self._bindings.get(size)
        if binding is None:
            p, device = self.prepared, self.prepared.device
            binding = p.sessions[size].io_binding()
            for name, array in zip(p.architecture.weights, self.weights):
                device.bind(binding, name, array)
            device.bind(binding, self.io.visual, p.visual[:size])
            device.bind(binding, self.io.audio, p.audio[:size])
            device.bind(binding, self.io.output, p.out[:size], output=True)
            self._bindings[size] = binding
        return binding

    def run(self, visual: Union[np.ndarray, Callable[[int, int], np.ndarray]], audio: np.ndarray,
            out: np.ndarray) -> None:
        """visual [B,6,320,320] (or a function giving frames [start, end) of it), audio [B,*A],
        out [B,3,320,320]: float32, C-contiguous; run as calls at prepared sizes."""
        batch = len(out)
        if audio.shape != (batch, *self.io.audio_shape):
            raise AssetError(f"{self.path}: audio must be [{batch}, {', '.join(map(str, self.io.audio_shape))}], "
                             f"got {list(audio.shape)}")
        frames = visual if callable(visual) else lambda start, end: visual[start:end]
        p, device = self.prepared, self.prepared.device
        for chunk in p.shapes.plan(batch):
            rows = chunk.end - chunk.start
            device.upload(p.visual[:rows], frames(chunk.start, chunk.end))
            device.upload(p.audio[:rows], audio[chunk.start:chunk.end])
            if chunk.padding:   # NOTE: padded rows are zeros, whatever the last call left there
                device.zero(p.visual[rows:chunk.size])
                device.zero(p.audio[rows:chunk.size])
            device.run(p.sessions[chunk.size], self._binding(chunk.size), chunk.size)
            device.download(p.out[:rows], out[chunk.start:chunk.end])


class Architectures:
    """A worker's prepared architectures, by key; `load` (the load thread) gives a model's runner."""

    def __init__(self, device, max_batch: int, threads: int, tensorrt: bool, spin: bool):
        self.device, self.max_batch = device, max_batch
        self._options = (threads, tensorrt, spin)
        self.prepared: dict[str, Prepared] = {}
        self._lock = threading.Lock()

    def load(self, path: Path, model: str = "") -> SharedRunner:
        split = split_model(path)
        key = split.architecture.key
        with self._lock:
            prepared = self.prepared.get(key)
        if prepared is None:
            check_convolutions(split.architecture, path)
            prepared = Prepared(split.architecture, self.device, self.max_batch, *self._options)
            weights = self.device.resident(split.weights)
            prepared.prepare(weights)
            log.info("architecture %s (from %s) prepared at batch sizes %s", key, path, prepared.shapes.sizes)
            with self._lock:
                self._forget_idle()
                self.prepared[key] = prepared
        else:
            prepared.architecture.check(model or str(path), split.weights)
            weights = self.device.resident(split.weights)
        return SharedRunner(prepared, weights, path)

    def _forget_idle(self) -> None:
        idle = [key for key, p in self.prepared.items() if not p.users]
        for key in idle[: max(len(idle) - IDLE_ARCHITECTURES + 1, 0)]:
            del self.prepared[key]

    def sizes(self) -> Optional[tuple[int, ...]]:
        with self._lock:
            return next((p.shapes.sizes for p in self.prepared.values()), None)
