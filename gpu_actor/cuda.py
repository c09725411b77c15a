"""The CUDA path: onnxruntime's CUDA provider with IO binding and cupy device buffers.

Per batch: the inputs are copied from their shm slot to the device once (host -> device), the
output is bound to a device buffer and copied from it straight into the destination shm slot once
(device -> host). No other host copy. Device buffers are allocated once per worker and grown to the
largest batch seen. Only imported where a worker runs on a GPU (`inference.devices`).
"""

from __future__ import annotations

import numpy as np

try:
    import cupy as cp
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError("a GPU worker needs cupy: install the gpu extra (LIPSYNC_EXTRAS=gpu python3 dev.py run)") from err

from config.assets import ModelIO


def device_memory_used(device_id: int) -> int:
    """Bytes in use on the device (all processes): the registry measures a load as the delta."""
    with cp.cuda.Device(device_id):
        free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


def device_memory_free(device_id: int) -> int:
    """Bytes free on the device now: a worker sizes its sub-batches from it (gpu_actor/runner.py)."""
    with cp.cuda.Device(device_id):
        free, _ = cp.cuda.runtime.memGetInfo()
    return int(free)


class CudaBinding:
    def __init__(self, session, io: ModelIO, device_id: int):
        self.session, self.io, self.device_id = session, io, device_id
        self._capacity = 0
        self._visual = self._audio = self._out = None

    def _buffers(self, batch: int):
        if batch > self._capacity:
            with cp.cuda.Device(self.device_id):
                self._visual = cp.empty((batch, 6, 320, 320), cp.float32)
                self._audio = cp.empty((batch, *self.io.audio_shape), cp.float32)
                self._out = cp.empty((batch, 3, 320, 320), cp.float32)
            self._capacity = batch
        return self._visual[:batch], self._audio[:batch], self._out[:batch]

    def run(self, visual: np.ndarray, audio: np.ndarray, out: np.ndarray) -> None:
        batch = visual.shape[0]
        with cp.cuda.Device(self.device_id):
            d_visual, d_audio, d_out = self._buffers(batch)
            d_visual.set(np.ascontiguousarray(visual))
            d_audio.set(np.ascontiguousarray(audio))
            # NOTE: .set() runs on the null stream; onnxruntime uses its own stream, so wait here.
            cp.cuda.Stream.null.synchronize()
            binding = self.session.io_binding()
            binding.bind_input(self.io.visual, "cuda", self.device_id, np.float32, list(d_visual.shape),
                               d_visual.data.ptr)
            binding.bind_input(self.io.audio, "cuda", self.device_id, np.float32, list(d_audio.shape),
                               d_audio.data.ptr)
            binding.bind_output(self.io.output, "cuda", self.device_id, np.float32, list(d_out.shape),
                                d_out.data.ptr)
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            d_out.get(out=out)  # device -> the destination shm slot, no host staging copy
