"""The device an inference worker runs on, as a small interface handed to the runners: where its buffers
live, how rows move between them and the shared-memory slots, how a prepared call runs, its memory.

Three devices:

- `CpuDevice` ("cpu"): one onnxruntime session per model (the CPU provider prepacks constant weights:
  a real-size unet_328 frame costs 90.5 ms so against 207.3 ms with its weights as inputs on a 2-core
  x86 host, `python -m bench gpu --stand-in 1.0`), one frame per call (gpu_actor/runner.py says why).
- `CudaDevice` ("cuda:N"): one prepared session per architecture and batch size, each model's weights
  resident on the device and bound per call (gpu_actor/shared.py), buffers in cupy, the host thread
  blocking (not spinning) while the GPU works.
- `StandInDevice`: the GPU's batching on the CPU provider, for tests and benches where there is no
  GPU. It runs exactly what a CudaDevice runs (shared sessions, prepared sizes, padding, staging copies)
  and stops for `stall_s` on the first call of each (session, batch size), as cuDNN does while it
  builds its plans for a shape (1.4-5.7 s on an H100). The environment variable
  LIPSYNC_STAND_IN_STALL_S=<seconds> makes a "cpu" worker one; it is not a setting a server needs.
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

from gpu_actor.shapes import prepared_sizes

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)
STAND_IN_ENV = "LIPSYNC_STAND_IN_STALL_S"


class DeviceError(RuntimeError):
    """A worker's device cannot run models at all; the message says what to install or configure."""


def out_of_memory(err: BaseException) -> bool:
    """cupy's OutOfMemoryError, or onnxruntime's failed allocation on the device."""
    text = f"{type(err).__name__}: {err}".lower()
    return "outofmemory" in text or "out of memory" in text or "failed to allocate memory" in text


def cuda_id(device: str) -> int:
    """The GPU index of a worker's device string, "cuda:N"."""
    return int(device.split(":")[1])


class Device(Protocol):
    """What the runners and the registry ask of a device (each implementation below has all of it:
    tests/test_shared.py checks, since CudaDevice runs nowhere a test can)."""

    name: str
    shared_weights: bool   # one prepared session per architecture, weights bound per call
    batched: bool          # calls of many frames (else one frame per call)

    def providers(self, tensorrt: bool = False, graphs: bool = False) -> list: ...
    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]: ...
    def memory_used(self) -> int: ...
    def memory_free(self) -> int: ...
    def bind_thread(self) -> None: ...
    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Any: ...
    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray: ...
    def upload(self, dst: Any, src: np.ndarray) -> None: ...
    def zero(self, dst: Any) -> None: ...
    def copy(self, dst: Any, src: Any) -> None: ...
    def synchronize(self) -> None: ...
    def account(self, owner: object, nbytes: int) -> None: ...
    def release(self) -> None: ...
    def pin(self, host: np.ndarray) -> None: ...
    def unpin_all(self) -> None: ...
    def download(self, src: Any, dst: np.ndarray) -> None: ...
    def bind(self, binding, name: str, array: Any, output: bool = False) -> None: ...
    def run(self, session: ort.InferenceSession, binding, size: int) -> None: ...


class CpuDevice:
    name = "cpu"
    shared_weights = False     # per-model sessions: faster per frame on the CPU provider (module docstring)
    batched = False            # one frame per call

    def providers(self, tensorrt: bool = False, graphs: bool = False) -> list:
        return ["CPUExecutionProvider"]

    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]:
        return prepared_sizes(max_batch, self.batched, fixed)

    def memory_used(self) -> int:
        return psutil.Process().memory_info().rss

    def memory_free(self) -> int:
        return psutil.virtual_memory().available

    def bind_thread(self) -> None:
        """(A thread that will use the device: the load thread) make it this device's."""

    # -- buffers (numpy: the CPU provider reads and writes host memory) ---------------------------

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A host buffer rows are gathered in before they go to the device (pinned on a GPU)."""
        return np.zeros(shape, dtype)

    def upload(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def zero(self, dst: np.ndarray) -> None:
        dst[...] = 0

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Device to device."""
        dst[...] = src

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

    def run(self, session: ort.InferenceSession, binding, size: int) -> None:
        session.run_with_iobinding(binding)


class StandInDevice(CpuDevice):
    """The GPU's batching path on the CPU provider, with cuDNN's first-call stall (module docstring)."""

    shared_weights = True
    batched = True

    def __init__(self, stall_s: float, memory_bytes: int = 0):
        self.stall_s = stall_s
        self.memory_bytes, self.weight_bytes = memory_bytes, 0   # a card's size for weights; 0: no limit
        self.stalls = 0                     # first calls that stalled: tests read it
        self._seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()       # the load thread prepares while the main thread runs

    def account(self, owner: object, nbytes: int) -> None:
        with self._lock:
            if self.memory_bytes and self.weight_bytes + nbytes > self.memory_bytes:
                raise MemoryError(f"stand-in device: out of memory ({self.weight_bytes} of {self.memory_bytes} bytes "
                                  f"of weights held, {nbytes} more asked)")
            self.weight_bytes += nbytes
        weakref.finalize(owner, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.weight_bytes -= nbytes

    def run(self, session: ort.InferenceSession, binding, size: int) -> None:
        key = (id(session), size)
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if first:
            self.stalls += 1
            time.sleep(self.stall_s)   # NOTE: the GIL is free meanwhile, as in a native call
        session.run_with_iobinding(binding)


class CudaDevice:
    shared_weights = True
    batched = True

    def __init__(self, device: str):
        self.name, self.device_id = device, cuda_id(device)
        self._pinned: list[np.ndarray] = []
        try:
            from gpu_actor import cuda
        except ImportError:   # NOTE: runner.check_device, next, says what to install
            return
        self._cuda = cuda
        cuda.block_while_waiting(self.device_id)
        from gpu_actor.cuda_libs import preload
        preload()   # NOTE: before any session: the CUDA provider has no RUNPATH to find pip's libraries

    def providers(self, tensorrt: bool = False, graphs: bool = False) -> list:
        return self.providers_for(self.device_id, tensorrt, graphs)

    @staticmethod
    def providers_for(device_id: int, tensorrt: bool = False, graphs: bool = False) -> list:
        options = {"device_id": device_id, **({"enable_cuda_graph": "1"} if graphs else {})}
        providers: list = [("CUDAExecutionProvider", options)]
        if tensorrt:
            providers.insert(0, ("TensorrtExecutionProvider", {"device_id": device_id}))
        return providers

    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]:
        return prepared_sizes(max_batch, True, fixed)

    def memory_used(self) -> int:
        return self._cuda.device_memory_used(self.device_id)

    def memory_free(self) -> int:
        return self._cuda.device_memory_free(self.device_id)

    def bind_thread(self) -> None:
        self._cuda.use_device(self.device_id)

    def account(self, owner: object, nbytes: int) -> None:
        pass   # cupy raises OutOfMemoryError by itself

    def release(self) -> None:
        self._cuda.release_pool(self.device_id)

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Any:
        return self._cuda.zeros(self.device_id, shape, dtype)

    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return self._cuda.pinned_empty(self.device_id, shape, dtype)

    def upload(self, dst, src: np.ndarray) -> None:
        self._cuda.upload(self.device_id, dst, src)

    def zero(self, dst) -> None:
        self._cuda.zero(self.device_id, dst)

    def copy(self, dst, src) -> None:
        self._cuda.copy(self.device_id, dst, src)

    def pin(self, host: np.ndarray) -> None:
        if self._cuda.pin(self.device_id, host):
            self._pinned.append(host)

    def unpin_all(self) -> None:
        while self._pinned:
            self._cuda.unpin(self.device_id, self._pinned.pop())

    def synchronize(self) -> None:
        self._cuda.synchronize(self.device_id)

    def download(self, src, dst: np.ndarray) -> None:
        self._cuda.download(self.device_id, src, dst)

    def bind(self, binding, name: str, array, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cuda", self.device_id, array.dtype, list(array.shape), array.data.ptr)

    def run(self, session: ort.InferenceSession, binding, size: int) -> None:
        # NOTE: the inputs (and a graph's weight slot) were copied on cupy's stream: done before
        # onnxruntime's stream reads them
        self._cuda.synchronize(self.device_id)
        # NOTE: Run synchronizes its own stream at its end; IOBinding.synchronize_outputs would be a
        # cudaDeviceSynchronize, waiting for the load thread's work on the device too
        session.run_with_iobinding(binding)


def make_device(device: str):
    """The device a worker's device string names; a "cpu" worker is a StandInDevice where the
    environment asks for one (tests and benches without a GPU)."""
    if device == "cpu":
        stall = os.environ.get(STAND_IN_ENV)
        if stall is None:
            return CpuDevice()
        try:
            return StandInDevice(float(stall))
        except ValueError:
            raise DeviceError(f"{STAND_IN_ENV}={stall!r}: expected seconds, e.g. 1.0") from None
    return CudaDevice(device)
