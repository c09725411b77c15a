"""The bridge's added latency: the same requests single-host and edge -> GPU host over loopback.

A tiny model keeps inference out of the way, so the difference is what the bridge costs: one copy of
the batch into the socket, CURVE encryption, the GPU host's copy into its input slot, the mouths back
the same way. Batches of 24, one request at a time, audio-only (32 KB a frame crosses) and with the
visual input (2.5 MB a frame crosses).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lipsync_client import Client
from tests.helpers import base_config, bridge_configs, bridge_keys, free_port, gpu_host, make_avatar, run_server

BATCH = 24


def _latencies(client: Client, n: int, visual: bool) -> list[float]:
    rng = np.random.default_rng(0)
    audio = rng.standard_normal((BATCH, 32, 16, 16)).astype(np.float32)
    vis = rng.random((BATCH, 6, 320, 320), dtype=np.float32) if visual else None
    client.composite("a", audio, visual=vis, format="jpeg")  # warm: model loaded, store filled
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        client.composite("a", audio, visual=vis, format="jpeg")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def run(n: int = 10) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lsync-bench-bridge-"))
    make_avatar(tmp / "models", "a", n_frames=BATCH, size=(1280, 720),
                rects=[[500 + k, 200, 800 + k, 500] for k in range(BATCH)])
    models = tmp / "models"
    common = {"limits.max_batch": BATCH, "compositing.max_frame_width": 1280, "compositing.max_frame_height": 720,
              "compositing.cache_bytes": 256 * 1024 * 1024, "compositing.workers": 1}
    keys = bridge_keys(tmp / "keys")
    results = {}
    with run_server(tmp, base_config(models, **common)) as single, single.client() as c:
        results["single"] = {v: _latencies(c, n, v) for v in (False, True)}
    gpu_cfg, edge_cfg = bridge_configs(models, keys, free_port(), "lsbench", **common)
    with gpu_host(tmp, gpu_cfg), run_server(tmp, edge_cfg, role="edge") as edge, edge.client() as c:
        results["bridge"] = {v: _latencies(c, n, v) for v in (False, True)}
    print(f"\nbridge over loopback with CURVE, batch {BATCH}, median of {n} (ms end to end):")
    print(f"  {'input':12} {'single host':>12} {'edge -> GPU':>12} {'added':>8}")
    summary = {}
    for visual, name in ((False, "audio only"), (True, "with visual")):
        one = statistics.median(results["single"][visual])
        two = statistics.median(results["bridge"][visual])
        summary[name] = {"single_ms": one, "bridge_ms": two, "added_ms": two - one}
        print(f"  {name:12} {one:12.1f} {two:12.1f} {two - one:8.1f}")
    return summary
