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
  GPU. It runs exactly what a CudaDevice runs (shared sessions, prepared sizes, padding, staging copies,
  the audio encoder at prepared sizes, sessions on the calling thread) and stops for `stall_s` on the
  first call of every session it made at each input shape, as cuDNN does while it builds its plans for a
  shape (1.4-5.7 s on an H100). The environment variable LIPSYNC_STAND_IN_STALL_S=<seconds> makes a
  "cpu" worker one; it is not a setting a server needs.

Every onnxruntime session that runs on a device is made by its `session` and run by its `run` (IO
binding) or `infer` (host arrays), so what differs between the three (providers, threads, the first-call
stall, CUDA graphs' run options) is decided in this file.
"""

from __future__ import annotations

import ctypes
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


class DeviceMemoryError(MemoryError):
    """The device had no memory for what a load asked (a session, its first call, a model's weights): the
    registry evicts an idle model and loads again."""


_OUT_OF_MEMORY = ("outofmemory", "out of memory", "failed to allocate memory", "alloc_failed",
                  "cudaerrormemoryallocation")


def out_of_memory(err: BaseException) -> bool:
    """A MemoryError (the stand-in's, DeviceMemoryError), cupy's OutOfMemoryError, or onnxruntime's failed
    allocation on the device: its arena's ("Failed to allocate memory"), CUDA's ("out of memory",
    cudaErrorMemoryAllocation), cuDNN's and cuBLAS's (CUDNN_STATUS_ALLOC_FAILED, CUBLAS_STATUS_ALLOC_FAILED)."""
    if isinstance(err, MemoryError):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return any(sign in text for sign in _OUT_OF_MEMORY)


def short(err: BaseException) -> str:
    """An exception's first line, at most 300 characters, or its type's name: onnxruntime's messages run
    to many lines of stack."""
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return text or type(err).__name__


def require_provider(session: ort.InferenceSession, device: str) -> None:
    # NOTE: onnxruntime does not fail when the CUDA provider cannot load (no onnxruntime-gpu, or its
    # CUDA / cuDNN libraries missing): it warns and runs on the CPU. A GPU worker must not.
    if device != "cpu" and "CUDAExecutionProvider" not in session.get_providers():
        import onnxruntime as ort
        from gpu_actor.cuda_libs import extra_for, missing_libraries
        missing = missing_libraries(ort.__version__)
        cause = (f"these libraries it links cannot be loaded: {', '.join(missing)}" if missing else
                 "its libraries load, so check the driver (nvidia-smi) and that this GPU is visible")
        raise DeviceError(
            f"onnxruntime {ort.__version__} cannot use {device}: its CUDA provider did not load ({cause}; it runs on "
            f"{session.get_providers()}). Install the extra built for this host's driver: LIPSYNC_EXTRAS=gpu picks it "
            f"(this onnxruntime needs extra {extra_for(ort.__version__)!r}), or set inference.devices: cpu")


def new_session(model: bytes | str, options: ort.SessionOptions, providers: list, device: str) -> ort.InferenceSession:
    """An onnxruntime session on `device`'s providers, never quietly on another. NOTE: onnxruntime's Python
    wrapper, when creating a session on the CUDA provider raises (an out-of-memory, a kernel it cannot
    make), prints the error and makes a CPU session instead (`enable_fallback`, on by default); here the
    error is raised, a DeviceMemoryError where it is one, and a session without the provider is refused."""
    import onnxruntime as ort
    try:
        session = ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    except Exception as err:   # onnxruntime raises its own exception types
        if out_of_memory(err):
            raise DeviceMemoryError(f"{device}: no memory for an onnxruntime session: {short(err)}") from None
        raise
    require_provider(session, device)
    return session


def cuda_id(device: str) -> int:
    """The GPU index of a worker's device string, "cuda:N"."""
    return int(device.split(":")[1])


def session_options(threads: int, spin: bool) -> ort.SessionOptions:
    """Options for a session of the worker's (`inference.intra_op_threads`, `inference.spin_threads`);
    a device may set its threads in them (Device.session)."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        # NOTE: onnxruntime's pool threads spin for a while after each run, waiting for the next one:
        # on a host shared with compositing processes that burns the cores they need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


_shared_cpu_arena = threading.Lock()
_registered: list[bool] = []


def share_cpu_arena(options: ort.SessionOptions) -> None:
    """Make the session's CPU memory come from one arena for the whole process (registered once), not
    an arena of its own: a real-size unet_328 session's arena keeps ~220 MiB of activations (for 46 MiB
    of weights) once it has run, and each of a worker's models kept its own. Measured with 3 models, one
    frame per call: 47-76 MiB more a model against 219-232, the same ms a frame (docs/benchmarks.md)."""
    import onnxruntime as ort
    with _shared_cpu_arena:
        if not _registered:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
            _registered.append(True)
    options.add_session_config_entry("session.use_env_allocators", "1")


class DeviceLock:
    """A lock taken in turn (first come, first served): the load thread takes it around each of its calls
    into the device, one after another; a plain Lock would let it take the lock back at once after each,
    and a main-thread capture waiting for it could wait for the whole load."""

    def __init__(self):
        self._turn = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> "DeviceLock":
        with self._turn:
            ticket, self._next = self._next, self._next + 1
            self._turn.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._turn:
            self._serving += 1
            self._turn.notify_all()

    def locked(self) -> bool:
        with self._turn:
            return self._serving != self._next


class Device(Protocol):
    """What the runners and the registry ask of a device (each implementation below has all of it:
    tests/test_shared.py checks, since CudaDevice runs nowhere a test can)."""

    name: str
    shared_weights: bool   # one prepared session per architecture, weights bound per call
    batched: bool          # calls of many frames (else one frame per call)
    lock: DeviceLock       # the load thread's calls into the device; the main thread's CUDA-graph captures
    precisions: tuple[str, ...]   # the inference.precision values it runs

    def check(self) -> None: ...

    def providers(self, graphs: bool = False) -> list: ...
    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession: ...
    def infer(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...
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
    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True) -> None: ...


class CpuDevice:
    name = "cpu"
    shared_weights = False     # per-model sessions: faster per frame on the CPU provider (module docstring)
    batched = False            # one frame per call
    # NOTE: fp16 loads on the CPU provider, but onnxruntime puts Casts back to float32 around every op it
    # has no float16 CPU kernel for (all of unet_328's): float32 arithmetic with the weights rounded,
    # about 10% slower per frame than fp32 (measured on a 2-core x86 host)
    precisions = ("fp32",)

    def __init__(self):
        # NOTE: held by the load thread around each of its calls into the device, and by the main thread
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

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True) -> None:
        """Run a call bound at batch `size`; `graphs` False: a session made with CUDA graphs runs without
        capturing or replaying one (the load thread's warm-up, a size whose capture failed)."""
        session.run_with_iobinding(binding)


class StandInDevice(CpuDevice):
    """The GPU's batching path on the CPU provider, with cuDNN's first-call stall (module docstring)."""

    shared_weights = True
    batched = True
    precisions = ("fp32", "fp16")   # (fp16 converted as on a card; the CPU provider computes it in float32)

    def __init__(self, stall_s: float, memory_bytes: int = 0):
        super().__init__()
        self.stall_s = stall_s
        self.memory_bytes, self.weight_bytes = memory_bytes, 0   # a card's size for weights; 0: no limit
        self.stalls = 0                     # first calls that stalled: tests read it
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # session -> input shapes run
        self._lock = threading.Lock()       # the load thread prepares while the main thread runs

    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession:
        # NOTE: as a card's (CudaDevice.session): the device does the work, the calling thread waits
        options.intra_op_num_threads = 1
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

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True) -> None:
        self._stall(session, size)
        session.run_with_iobinding(binding)


class CudaDevice:
    """A GPU, "cuda:N": buffers in cupy, copies on cupy's null stream, which `run` synchronizes before
    onnxruntime's stream reads them. Buffers are allocated once (a prepared architecture's staging
    buffers, a model's weights) and never move, so a binding made once stays valid.

    Every thread that uses it calls `bind_thread` first (its constructor does, for the calling thread)
    and nothing here switches devices: cupy's `with Device(n)` sets the previous device back on exit, and
    since CUDA 12 making device 0 current creates its context (~500 MB on GPU 0 for a worker of cuda:1)."""

    shared_weights = True
    batched = True
    precisions = ("fp32", "fp16")
    ARENA = {"arena_extend_strategy": "kSameAsRequested"}   # NOTE: the default doubles: up to 2x each session's peak

    def __init__(self, device: str):
        self.name, self.device_id = device, cuda_id(device)
        self.lock = DeviceLock()   # (CpuDevice.__init__ says what it guards)
        self._pinned: list[np.ndarray] = []
        try:
            import cupy
        except ImportError as err:
            raise DeviceError(f"{device}: a GPU worker needs cupy ({err}): install the gpu extra "
                              "(LIPSYNC_EXTRAS=gpu python3 dev.py run), or set inference.devices: cpu") from None
        self._cp = cupy
        self._block_while_waiting()
        from gpu_actor.cuda_libs import preload
        preload()   # NOTE: before any session: the CUDA provider has no RUNPATH to find pip's libraries
        self.bind_thread()
        self._no_graph: Optional[ort.RunOptions] = None

    def check(self) -> None:
        """A one-node model on the card, so a GPU worker that would run on the CPU refuses to start instead,
        with the cause; and cupy, which moves the tensors, must work there too."""
        from onnx import TensorProto, helper
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "device_check",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
        self.session(model.SerializeToString(), session_options(1, False))
        try:
            self.memory_used()
        except Exception as err:   # cupy's CUDA errors
            import onnxruntime as ort
            from gpu_actor.cuda_libs import extra_for
            raise DeviceError(f"cupy cannot use {self.name}: {type(err).__name__}: {err} (install the extra that "
                              f"pairs cupy with this onnxruntime's CUDA: {extra_for(ort.__version__)!r}; "
                              "LIPSYNC_EXTRAS=gpu picks it by the driver)") from None

    def _block_while_waiting(self) -> None:
        """Make the host thread sleep, not spin, while it waits for the GPU (CU_CTX_SCHED_BLOCKING_SYNC on
        the device's primary context, through the driver API: cupy's runtime module has no setDeviceFlags):
        the inference process then uses a core's fraction, not a whole core, whatever the GPU's load.
        NOTE: before the device's context exists (before any session or buffer) it surely applies."""
        blocking_sync = 0x04
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            device = ctypes.c_int()
            status = driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), self.device_id) or \
                driver.cuDevicePrimaryCtxSetFlags_v2(device, blocking_sync)
            if status:
                raise RuntimeError(f"CUDA driver error {status}")
        except (OSError, AttributeError, RuntimeError) as err:   # waits spin then: CPU, not results
            log.warning("%s: cannot make waits block (%s); the worker's thread spins while the GPU runs", self.name, err)

    def providers(self, graphs: bool = False) -> list:
        return self.providers_for(self.device_id, graphs)

    @classmethod
    def providers_for(cls, device_id: int, graphs: bool = False) -> list:
        options = {"device_id": device_id, **cls.ARENA, **({"enable_cuda_graph": "1"} if graphs else {})}
        return [("CUDAExecutionProvider", options)]

    def session(self, model: bytes | str, options: ort.SessionOptions, graphs: bool = False) -> ort.InferenceSession:
        # NOTE: the GPU does the work: a pool of intra-op threads per session (one per core by default)
        # would be ~100 idle threads per prepared architecture
        options.intra_op_num_threads = 1
        return new_session(model, options, self.providers(graphs), self.name)

    def infer(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return session.run(None, feeds)

    def sizes(self, max_batch: int, fixed: Optional[int] = None) -> tuple[int, ...]:
        return prepared_sizes(max_batch, True, fixed)

    def memory_used(self) -> int:
        """Bytes in use on the device (all processes)."""
        free, total = self._cp.cuda.runtime.memGetInfo()
        return int(total - free)

    def memory_free(self) -> int:
        return int(self._cp.cuda.runtime.memGetInfo()[0])

    def bind_thread(self) -> None:
        """Make the calling thread's current device this one (a new thread starts on device 0)."""
        self._cp.cuda.runtime.setDevice(self.device_id)

    def account(self, owner: object, nbytes: int) -> None:
        pass   # cupy raises OutOfMemoryError by itself

    def release(self) -> None:
        """Free cupy's cached blocks (evicted weights, warm-up buffers) so onnxruntime's allocator can have them."""
        self._cp.get_default_memory_pool().free_all_blocks()
        self._cp.get_default_pinned_memory_pool().free_all_blocks()

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Any:
        return self._cp.zeros(shape, dtype)

    def host_empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A host array in page-locked memory: copied to the device at the bus's speed (a batch-64 input:
        3.1 ms pinned, 25.0 ms pageable, measured on an H100)."""
        count = int(np.prod(shape))
        memory = self._cp.cuda.alloc_pinned_memory(count * np.dtype(dtype).itemsize)
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def upload(self, dst, src: np.ndarray) -> None:
        dst.set(np.require(src, requirements="C"))   # NOTE: not ascontiguousarray, which makes a 0-d array [1]

    def zero(self, dst) -> None:
        dst.fill(0)

    def copy(self, dst, src) -> None:
        """Device to device (a model's weights into a CUDA graph's slot)."""
        self._cp.copyto(dst, src)

    def pin(self, host: np.ndarray) -> None:
        """Page-lock `host` (cudaHostRegister) so copies to and from it run at the bus's speed and need no
        staging; where CUDA refuses (logged), copies work as before, slower."""
        try:
            self._cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
        except Exception as err:   # a locked-memory limit (ulimit -l, a container's), or an old driver
            log.warning("%s: cannot pin %.0f MB of shared memory for the device (%s); copies go pageable",
                        self.name, host.nbytes / 1e6, err)
            return
        self._pinned.append(host)

    def unpin_all(self) -> None:
        while self._pinned:
            host = self._pinned.pop()
            try:
                self._cp.cuda.runtime.hostUnregister(host.ctypes.data)
            except Exception as err:   # nothing to undo then
                log.warning("%s: unpinning shared memory failed: %s", self.name, err)

    def synchronize(self) -> None:
        self._cp.cuda.Stream.null.synchronize()

    def download(self, src, dst: np.ndarray) -> None:
        """Device -> the destination shm slot, no host staging copy."""
        src.get(out=dst)

    def bind(self, binding, name: str, array, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cuda", self.device_id, array.dtype, list(array.shape), array.data.ptr)

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True) -> None:
        # NOTE: the inputs (and a graph's weight slot) were copied on cupy's stream: done before
        # onnxruntime's stream reads them
        self.synchronize()
        # NOTE: Run synchronizes its own stream at its end; IOBinding.synchronize_outputs would be a
        # cudaDeviceSynchronize, waiting for the load thread's work on the device too
        session.run_with_iobinding(binding, None if graphs else self._plain_run())

    def _plain_run(self) -> ort.RunOptions:
        """Run options for a run that neither captures nor replays a CUDA graph (onnxruntime's
        kCudaGraphAnnotationSkip). NOTE: without them a graph-enabled session's first run on a thread
        runs twice more and captures, in cudaStreamCaptureModeGlobal, inside that one call."""
        if self._no_graph is None:
            import onnxruntime as ort
            self._no_graph = ort.RunOptions()
            self._no_graph.add_run_config_entry("gpu_graph_id", "-1")
        return self._no_graph


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
