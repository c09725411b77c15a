"""Live sessions: how many concurrent 25-fps sessions one machine serves with >= 99 % of frames on time
(sent <= 40 ms after due) and none dropped, speaking 27 % of the time in bursts of about 3 s, or all
silent; speech latency; and which process saturates (CPU per process over each run).

A near-zero-cost model (so inference does not hide the rest), the demo's 1280x720 background, JPEG q75.
Audio is sent in real time, one frame's window per frame period while a session speaks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from frontend.stream import AsyncSession
from gpu_actor.model_builder import write_model
from tests.helpers import base_config, run_server

FPS = 25.0


def _models(demo_dir: Path, root: Path) -> Path:
    d = root / "avatar"
    (d / "frames").mkdir(parents=True)
    src = demo_dir / "demo"
    for f in (src / "frames").iterdir():
        os.link(f, d / "frames" / f.name)
    shutil.copy(src / "crop_rects.json", d / "crop_rects.json")
    write_model(d / "model.onnx", kind="tiny", audio="ave")
    return root


async def _session(endpoint: str, seconds: float, duty: float, burst_s: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    async with AsyncSession(endpoint, "avatar", format="jpeg", quality=75, timeout_s=60) as s:
        async def drain():
            while True:
                await s.frames.get()

        reader = asyncio.create_task(drain())
        window = rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
        t0 = time.monotonic() + rng.uniform(0, 1 / FPS)
        speaking_until, tick = 0.0, 0
        next_burst = t0 + (rng.uniform(0, burst_s / duty) if duty else float("inf"))
        while (now := time.monotonic()) - t0 < seconds:
            if now >= next_burst:
                speaking_until = now + burst_s * rng.uniform(0.7, 1.3)
                next_burst = speaking_until + burst_s * (1 - duty) / duty * rng.uniform(0.7, 1.3)
            if now < speaking_until:
                await s.send_audio(window)
            tick += 1
            await asyncio.sleep(max(t0 + tick / FPS - time.monotonic(), 0))
        stats = await s.close()
        reader.cancel()
        return stats


async def _level(endpoint: str, n: int, seconds: float, duty: float) -> list[dict]:
    return await asyncio.gather(*(_session(endpoint, seconds, duty, 3.0, i) for i in range(n)))


def _cpu(pids: dict) -> dict:
    return {name: sum(psutil.Process(p).cpu_times()[:2]) for name, p in pids.items()}


def _run_level(srv, n: int, seconds: float, duty: float) -> dict:
    pids = {f"{p['role']}{p['index']}": p["pid"] for p in srv.health()["processes"]}
    pids["bench client"] = os.getpid()
    before, t0 = _cpu(pids), time.monotonic()
    stats = asyncio.run(_level(srv.endpoint, n, seconds, duty))
    wall = time.monotonic() - t0
    after = _cpu(pids)
    frames = sum(s["frames_speech"] + s["frames_idle"] for s in stats)
    late = sum(s["late"] for s in stats)
    p99 = [s["latency_ms_p99"] for s in stats if s["latency_ms_p99"] is not None]
    return {"sessions": n, "duty": duty, "frames": frames, "speech": sum(s["frames_speech"] for s in stats),
            "on_time": 1 - late / max(frames, 1), "late": late, "missed": sum(s["missed"] for s in stats),
            "dropped": sum(s["dropped"] for s in stats), "max_late_ms": max(s["max_late_ms"] for s in stats),
            "latency_p99_ms": max(p99) if p99 else None,
            "cpu_percent": {k: round(100 * (after[k] - before[k]) / wall) for k in pids}}


def run(demo_dir: str, seconds: float = 10.0, speaking=(10, 20, 30, 40), silent=(100, 200, 300)) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lsync-sessions-"))
    try:
        models = _models(Path(demo_dir), root)
        cfg = base_config(models, **{"sessions.max_sessions": 1000, "limits.max_batch": 24,
                                     "compositing.max_frame_width": 1280, "compositing.max_frame_height": 720,
                                     "compositing.cache_bytes": 512 << 20, "compositing.workers": "auto",
                                     "limits.queue_depth": 256, "shm.slots": 4})
        results = []
        with run_server(root, cfg) as srv:
            for n in speaking:
                results.append(_run_level(srv, n, seconds, 0.27))
                _print(results[-1])
            for n in silent:
                results.append(_run_level(srv, n, seconds, 0.0))
                _print(results[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"levels": results}


def _print(r: dict) -> None:
    kind = "speaking 27%" if r["duty"] else "silent"
    cpu = ", ".join(f"{k} {v}%" for k, v in r["cpu_percent"].items())
    print(f"  {r['sessions']:4d} sessions {kind}: {r['frames']} frames ({r['speech']} speech), "
          f"{100 * r['on_time']:.2f}% on time, late {r['late']} (max {r['max_late_ms']:.0f} ms), "
          f"missed {r['missed']}, dropped {r['dropped']}, speech latency p99 {r['latency_p99_ms']} ms\n"
          f"        CPU: {cpu}", flush=True)
