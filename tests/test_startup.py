"""Start-up: the embedded default's demo avatar, and a child that cannot start."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import yaml

from config import parse_config
from shm import list_segments
from supervisor.demo import build_demo
from tests.conftest import TEST_PREFIX
from tests.helpers import ROOT, base_config, decode_image, free_port, run_server

pytestmark = pytest.mark.slow


def test_demo_avatar_is_built_once_and_served(tmp_path):
    cfg = {"demo": {"cache_dir": str(tmp_path / "cache"), "frames": 12}}
    root = build_demo(parse_config(cfg, base_dir="/"))
    frames = sorted((root / "demo" / "frames").iterdir())
    assert len(frames) == 12 and (root / "demo" / "model.onnx").stat().st_size > 40e6  # unet_328-sized
    rects = json.loads((root / "demo" / "crop_rects.json").read_text())
    centres = {(r["rect"][0] + r["rect"][2]) // 2 for r in rects.values()}
    assert len(centres) > 3, "the face crop should move a little"
    mtime = (root / "complete").stat().st_mtime
    assert build_demo(parse_config(cfg, base_dir="/")) == root and (root / "complete").stat().st_mtime == mtime

    # No models configured: the server serves the demo from the cache (already built above).
    server_cfg = base_config(tmp_path, **cfg, **{"compositing.max_frame_width": 1280,
                                                  "compositing.max_frame_height": 720})
    del server_cfg["models_dir"]
    with run_server(tmp_path, server_cfg) as srv, srv.client() as c:
        (model,) = c.models()
        assert (model["id"], model["width"], model["height"], model["frames"]) == ("demo", 1280, 720, 12)
        header, images = c.composite("demo", np.zeros((2, 32, 16, 16), np.float32), format="png")
        assert decode_image(images[0], "png", header).shape == (720, 1280, 3)
    assert "building the demo avatar" not in srv.log.read_text()  # reused, not rebuilt


def test_a_child_that_cannot_start_is_named_with_its_cause(tmp_path):
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    cfg = base_config(tmp_path, **{"frontend.bind": [f"tcp://127.0.0.1:{port}"]})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        proc = subprocess.run([sys.executable, "-m", "supervisor", "--config", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        blocker.close()
    assert proc.returncode == 1
    assert "cannot start: frontend0 died during start-up" in proc.stderr
    assert "Address already in use" in proc.stderr
    assert not list_segments(TEST_PREFIX), "shared memory left behind by a failed start"
