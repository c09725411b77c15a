"""One ONNX model in a session of its own on the CPU provider: find its inputs by rank and shape, run a
batch into a given buffer. (On a GPU, and on the stand-in device, models share one prepared session per
architecture instead: gpu_actor/shared.py.)

The inputs are bound straight from their shared-memory views and the output straight into the
destination slot (IO binding), so a batch costs no copy besides the model's own work.
A model with a fixed batch dimension is run in chunks of that size, the last one padded.

Memory: a batch is run as consecutive sub-batches into the same output buffer, each at most
`max_frames` frames, so one request costs at most the worker's batch-memory budget whatever its size.
`max_frames` is sized once, at warm-up, from the model's measured peak memory per frame (the growth
of peak resident memory from a 1-frame to a 2-frame run) and the budget (`inference.batch_memory_bytes`,
or half of the memory free, shared by the device's workers).

On the CPU a batch runs one frame per call, its visual input built just before the call (`run` takes a
function for it): a call over B frames takes each op over all B frames before the next op, and at
320x320 a frame's input, output and intermediates (~5 MB) then fall out of the cache between ops. The
bench's 1x1-conv model costs 0.79 ms a frame so, 1.79 ms in calls of 8 with the visual input built
for all 8 first; unet_328, compute-bound, costs the same either way (82 ms). Batches are for the GPU.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np
import psutil

from config.assets import AssetError, ModelIO, classify_io
from config.geometry import VISUAL_SHAPE
from gpu_actor.device import CpuDevice, DeviceError, session_options, short

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)
WARM_FRAMES = 8   # the batch a load also warms at (warm_up), when the memory budget allows it
AUTO_BUDGET_SHARE = 0.5   # of the memory the device has free at load, when inference.batch_memory_bytes is 0
MIN_FRAME_BYTES = 4 * (6 + 3) * 320 * 320   # a frame's input and output: the least a frame can cost
CPU_CALL_FRAMES = 1   # frames per onnxruntime call on the CPU (the module's docstring says why)


def dims(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


def own_session(path: Path, device, threads: int, tensorrt: bool = False, spin: bool = False) -> ort.InferenceSession:
    """A model file in a session of its own on `device`; AssetError says what is wrong with the file."""
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    # NOTE: onnxruntime is imported here (session_options), in the load thread: a worker imports it
    # (20-30 ms) with its first model, not before READY (on a GPU, Device.check has imported it by then).
    try:
        return device.session(str(path), session_options(threads, spin), tensorrt)
    except (DeviceError, MemoryError):
        raise
    except Exception as err:  # onnxruntime raises its own exception types for bad files
        raise AssetError(f"{path}: onnxruntime cannot load it: {short(err)}") from None


def _peak_reset() -> None:
    """Start a new peak-resident-memory window (Linux: VmHWM := current RSS); elsewhere a no-op."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """Peak resident bytes since the last `_peak_reset` (Linux), else the current resident bytes."""
    rss = psutil.Process().memory_info().rss
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return max(int(line.split()[1]) * 1024, rss)
    except OSError:
        pass
    return rss


class ModelRunner:
    frames_per_s = 0.0   # not measured: on the CPU, admission counts inference in the host's CPU (frontend/live)

    def __init__(self, path: Path, device=None, threads: int = 0, tensorrt: bool = False, spin: bool = False,
                 batch_memory_bytes: int = 0, workers: int = 1):
        device = device or CpuDevice()
        if device.shared_weights:
            raise DeviceError(f"{path}: a model on {device.name} runs in its architecture's shared session "
                              "(gpu_actor/shared.py), not a session of its own")
        self.path = path
        self.device = device
        self.batch_memory_bytes, self._workers = batch_memory_bytes, workers
        self.frame_bytes = 0                  # measured peak memory per frame (warm_up)
        self.max_frames: Optional[int] = None  # frames per onnxruntime call; None: the whole batch
        self.session = own_session(path, device, threads, tensorrt, spin)
        self.io: ModelIO = classify_io(
            [(i.name, dims(i.shape)) for i in self.session.get_inputs()],
            [(o.name, dims(o.shape)) for o in self.session.get_outputs()], str(path))

    def run(self, visual: Union[np.ndarray, Callable[[int, int], np.ndarray]], audio: np.ndarray,
            out: np.ndarray) -> None:
        """visual [B,6,320,320] (or a function giving frames [start, end) of it, called just before the
        call that needs them), audio [B,*A], out [B,3,320,320]: float32, C-contiguous."""
        batch = len(out)
        if audio.shape != (batch, *self.io.audio_shape):
            raise AssetError(f"{self.path}: audio must be [{batch}, {', '.join(map(str, self.io.audio_shape))}], "
                             f"got {list(audio.shape)}")
        frames = visual if callable(visual) else lambda start, end: visual[start:end]
        step = self.io.batch or min(batch, self.max_frames or batch)
        if not self.io.batch:
            step = min(step, CPU_CALL_FRAMES)
        for start in range(0, batch, step):
            end = min(start + step, batch)
            # NOTE: onnxruntime's CPU arena keeps what a call grew it to; after a batch split by the
            # memory budget it gives that back, so a long request does not leave the worker holding it.
            shrink = end == batch and batch > (self.max_frames or batch)
            if end - start == step or self.io.batch is None:
                self._run(frames(start, end), audio[start:end], out[start:end], shrink)
            else:  # the last chunk of a fixed-batch model: pad, run, keep the real frames
                pad_v = np.zeros((step, *VISUAL_SHAPE), np.float32)
                pad_a = np.zeros((step, *audio.shape[1:]), np.float32)
                pad_o = np.empty((step, *out.shape[1:]), np.float32)
                pad_v[: end - start], pad_a[: end - start] = frames(start, end), audio[start:end]
                self._run(pad_v, pad_a, pad_o)
                out[start:end] = pad_o[: end - start]

    def _run(self, visual: np.ndarray, audio: np.ndarray, out: np.ndarray, shrink: bool = False) -> None:
        binding = self.session.io_binding()
        # NOTE: bound by address: the contiguous copies (if any) must live until the run
        inputs = {self.io.visual: np.ascontiguousarray(visual), self.io.audio: np.ascontiguousarray(audio)}
        for name, array in inputs.items():
            self.device.bind(binding, name, array)
        if not out.flags.c_contiguous:
            raise ValueError("output buffer must be C-contiguous")
        self.device.bind(binding, self.io.output, out, output=True)
        options = None
        if shrink:
            import onnxruntime as ort
            options = ort.RunOptions()
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.session.run_with_iobinding(binding, options)

    def _zeros_run(self, batch: int) -> None:
        out = np.empty((batch, 3, 320, 320), np.float32)
        self.run(np.zeros((batch, 6, 320, 320), np.float32), np.zeros((batch, *self.io.audio_shape), np.float32), out)

    def _memory(self) -> int:
        """Peak bytes since `_peak_reset`."""
        return _peak_rss()

    def _budget(self) -> int:
        if self.batch_memory_bytes:
            return self.batch_memory_bytes
        free = psutil.virtual_memory().available
        return int(free * AUTO_BUDGET_SHARE / max(self._workers, 1))

    def warm_up(self) -> None:
        """Runs at load, so the first request does not pay for lazy initialisation; on a model with a free
        batch dimension, a 1-frame and a 2-frame run measure its memory per frame and size `max_frames`."""
        if self.io.batch is not None:   # its calls have one size whatever the request
            self._zeros_run(self.io.batch)
            return
        _peak_reset()
        before = self._memory()
        self._zeros_run(1)
        one = self._memory()
        _peak_reset()
        self._zeros_run(2)
        two = self._memory()
        # NOTE: conservative on purpose: the first run also pays lazy initialisation, and another thread
        # of the worker may run meanwhile; either makes the estimate larger, never the batch too large.
        self.frame_bytes = max(two - one, (two - before) // 2, MIN_FRAME_BYTES)
        budget = self._budget()
        self.max_frames = max(1, budget // self.frame_bytes)
        log.info("model %s: %.0f MB peak per frame, up to %d frames per call (budget %.0f MB)", self.path,
                 self.frame_bytes / 1e6, self.max_frames, budget / 1e6)
        # NOTE: a call larger than a frame would grow onnxruntime's memory pool on its first run (5x the
        # time of the next one): warm it too where calls are (tests set CPU_CALL_FRAMES above 1)
        warm = min(self.max_frames, WARM_FRAMES, CPU_CALL_FRAMES)
        if warm > 2:
            self._zeros_run(warm)
