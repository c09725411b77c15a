"""`CudaDevice`, a GPU worker's device ("cuda:N"): the interface gpu_actor/device.py draws, in cupy and
onnxruntime's CUDA provider. Imported only where a worker runs on a GPU (`inference.devices`); cupy is
imported when one is made, so that this class can be read (and its protocol checked) anywhere.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from gpu_actor.onnx_sessions import DeviceError, DeviceLock, cuda_id, new_session, session_options
from gpu_actor.shapes import prepared_sizes

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)


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
    crop_rows = None   # the crops graph in one call at the step's prepared size
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

    def stack(self, dst, srcs: list) -> None:
        """Device to device, one kernel: dst[i] = srcs[i] (a grouped call's stacked weights)."""
        self._cp.stack(srcs, out=dst)

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

    def run(self, session: ort.InferenceSession, binding, size: int, graphs: bool = True,
            model: bool = True) -> None:
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
