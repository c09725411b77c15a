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


def test_the_shared_session_on_cuda_matches_the_cpu_provider_at_every_size(tmp_path):
    """One prepared session per architecture and batch size, the weights resident and bound per call:
    the CPU provider's results at sizes run whole, padded (3, 5) and split (11)."""
    from gpu_actor.device import CudaDevice
    from gpu_actor.runner import ModelRunner
    from gpu_actor.shared import Architectures
    paths = [write_model(tmp_path / f"unet{k}.onnx", kind="unet328", audio="ave", seed=k) for k in (1, 2)]
    archs = Architectures(CudaDevice("cuda:0"), 8, 0, False, False)
    runners = [archs.load(p) for p in paths]
    assert len(archs.prepared) == 1
    assert all(s.get_providers()[0] == "CUDAExecutionProvider" for s in runners[0].prepared.sessions.values())
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 8, 11):
        visual = rng.random((n, 6, 320, 320), dtype=np.float32)
        audio = rng.standard_normal((n, 32, 16, 16)).astype(np.float32)
        for path, runner in zip(paths, runners):
            cpu_out, gpu_out = (np.empty((n, 3, 320, 320), np.float32) for _ in range(2))
            ModelRunner(path, "cpu").run(visual, audio, cpu_out)
            runner.run(visual, audio, gpu_out)
            np.testing.assert_allclose(gpu_out, cpu_out, atol=2e-3)


def test_a_model_on_the_card_holds_its_weights(tmp_path):
    """The first model of an architecture prepares it; each later one costs its weights on the device."""
    from gpu_actor.device import CudaDevice
    from gpu_actor.graphs import split_model
    from gpu_actor.registry import Registry
    from gpu_actor.weights import ALIGN
    paths = {f"m{k}": write_model(tmp_path / f"m{k}.onnx", kind="unet328", seed=k) for k in range(4)}
    device = CudaDevice("cuda:0")
    reg = Registry(device, 8, 0, "lru", 0, 0, False, paths.get, lambda *a: None, lambda: None, max_batch=8)
    architecture = split_model(paths["m0"]).architecture
    weights = architecture.nbytes
    used = []
    for model in paths:
        assert reg.start_load(model)
        reg.loading[model].result(600)
        (result,) = reg.poll_loads()
        # (each tensor at an ALIGN-aligned offset of one buffer: unet_328 has a 12-byte bias)
        assert result.error is None and weights <= result.nbytes <= weights + ALIGN * len(architecture.weights)
        used.append(device.memory_used())
    per_model = (used[-1] - used[1]) / 2
    assert per_model <= 1.5 * weights, f"{per_model / 2**20:.0f} MiB a model for {weights / 2**20:.0f} MiB of weights"
    reg.close()


def test_fp16_on_the_card_keeps_the_crop_within_45_db_of_fp32(tmp_path):
    from gpu_actor.device import CudaDevice
    from gpu_actor.shared import Architectures, _crop, _psnr
    path = write_model(tmp_path / "unet.onnx", kind="unet328", audio="ave", seed=3)
    rng = np.random.default_rng(7)
    visual = rng.random((4, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((4, 32, 16, 16)).astype(np.float32)
    mouths, nbytes = {}, {}
    for precision in ("fp32", "fp16"):
        runner = Architectures(CudaDevice("cuda:0"), 4, 0, False, False, precision).load(path)
        mouths[precision] = np.empty((4, 3, 320, 320), np.float32)
        runner.run(visual, audio, mouths[precision])
        nbytes[precision] = runner.nbytes
    psnr = _psnr(_crop(mouths["fp16"]), _crop(mouths["fp32"]))
    print(f"\nfp16 vs fp32 on the card: crop PSNR {psnr:.1f} dB, weights {nbytes['fp16']} vs {nbytes['fp32']} bytes")
    # fp16 really ran (a fall-back to fp32, documented, would give equal crops: inf dB), its weights in float16
    assert nbytes["fp16"] < 0.6 * nbytes["fp32"] and 45 <= psnr < float("inf")


def test_the_crops_graph_on_the_card_builds_build_visuals_input_to_the_bit():
    from gpu_actor.device import CudaDevice
    from gpu_actor.preprocess import visual_graph
    from gpu_actor.runner import session_options
    from gpu_actor.visual import build_visual
    crops = np.random.default_rng(4).integers(0, 256, (3, 328, 328, 3), dtype=np.uint8)
    want = np.empty((3, 6, 320, 320), np.float32)
    build_visual(list(crops), want)
    # (the device's session: CUDA's libraries preloaded, and refused unless it runs on the CUDA provider)
    session = CudaDevice("cuda:0").session(visual_graph().SerializeToString(), session_options(0, False))
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    got = session.run(None, {session.get_inputs()[0].name: crops})[0]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), float(np.abs(got - want).max())


def test_cuda_graphs_replay_each_models_own_weights_when_models_alternate(tmp_path):
    from gpu_actor.device import CudaDevice
    from gpu_actor.runner import ModelRunner
    from gpu_actor.shared import Architectures
    paths = [write_model(tmp_path / f"unet{k}.onnx", kind="unet328", audio="ave", seed=k) for k in range(2)]
    archs = Architectures(CudaDevice("cuda:0"), 4, 0, False, False, graphs=True)
    runners = [archs.load(p) for p in paths]
    prepared = runners[0].prepared
    assert prepared.slot is not None, "the architecture's sessions were made without CUDA graphs"
    rng = np.random.default_rng(5)
    visual = rng.random((3, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((3, 32, 16, 16)).astype(np.float32)
    want = []
    for path in paths:
        want.append(np.empty((3, 3, 320, 320), np.float32))
        ModelRunner(path, "cpu").run(visual, audio, want[-1])
    for k in (0, 1, 1, 0, 1):
        got = np.empty((3, 3, 320, 320), np.float32)
        runners[k].run(visual, audio, got)
        np.testing.assert_allclose(got, want[k], atol=2e-3)
    # every call was captured, then replayed: no size fell back to plain runs
    assert not prepared.plain and prepared.main_runs[4] == 5, (prepared.plain, prepared.main_runs)


def test_a_prepared_architecture_on_the_card_costs_no_idle_threads(tmp_path):
    """Its sessions run on the calling thread (a session's intra-op pool, one thread per core by default,
    would only wait for the GPU): a second architecture adds fewer threads than it has sessions."""
    import psutil

    from gpu_actor.device import CudaDevice
    from gpu_actor.shared import Architectures
    archs = Architectures(CudaDevice("cuda:0"), 16, 0, False, False)
    archs.load(write_model(tmp_path / "first.onnx", kind="tiny"))   # (CUDA's and onnxruntime's own threads)
    before = psutil.Process().num_threads()
    runner = archs.load(write_model(tmp_path / "m.onnx", kind="tiny", audio="hubert"))
    grown = psutil.Process().num_threads() - before
    print(f"\nthreads: {grown} more for {len(runner.prepared.sessions) + 1} sessions")
    assert grown < len(runner.prepared.sessions) + 1
