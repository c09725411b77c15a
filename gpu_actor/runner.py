"""One ONNX model on one device: find its inputs by rank and shape, run a batch into a given buffer.

On the CPU the inputs are bound straight from their shared-memory views and the output straight
into the destination slot (IO binding), so a batch costs no copy besides the model's own work.
On CUDA the inputs are copied host -> device once, the output is bound to a device buffer and copied
device -> the destination slot once (cupy); see gpu_actor/cuda.py.
A model with a fixed batch dimension is run in chunks of that size, the last one padded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from config.assets import AssetError, ModelIO, classify_io


class DeviceError(RuntimeError):
    """A worker's device cannot run models at all; the message says what to install or configure."""


def cuda_id(device: str) -> int:
    """The GPU index of a worker's device string, "cuda:N"."""
    return int(device.split(":")[1])


def _providers(device: str, tensorrt: bool = False) -> list:
    if device == "cpu":
        return ["CPUExecutionProvider"]
    device_id = cuda_id(device)
    providers: list = [("CUDAExecutionProvider", {"device_id": device_id})]
    if tensorrt:
        providers.insert(0, ("TensorrtExecutionProvider", {"device_id": device_id}))
    return providers


def _require_cuda(session: ort.InferenceSession, device: str) -> None:
    # NOTE: onnxruntime does not fail when the CUDA provider cannot load (no onnxruntime-gpu, or its
    # CUDA / cuDNN libraries missing): it warns and runs on the CPU. A GPU worker must not.
    if device != "cpu" and "CUDAExecutionProvider" not in session.get_providers():
        from gpu_actor.cuda_libs import extra_for, missing_libraries
        missing = missing_libraries(ort.__version__)
        cause = (f"these libraries it links cannot be loaded: {', '.join(missing)}" if missing else
                 "its libraries load, so check the driver (nvidia-smi) and that this GPU is visible")
        raise DeviceError(
            f"onnxruntime {ort.__version__} cannot use {device}: its CUDA provider did not load ({cause}; it runs on "
            f"{session.get_providers()}). Install the extra built for this host's driver: LIPSYNC_EXTRAS=gpu picks it "
            f"(this onnxruntime needs extra {extra_for(ort.__version__)!r}), or set inference.devices: cpu")


def check_device(device: str) -> None:
    """At a worker's start: a one-node model on its device, so a GPU worker that would silently run on
    the CPU refuses to start instead, with the cause."""
    if device == "cpu":
        return
    from gpu_actor.cuda_libs import preload
    preload()
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "device_check",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    _require_cuda(ort.InferenceSession(model.SerializeToString(), options, providers=_providers(device)), device)
    from gpu_actor.cuda import device_memory_used  # cupy, which moves the tensors, must work there too
    try:
        device_memory_used(cuda_id(device))
    except Exception as err:
        from gpu_actor.cuda_libs import extra_for
        raise DeviceError(f"cupy cannot use {device}: {type(err).__name__}: {err} (install the extra that pairs "
                          f"cupy with this onnxruntime's CUDA: {extra_for(ort.__version__)!r}; LIPSYNC_EXTRAS=gpu "
                          "picks it by the driver)") from None


def _dims(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


def make_session(path: Path, device: str, threads: int, tensorrt: bool = False,
                 spin: bool = False) -> ort.InferenceSession:
    if device != "cpu":
        from gpu_actor.cuda_libs import preload
        preload()   # NOTE: before the session: the CUDA provider has no RUNPATH to find pip's libraries
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
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    try:
        session = ort.InferenceSession(str(path), options, providers=_providers(device, tensorrt))
    except Exception as err:  # onnxruntime raises its own exception types for bad files
        raise AssetError(f"{path}: onnxruntime cannot load it: {str(err).splitlines()[0][:300]}") from None
    _require_cuda(session, device)
    return session


class ModelRunner:
    def __init__(self, path: Path, device: str = "cpu", threads: int = 0, tensorrt: bool = False, spin: bool = False):
        self.path = path
        self.device = device
        self.session = make_session(path, device, threads, tensorrt, spin)
        self.io: ModelIO = classify_io(
            [(i.name, _dims(i.shape)) for i in self.session.get_inputs()],
            [(o.name, _dims(o.shape)) for o in self.session.get_outputs()], str(path))
        self._cuda = None
        if device != "cpu":
            from gpu_actor.cuda import CudaBinding
            self._cuda = CudaBinding(self.session, self.io, cuda_id(device))

    def run(self, visual: np.ndarray, audio: np.ndarray, out: np.ndarray) -> None:
        """visual [B,6,320,320], audio [B,*A], out [B,3,320,320]: float32, C-contiguous."""
        batch = visual.shape[0]
        if audio.shape != (batch, *self.io.audio_shape):
            raise AssetError(f"{self.path}: audio must be [{batch}, {', '.join(map(str, self.io.audio_shape))}], "
                             f"got {list(audio.shape)}")
        step = self.io.batch or batch
        for start in range(0, batch, step):
            end = min(start + step, batch)
            if end - start == step or self.io.batch is None:
                self._run(visual[start:end], audio[start:end], out[start:end])
            else:  # the last chunk of a fixed-batch model: pad, run, keep the real frames
                pad_v = np.zeros((step, *visual.shape[1:]), np.float32)
                pad_a = np.zeros((step, *audio.shape[1:]), np.float32)
                pad_o = np.empty((step, *out.shape[1:]), np.float32)
                pad_v[: end - start], pad_a[: end - start] = visual[start:end], audio[start:end]
                self._run(pad_v, pad_a, pad_o)
                out[start:end] = pad_o[: end - start]

    def _run(self, visual: np.ndarray, audio: np.ndarray, out: np.ndarray) -> None:
        if self._cuda is not None:
            self._cuda.run(visual, audio, out)
            return
        binding = self.session.io_binding()
        for name, array in ((self.io.visual, visual), (self.io.audio, audio)):
            array = np.ascontiguousarray(array)
            binding.bind_input(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)
        if not out.flags.c_contiguous:
            raise ValueError("output buffer must be C-contiguous")
        binding.bind_output(self.io.output, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self.session.run_with_iobinding(binding)

    def warm_up(self) -> None:
        """One run at load, so the first request does not pay for lazy initialisation."""
        b = self.io.batch or 1
        out = np.empty((b, 3, 320, 320), np.float32)
        self.run(np.zeros((b, 6, 320, 320), np.float32), np.zeros((b, *self.io.audio_shape), np.float32), out)
