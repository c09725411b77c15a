"""The device an inference worker runs on, as a small interface handed to the runners: where its buffers
live, how rows move between them and the shared-memory slots, how a prepared call runs, its memory.

Three devices:

- `CpuDevice` ("cpu"): one onnxruntime session per model (the CPU provider prepacks constant weights:
  a real-size unet_328 frame costs 90.5 ms so against 207.3 ms with its weights as inputs on a 2-core
  x86 host, `python -m bench gpu --stand-in 1.0`), one frame per call (gpu_actor/own_session.py says why).
- `CudaDevice` ("cuda:N", gpu_actor/cuda.py): one prepared session per architecture and batch size, each
  model's weights resident on the device and bound per call (gpu_actor/prepared.py,
  gpu_actor/architectures.py), buffers in cupy, the host thread blocking (not spinning) while the GPU works.
- `StandInDevice`: the GPU's batching on the CPU provider, for tests and benches where there is no
  GPU. It runs exactly what a CudaDevice runs (prepared sessions, prepared sizes, padding, staging copies,
  the audio encoder at prepared sizes, sessions called on the worker's thread) and stops for `stall_s` on the
  first call of every session it made at each input shape, as cuDNN does while it builds its plans for a
  shape (1.4-5.7 s on an H100). The environment variable LIPSYNC_STAND_IN_STALL_S=<seconds> makes a
  "cpu" worker one; it is not a setting a server needs. LIPSYNC_STAND_IN_COST_MS=<fixed>,<per frame>
  gives its model calls a card's cost curve: a call of N frames lasts at least fixed + N x per frame ms
  (a real-size unet_328 on an H100: ~1.6 + 0.89), counting the crops graph's calls that built its input,
  so a few sessions on a CPU host load it as a card's many do, and how many frames a call holds matters
  in a test as it does on a card.

Every onnxruntime session that runs on a device is made by its `session` and run by its `run` (IO
binding) or `infer` (host arrays), so what differs between the three (providers, threads, the first-call
stall, CUDA graphs' run options) is decided in this file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Optional, Protocol

import numpy as np
import psutil

from gpu_actor.onnx_sessions import DeviceError, DeviceLock, DeviceMemoryError, new_session, share_cpu_arena
from gpu_actor.shapes import prepared_sizes

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)
STAND_IN_ENV = "LIPSYNC_STAND_IN_STALL_S"
CPU = "cpu"   # a worker's device string for the CPU provider; a GPU's is "cuda:N"
STAND_IN_COST_ENV = "LIPSYNC_STAND_IN_COST_MS"


class Device(Protocol):
    """What the runners and the registry ask of a device (each implementation below has all of it:
    tests/test_architectures.py checks, since CudaDevice runs nowhere a test can)."""

    name: str
    shared_weights: bool   # one prepared session per architecture, weights bound per call
    batched: bool          # calls of many frames (else one frame per call)
    lock: DeviceLock       # the load thread's calls into the device; the device thread's CUDA-graph captures
    precisions: tuple[str, ...]   # the inference.precision values it runs
    crop_rows: Optional[int]      # the most rows one call of the crops graph holds (None: a step's prepared size)

    def check(self) -> None: ...

    def providers(self, graphs: bool = False) -> list: ...
    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession: ...
    def infer(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...
    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]: ...
    def memory_used(self) -> int: ...
    def bind_thread(self) -> None: ...
    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Any: ...
    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray: ...
    def upload(self, dst: Any, src: np.ndarray) -> None: ...
    def zero(self, dst: Any) -> None: ...
    def copy(self, dst: Any, src: Any) -> None: ...
    def stack(self, dst: Any, srcs: list) -> None: ...
    def synchronize(self) -> None: ...
    def account(self, owner: object, nbytes: int) -> None: ...
    def release(self) -> None: ...
    def pin(self, host: np.ndarray) -> None: ...
    def unpin_all(self) -> None: ...
    def download(self, src: Any, dst: np.ndarray) -> None: ...
    def bind(self, binding, name: str, array: Any, output: bool = False) -> None: ...
    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True,
            model: bool = True) -> None: ...


class CpuDevice:
    name = "cpu"
    shared_weights = False     # per-model sessions: faster per frame on the CPU provider (module docstring)
    batched = False            # one frame per call
    # NOTE: fp16 loads on the CPU provider, but onnxruntime puts Casts back to float32 around every op it
    # has no float16 CPU kernel for (all of unet_328's): float32 arithmetic with the weights rounded,
    # about 10% slower per frame than fp32 (measured on a 2-core x86 host)
    precisions = ("fp32",)
    # NOTE: the crops graph (gpu_actor/visual_onnx.py) on the CPU provider: 1.24 ms a frame in one call of
    # 16, 0.87 in calls of 1 or 2 (each op's output stays in the cache); only the real rows, not padding
    crop_rows: Optional[int] = 2

    def __init__(self):
        # NOTE: held by the load thread around each of its calls into the device, and by the device thread
        # while it captures a CUDA graph (cudaStreamCaptureModeGlobal: another thread's allocation, free or
        # synchronizing call meanwhile breaks the capture); never for a whole load
        self.lock = DeviceLock()

    def providers(self, graphs: bool = False) -> list:
        return ["CPUExecutionProvider"]

    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]:
        return prepared_sizes(max_batch, self.batched, fixed)

    def check(self) -> None:
        """At a worker's start: raise DeviceError, saying what to install or configure, where this device
        cannot run models."""

    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession:
        """A session on this device (`model`: a serialized ModelProto or a file's path); on the CPU its
        memory comes from the process's one arena."""
        share_cpu_arena(options)
        return new_session(model, options, self.providers(graphs), self.name)

    def infer(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run `session` on host arrays (a model's audio encoder, a precision probe): its outputs."""
        return session.run(None, feeds)

    def memory_used(self) -> int:
        return psutil.Process().memory_info().rss

    def bind_thread(self) -> None:
        """(A thread that will use the device: the load thread, a worker's device thread) make it this device's."""

    # -- buffers (numpy: the CPU provider reads and writes host memory) ---------------------------

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A host buffer rows are gathered in before they go to the device (pinned on a GPU)."""
        return np.zeros(shape, dtype)

    def upload(self, dst: np.ndarray, src: np.ndarray) -> None:
        # NOTE: as cupy's ndarray.set, which copies only from an array of the very same shape (numpy's
        # assignment also takes a [1] into a [], so the stand-in would pass what a card refuses)
        if dst.shape != src.shape:
            raise ValueError(f"upload: shape mismatch, {src.shape} into {dst.shape}")
        dst[...] = src

    def zero(self, dst: np.ndarray) -> None:
        dst[...] = 0

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Device to device."""
        dst[...] = src

    def stack(self, dst: np.ndarray, srcs: list) -> None:
        """Device to device: dst[i] = srcs[i] (a grouped call's stacked weights)."""
        np.stack(srcs, out=dst)

    def account(self, owner: object, nbytes: int) -> None:
        """`owner` (a model's weights) holds `nbytes` of the device until it is freed: where the device
        has no room, MemoryError (a GPU's own allocator says so by itself)."""

    def release(self) -> None:
        """Give memory freed since (an evicted model's weights, warm-up buffers) back to the device, where
        its allocator keeps it: onnxruntime allocates apart from it."""

    def pin(self, host: np.ndarray) -> None:
        """Page-lock host memory the device copies to and from (a worker's shared-memory slots)."""

    def unpin_all(self) -> None:
        """Undo every `pin` (before the memory is unmapped)."""

    def synchronize(self) -> None:
        pass

    def download(self, src: np.ndarray, dst: np.ndarray) -> None:
        dst[...] = src

    def bind(self, binding, name: str, array: np.ndarray, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True,
            model: bool = True) -> None:
        """Run a call bound at batch `size`; `graphs` False: a session made with CUDA graphs runs without
        capturing or replaying one (the load thread's warm-up, a size whose capture failed); `model` False:
        a helper graph's call (the crops'), not the model's."""
        session.run_with_iobinding(binding)


class StandInDevice(CpuDevice):
    """The GPU's batching path on the CPU provider, with cuDNN's first-call stall (module docstring)."""

    shared_weights = True
    batched = True
    precisions = ("fp32", "fp16")   # (fp16 converted as on a card; the CPU provider computes it in float32)

    def __init__(self, stall_s: float, memory_bytes: int = 0, cost_s: tuple[float, float] = (0.0, 0.0)):
        super().__init__()
        self.stall_s = stall_s
        self.cost_s = cost_s                # a model call's least seconds: fixed, per frame
        self.memory_bytes, self.weight_bytes = memory_bytes, 0   # a card's size for weights; 0: no limit
        self.stalls = 0                     # first calls that stalled: tests read it
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # session -> input shapes run
        self._lock = threading.Lock()       # the load thread prepares while the device thread runs
        self._helpers = threading.local()   # per thread: the seconds of helper calls since its last model call

    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession:
        # NOTE: a card's sessions run on the calling thread (CudaDevice.session), which waits while the card
        # computes. The stand-in computes the same on the CPU, and on one thread its own computing (the crops
        # graph, the N-model form) took longer than the cost curve it stands in for: its sessions share the
        # host's cores (a pool of them per session, which does not spin unless inference.spin_threads)
        options.intra_op_num_threads = len(os.sched_getaffinity(0))
        return new_session(model, options, self.providers(graphs), self.name)

    def account(self, owner: object, nbytes: int) -> None:
        with self._lock:
            if self.memory_bytes and self.weight_bytes + nbytes > self.memory_bytes:
                raise DeviceMemoryError(f"stand-in device: out of memory ({self.weight_bytes} of {self.memory_bytes} "
                                        f"bytes of weights held, {nbytes} more asked)")
            self.weight_bytes += nbytes
        weakref.finalize(owner, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.weight_bytes -= nbytes

    def _stall(self, session: ort.InferenceSession, shape: object) -> None:
        """The first call of `session` at `shape` waits stall_s, as a card's does while cuDNN plans it."""
        with self._lock:
            seen = self._seen.setdefault(session, set())
            first = shape not in seen
            seen.add(shape)
        if first:
            self.stalls += 1
            time.sleep(self.stall_s)   # NOTE: the GIL is free meanwhile, as in a native call

    def infer(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self._stall(session, tuple((name, np.shape(value)) for name, value in sorted(feeds.items())))
        return session.run(None, feeds)

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True,
            model: bool = True) -> None:
        self._stall(session, size)
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        spent = time.perf_counter() - t0
        helpers = getattr(self._helpers, "s", 0.0)
        if not model:
            # NOTE: a card builds the crops into the model's input in a few us a frame; the CPU takes about
            # as long as the curve's own per-frame part: that time counts within the model call it feeds
            self._helpers.s = helpers + spent
            return
        self._helpers.s = 0.0
        if any(self.cost_s):
            fixed, per_frame = self.cost_s
            time.sleep(max(fixed + per_frame * size - spent - helpers, 0.0))   # (the GIL is free)


def cuda_provider() -> bool:
    """Whether this onnxruntime has its CUDA provider (the gpu extra, onnxruntime-gpu)."""
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


def visible_gpus() -> list[int]:
    """The GPUs a worker could run on here: none without onnxruntime's CUDA provider, else those cupy
    counts (none where cupy or the driver is missing)."""
    if not cuda_provider():
        return []
    try:
        import cupy
        return list(range(cupy.cuda.runtime.getDeviceCount()))
    except Exception:   # no cupy, or a CUDA runtime without a driver
        return []


def is_gpu(device: str) -> bool:
    """Whether a worker's device string names a GPU ("cuda:N") rather than the CPU provider: the one place
    outside the device classes that tells them apart (tests/test_layout.py)."""
    return device != CPU


def parse_device(text: str) -> str:
    """A device a person named ("cpu" or "cuda:N"), as a worker's device string; ValueError says what is
    expected."""
    if text == CPU or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ValueError(f"{text!r}: expected cpu or cuda:N (N: the GPU's index)")


def make_device(device: str):
    """The device a worker's device string names; a "cpu" worker is a StandInDevice where the
    environment asks for one (tests and benches without a GPU)."""
    if device == "cpu":
        stall, cost = os.environ.get(STAND_IN_ENV), os.environ.get(STAND_IN_COST_ENV)
        if stall is None and cost is None:
            return CpuDevice()
        try:
            stall_s = float(stall or 0)
        except ValueError:
            raise DeviceError(f"{STAND_IN_ENV}={stall!r}: expected seconds, e.g. 1.0") from None
        try:
            fixed, per_frame = (float(x) / 1000 for x in (cost or "0,0").split(","))
        except ValueError:
            raise DeviceError(f"{STAND_IN_COST_ENV}={cost!r}: expected milliseconds <fixed>,<per frame>, "
                              "e.g. 10,1") from None
        return StandInDevice(stall_s, cost_s=(fixed, per_frame))
    from gpu_actor.cuda import CudaDevice   # NOTE: here: only a GPU worker loads it (and cupy)
    return CudaDevice(device)
