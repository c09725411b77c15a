"""Server CPU per served frame vs the sum of its bare parts, in one run.

The compositing-bound regime: a near-zero-cost model, audio-only `composite` requests of batch 24,
JPEG q75, the demo's 1280x720 background, two requests in flight. Served: CPU time (user + system) of
every server process over the run, per frame. Bare: the same work in this process with nothing
around it: building the visual input from cached crops, the model run (one thread, as the worker is
one thread), and pasting + encoding each frame. Measured with onnxruntime's threads spinning
between runs (its default) and not (this server's default, inference.spin_threads: false).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import psutil

from bench.procstat import server_pids
from config.assets import ModelPaths, load_assets
from config.geometry import crop_328
from cpu_actor.composite import encode_image, mouth_to_uint8, paste
from lipsync_client import AsyncClient
from gpu_actor.own_session import OwnSessionRunner
from gpu_actor.visual import build_visual
from tests.helpers import base_config, run_server

BATCH = 24


def bare_per_frame(avatar: Path, rounds: int = 8) -> dict:
    assets = load_assets(ModelPaths("avatar", avatar / "model.onnx", avatar / "frames", avatar / "crop_rects.json"),
                         (4096, 4096))
    backgrounds = [assets.decode(i)[0] for i in range(min(assets.n_frames, BATCH))]
    crops = [crop_328(bg, assets.rects[i]) for i, bg in enumerate(backgrounds)]
    cv2.setNumThreads(1)   # as in a compositing process
    runner = OwnSessionRunner(avatar / "model.onnx", threads=1)
    audio = np.zeros((BATCH, 32, 16, 16), np.float32)
    visual = np.empty((BATCH, 6, 320, 320), np.float32)
    mouths = np.empty((BATCH, 3, 320, 320), np.float32)
    parts = {"visual input": 0.0, "model": 0.0, "composite + encode": 0.0}
    for r in range(rounds + 1):
        if r == 1:   # the first round warms caches and onnxruntime's allocations: not counted
            parts = dict.fromkeys(parts, 0.0)
        t = time.process_time()
        build_visual([crops[i % len(crops)].copy() for i in range(BATCH)], visual)
        parts["visual input"] += time.process_time() - t
        t = time.process_time()
        runner.run(visual, audio, mouths)
        parts["model"] += time.process_time() - t
        t = time.process_time()
        for i in range(BATCH):
            k = i % len(backgrounds)
            frame = paste(backgrounds[k].copy(), crops[k].copy(), mouth_to_uint8(mouths[i]), assets.rects[k])
            encode_image(frame, "jpeg", 75)
        parts["composite + encode"] += time.process_time() - t
    return {k: v / (rounds * BATCH) * 1000 for k, v in parts.items()}


async def _load(endpoint: str, seconds: float) -> int:
    frames = 0
    async with AsyncClient(endpoint, timeout_s=60) as c:
        audio = np.zeros((BATCH, 32, 16, 16), np.float32)
        await c.composite("avatar", audio, format="jpeg", quality=75)   # warm: model loaded, store filled
        deadline = time.monotonic() + seconds

        async def one():
            nonlocal frames
            while time.monotonic() < deadline:
                await c.composite("avatar", audio, format="jpeg", quality=75)
                frames += BATCH

        await asyncio.gather(one(), one())
    return frames


def served_per_frame(root: Path, seconds: float, spin: bool) -> tuple[float, dict]:
    cfg = base_config(root, **{"compositing.max_frame_width": 1280, "compositing.max_frame_height": 720,
                               "compositing.cache_bytes": 512 << 20, "compositing.workers": "auto",
                               "limits.max_batch": BATCH, "inference.spin_threads": spin,
                               "inference.intra_op_threads": 0})   # the default: onnxruntime picks (2 here)
    with run_server(root, cfg) as srv:
        asyncio.run(_load(srv.endpoint, 1.0))
        procs = {name: psutil.Process(pid) for name, pid in server_pids(srv).items()}
        before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
        frames = asyncio.run(_load(srv.endpoint, seconds))
        used = {k: (sum(p.cpu_times()[:2]) - before[k]) * 1000 / frames for k, p in procs.items()}
    return sum(used.values()), used


def run(demo_dir: str, seconds: float = 8.0) -> dict:
    from bench.sessions import _models
    root = Path(tempfile.mkdtemp(prefix="lsync-cpu-"))
    try:
        _models(Path(demo_dir), root)
        bare = bare_per_frame(root / "avatar")
        bare_total = sum(bare.values())
        out = {"bare_ms": bare, "bare_total_ms": bare_total}
        print(f"\nserver CPU per served frame (near-zero-cost model, audio-only, JPEG q75, batch {BATCH}, 1280x720):")
        print("  bare parts (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in bare.items()) + f" = {bare_total:.2f}")
        for spin in (True, False):
            total, used = served_per_frame(root, seconds, spin)
            out[f"spin_{spin}"] = {"served_ms": total, "by_process_ms": used, "ratio": total / bare_total}
            print(f"  served, onnxruntime threads {'spinning' if spin else 'not spinning'}: {total:.2f} ms = "
                  f"{total / bare_total:.2f}x bare (" + ", ".join(f"{k} {v:.2f}" for k, v in used.items()) + ")")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out

