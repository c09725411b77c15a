"""End to end over real sockets and processes: `python -m supervisor` serving REQ and DEALER clients."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request

import cv2
import numpy as np
import onnxruntime as ort
import pytest
import zmq

from lipsync_client import AsyncClient, ServerError
from tests.helpers import base_config, decode_image, expected_frames, free_port, make_avatar, mirror_index, run_server

N_FRAMES, SIZE = 5, (320, 240)
MAX_BATCH = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "a", n_frames=N_FRAMES, size=SIZE, rects=[[60, 40, 200, 190], [0, 0, 150, 130],
                                                                [-30, -20, 120, 110], [250, 150, 400, 300],
                                                                [100, 60, 220, 200]])
    make_avatar(root, "h", n_frames=3, size=SIZE, audio="hubert", batch=2, seed=4)
    (root / "broken").mkdir()
    (root / "broken" / "model.onnx").write_bytes(b"not onnx")
    return root


server_metrics_port = [0]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    cfg = base_config(models, **{"limits.max_batch": MAX_BATCH, "limits.queue_depth": 32,
                                 "metrics.port": free_port(), "compositing.preload": ["h"]})
    server_metrics_port[0] = cfg["metrics"]["port"]
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        yield srv


def test_health_and_models(server):
    health = server.health()
    assert health["status"] == "ready"
    roles = sorted((p["role"], p["index"]) for p in health["processes"])
    assert roles == [("cpu", 0), ("cpu", 1), ("frontend", 0), ("gpu", 0)]
    with server.client() as c:
        models = {m["id"]: m for m in c.models()}
    assert models["a"]["audio_shape"] == [32, 16, 16] and models["a"]["frames"] == N_FRAMES
    assert (models["a"]["width"], models["a"]["height"]) == SIZE
    assert models["h"]["audio_shape"] == [32, 32, 32]
    assert "broken" in models and "not a readable ONNX model" in models["broken"]["error"]


@pytest.mark.parametrize("fmt", ["raw", "png", "jpeg"])
def test_audio_only_composite_matches_reference(server, models, fmt):
    audio = np.random.default_rng(1).standard_normal((4, 32, 16, 16)).astype(np.float32)
    with server.client() as c:
        header, images = c.composite("a", audio, start_frame=3, format=fmt)
    frames, expected = expected_frames(models, "a", audio, 3, 4)
    assert header["frames"] == frames == [3, 4, 4, 3]
    assert (header["width"], header["height"], header["batch"], header["format"]) == (*SIZE, 4, fmt)
    timing = header["timing"]
    assert set(timing) == {"queue_ms", "input_ms", "inference_ms", "composite_ms", "total_ms"}
    assert timing["input_ms"] > 0  # the visual input was built from the avatar
    assert timing["queue_ms"] + timing["input_ms"] + timing["inference_ms"] + timing["composite_ms"] <= timing["total_ms"]
    assert len(images) == 4
    for image, want in zip(images, expected):
        got = decode_image(image, fmt, header)
        assert got.shape == (SIZE[1], SIZE[0], 3)
        if fmt == "jpeg":  # libjpeg-turbo is deterministic: the reference, encoded alike, is the same file
            mcus = (want.shape[1] + 15) // 16   # a restart marker per row of 16x16 MCUs, 4:2:0
            assert image == cv2.imencode(".jpg", want, [cv2.IMWRITE_JPEG_QUALITY, 75, cv2.IMWRITE_JPEG_RST_INTERVAL, mcus,
                                                       cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                                                       cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420])[1].tobytes()
        else:
            np.testing.assert_array_equal(got, want)


def test_visual_and_audio_composite_with_one_audio_window(server, models):
    rng = np.random.default_rng(2)
    visual = rng.random((3, 6, 320, 320), dtype=np.float32)
    window = rng.standard_normal((32, 16, 16)).astype(np.float32)
    with server.client() as c:
        header, images = c.composite("a", window, visual=visual, format="raw")
    assert header["timing"]["input_ms"] == 0  # the client sent it
    _, expected = expected_frames(models, "a", window, 0, 3, visual=visual)
    for image, want in zip(images, expected):
        np.testing.assert_array_equal(decode_image(image, "raw", header), want)


def test_infer_returns_the_models_mouths(server, models):
    rng = np.random.default_rng(3)
    visual = rng.random((3, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((3, 32, 32, 32)).astype(np.float32)
    with server.client() as c:
        header, mouths = c.infer("h", visual, audio)
    session = ort.InferenceSession(str(models / "h" / "model.onnx"), providers=["CPUExecutionProvider"])
    for i in range(3):  # model "h" has a fixed batch of 2
        pair = {"input": np.repeat(visual[i:i + 1], 2, 0), "audio": np.repeat(audio[i:i + 1], 2, 0)}
        np.testing.assert_array_equal(mouths[i], session.run(None, pair)[0][0])
    assert header["shape"] == [3, 320, 320] and header["worker"] == {"device": "cpu", "index": 0}


def test_req_socket_client(server):
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        audio = np.zeros((2, 32, 16, 16), np.float32)
        sock.send_multipart([json.dumps({"op": "composite", "id": "r1", "model": "a", "batch": 2,
                                         "format": "png"}).encode(), audio.tobytes()])
        assert sock.poll(60_000)
        header, *images = sock.recv_multipart()
        header = json.loads(header)
        assert header["ok"] and header["id"] == "r1" and len(images) == 2
        sock.send_multipart([b'{"op": "health", "id": 7}'])
        assert sock.poll(10_000) and json.loads(sock.recv())["id"] == 7
    finally:
        sock.close()


def test_dealer_with_32_requests_in_flight(server):
    async def main():
        async with AsyncClient(server.endpoint) as client:
            audio = np.random.default_rng(5).standard_normal((2, 32, 16, 16)).astype(np.float32)
            replies = await asyncio.gather(*(client.composite("a", audio, start_frame=k, format="jpeg")
                                             for k in range(32)))
        return replies

    replies = asyncio.run(main())
    for k, (header, images) in enumerate(replies):
        assert header["frames"] == [mirror_index(k, N_FRAMES), mirror_index(k + 1, N_FRAMES)]
        assert len(images) == 2


def test_load_unload_and_stats(server):
    with server.client() as c:
        loaded = c.load("h")
        assert loaded["model"] == "h" and loaded["loaded_on"] == [0]
        assert c.health()["models_loaded"]["h"] == [0]
        stats = c.stats()
        assert stats["models"]["h"]["loads"] >= 1
        assert {"requests", "frames", "errors", "evictions", "inference_ms_p50", "inference_ms_p99"} <= set(stats["models"]["h"])
        assert c.unload("h")["loaded_on"] == []
        assert "h" not in c.health()["models_loaded"]
        with pytest.raises(ServerError) as err:
            c.load("broken")
        assert err.value.code in ("bad_request", "unknown_model") and "broken" in err.value.message


def test_unload_takes_up_replaced_model_files(server, models):
    """An avatar retrained and rewritten on disk: after `unload`, the next request serves the new files
    (new model, frames, size and frame count), with no restart and no stale decoded frame."""
    audio = np.random.default_rng(3).standard_normal((3, 32, 16, 16)).astype(np.float32)
    make_avatar(models, "swap", n_frames=3, size=(320, 240), seed=1)
    with server.client() as c:
        header, images = c.composite("swap", audio, format="raw")
        _, expected = expected_frames(models, "swap", audio, 0, 3)
        for image, want in zip(images, expected):
            np.testing.assert_array_equal(decode_image(image, "raw", header), want)
        shutil.rmtree(models / "swap")
        make_avatar(models, "swap", n_frames=4, size=(256, 192), seed=9)
        assert c.unload("swap")["loaded_on"] == []
        assert next(m for m in c.models() if m["id"] == "swap")["frames"] == 4
        header, images = c.composite("swap", audio, start_frame=2, format="png")
        assert (header["width"], header["height"]) == (256, 192) and header["frames"] == [2, 3, 3]
        _, expected = expected_frames(models, "swap", audio, 2, 3)
        for image, want in zip(images, expected):
            np.testing.assert_array_equal(decode_image(image, "png", header), want)
        c.unload("swap")

VISUAL1 = np.zeros((1, 6, 320, 320), np.float32).tobytes()
AUDIO1 = np.zeros((1, 32, 16, 16), np.float32).tobytes()
BAD_INPUTS = [
    ("malformed JSON", [b"{not json"], "bad_request", "JSON"),
    ("header not an object", [b"[1, 2]"], "bad_request", "JSON object"),
    ("unknown op", [b'{"op": "dance", "id": 1}'], "bad_request", "unknown op"),
    ("missing op", [b'{"id": 1}'], "bad_request", "op"),
    ("extra header key", [b'{"op": "health", "colour": "red"}'], "bad_request", "colour"),
    ("no frames", [b'{"op": "composite", "model": "a", "batch": 1}'], "bad_request", "payload"),
    ("extra frames", [b'{"op": "composite", "model": "a", "batch": 1}', VISUAL1, AUDIO1, AUDIO1], "bad_request", "payload"),
    ("infer without visual", [b'{"op": "infer", "model": "a", "batch": 1}', AUDIO1], "bad_request", "payload"),
    ("frames on health", [b'{"op": "health"}', AUDIO1], "bad_request", "payload"),
    ("wrong audio size", [b'{"op": "composite", "model": "a", "batch": 1}', AUDIO1[:-4]], "bad_request", "audio"),
    ("wrong visual size", [b'{"op": "composite", "model": "a", "batch": 1}', VISUAL1[:100], AUDIO1], "bad_request", "visual"),
    ("batch 0", [b'{"op": "composite", "model": "a", "batch": 0}', AUDIO1], "bad_request", "batch"),
    ("batch max+1", [json.dumps({"op": "composite", "model": "a", "batch": MAX_BATCH + 1}).encode(), AUDIO1],
     "bad_request", "limits.max_batch"),
    ("missing batch", [b'{"op": "composite", "model": "a"}', AUDIO1], "bad_request", "batch"),
    ("non-numeric batch", [b'{"op": "composite", "model": "a", "batch": "two"}', AUDIO1], "bad_request", "batch"),
    ("non-numeric quality", [b'{"op": "composite", "model": "a", "batch": 1, "quality": "hi"}', AUDIO1],
     "bad_request", "quality"),
    ("quality out of range", [b'{"op": "composite", "model": "a", "batch": 1, "quality": 0}', AUDIO1],
     "bad_request", "quality"),
    ("bad format", [b'{"op": "composite", "model": "a", "batch": 1, "format": "gif"}', AUDIO1], "bad_request", "format"),
    ("negative start_frame", [b'{"op": "composite", "model": "a", "batch": 1, "start_frame": -1}', AUDIO1],
     "bad_request", "start_frame"),
    ("unknown model", [b'{"op": "composite", "model": "nobody", "batch": 1}', AUDIO1], "unknown_model", "nobody"),
    ("invalid model id", [b'{"op": "composite", "model": "../x", "batch": 1}', AUDIO1], "bad_request", "model"),
    ("missing model", [b'{"op": "load"}'], "bad_request", "model"),
    ("broken model", [b'{"op": "composite", "model": "broken", "batch": 1}', AUDIO1], "bad_request", "broken"),
]


@pytest.mark.parametrize("name, frames, code, hint", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_exactly_one_typed_error(server, name, frames, code, hint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([b"", *frames])
        assert sock.poll(30_000), f"no reply to {name}"
        reply = sock.recv_multipart()
        assert reply[0] == b"" and len(reply) == 2, "an error carries no data frames"
        header = json.loads(reply[1])
        assert header["ok"] is False and header["error"]["code"] == code, header
        assert hint.lower() in header["error"]["message"].lower(), header
        assert not sock.poll(300), "a second reply arrived"
    finally:
        sock.close()
    assert server.health()["status"] == "ready"


def test_error_echoes_the_request_id(server):
    with server.client() as c:
        header, _ = c.request("health")
        with pytest.raises(ServerError) as err:
            c.request("composite", [AUDIO1], model="a", batch=0)
    assert err.value.reply["id"] is not None and header["ok"]


def test_preloaded_backgrounds_are_store_hits(server):
    # Model "h" is in compositing.preload and never used before this test: every lookup must hit.
    deadline, compositors = time.monotonic() + 60, len(server.pids("cpu"))
    while server.log.read_text().count("compositing.preload: done") < compositors:   # each one's share
        assert time.monotonic() < deadline, "the compositors never finished compositing.preload"
        time.sleep(0.1)
    with server.client() as c:
        c.composite("h", np.zeros((3, 32, 32, 32), np.float32), format="raw")
        assert c.stats("h")["store"]["h"] == {"hits": 3, "misses": 0}


def test_prometheus_metrics(server):
    with server.client() as c:
        c.composite("a", np.zeros((2, 32, 16, 16), np.float32))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server_metrics_port[0]}/metrics", timeout=10).read().decode()
    for name in ("lipsync_requests_total", "lipsync_latency_ms_bucket", "lipsync_queue_depth",
                 "lipsync_models_loaded", "lipsync_model_events_total", "lipsync_model_load_ms_bucket",
                 "lipsync_background_cache_total", "lipsync_shm_slots_in_use", "lipsync_frames_total"):
        assert name in body, name
    assert 'lipsync_requests_total{model="a",op="composite",outcome="ok"}' in body
    assert 'stage="inference"' in body and 'stage="composite"' in body


def test_raw_frames_return_their_image_slots(server):
    """Raw frames leave from the compositors' image rings (2 slots each here): many more requests than
    slots, in a row and at once, all succeed only if every slot comes back."""
    audio = np.zeros((3, 32, 16, 16), np.float32)
    with server.client() as c:
        for k in range(6):
            header, images = c.composite("a", audio, start_frame=k, format="raw")
            assert len(images) == 3 and len(images[0]) == SIZE[0] * SIZE[1] * 3

    async def burst():
        async with AsyncClient(server.endpoint) as client:
            return await asyncio.gather(*(client.composite("a", audio, start_frame=k, format="raw") for k in range(12)))

    assert all(len(images) == 3 for _, images in asyncio.run(burst()))


def test_client_cli(server, tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "lipsync_client", "--endpoint", server.endpoint, *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(cli("health"))["status"] == "ready"
    assert "a" in {m["id"] for m in json.loads(cli("models"))}
    out = tmp_path / "frames"
    cli("composite", "a", "--batch", "3", "--format", "png", "--out", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["frame_00000.png", "frame_00001.png", "frame_00002.png"]
    bench = json.loads(cli("bench", "--models", "a", "--count", "6", "--batch", "2", "--concurrency", "2", "--json"))
    assert bench["requests"] == 6 and not bench["errors"] and bench["frames_per_s"] > 0
    assert set(bench["latency_ms"]) == {"p50", "p90", "p99"}
    bad = subprocess.run([sys.executable, "-m", "lipsync_client", "--endpoint", server.endpoint, "load", "nobody"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown_model" in bad.stderr


def test_models_over_many_directories_answers_at_once_and_fills_in(tmp_path):
    """`models` never waits for thousands of unread model directories: it lists every id at once,
    the unread ones `pending`, and reads them in the background (bench: python -m bench catalog)."""
    import os

    src = make_avatar(tmp_path, "m0000", n_frames=2)
    for i in range(1, 1500):
        d = tmp_path / f"m{i:04d}"
        (d / "frames").mkdir(parents=True)
        for name in ("model.onnx", "crop_rects.json", "frames/0.png", "frames/1.png"):
            os.link(src / name, d / name)
    with run_server(tmp_path, base_config(tmp_path)) as srv, srv.client() as c:
        header, _ = c.request("models")
        first = header["models"]
        assert [m["id"] for m in first] == [f"m{i:04d}" for i in range(1500)]
        assert all(m["pending"] or m["frames"] == 2 for m in first)
        assert header["ok"] and c.health()["status"] == "ready"
        complete = c.models()   # waits for the pending ones
        assert all(not m["pending"] and m["frames"] == 2 and m["audio_shape"] == [32, 16, 16] for m in complete)


def test_a_reader_takes_a_burst_in_turns_and_nothing_once_closed():
    """The frontend's socket readers (server/process.Reader), on a real event loop and a real fd: a
    burst (`take` stops at its limit) goes on in a later turn of the loop, not in one go; a closed
    reader (a draining frontend reads no more requests) takes nothing, though every pass of sends
    wakes each reader in case a send took its socket's fd edge."""
    import os
    from frontend.server.process import Reader

    async def main():
        r, w = os.pipe()
        left = [3]   # a burst of three takes' worth

        def take() -> bool:
            taken.append(left[0])
            left[0] = max(left[0] - 1, 0)
            return left[0] == 0
        taken: list = []
        reader = Reader(r, take)
        assert taken == [3], "what came before the fd was watched is taken at once, one take a turn"
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert taken == [3, 2, 1]
        reader.wake()
        assert taken == [3, 2, 1, 0]
        reader.close()
        reader.wake()
        os.write(w, b"x")
        await asyncio.sleep(0.01)
        assert taken == [3, 2, 1, 0], "a closed reader takes nothing"
        os.close(r), os.close(w)

    asyncio.run(main())
