"""How an inference worker's onnxruntime sessions are made, whatever the device (gpu_actor/device.py
asks for them): options, the CPU's one arena, the provider check, and the errors a device raises.
gpu_actor/device.py and gpu_actor/cuda.py both stand on it."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import onnxruntime as ort


class DeviceError(RuntimeError):
    """A worker's device cannot run models at all; the message says what to install or configure."""


class DeviceMemoryError(MemoryError):
    """The device had no memory for what a load asked (a session, its first call, a model's weights): the
    registry evicts an idle model and loads again."""


_OUT_OF_MEMORY = ("outofmemory", "out of memory", "failed to allocate memory", "alloc_failed",
                  "cudaerrormemoryallocation")


TIMED_CALLS = 3   # a prepared call's steady cost: the least of this many (a busy host slows one, not all)


def least_time(lock, run: Callable[[], None], calls: int = TIMED_CALLS) -> float:
    """The least seconds of `calls` runs of `run`, `lock` (the device's) held around each and not between
    them, so the device thread's calls go on meanwhile."""
    best = float("inf")
    for _ in range(calls):
        with lock:
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return best


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
    """Who may call into a device while a CUDA graph is captured. A capture (the device thread's first calls
    at a size, `exclusive`) must see no other thread's CUDA call: it waits for the calls in progress and
    holds the device alone. Every other holder (the load thread, the background preparation, each around
    one call into the device) shares it with the others: a new avatar's load never waits for another
    thread's preparation. A capture that is waiting goes before shared holders that come after it: the
    load thread, taking it again after each call, cannot keep a capture waiting for a whole load."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0                 # holders now, sharing
        self._exclusive = False          # held by a capture now
        self._captures_waiting = 0

    def __enter__(self) -> "DeviceLock":
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._captures_waiting)
            self._shared += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._shared -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the device alone (a capture)."""
        with self._cond:
            self._captures_waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._captures_waiting -= 1
            self._exclusive = True
        try:
            yield self
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._exclusive or self._shared > 0
