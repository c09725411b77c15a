"""An inference worker's memory is bounded whatever the request: on the CPU a batch runs one frame per
onnxruntime call, with the results of one call over the whole batch; a fixed-batch model's calls are its
size, the last one padded."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from config import audio as A
from gpu_actor.model_builder import write_audio_encoder
from gpu_actor.own_session import OwnSessionRunner
from gpu_actor.visual import VisualFrames, build_visual
from tests.helpers import base_config, make_avatar, run_server
from tests.test_audio import speech_like

GB = 1024**3


def _inputs(batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((batch, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((batch, 32, 16, 16)).astype(np.float32))


def _one_call(path, visual: np.ndarray, audio: np.ndarray) -> np.ndarray:
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": visual, "audio": audio})[0]


def test_on_the_cpu_a_batch_runs_frame_by_frame_its_visual_input_built_per_call(tmp_path):
    """The CPU provider's calls are one frame each, each frame's visual input built from its crop just
    before its call: the results of one call over the whole batch."""
    path = make_avatar(tmp_path, "m", n_frames=1, kind="tiny", seed=5) / "model.onnx"
    runner = OwnSessionRunner(path)
    rng = np.random.default_rng(1)
    crops = [rng.integers(0, 256, (328, 328, 3), dtype=np.uint8) for _ in range(5)]
    _, audio = _inputs(5)
    visual = np.empty((5, 6, 320, 320), np.float32)
    build_visual(crops, visual)
    want, got = _one_call(path, visual, audio), np.empty((5, 3, 320, 320), np.float32)
    calls = []
    frames = VisualFrames(crops, np.empty((5, 6, 320, 320), np.float32))
    runner.run(lambda start, end: calls.append((start, end)) or frames(start, end), audio, got)
    assert calls == [(k, k + 1) for k in range(5)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert frames.spent_s > 0


def test_a_fixed_batch_model_runs_calls_of_its_size_the_last_one_padded(tmp_path):
    path = make_avatar(tmp_path, "f", n_frames=1, kind="tiny", batch=2) / "model.onnx"
    runner = OwnSessionRunner(path)
    assert runner.shapes.sizes == (2,)
    visual, audio = _inputs(5)

    def padded(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((2 - len(a), *a.shape[1:]), a.dtype)])
    want = np.concatenate([_one_call(path, padded(visual[k:k + 2]), padded(audio[k:k + 2]))[:len(visual[k:k + 2])]
                           for k in (0, 2, 4)])
    for _ in range(2):   # (the padded call's buffers are made once: a second batch reuses them)
        got = np.empty((5, 3, 320, 320), np.float32)
        runner.run(visual, audio, got)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        visual, audio = visual[::-1].copy(), audio[::-1].copy()
        want = want[::-1].copy()


def _peak_rss(pid: int) -> int:
    """The process's peak resident bytes (Linux VmHWM), the kernel's own high-water mark."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_a_10_s_pcm_composite_on_unet_328_with_max_batch_256_stays_in_budget(tmp_path):
    """252 frames through a real-size unet_328 on the CPU: one onnxruntime call would take ~0.2 GB per
    frame (~50 GB); one frame a call keeps the worker within a few frames' worth, and the request
    completes."""
    budget = 1 * GB   # ~5 frames' activations: what one frame a call takes, with room
    root = tmp_path / "models"
    write_audio_encoder(make_avatar(root, "u", n_frames=4, kind="unet328") / "audio_encoder.onnx")
    pcm = np.clip(np.round(speech_like(162000 / 16000, seed=2) * 32767), -32768, 32767).astype("<i2")
    assert A.frame_count(len(pcm)) == 252
    cfg = base_config(root, **{"limits.max_batch": 256, "limits.request_timeout_s": 3600, "shm.slots": 1,
                               "compositing.workers": 1, "inference.preload": ["u"]})
    with run_server(tmp_path, cfg) as srv:
        with srv.client(timeout_s=3600) as c:
            while "u" not in c.stats()["workers"][0].get("loaded", []):   # preloaded and warm
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
