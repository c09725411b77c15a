"""The CUDA side of gpu_actor/device.CudaDevice, in cupy: device buffers, copies between them and the
shared-memory slots, memory figures. Only imported where a worker runs on a GPU (`inference.devices`).

Buffers are allocated once (a prepared architecture's staging buffers, a model's weights) and never
move, so a binding made once stays valid. Copies run on cupy's null stream, which the device's `run`
synchronises before onnxruntime's stream reads them.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

try:
    import cupy as cp
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError("a GPU worker needs cupy: install the gpu extra (LIPSYNC_EXTRAS=gpu python3 dev.py run)") from err

log = logging.getLogger(__name__)


def block_while_waiting(device_id: int) -> None:
    """Make the host thread sleep, not spin, while it waits for the GPU (CU_CTX_SCHED_BLOCKING_SYNC on the
    device's primary context, through the driver API: cupy's runtime module has no setDeviceFlags): the
    inference process then uses a core's fraction, not a whole core, whatever the GPU's load.
    NOTE: before the device's context exists (before any session or buffer) it surely applies."""
    blocking_sync = 0x04
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        status = driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), device_id) or \
            driver.cuDevicePrimaryCtxSetFlags_v2(device, blocking_sync)
        if status:
            raise RuntimeError(f"CUDA driver error {status}")
    except (OSError, AttributeError, RuntimeError) as err:   # waits spin then: CPU, not results
        log.warning("cuda:%d: cannot make waits block (%s); the worker's thread spins while the GPU runs",
                    device_id, err)


def use_device(device_id: int) -> None:
    """Make the calling thread's current device this one (a new thread starts on device 0, and cupy's
    context managers set back what they found: the load thread would make a context on GPU 0)."""
    cp.cuda.runtime.setDevice(device_id)


def release_pool(device_id: int) -> None:
    """Free cupy's cached blocks (evicted weights, warm-up buffers) so onnxruntime's allocator can have them."""
    with cp.cuda.Device(device_id):
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()


def device_memory_used(device_id: int) -> int:
    """Bytes in use on the device (all processes)."""
    with cp.cuda.Device(device_id):
        free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


def device_memory_free(device_id: int) -> int:
    """Bytes free on the device now."""
    with cp.cuda.Device(device_id):
        free, _ = cp.cuda.runtime.memGetInfo()
    return int(free)


def zeros(device_id: int, shape: tuple[int, ...], dtype) -> cp.ndarray:
    with cp.cuda.Device(device_id):
        return cp.zeros(shape, dtype)


def pinned_empty(device_id: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A host array in page-locked memory: copied to the device at the bus's speed (a batch-64 input:
    3.1 ms pinned, 25.0 ms pageable, measured on an H100)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    with cp.cuda.Device(device_id):
        memory = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(memory, dtype, int(np.prod(shape))).reshape(shape)


def upload(device_id: int, dst: cp.ndarray, src: np.ndarray) -> None:
    with cp.cuda.Device(device_id):
        dst.set(np.ascontiguousarray(src))


def zero(device_id: int, dst: cp.ndarray) -> None:
    with cp.cuda.Device(device_id):
        dst.fill(0)


def copy(device_id: int, dst: cp.ndarray, src: cp.ndarray) -> None:
    """Device to device (a model's weights into a CUDA graph's slot)."""
    with cp.cuda.Device(device_id):
        cp.copyto(dst, src)


def pin(device_id: int, host: np.ndarray) -> bool:
    """Page-lock `host` (cudaHostRegister) so copies to and from it run at the bus's speed and need no
    staging; False (logged) where CUDA refuses: copies then work as before, slower."""
    try:
        with cp.cuda.Device(device_id):
            cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
        return True
    except Exception as err:   # a locked-memory limit (ulimit -l, a container's), or an old driver
        log.warning("cuda:%d: cannot pin %.0f MB of shared memory for the device (%s); copies go pageable",
                    device_id, host.nbytes / 1e6, err)
        return False


def unpin(device_id: int, host: np.ndarray) -> None:
    try:
        with cp.cuda.Device(device_id):
            cp.cuda.runtime.hostUnregister(host.ctypes.data)
    except Exception as err:   # nothing to undo then
        log.warning("cuda:%d: unpinning shared memory failed: %s", device_id, err)


def download(device_id: int, src: cp.ndarray, dst: np.ndarray) -> None:
    """Device -> the destination shm slot, no host staging copy."""
    with cp.cuda.Device(device_id):
        src.get(out=dst)


def synchronize(device_id: int) -> None:
    with cp.cuda.Device(device_id):
        cp.cuda.Stream.null.synchronize()
