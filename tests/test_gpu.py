"""The GPU path on a card, and the same checks through the stand-in device wherever it can show them
(everything but real float16 arithmetic and real CUDA graphs), so CI runs each of them every time and a
card adds only what needs it. The card's runs skip, with the reason, where there is no GPU; where there
is one they really run (`bash bench/gpu_check.sh` runs this file there)."""

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


@pytest.fixture(params=["standin", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        missing = _gpu_missing()
        if missing:
            pytest.skip(missing)
        from gpu_actor.cuda import CudaDevice
        return CudaDevice("cuda:0")
    from gpu_actor.device import StandInDevice
    return StandInDevice(0.0)


def _card(device) -> bool:
    return device.name != "cpu"


def _atol(device) -> float:
    return 2e-3 if _card(device) else 1e-5   # (a card's convolutions may run in TF32)


def test_the_shared_session_matches_the_cpu_provider_at_every_size(tmp_path, device):
    """One prepared session per architecture and batch size, the weights resident and bound per call:
    the CPU provider's results at sizes run whole, padded (3, 5) and split (11)."""
    from gpu_actor.architectures import Architectures
    from gpu_actor.own_session import OwnSessionRunner
    kind = "unet328" if _card(device) else "tiny"   # (the real size on the card; the stand-in runs on the CPU)
    paths = [write_model(tmp_path / f"m{k}.onnx", kind=kind, audio="ave", seed=k) for k in (1, 2)]
    archs = Architectures(device, 8, 0, False)
    runners = [archs.load(p) for p in paths]
    assert len(archs.prepared) == 1
    sessions = [*runners[0].prepared.sessions.values(), runners[0].prepared.crop_session]
    want = "CUDAExecutionProvider" if _card(device) else "CPUExecutionProvider"
    assert all(s.get_providers()[0] == want for s in sessions)
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 8, 11):
        visual = rng.random((n, 6, 320, 320), dtype=np.float32)
        audio = rng.standard_normal((n, 32, 16, 16)).astype(np.float32)
        for path, runner in zip(paths, runners):
            cpu_out, gpu_out = (np.empty((n, 3, 320, 320), np.float32) for _ in range(2))
            OwnSessionRunner(path).run(visual, audio, cpu_out)
            runner.run(visual, audio, gpu_out)
            np.testing.assert_allclose(gpu_out, cpu_out, rtol=0, atol=_atol(device))


def test_a_model_on_the_device_holds_its_weights(tmp_path, device):
    """The first model of an architecture prepares it; each later one costs its weights on the device
    (on the card: its memory in use; on the stand-in: the weight bytes it accounts)."""
    from config.schema import InferenceConfig
    from gpu_actor.model_split import split_model
    from gpu_actor.registry import Registry
    from gpu_actor.weights import ALIGN
    paths = {f"m{k}": write_model(tmp_path / f"m{k}.onnx", kind="unet328", seed=k) for k in range(4)}
    reg = Registry(device, InferenceConfig(max_models_per_worker=8), 2, paths.get, lambda *a: None, lambda: None)
    architecture = split_model(paths["m0"]).architecture
    weights = architecture.nbytes
    used = []
    for model in paths:
        assert reg.start_load(model)
        reg.loading[model].result(600)
        (result,) = reg.poll_loads()
        # (each tensor at an ALIGN-aligned offset of one buffer: unet_328 has a 12-byte bias)
        assert result.error is None and weights <= result.nbytes <= weights + ALIGN * len(architecture.weights)
        used.append(device.memory_used() if _card(device) else device.weight_bytes)
    per_model = (used[-1] - used[1]) / 2
    assert weights <= per_model <= 1.5 * weights, \
        f"{per_model / 2**20:.0f} MiB a model for {weights / 2**20:.0f} MiB of weights"
    reg.close()


def test_fp16_runs_in_float16_and_keeps_the_crop_within_45_db_of_fp32(tmp_path, device):
    """fp16 really runs (a fall-back to fp32, documented, would give equal crops: inf dB), its weights in
    float16. On the stand-in the CPU provider computes in float32 with the weights rounded: the card's
    float16 arithmetic is checked on the card."""
    from gpu_actor.architectures import Architectures
    from gpu_actor.precision import crop, psnr
    path = write_model(tmp_path / "unet.onnx", kind="unet328", audio="ave", seed=3)
    rng = np.random.default_rng(7)
    visual = rng.random((2, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((2, 32, 16, 16)).astype(np.float32)
    mouths, nbytes, dtypes = {}, {}, {}
    for precision in ("fp32", "fp16"):
        runner = Architectures(device, 2, 0, False, precision).load(path)
        mouths[precision] = np.empty((2, 3, 320, 320), np.float32)
        runner.run(visual, audio, mouths[precision])
        nbytes[precision] = runner.nbytes
        dtypes[precision] = {np.dtype(d).name for d in runner.prepared.architecture.dtypes}
    db = psnr(crop(mouths["fp16"]), crop(mouths["fp32"]))
    print(f"\nfp16 vs fp32 on {device.name}: crop PSNR {db:.1f} dB, weights {nbytes['fp16']} vs {nbytes['fp32']} bytes")
    assert "float16" in dtypes["fp16"] and dtypes["fp32"] == {"float32"}
    assert nbytes["fp16"] < 0.6 * nbytes["fp32"] and 45 <= db < float("inf")


def test_the_crops_graph_builds_build_visuals_input_to_the_bit(device):
    from gpu_actor.onnx_sessions import session_options
    from gpu_actor.visual import build_visual
    from gpu_actor.visual_onnx import visual_graph
    crops = np.random.default_rng(4).integers(0, 256, (3, 328, 328, 3), dtype=np.uint8)
    want = np.empty((3, 6, 320, 320), np.float32)
    build_visual(list(crops), want)
    # (the device's session: on a card CUDA's libraries preloaded, and refused unless on the CUDA provider)
    session = device.session(visual_graph().SerializeToString(), session_options(0, False))
    assert session.get_providers()[0] == ("CUDAExecutionProvider" if _card(device) else "CPUExecutionProvider")
    got = device.infer(session, {session.get_inputs()[0].name: crops})[0]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), float(np.abs(got - want).max())


def test_cuda_graphs_replay_each_models_own_weights_when_models_alternate(tmp_path, device):
    """inference.cuda_graphs: each size binds the architecture's one weight slot; a model's weights are
    copied in when another model ran last. On the card every call at a size is captured once, then
    replayed (no size fell back to plain runs); the stand-in runs the same bindings and locking."""
    from gpu_actor.architectures import Architectures
    from gpu_actor.own_session import OwnSessionRunner
    kind = "unet328" if _card(device) else "tiny"
    paths = [write_model(tmp_path / f"m{k}.onnx", kind=kind, audio="ave", seed=k) for k in range(2)]
    archs = Architectures(device, 4, 0, False, graphs=True)
    runners = [archs.load(p) for p in paths]
    prepared = runners[0].prepared
    assert prepared.graph_slot is not None, "the architecture's sessions were made without CUDA graphs"
    rng = np.random.default_rng(5)
    visual = rng.random((3, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((3, 32, 16, 16)).astype(np.float32)
    want = []
    for path in paths:
        want.append(np.empty((3, 3, 320, 320), np.float32))
        OwnSessionRunner(path).run(visual, audio, want[-1])
    for k in (0, 1, 1, 0, 1):
        got = np.empty((3, 3, 320, 320), np.float32)
        runners[k].run(visual, audio, got)
        np.testing.assert_allclose(got, want[k], rtol=0, atol=_atol(device))
    from gpu_actor.cuda_graphs import CAPTURE_RUNS
    assert not prepared.graph_slot.plain and prepared.graph_slot.runs[4] == CAPTURE_RUNS, (prepared.graph_slot.plain, prepared.graph_slot.runs)


def test_a_prepared_architecture_costs_no_idle_threads(tmp_path, device):
    """Its sessions run on the calling thread (a session's intra-op pool, one thread per core by default,
    would only wait for the GPU): a second architecture adds fewer threads than it has sessions. (The
    stand-in gives each of its sessions a pool of the host's cores on purpose, to compute what a card
    would: there a pool thread per session and core past the first.)"""
    import os

    import psutil

    from gpu_actor.architectures import Architectures
    archs = Architectures(device, 16, 0, False)
    archs.load(write_model(tmp_path / "first.onnx", kind="tiny"))   # (CUDA's and onnxruntime's own threads)
    before = psutil.Process().num_threads()
    runner = archs.load(write_model(tmp_path / "m.onnx", kind="tiny", audio="hubert"))
    assert len(archs.prepared) == 2
    grown = psutil.Process().num_threads() - before
    sessions = len(runner.prepared.sessions) + 1
    print(f"\nthreads: {grown} more for {sessions} sessions")
    pools = 0 if _card(device) else sessions * (len(os.sched_getaffinity(0)) - 1)
    assert grown < sessions + pools


def test_a_grouped_step_on_the_device_gives_each_frame_its_own_models_mouths(tmp_path, device):
    """A step of two models' frames (one of them twice, 5 frames padded to 8) in one call of the N-model
    form, its 1x1 convolutions in whichever way the device ran faster at preparation: each part's mouths
    are what the CPU provider gives for its own model alone."""
    import weakref

    from gpu_actor.architectures import Architectures
    from gpu_actor.own_session import OwnSessionRunner
    from gpu_actor.runner import Part
    kind = "unet328" if _card(device) else "tiny"
    paths = [write_model(tmp_path / f"m{k}.onnx", kind=kind, audio="ave", seed=k) for k in (1, 2)]
    archs = Architectures(device, 8, 0, False, mixed="grouped")
    runners = [archs.load(p) for p in paths]
    archs.prepare_more(weakref.ref(runners[1]))
    prepared = runners[0].prepared
    grouped = prepared.grouped
    assert grouped is not None and tuple(grouped.sessions) == (2, 4, 8)
    assert set(grouped.pointwise_s) == {"conv", "matmul"}
    print("\nthe N-model form at 8: " + ", ".join(f"{m} {s * 1000:.2f} ms" for m, s in grouped.pointwise_s.items())
          + f"; kept {grouped.pointwise}")
    rng = np.random.default_rng(3)
    rows = (2, 1, 2)   # models 0, 1, 0
    inputs = [(rng.random((n, 6, 320, 320), dtype=np.float32), rng.standard_normal((n, 32, 16, 16)).astype(np.float32))
              for n in rows]
    outs = [np.full((n, 3, 320, 320), np.nan, np.float32) for n in rows]
    parts = [Part(v, a, o) for (v, a), o in zip(inputs, outs)]
    prepared.run_grouped([(runners[0], [parts[0], parts[2]]), (runners[1], [parts[1]])])
    for k, ((visual, audio), out) in enumerate(zip(inputs, outs)):
        want = np.empty_like(out)
        OwnSessionRunner(paths[(0, 1, 0)[k]]).run(visual, audio, want)
        np.testing.assert_allclose(out, want, rtol=0, atol=_atol(device), err_msg=f"part {k}")


def test_a_server_on_the_device_serves_two_avatars_through_its_workers_device_thread(tmp_path, device):
    """A worker's steps run on a thread of their own (gpu_actor/step.py), which makes the worker's device
    its own before its first call: a server whose worker runs on the device answers a burst of two
    avatars' requests, each with its own model's mouths (the CPU provider's, within the device's
    tolerance), and its stats count the steps that thread ran."""
    from gpu_actor.device import STAND_IN_COST_ENV, STAND_IN_ENV
    from gpu_actor.own_session import OwnSessionRunner
    from tests.helpers import base_config, infer_at_once, make_avatar, run_server
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b")):
        make_avatar(root, model, kind="tiny", seed=seed)
    card = _card(device)
    cfg = base_config(root, **{"limits.max_batch": 8, **({"inference.devices": [0]} if card else {})})
    # (the stand-in: a call lasts 200 ms at least, so the burst queues behind the first and shares steps)
    env = {} if card else {STAND_IN_ENV: "0", STAND_IN_COST_ENV: "200,0"}
    rng = np.random.default_rng(4)
    work = [("ab"[k % 2], rng.random((1, 6, 320, 320), np.float32),
             rng.standard_normal((1, 32, 16, 16)).astype(np.float32)) for k in range(8)]
    with run_server(tmp_path, cfg, env=env) as srv:
        with srv.client(timeout_s=300) as c:
            for model in ("a", "b"):
                c.load(model)
        answers = infer_at_once(srv.endpoint, work, timeout_s=300)
        with srv.client() as c:
            worker = c.stats()["workers"][0]
    runners = {m: OwnSessionRunner(root / m / "model.onnx") for m in ("a", "b")}
    for (model, visual, audio), (_, frames) in zip(work, answers):
        expected = np.empty((1, 3, 320, 320), np.float32)
        runners[model].run(visual, audio, expected)
        got = np.frombuffer(frames[0], "<f4").reshape(1, 3, 320, 320)
        np.testing.assert_allclose(got, expected, rtol=0, atol=_atol(device))
    steps = worker["steps"]
    assert 1 <= steps["steps"] <= 8 and steps["device_busy_s"] > 0, steps
    if not card:   # (a card's calls take a millisecond: the burst may come one request a step)
        assert steps["steps"] < 8, steps
