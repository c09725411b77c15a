"""Start-up: the embedded default's demo avatar, and a child that cannot start."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import cv2
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
    assert len(frames) == 12 and (root / "demo-unet328" / "model.onnx").stat().st_size > 40e6  # unet_328-sized
    assert (root / "demo" / "model.onnx").stat().st_size < 20e6 and (root / "demo" / "speech.wav").exists()
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
        demo, unet = c.models()
        assert (demo["id"], demo["width"], demo["height"], demo["frames"]) == ("demo", 1280, 720, 12)
        assert unet["id"] == "demo-unet328" and unet["frames"] == 12
        header, images = c.composite("demo-unet328", np.zeros((2, 32, 16, 16), np.float32), format="png")
        assert decode_image(images[0], "png", header).shape == (720, 1280, 3)
        _demo_talks(c, root)
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


def _demo_talks(c, root) -> None:
    """The demo's mouth opens with loud speech and stays the face's own in silence: frames from 16 kHz
    PCM (the demo's speech.wav), the mouth region compared with the background it was pasted on."""
    from lipsync_client.commands import read_wav
    pcm = read_wav(str(root / "demo" / "speech.wav"))
    rects = json.loads((root / "demo" / "crop_rects.json").read_text())
    n = 5600                                                           # 8 frames: limits.max_batch here
    start = max(range(0, len(pcm) - n, 800), key=lambda i: np.abs(pcm[i:i + n].astype(float)).mean())
    loud = pcm[start:start + n]                                        # the loudest stretch of speech
    silent = np.zeros(n, "<i2")                                        # silence
    openings = {}
    for name, audio in (("loud", loud), ("silent", silent)):
        header, images = c.request("composite", [audio.astype("<i2")], model="demo", audio_format="pcm16",
                                   format="png", timeout_ms=60_000)
        changes = []
        for image, k in zip(images, header["frames"]):
            frame = decode_image(image, "png", header).astype(int)
            background = cv2.imread(str(sorted((root / "demo" / "frames").iterdir())[k])).astype(int)
            x1, y1, x2, y2 = rects[str(k)]["rect"]
            mouth = (slice(y1 + 160, y1 + 230), slice(x1 + 100, x1 + 200))   # the lower middle of the face box
            changes.append(np.abs(frame[mouth] - background[mouth]).mean())
        openings[name] = changes
    assert max(openings["silent"]) < 3, openings["silent"]   # nothing drawn: the resampled face itself
    assert np.median(openings["loud"]) > 10 * max(max(openings["silent"]), 0.5), openings
