"""Start-up: the embedded default's demo avatar, and a child that cannot start."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from config import parse_config
from shm import list_segments
from supervisor.demo import build_demo
from tests.conftest import TEST_PREFIX
from tests.helpers import ROOT, base_config, decode_image, free_port, make_avatar, run_server

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


def _children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _gone(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still alive (not zombies) after waiting up to timeout_s for them to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_children_die_with_a_killed_supervisor_and_the_next_one_starts(tmp_path):
    """kill -9 of the supervisor (OOM killer): the frontend must not keep the port, nor the workers the
    shared memory, or the next `python -m supervisor` fails with 'Address already in use'."""
    make_avatar(tmp_path, "a", n_frames=2)
    cfg = base_config(tmp_path)
    with run_server(tmp_path, cfg) as first:
        children = _children(first.proc.pid)
        assert len(children) >= 4
        first.proc.kill()
        first.proc.wait(10)
        assert _gone(children) == [], "children outlived their supervisor"
        # The dead run's shared memory stays until the next start sweeps it (first's exit checks that).
        with run_server(tmp_path, cfg) as second, second.client() as c:   # same port, same prefix
            assert c.composite("a", np.zeros((1, 32, 16, 16), np.float32))[0]["ok"]


def test_sigterm_during_start_up_stops_every_child_and_removes_shm(tmp_path):
    make_avatar(tmp_path, "a", n_frames=2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--config", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 4:   # every child spawned, none ready yet (they take ~1 s)
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "stopped by a signal during start-up" in out, out[-2000:]
    assert _gone(children) == []
    assert not [s for s in list_segments(TEST_PREFIX) if f"-{proc.pid}-" in s]
