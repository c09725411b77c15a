"""Hostile clients and broken tenant files against one real server: every request gets exactly one typed
reply, nothing leaks, and no process dies (the pids before and after are the same)."""

from __future__ import annotations

import json
import shutil
import struct
import time
import zlib

import msgspec
import numpy as np
import onnx
import pytest
import zmq
from onnx import TensorProto, helper

from config.audio import frame_count
from frontend.server.validate import parse_header
from gpu_actor.model_builder import write_audio_encoder
from lipsync_client.protocol import RequestHeader
from tests.helpers import base_config, free_port, make_avatar, run_server

pytestmark = pytest.mark.slow
AUDIO1 = np.zeros((1, 32, 16, 16), np.float32).tobytes()


def write_failing_model(path) -> None:
    """Valid I/O, but `Reshape`s its output to the shape in audio[0, 0, 0, :4]: all-zero audio keeps the
    shape (ONNX copies a 0 dim), any other values make onnxruntime fail at run time."""
    nodes = [
        helper.make_node("Constant", [], ["flat"], value=helper.make_tensor("f", TensorProto.INT64, [1], [-1])),
        helper.make_node("Reshape", ["audio", "flat"], ["a1"]),
        helper.make_node("Constant", [], ["s0"], value=helper.make_tensor("s0v", TensorProto.INT64, [1], [0])),
        helper.make_node("Constant", [], ["s4"], value=helper.make_tensor("s4v", TensorProto.INT64, [1], [4])),
        helper.make_node("Constant", [], ["s3"], value=helper.make_tensor("s3v", TensorProto.INT64, [1], [3])),
        helper.make_node("Constant", [], ["ax1"], value=helper.make_tensor("ax1v", TensorProto.INT64, [1], [1])),
        helper.make_node("Slice", ["a1", "s0", "s4"], ["a4"]),
        helper.make_node("Cast", ["a4"], ["shape"], to=TensorProto.INT64),
        helper.make_node("Slice", ["input", "s0", "s3", "ax1"], ["rgb"]),
        helper.make_node("Reshape", ["rgb", "shape"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "fails_on_loud_audio",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["b", 6, 320, 320]),
                               helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["b", 32, 16, 16])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["b", 3, 320, 320])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header (with a correct CRC) claims width x height; its pixel data is tiny."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + data)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "a", n_frames=4)
    write_audio_encoder(make_avatar(root, "speaks", n_frames=4) / "audio_encoder.onnx")
    write_audio_encoder(make_avatar(root, "hubert", n_frames=2, audio="hubert") / "audio_encoder.onnx")
    make_avatar(root, "shrinks", n_frames=6, seed=1)
    for name, value in (("nan", "NaN"), ("huge", "1e300"), ("bigint", "1" + "0" * 40)):
        d = make_avatar(root, name, n_frames=2)
        (d / "crop_rects.json").write_text('{"0": {"rect": [10, 10, 100, 100]}, "1": {"rect": [%s, 10, 100, 100]}}'
                                           % value)
    bomb = make_avatar(root, "bomb", n_frames=2)
    (bomb / "frames" / "0.png").write_bytes(png_claiming(60000, 60000))
    failing = make_avatar(root, "fails", n_frames=2)
    write_failing_model(failing / "model.onnx")
    garbled = make_avatar(root, "garbled", n_frames=2)
    (garbled / "frames" / "1.png").write_bytes(b"\x89PNG but not really")   # (frame 0 gives the size)
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    # The broken avatars are preloaded too: before, a NaN rect crash-looped every compositor.
    cfg = base_config(models, **{"compositing.preload": ["nan", "huge", "bomb", "a"]})
    cfg["limits"]["max_message_bytes"] = 5 << 20
    cfg["limits"]["max_client_backlog_bytes"] = 4 << 20
    cfg["limits"]["queue_depth"] = 64
    cfg["metrics"]["port"] = free_port()
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        srv.metrics_port = cfg["metrics"]["port"]
        srv.initial_pids = _pids(srv)
        yield srv
        assert _pids(srv) == srv.initial_pids, "a process died (and was restarted) during these tests"


def _pids(srv) -> dict:
    return {(p["role"], p["index"]): p["pid"] for p in srv.health()["processes"]}


def _ask(server, frames: list, timeout_ms: int = 30_000) -> list[dict]:
    """Send one raw request; return every reply header that arrives (a correct server sends one)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([b"", *frames])
        replies = []
        while sock.poll(timeout_ms if not replies else 300):
            reply = sock.recv_multipart()
            replies.append(json.loads(reply[1]))
        return replies
    finally:
        sock.close()


def _error(replies: list[dict]) -> dict:
    assert len(replies) == 1, f"expected exactly one reply, got {replies}"
    assert replies[0]["ok"] is False, replies[0]
    return replies[0]["error"]


@pytest.mark.parametrize("name", ["nan", "huge", "bigint"])
def test_bad_numbers_in_crop_rects_name_the_model_and_file(server, name):
    err = _error(_ask(server, [json.dumps({"op": "composite", "model": name, "batch": 1}).encode(), AUDIO1]))
    assert err["code"] == "bad_request", err
    assert "crop_rects.json" in err["message"] and "index 1" in err["message"] and name in err["message"], err


def test_an_image_whose_header_claims_a_huge_size_is_refused_before_decoding(server):
    err = _error(_ask(server, [b'{"op": "composite", "model": "bomb", "batch": 1}', AUDIO1]))
    assert err["code"] == "bad_request" and "60000x60000" in err["message"], err
    assert "compositing.max_frame_width" in err["message"], err


def test_avatar_replaced_by_fewer_frames_fails_that_request_only(server, models):
    with server.client() as c:
        # Only the frontend reads the files now (as `models` does); the workers read them on first use,
        # after the change: they find 3 frames where the frontend counted 6.
        assert next(m for m in c.models() if m["id"] == "shrinks")["frames"] == 6
        for k in (3, 4, 5):
            (models / "shrinks" / "frames" / f"{k}.png").unlink()
        shutil.copy(models / "a" / "crop_rects.json", models / "shrinks" / "crop_rects.json")
        # The server still believes in 6 frames (no `unload` yet): frame 5 is gone.
        replies = _ask(server, [b'{"op": "composite", "model": "shrinks", "batch": 1, "start_frame": 4}', AUDIO1])
        err = _error(replies)
        assert err["code"] == "bad_request" and "shrinks" in err["message"], err
        c.unload("shrinks")
        header, images = c.composite("shrinks", np.zeros((2, 32, 16, 16), np.float32), start_frame=4)
        assert header["ok"] and len(images) == 2


def test_a_frame_file_that_does_not_decode_is_a_bad_request_named_at_once(server):
    """A request on it is answered bad_request, naming the file, well before its deadline (the worker
    once decoded it again and again until then); its other frame still serves."""
    started = time.monotonic()
    err = _error(_ask(server, [b'{"op": "composite", "model": "garbled", "batch": 1, "start_frame": 1, '
                               b'"timeout_ms": 60000}', AUDIO1]))
    assert err["code"] == "bad_request" and "garbled" in err["message"] and "1.png" in err["message"], err
    assert time.monotonic() - started < 30, "answered only at its deadline"
    with server.client() as c:
        assert c.composite("garbled", np.zeros((1, 32, 16, 16), np.float32), start_frame=0)[0]["ok"]


@pytest.mark.parametrize("fmt", ["jpeg", "h264"])
def test_a_session_on_an_avatar_whose_frames_do_not_decode_is_refused_as_a_bad_request(server, fmt):
    """Its idle frames cannot be rendered: session_open says so, naming the file, as bad_request (a retry
    cannot help: the avatar's files need fixing), not unavailable."""
    err = _error(_ask(server, [json.dumps({"op": "session_open", "model": "garbled", "format": fmt}).encode()]))
    assert err["code"] == "bad_request", err
    assert "could not be rendered" in err["message"] and "1.png" in err["message"], err


def test_a_model_that_fails_at_run_time_fails_only_its_request(server):
    loud = np.full((1, 32, 16, 16), 7, np.float32).tobytes()
    err = _error(_ask(server, [b'{"op": "composite", "model": "fails", "batch": 1}', loud]))
    assert err["code"] == "internal" and "fails" in err["message"], err
    with server.client() as c:
        assert c.composite("fails", np.zeros((1, 32, 16, 16), np.float32))[0]["ok"]
        assert c.stats("fails")["models"]["fails"]["errors"] >= 1


@pytest.mark.parametrize("model", ["a\n", "a\r\n", "../a", "a/b"])
def test_model_ids_with_path_or_line_tricks_are_refused(server, model):
    err = _error(_ask(server, [json.dumps({"op": "composite", "model": model, "batch": 1}).encode(), AUDIO1]))
    assert err["code"] == "bad_request" and "model" in err["message"], err


def test_an_id_that_cannot_be_encoded_back_still_gets_one_reply_and_leaks_nothing(server):
    # JSON allows a lone surrogate escape; UTF-8 cannot carry it back. More of them than the worker's
    # input slots (shm.slots = 2): a leak would leave every later request waiting for a slot.
    header = b'{"op": "composite", "id": "\\ud800", "model": "a", "batch": 1}'
    for _ in range(4):
        err = _error(_ask(server, [header, AUDIO1]))
        assert err["code"] == "bad_request" and "id" in err["message"], err
    with server.client(timeout_s=20) as c:
        assert c.composite("a", np.zeros((1, 32, 16, 16), np.float32))[0]["ok"]


@pytest.mark.parametrize("raw", [
    b'{"op": "session_audio", "id": 7, "session": "abc", "utterance": 2}', b'{"op": "health", "op": "models"}',
    b'\xef\xbb\xbf{"op": "health"}', '{"op": "health", "id": "\u00e9"}'.encode("utf-16"),
    b'{"op": "health", "id": 123456789012345678901234567890}', b'{"op": "session_audio", "session": "\\ud800"}',
    b'{"op": "session_open", "model": "a", "fps": 25}',
], ids=["audio", "duplicate key", "BOM", "UTF-16", "big id", "surrogate session", "int fps"])
def test_a_header_reads_the_same_whichever_way_it_is_parsed(raw):
    # parse_header decodes a valid header in one step (msgspec) and falls back to json + convert: both
    # must read a header alike
    assert parse_header(raw) == msgspec.convert(json.loads(raw), RequestHeader, strict=True)


def _pcm(frames: int) -> bytes:
    """The shortest 16 kHz utterance (int16, silence) that gives `frames` frames."""
    return b"\0\0" * next(n for n in range(0, 100_000, 40) if frame_count(n) >= frames)


MODEL_A = {"op": "composite", "model": "a", "batch": 1}
PCM = {"op": "composite", "model": "speaks", "audio_format": "pcm16"}


@pytest.mark.parametrize("header, payload, hint", [
    ({"op": "composite", "batch": 1}, [AUDIO1], "header.model: required"),
    ({"op": "composite", "model": "a"}, [AUDIO1], "header.batch: required"),
    ({**MODEL_A, "batch": 9}, [AUDIO1], "header.batch: 9 is more than limits.max_batch (8)"),
    ({"op": "infer", "model": "a", "batch": 1}, [AUDIO1], "op infer takes 2 (visual, audio)"),
    ({"op": "session_audio"}, [AUDIO1], "header.session: required"),
    ({"op": "session_audio", "session": "x"}, [AUDIO1, AUDIO1], "op session_audio takes 1 (audio)"),
    ({"op": "health"}, [b"x"], "op health takes no frames after the header"),
    ({**MODEL_A, "return_audio": True}, [AUDIO1], "header.return_audio"),
    ({**MODEL_A, "format": "png", "quality": 80}, [AUDIO1], "header.quality"),
    ({**MODEL_A, "format": "h264"}, [AUDIO1], "header.format: h264 is for live sessions"),
    ({**MODEL_A, "webrtc": True}, [AUDIO1], "header.webrtc"),
    ({**MODEL_A, "sample_rate": 24000}, [AUDIO1], "header.sample_rate"),
    ({**MODEL_A, "utterance": 1}, [AUDIO1], "header.utterance"),
    ({**MODEL_A, "pixel_format": "rgb24"}, [AUDIO1], "header.pixel_format"),
    ({**MODEL_A, "batch": 2}, [b"\0" * 10, AUDIO1], "payload[0] (visual): 10 bytes"),
    ({**MODEL_A, "batch": 2}, [AUDIO1[:100]], "payload[0] (audio): 100 bytes"),
    ({"op": "composite", "model": "a", "audio_format": "pcm16"}, [_pcm(2)], "has no audio encoder"),
    ({**PCM, "model": "hubert"}, [_pcm(2)], "takes [32, 32, 32] feature windows (hubert or wenet)"),
    (PCM, [_pcm(2) + b"\0"], "2 bytes per sample"),
    (PCM, [b"\0" * 200], "an utterance needs at least"),
    ({**PCM, "batch": 3}, [_pcm(2)], "header.batch: 3, but"),
    (PCM, [_pcm(9)], "split the utterance"),
    (PCM, [b"\0" * 10, _pcm(2)], f"for the {frame_count(len(_pcm(2)) // 2)} frames this PCM gives"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_malformed_request_is_refused_saying_what_to_fix(server, header, payload, hint):
    err = _error(_ask(server, [json.dumps(header).encode(), *payload]))
    assert err["code"] == "bad_request" and hint in err["message"], err


def test_deeply_nested_json_is_a_bad_request(server):
    err = _error(_ask(server, [b"[" * 100_000 + b"]" * 100_000]))
    assert err["code"] == "bad_request", err


@pytest.mark.parametrize("frames, hint", [
    ([b'{"op": "health"}'] + [b"x"] * 5000, "5001 frames"),
    ([b'{"op": "health", "id": "' + b" " * (2 << 20) + b'"}'], "limits.max_header_bytes"),
    ([b'{"op": "health"}'] + [b"x" * (3 << 20)] * 2, "limits.max_message_bytes"),
], ids=["5000 frames", "2 MiB header", "6 MiB in all"])
def test_oversized_messages_are_refused_before_parsing(server, frames, hint):
    err = _error(_ask(server, frames))
    assert err["code"] == "bad_request" and hint in err["message"], err


def test_a_model_whose_files_never_answer_does_not_hold_other_clients_up(server, models):
    """crop_rects.json is a FIFO nobody writes: reading it blocks for good. Other clients are served
    meanwhile, and the request itself gets `timeout` at its deadline."""
    import os
    import threading
    import time

    d = make_avatar(models, "fifo", n_frames=2)
    (d / "crop_rects.json").unlink()
    os.mkfifo(d / "crop_rects.json")
    def serve_another() -> float:
        start = time.monotonic()
        with server.client(timeout_s=60) as c:
            assert c.health()["status"] == "ready"
            assert c.composite("a", np.zeros((1, 32, 16, 16), np.float32))[0]["ok"]
        return time.monotonic() - start

    # The blocked request's deadline: far longer than serving the other client takes here.
    timeout_s = 3.0 + 30 * max(serve_another() for _ in range(2))
    try:
        answer = {}
        header = json.dumps({"op": "composite", "model": "fifo", "batch": 1, "timeout_ms": int(timeout_s * 1000)})

        def blocked_request():
            answer["replies"] = _ask(server, [header.encode(), AUDIO1], timeout_ms=int(timeout_s * 1000) + 30_000)
            answer["at"] = time.monotonic()

        blocked = threading.Thread(target=blocked_request)
        blocked.start()
        time.sleep(0.3)   # it reaches the server (if not, the other client is served first all the same)
        serve_another()
        served_at = time.monotonic()
        blocked.join(timeout_s + 60)
        err = _error(answer["replies"])
        assert err["code"] == "timeout" and "fifo" in err["message"], err
        assert served_at < answer["at"], "other clients were served only after the blocked read gave up"
    finally:
        fd = os.open(d / "crop_rects.json", os.O_WRONLY | os.O_NONBLOCK)   # release the blocked reader
        os.write(fd, b"[]")
        os.close(fd)
        shutil.rmtree(d)


def test_unknown_model_ids_share_one_metrics_label(server):
    import urllib.request

    for k in range(5):
        _ask(server, [json.dumps({"op": "composite", "model": f"nobody{k}", "batch": 1}).encode(), AUDIO1])
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'model="_other"' in body and "nobody" not in body


def test_a_client_that_stops_reading_is_bounded_and_holds_no_one_up(server):
    """A client sends 60 raw requests (110 MB of replies) and reads nothing: its unread replies stay
    under limits.max_client_backlog_bytes (the rest are dropped and counted), the frontend's memory
    does not grow with them, and another client's raw requests are served meanwhile."""
    import time
    import urllib.request

    import psutil

    def metric(name: str) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + " "))

    frontend = psutil.Process(next(p for (role, _), p in server.initial_pids.items() if role == "frontend"))
    rss_before, dropped_before = frontend.memory_info().rss, metric("lipsync_replies_dropped_total")
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.DEALER)
    stalled.setsockopt(zmq.RCVHWM, 1)             # libzmq itself stops taking replies off the wire
    stalled.setsockopt(zmq.RCVBUF, 64 * 1024)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.connect(server.endpoint)
    try:
        header = json.dumps({"op": "composite", "model": "a", "batch": 8, "format": "raw"}).encode()
        for _ in range(60):
            stalled.send_multipart([b"", header, np.zeros((32, 16, 16), np.float32).tobytes()])
        deadline = time.monotonic() + 60
        while metric("lipsync_replies_dropped_total") - dropped_before < 40:
            assert time.monotonic() < deadline, "replies to a client that reads nothing were not dropped"
            time.sleep(0.2)
        with server.client(timeout_s=20) as c:
            for _ in range(3):
                header_ok, images = c.composite("a", np.zeros((8, 32, 16, 16), np.float32), format="raw")
                assert header_ok["ok"] and len(images) == 8
        grown = frontend.memory_info().rss - rss_before
        assert grown < 40 << 20, f"the frontend grew by {grown >> 20} MiB holding unread replies"
    finally:
        stalled.close()
        ctx.term()


def test_clients_that_stop_reading_are_bounded_all_together(models, tmp_path):
    """limits.max_backlog_bytes bounds every connection's unread replies together: three clients that
    each stay under their own bound (256 MiB) but read nothing get their replies dropped and counted
    once the sum passes 8 MiB, and a client that reads is still served.
    (The kernel's socket buffers hold some unread bytes too: those have left the server's memory.)"""
    import time
    import urllib.request

    cfg = base_config(models)
    cfg["limits"]["max_backlog_bytes"] = 8 << 20
    cfg["limits"]["queue_depth"] = 64   # all 60 requests are taken (none refused overloaded)
    cfg["metrics"]["port"] = free_port()

    def dropped() -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{cfg['metrics']['port']}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("lipsync_replies_dropped_total "))

    with run_server(tmp_path, cfg) as srv:
        ctx = zmq.Context()
        stalled = []
        try:
            # PNG, not raw: raw replies also hold compositors' image slots, which bound them first
            header = json.dumps({"op": "composite", "model": "a", "batch": 8, "format": "png"}).encode()
            for _ in range(3):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.RCVHWM, 1)
                sock.setsockopt(zmq.RCVBUF, 64 * 1024)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(srv.endpoint)
                stalled.append(sock)
                for _ in range(20):   # 8 PNGs, 1.4 MB: 28 MB unread per client, 84 MB in all
                    sock.send_multipart([b"", header, np.zeros((32, 16, 16), np.float32).tobytes()])
            deadline = time.monotonic() + 60
            while dropped() < 30:
                assert time.monotonic() < deadline, f"only {dropped():g} replies dropped: unread bytes are not bounded"
                time.sleep(0.2)
        finally:
            for sock in stalled:
                sock.close()
            ctx.term()
        with srv.client(timeout_s=20) as c:
            ok, images = c.composite("a", np.zeros((8, 32, 16, 16), np.float32), format="raw")
            assert ok["ok"] and len(images) == 8
