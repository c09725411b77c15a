"""The CUDA path. Skipped, with the reason, where there is no GPU; really run where there is one."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_actor.model_builder import write_model


def _gpu_missing() -> str | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("no GPU here: onnxruntime has no CUDAExecutionProvider (install the gpu extra, "
                "LIPSYNC_EXTRAS=gpu, on a machine with an NVIDIA GPU)")
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU here: cupy sees no CUDA device"
    except Exception as err:  # ImportError, or a CUDA runtime error without a driver
        return f"no GPU here: cupy unavailable ({type(err).__name__}: {err})"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))]


def test_cuda_runner_matches_the_cpu_provider(tmp_path):
    from gpu_actor.runner import ModelRunner
    path = write_model(tmp_path / "unet.onnx", kind="unet328", audio="ave", seed=1)
    rng = np.random.default_rng(0)
    visual = rng.random((4, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((4, 32, 16, 16)).astype(np.float32)
    cpu_out, gpu_out = (np.empty((4, 3, 320, 320), np.float32) for _ in range(2))
    ModelRunner(path, "cpu").run(visual, audio, cpu_out)
    gpu = ModelRunner(path, "cuda:0")
    assert gpu.session.get_providers()[0] == "CUDAExecutionProvider"
    gpu.run(visual, audio, gpu_out)
    np.testing.assert_allclose(gpu_out, cpu_out, atol=2e-3)


def test_registry_measures_device_memory(tmp_path):
    from gpu_actor.registry import Registry
    path = write_model(tmp_path / "unet.onnx", kind="unet328", seed=2)
    reg = Registry("cuda:0", 4, 0, "lru", 0, 0, False, {"m": path}.get, lambda *a: None, lambda: None)
    assert reg.start_load("m")
    reg.loading["m"].result(300)
    (result,) = reg.poll_loads()
    assert result.error is None and result.nbytes >= path.stat().st_size
    reg.close()
