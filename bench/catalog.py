"""Catalog: `models` over many model directories, and a `health` sent meanwhile, against an idle
`health`, in one run. Each model directory is hard-linked from one small avatar, so only the count
matters (the frontend reads each one's ONNX inputs, frame list, crop rects and first frame header)."""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from lipsync_client import AsyncClient
from tests.helpers import base_config, make_avatar, run_server


def _models_dir(root: Path, n: int) -> None:
    src = make_avatar(root, "m00000", n_frames=2)
    for i in range(1, n):
        d = root / f"m{i:05d}"
        (d / "frames").mkdir(parents=True)
        for name in ("model.onnx", "crop_rects.json"):
            os.link(src / name, d / name)
        for f in (src / "frames").iterdir():
            os.link(f, d / "frames" / f.name)


async def _measure(endpoint: str) -> dict:
    async with AsyncClient(endpoint, timeout_s=120) as c:
        idle = []
        for _ in range(20):
            t0 = time.monotonic()
            await c.request("health")
            idle.append(time.monotonic() - t0)
        out = {"health_idle_ms": statistics.median(idle) * 1000}
        for name in ("first", "second", "after_warm"):
            if name == "after_warm":
                while any(m.get("pending") for m in (await c.request("models"))[0]["models"]):
                    await asyncio.sleep(0.5)
            t0 = time.monotonic()
            models = asyncio.create_task(c.request("models"))
            await asyncio.sleep(0)
            t1 = time.monotonic()
            await c.request("health")
            health = time.monotonic() - t1
            header, _ = await models
            out[name] = {"models_ms": (time.monotonic() - t0) * 1000, "health_meanwhile_ms": health * 1000,
                         "pending": sum(bool(m.get("pending")) for m in header["models"])}
        return out


def run(n: int = 10_000) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lsync-catalog-"))
    try:
        _models_dir(root, n)
        with run_server(root, base_config(root)) as srv:
            out = asyncio.run(_measure(srv.endpoint))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"catalog: `models` over {n} model directories; health alone {out['health_idle_ms']:.1f} ms")
    for name in ("first", "second", "after_warm"):
        r = out[name]
        print(f"  {name:>10}: models {r['models_ms']:.0f} ms ({r['pending']} pending), health sent meanwhile "
              f"{r['health_meanwhile_ms']:.1f} ms = {r['health_meanwhile_ms'] / out['health_idle_ms']:.1f}x alone")
    return out
