"""An inference worker's memory is bounded whatever the request: a batch runs as sub-batches sized
from the model's measured memory per frame and the batch-memory budget, with the results of one call."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from config import audio as A
from gpu_actor.model_builder import write_audio_encoder
from gpu_actor import runner as runner_module
from gpu_actor.runner import ModelRunner
from gpu_actor.visual import VisualFrames, build_visual
from tests.helpers import base_config, make_avatar, run_server
from tests.test_audio import speech_like

GB = 1024**3


def _inputs(batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((batch, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((batch, 32, 16, 16)).astype(np.float32))


def test_sub_batches_give_the_results_of_one_call(tmp_path, monkeypatch):
    path = make_avatar(tmp_path, "m", n_frames=1, kind="tiny", seed=5) / "model.onnx"
    whole, split = ModelRunner(path), ModelRunner(path)
    visual, audio = _inputs(7)
    want, got = np.empty((7, 3, 320, 320), np.float32), np.empty((7, 3, 320, 320), np.float32)
    monkeypatch.setattr(runner_module, "CPU_CALL_FRAMES", 7)   # the whole batch in one call
    whole.run(visual, audio, want)
    split.max_frames = 3   # 3 + 3 + 1, into the same output buffer
    split.run(visual, audio, got)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_on_the_cpu_a_batch_runs_frame_by_frame_its_visual_input_built_per_call(tmp_path, monkeypatch):
    """The CPU provider's calls are one frame each (runner.CPU_CALL_FRAMES), each frame's visual input
    built from its crop just before its call: the results of one call over the whole batch."""
    path = make_avatar(tmp_path, "m", n_frames=1, kind="tiny", seed=5) / "model.onnx"
    runner = ModelRunner(path)
    rng = np.random.default_rng(1)
    crops = [rng.integers(0, 256, (328, 328, 3), dtype=np.uint8) for _ in range(5)]
    _, audio = _inputs(5)
    visual = np.empty((5, 6, 320, 320), np.float32)
    build_visual(crops, visual)
    want, got = np.empty((5, 3, 320, 320), np.float32), np.empty((5, 3, 320, 320), np.float32)
    with monkeypatch.context() as m:
        m.setattr(runner_module, "CPU_CALL_FRAMES", 5)
        runner.run(visual, audio, want)
    calls = []
    frames = VisualFrames(crops, np.empty((5, 6, 320, 320), np.float32))
    runner.run(lambda start, end: calls.append((start, end)) or frames(start, end), audio, got)
    assert calls == [(k, k + 1) for k in range(5)]
    np.testing.assert_array_equal(got, want)
    assert frames.spent_s > 0


def test_warm_up_sizes_sub_batches_from_the_measured_memory_and_the_budget(tmp_path):
    path = make_avatar(tmp_path, "m", n_frames=1, kind="tiny") / "model.onnx"
    runner = ModelRunner(path, batch_memory_bytes=1)   # less than any frame costs: one frame per call
    runner.warm_up()
    assert runner.frame_bytes >= 4 * 9 * 320 * 320 and runner.max_frames == 1
    roomy = ModelRunner(path, batch_memory_bytes=runner.frame_bytes * 5)
    roomy.warm_up()
    assert roomy.max_frames >= 2   # its own measurement may differ a little, never by 2.5x
    fixed = ModelRunner(make_avatar(tmp_path, "f", n_frames=1, kind="tiny", batch=2) / "model.onnx",
                        batch_memory_bytes=1)
    fixed.warm_up()
    assert fixed.max_frames is None   # a fixed batch dimension decides its calls' size


def _peak_rss(pid: int) -> int:
    """The process's peak resident bytes (Linux VmHWM), the kernel's own high-water mark."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_a_10_s_pcm_composite_on_unet_328_with_max_batch_256_stays_in_budget(tmp_path):
    """252 frames through a real-size unet_328 on the CPU: one onnxruntime call would take ~0.2 GB per
    frame (~50 GB); sub-batches keep the worker within its budget, and the request completes."""
    budget = 3 * GB
    root = tmp_path / "models"
    write_audio_encoder(make_avatar(root, "u", n_frames=4, kind="unet328") / "audio_encoder.onnx")
    pcm = np.clip(np.round(speech_like(162000 / 16000, seed=2) * 32767), -32768, 32767).astype("<i2")
    assert A.frame_count(len(pcm)) == 252
    cfg = base_config(root, **{"limits.max_batch": 256, "limits.request_timeout_s": 3600, "shm.slots": 1,
                               "compositing.workers": 1, "inference.preload": ["u"],
                               "inference.batch_memory_bytes": budget})
    with run_server(tmp_path, cfg) as srv:
        with srv.client(timeout_s=3600) as c:
            while "u" not in c.stats()["workers"][0].get("loaded", []):   # preloaded: measured, sub-batches sized
                time.sleep(0.5)
            pid = srv.pids("gpu")[0]
            idle = psutil.Process(pid).memory_info().rss
            t0 = time.perf_counter()
            header, images = c.request("composite", [pcm.tobytes()], model="u", audio_format="pcm16", format="jpeg")
            seconds = time.perf_counter() - t0
        peak = _peak_rss(pid)
        assert header["batch"] == len(images) == 252
        assert psutil.Process(pid).is_running()
        # What a request may add: the budget, plus what max_batch frames of input cost the worker itself
        # (its visual-input buffer, 2.46 MB a frame, and the shm slots it touches, 4.2 MB a frame).
        allowed = budget + 252 * (2.46 + 4.2) * 1e6
        print(f"\n252-frame PCM composite, unet_328, CPU: {seconds:.1f} s; worker peak RSS {peak / GB:.2f} GiB "
              f"(idle {idle / GB:.2f} GiB, budget {budget / GB:.0f} GiB)")
        assert peak - idle <= allowed, f"peak {peak / GB:.2f} GiB, idle {idle / GB:.2f} GiB, budget {budget / GB} GiB"
