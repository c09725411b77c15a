"""The audio encoders of a worker's models: 16 kHz PCM's mel windows -> features (config/audio.py), on the
worker's device, and the features a live session's frames share.

An encoder is run only at prepared batch sizes, as the models are (gpu_actor/shapes.py): SyncTalk_2D's
encoder is convolutional, so on a card each new count of rows would stop the worker's device thread for
cuDNN's plans (seconds) while every session waits. Each size is its own session (onnxruntime rebuilds a
session's plans when its input shape changes), warmed largest first on the load thread before the model
that uses it counts as loaded; the device thread never makes or first-runs an encoder. On the CPU provider
(a device that does not batch) there is no plan to build: one session runs any count in one call.

Encoders are kept by their file's content, so avatars that share one (SyncTalk_2D's is one generic model)
share its sessions whatever their paths.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np

from config import audio as A
from config.assets import AssetError
from gpu_actor.onnx_sessions import session_options, short
from gpu_actor.shapes import BatchShapes

log = logging.getLogger(__name__)
FEATURES_CACHE = 20_000   # encoder outputs kept for live sessions (2 KB each)


class Encoder:
    """One encoder file on a device: a session per prepared size (one session where the device does not
    batch). The load thread makes and warms it, holding the device's lock around each call."""

    def __init__(self, path: Path, device, max_batch: int, threads: int, spin: bool):
        self.path, self.device = path, device
        first = self._session(threads, spin)
        inputs = first.get_inputs()
        if len(inputs) != 1:
            raise AssetError(f"{path}: an audio encoder takes one input (mel windows "
                             f"[N, {', '.join(map(str, A.ENCODER_INPUT_SHAPE))}]), it has {len(inputs)}")
        self.input = inputs[0].name
        fixed = inputs[0].shape[0] if isinstance(inputs[0].shape[0], int) else None
        self.shapes: Optional[BatchShapes] = None
        self.sessions = {0: first}
        if device.batched or fixed:
            self.shapes = BatchShapes(device.sizes(max_batch, fixed))
            self.sessions = {size: first if size == self.shapes.largest else self._session(threads, spin)
                             for size in self.shapes.sizes}

    def _session(self, threads: int, spin: bool):
        with self.device.lock:
            return self.device.session(str(self.path), session_options(threads, spin))

    def warm(self) -> None:
        """Run every size once, largest first, so no call of the device thread meets a new shape."""
        for size in sorted(self.sessions, reverse=True):
            rows = np.zeros((max(size, 1), *A.ENCODER_INPUT_SHAPE), np.float32)
            with self.device.lock:
                self.device.infer(self.sessions[size], {self.input: rows})

    def run(self, inputs: np.ndarray) -> np.ndarray:
        """Features of `inputs` [N, *ENCODER_INPUT_SHAPE]: [N, ...], in calls at prepared sizes, the last
        padded with zero rows."""
        if self.shapes is None:
            return self.device.infer(self.sessions[0], {self.input: np.ascontiguousarray(inputs, np.float32)})[0]
        out = []
        for step in self.shapes.plan(len(inputs)):
            rows = np.zeros((step.size, *inputs.shape[1:]), np.float32)
            rows[:step.end - step.start] = inputs[step.start:step.end]
            out.append(self.device.infer(self.sessions[step.size], {self.input: rows})[0][:step.end - step.start])
        return np.concatenate(out)


class AudioEncoders:
    """A worker's encoders by file content, which model uses which, and the features cache of live
    sessions. `load` runs on the load thread; the rest on the device thread."""

    def __init__(self, device, max_batch: int, threads: int, spin: bool):
        self.device, self.max_batch, self._options = device, max_batch, (threads, spin)
        self._by_content: dict[str, Encoder] = {}
        self._of_model: dict[str, tuple[Optional[str], str]] = {}   # model -> (content key, or None: its error)
        self._lock = threading.Lock()   # NOTE: both threads read and write the two maps
        self._features: OrderedDict[tuple, np.ndarray] = OrderedDict()   # (utterance, input) -> features

    def load(self, model: str, path: Optional[Path]) -> None:
        """(The load thread) the encoder `model` runs with, loaded and warmed unless one of its content is.
        A failure is logged and kept: the model's PCM requests fail with it; its window requests still run."""
        if path is None:
            with self._lock:
                self._of_model[model] = (None, f"model {model} has no audio encoder: put audio_encoder.onnx in its "
                                               "directory or set audio.encoder")
            return
        try:
            key = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as err:
            key, error = None, f"model {model}: its audio encoder {path} cannot be read: {err}"
        else:
            error = ""
            with self._lock:
                known = key in self._by_content
            if not known:
                try:
                    encoder = Encoder(path, self.device, self.max_batch, *self._options)
                    encoder.warm()
                except Exception as err:   # onnxruntime's own errors, or an AssetError about the file
                    key, error = None, f"model {model}: its audio encoder {path} did not load: {short(err)}"
                    log.warning("%s", error)
                else:
                    with self._lock:
                        self._by_content[key] = encoder
        with self._lock:
            self._of_model[model] = (key, error)

    def of(self, model: str) -> Encoder:
        """The encoder `model` loaded with; AssetError (the request's answer) where it has none."""
        with self._lock:
            key, error = self._of_model.get(model, (None, f"model {model}: its audio encoder is not loaded"))
            encoder = self._by_content.get(key) if key else None
        if encoder is None:
            raise AssetError(error)
        return encoder

    def windows(self, model: str, pcm: np.ndarray) -> np.ndarray:
        """A whole utterance's 16 kHz PCM (int16) -> each frame's audio window."""
        inputs = A.encoder_inputs(A.melspectrogram(pcm.astype(np.float32) / 32768.0))
        return A.frame_windows(self.of(model).run(inputs))

    def features_many(self, requests: list[tuple[str, object, int, np.ndarray]]) -> list:
        """Each request's (model, utterance, first input's number, inputs) encoder outputs, or the AssetError
        it fails with alone. Consecutive frames share 15 of their 16 window rows: each (utterance, input
        number) is encoded once and kept (bounded, least recently used out; a falsy utterance is never
        cached). The inputs missing from the cache run together, one batch per encoder whatever the
        sessions or avatars they come from (a worker's step)."""
        cache = self._features
        results: list = [None] * len(requests)
        todo: dict[int, tuple[Encoder, dict]] = {}   # id(encoder) -> (encoder, key -> its input row)
        wanted = []
        for i, (model, utterance, first, inputs) in enumerate(requests):
            try:
                encoder = self.of(model)
            except AssetError as err:
                results[i] = err
                continue
            keys = [(utterance, first + j) if utterance else (id(requests[i]), j) for j in range(len(inputs))]
            rows = todo.setdefault(id(encoder), (encoder, {}))[1]
            for key, row in zip(keys, inputs):
                if key not in cache:
                    rows.setdefault(key, row)
                else:
                    cache.move_to_end(key)
            wanted.append((i, keys))
        for encoder, rows in todo.values():
            if rows:
                computed = encoder.run(np.ascontiguousarray(np.stack(list(rows.values())), np.float32))
                cache.update(zip(rows, computed))
        for i, keys in wanted:
            results[i] = np.stack([cache[key] for key in keys])
        for i, keys in wanted:   # NOTE: an uncached request's rows go as soon as it has them
            if not requests[i][1]:
                for key in keys:
                    cache.pop(key, None)
        while len(cache) > FEATURES_CACHE:
            cache.popitem(last=False)
        return results
