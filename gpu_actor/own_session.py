"""Models in sessions of their own, the CPU provider's way: `OwnSessions` (the loader) and
`OwnSessionRunner` (a model: its inputs found by rank and shape, a batch run into a given buffer). On a
GPU, and on the stand-in device, models share one prepared session per architecture and size instead
(gpu_actor/architectures.py).

The inputs are bound straight from their shared-memory views and the output straight into the
destination slot (IO binding), so a batch costs no copy besides the model's own work.
A model with a fixed batch dimension is run in chunks of that size, the last one padded.

On the CPU a batch runs one frame per call (gpu_actor/shapes.py plans the calls, as on the GPU path),
its visual input built just before the call (`run` takes a function for it): a call over B frames takes
each op over all B frames before the next op, and at 320x320 a frame's input, output and intermediates
(~5 MB) then fall out of the cache between ops. The bench's 1x1-conv model costs 0.79 ms a frame so,
1.79 ms in calls of 8 with the visual input built for all 8 first; unet_328, compute-bound, costs the
same either way (82 ms). Batches are for the GPU.
One frame a call also bounds a request's memory whatever its batch: a frame's activations (~0.2 GB for
a real-size unet_328), never a batch's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from config.assets import AssetError, ModelIO, classify_io
from config.geometry import VISUAL_SHAPE
from gpu_actor.device import CpuDevice
from gpu_actor.onnx_sessions import DeviceError, session_options, short
from gpu_actor.runner import Part, check_audio, dims
from gpu_actor.shapes import BatchShapes
from shm.child import release_freed_memory

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)


def own_session(path: Path, device, threads: int, spin: bool = False) -> ort.InferenceSession:
    """A model file in a session of its own on `device`; AssetError says what is wrong with the file."""
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    # NOTE: onnxruntime is imported here (session_options), in the load thread: a worker imports it
    # (20-30 ms) with its first model, not before READY (on a GPU, Device.check has imported it by then).
    try:
        return device.session(str(path), session_options(threads, spin))
    except (DeviceError, MemoryError):
        raise
    except Exception as err:  # onnxruntime raises its own exception types for bad files
        raise AssetError(f"{path}: onnxruntime cannot load it: {short(err)}") from None


class OwnSessions:
    """The loader of a device whose models run in sessions of their own (gpu_actor/runner.Loader)."""

    def __init__(self, device, threads: int, spin: bool):
        self.device, self._options = device, (threads, spin)

    def load(self, path: Path, model: str = "") -> OwnSessionRunner:
        before = self.device.memory_used()
        runner = OwnSessionRunner(path, self.device, *self._options)
        runner.warm_up()
        release_freed_memory()   # NOTE: else the file's bytes, freed, count as the model's
        # The byte cap is checked on what the load really cost; never below the file's size.
        runner.nbytes = max(self.device.memory_used() - before, path.stat().st_size)
        return runner

    def prepare_more(self, runner: Callable[[], Optional[OwnSessionRunner]]) -> bool:
        """(Nothing: a model in a session of its own is ready when loaded.)"""
        return False

    def describe(self) -> dict[str, dict]:
        return {}


class OwnSessionRunner:
    """A model in a session of its own on the CPU provider (module docstring)."""

    frames_per_s = 0.0   # not measured: on the CPU, admission counts inference in the host's CPU (frontend/live)
    nbytes = 0           # what its load cost in resident memory: measured by OwnSessions.load

    def __init__(self, path: Path, device=None, threads: int = 0, spin: bool = False):
        device = device or CpuDevice()
        if device.shared_weights:
            raise DeviceError(f"{path}: a model on {device.name} runs in its architecture's prepared sessions "
                              "(gpu_actor/architectures.py), not a session of its own")
        self.path, self.device = path, device
        self.session = own_session(path, device, threads, spin)
        self.io: ModelIO = classify_io(
            [(i.name, dims(i.shape)) for i in self.session.get_inputs()],
            [(o.name, dims(o.shape)) for o in self.session.get_outputs()], str(path))
        # one frame a call (or the model's fixed batch), planned as the GPU path's calls are
        self.shapes = BatchShapes(device.sizes(1, self.io.batch))
        self.group, self.step_rows = self, self.shapes.largest   # a step: this model's rows, one call's worth
        self._padded: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None   # a fixed batch's last call

    def run(self, visual: Union[np.ndarray, Callable[[int, int], np.ndarray]], audio: np.ndarray,
            out: np.ndarray) -> None:
        """visual [B,6,320,320] (or a function giving frames [start, end) of it, called just before the
        call that needs them), audio [B,*A], out [B,3,320,320]: float32, C-contiguous."""
        batch = len(out)
        check_audio(self.path, self.io, audio, batch)
        frames = visual if callable(visual) else lambda start, end: visual[start:end]
        for step in self.shapes.plan(batch):
            rows = step.end - step.start
            if not step.padding:
                self._run(frames(step.start, step.end), audio[step.start:step.end], out[step.start:step.end])
                continue
            # a fixed-batch model's last call: padded with zero rows, the real frames kept
            if self._padded is None:
                self._padded = (np.zeros((step.size, *VISUAL_SHAPE), np.float32),
                                np.zeros((step.size, *self.io.audio_shape), np.float32),
                                np.empty((step.size, *out.shape[1:]), np.float32))
            pad_v, pad_a, pad_o = self._padded
            pad_v[:rows], pad_a[:rows] = frames(step.start, step.end), audio[step.start:step.end]
            pad_v[rows:], pad_a[rows:] = 0, 0
            self._run(pad_v, pad_a, pad_o)
            out[step.start:step.end] = pad_o[:rows]

    def end_step(self, kind: str) -> list[tuple[int, int]]:
        """(Steps and calls are counted where calls hold many frames: gpu_actor/prepared.py.)"""
        return []

    def run_parts(self, parts: list[Part]) -> None:
        """Several requests' rows: one frame a call whatever the step, so each part runs as its own batch."""
        for part in parts:
            self.run(part.visual, part.audio, part.out)

    def _run(self, visual: np.ndarray, audio: np.ndarray, out: np.ndarray) -> None:
        binding = self.session.io_binding()
        # NOTE: bound by address: the contiguous copies (if any) must live until the run
        inputs = {self.io.visual: np.ascontiguousarray(visual), self.io.audio: np.ascontiguousarray(audio)}
        for name, array in inputs.items():
            self.device.bind(binding, name, array)
        if not out.flags.c_contiguous:
            raise ValueError("output buffer must be C-contiguous")
        self.device.bind(binding, self.io.output, out, output=True)
        self.device.run(self.session, binding, len(out))

    def warm_up(self) -> None:
        """Run once at load (a call of its size), so the first request does not pay for lazy initialisation."""
        size = self.shapes.largest
        out = np.empty((size, 3, 320, 320), np.float32)
        self.run(np.zeros((size, *VISUAL_SHAPE), np.float32), np.zeros((size, *self.io.audio_shape), np.float32), out)
