"""Serving: the real server on the unet_328-shaped model vs onnxruntime alone on the same cores.

- raw ORT frames/s (one session, as a worker makes it) vs frames/s through the server (`infer` with
  visual input: inference only; `composite` audio-only: the whole path), at batch 1, 8, 24;
- serving overhead per batch of 24 (end-to-end minus inference minus compositing) vs a plain memcpy
  of the request's payload;
- batch-1 latency minus (inference + compositing).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lipsync_client import AsyncClient, Client
from tests.helpers import base_config, run_server

AUDIO = (32, 16, 16)


def raw_ort(model: Path, batch: int, seconds: float) -> float:
    """Frames/s of onnxruntime alone, the session made as an inference worker makes it."""
    from gpu_actor.own_session import OwnSessionRunner
    runner = OwnSessionRunner(model, threads=0)
    rng = np.random.default_rng(0)
    visual = rng.random((batch, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((batch, *AUDIO)).astype(np.float32)
    out = np.empty((batch, 3, 320, 320), np.float32)
    runner.run(visual, audio, out)  # warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        runner.run(visual, audio, out)
        n += 1
    return n * batch / (time.perf_counter() - t0)


async def _served(endpoint: str, op: str, batch: int, seconds: float, concurrency: int = 2) -> tuple[float, list]:
    rng = np.random.default_rng(1)
    audio = rng.standard_normal((batch, *AUDIO)).astype(np.float32)
    visual = rng.random((batch, 6, 320, 320), dtype=np.float32) if op in ("infer", "composite_visual") else None
    timings: list = []
    async with AsyncClient(endpoint, timeout_s=600) as client:
        await client.request("infer" if op == "infer" else "composite",
                             [a for a in (visual, audio) if a is not None], model="demo-unet328", batch=batch)  # warm
        stop = time.perf_counter() + seconds
        done = 0

        async def loop(k: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < stop or i == 0:
                t0 = time.perf_counter()
                if op == "infer":
                    header, _ = await client.infer("demo-unet328", visual, audio)
                else:
                    header, _ = await client.composite("demo-unet328", audio, visual=visual, batch=batch,
                                                       start_frame=k * 1000 + i, format="jpeg")
                timings.append((header["timing"], (time.perf_counter() - t0) * 1000))
                done += batch
                i += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0), timings


def _memcpy_ms(nbytes: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, src)
    return (time.perf_counter() - t0) / 5 * 1000


def run(models_dir: str, seconds: float = 8.0, batches=(1, 8, 24), rounds: int = 2) -> dict:
    model = Path(models_dir) / "demo-unet328" / "model.onnx"
    tmp = Path(tempfile.mkdtemp(prefix="lsync-bench-"))
    cfg = base_config(Path(models_dir), **{"limits.max_batch": max(batches), "limits.request_timeout_s": 600,
                                            "inference.intra_op_threads": 0, "compositing.workers": 1,
                                            "compositing.max_frame_width": 1280, "compositing.max_frame_height": 720,
                                            "compositing.cache_bytes": 512 * 1024 * 1024, "shm.slots": 2})
    raw: dict = {b: 0.0 for b in batches}
    infer: dict = {b: (0.0, []) for b in batches}
    composite: dict = {b: (0.0, []) for b in batches}
    result: dict = {}
    with run_server(tmp, cfg) as server:
        with Client(server.endpoint, timeout_s=600) as c:
            c.load("demo-unet328")
        # Interleaved rounds, best of each: raw runs while the server idles, so neither disturbs the
        # other, and a drift in this machine's load hits both alike.
        for _ in range(rounds):
            for b in batches:
                raw[b] = max(raw[b], raw_ort(model, b, seconds))
                infer[b] = max(infer[b], asyncio.run(_served(server.endpoint, "infer", b, seconds)), key=lambda v: v[0])
                composite[b] = max(composite[b], asyncio.run(_served(server.endpoint, "composite", b, seconds)),
                                   key=lambda v: v[0])
        one, one_timings = asyncio.run(_served(server.endpoint, "composite", 1, seconds, concurrency=1))
        # One request at a time, so that no request waits behind another.
        _, alone = asyncio.run(_served(server.endpoint, "composite_visual", max(batches), seconds, concurrency=1))
    result["raw_fps"] = raw
    result["infer_fps"] = {b: v[0] for b, v in infer.items()}
    result["composite_fps"] = {b: v[0] for b, v in composite.items()}
    top = max(batches)
    # Overhead of a batch of `top` with its visual payload: end-to-end (client) - inference - compositing.
    overhead = [client_ms - t["inference_ms"] - t["composite_ms"] for t, client_ms in alone]
    payload = top * (6 * 320 * 320 + int(np.prod(AUDIO))) * 4
    result["overhead_ms"] = statistics.median(overhead)
    result["memcpy_ms"] = _memcpy_ms(payload)
    result["batch1_extra_ms"] = statistics.median(ms - t["inference_ms"] - t["composite_ms"] for t, ms in one_timings)
    result["batch1_latency_ms"] = statistics.median(ms for _, ms in one_timings)
    result["batch1_input_ms"] = statistics.median(t.get("input_ms", 0.0) for t, _ in one_timings)

    print(f"\nserving the unet_328-shaped model on the CPU ({seconds:g} s per point, best of {rounds} interleaved "
          "rounds, 2 requests in flight):")
    print(f"  {'batch':>5} {'raw ORT fps':>12} {'infer fps':>10} {'ratio':>6} {'composite fps':>14} {'ratio':>6}")
    for b in batches:
        print(f"  {b:5d} {raw[b]:12.2f} {result['infer_fps'][b]:10.2f} {result['infer_fps'][b] / raw[b]:6.2f} "
              f"{result['composite_fps'][b]:14.2f} {result['composite_fps'][b] / raw[b]:6.2f}")
    print(f"  serving overhead per batch of {top} with visual input, one request at a time "
          "(end-to-end - inference - compositing): "
          f"{result['overhead_ms']:.1f} ms vs memcpy of its {payload / 1e6:.1f} MB payload {result['memcpy_ms']:.1f} ms "
          f"= {result['overhead_ms'] / result['memcpy_ms']:.1f}x")
    print(f"  batch-1 latency {result['batch1_latency_ms']:.1f} ms, of which not inference or compositing: "
          f"{result['batch1_extra_ms']:.1f} ms (building the audio-only visual input: {result['batch1_input_ms']:.1f} ms "
          "of it)")
    return result
