"""Live sessions over real processes: pacing, idle and speech pixels, features-mode windows, interrupt,
close, disconnect, a killed inference worker, a client that does not read, admission."""

from __future__ import annotations

import inspect
import json
import os
import signal
import time

import cv2
import numpy as np
import pytest
import zmq

from config import audio as A
from lipsync_client import ServerError
from lipsync_client import Session
from gpu_actor.model_builder import write_audio_encoder
from tests.helpers import base_config, decode_image, frames_until, free_port, make_avatar, mirror_index, run_server

pytestmark = pytest.mark.slow
N_FRAMES = 5
FPS = 25.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_audio_encoder(make_avatar(root, "a", n_frames=N_FRAMES) / "audio_encoder.onnx", seed=2)
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    # A generous latency budget: on a loaded test machine every speech frame is still ready in time,
    # so that pixels can be compared frame by frame (pacing under load is the bench's business).
    cfg = base_config(models, sessions={"latency_budget_ms": 1200, "max_sessions": 3, "start_delay_ms": 300,
                                        "max_queued_frames": 10}, metrics={"port": free_port()})
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        srv.metrics_port = cfg["metrics"]["port"]
        yield srv


def background(models, k: int) -> np.ndarray:
    return cv2.imread(str(models / "a" / "frames" / f"{k}.png"))


def test_frames_are_paced_in_order_and_idle_frames_are_the_background(server, models):
    with Session(server.endpoint, "a", format="png", start_frame=3) as s:
        assert s.info["fps"] == FPS and (s.info["width"], s.info["height"]) == (320, 240)
        got = frames_until(s, 2 * int(FPS))
    indices = [h["index"] for _, h, _ in got]
    assert indices == list(range(len(indices))), "frames left out of order or with gaps"
    # Paced in real time by the stream's own count: 40 ms apart, not in bursts, and 2 s for 50 frames.
    arrivals = [t for t, _, _ in got]
    assert 0.75 / FPS < np.median(np.diff(arrivals)) < 1.25 / FPS, np.median(np.diff(arrivals))
    span = (len(got) - 1) / FPS
    assert 0.8 * span < arrivals[-1] - arrivals[0] < 1.2 * span, (arrivals[-1] - arrivals[0], span)
    for _, header, image in got[:12]:
        assert header["kind"] == "idle" and header["pts_ms"] == header["index"] * 40
        k = mirror_index(3 + header["index"], N_FRAMES)
        assert header["frame"] == k
        np.testing.assert_array_equal(decode_image(image, "png", {}), background(models, k))


def test_speech_frames_equal_the_batch_api_for_the_same_audio_and_frame(server):
    windows = np.random.default_rng(3).standard_normal((6, 32, 16, 16)).astype(np.float32)
    with Session(server.endpoint, "a", format="png") as s:
        frames_until(s, 0)   # the stream has started
        reply = s.send_audio(windows)
        assert reply["frames"] == 6
        got = {h["index"]: (h, img) for _, h, img in frames_until(s, reply["first_frame"] + 5) if h["kind"] == "speech"}
    first = reply["first_frame"]
    assert sorted(got) == list(range(first, first + 6)), sorted(got)
    with server.client() as c:
        for i, k in enumerate(range(first, first + 6)):
            header, image = got[k]
            _, (want,) = c.composite("a", windows[i:i + 1], start_frame=header["frame"], format="png")
            np.testing.assert_array_equal(decode_image(image, "png", {}), decode_image(want, "png", {}))


def get_audio_features(features: np.ndarray, index: int) -> np.ndarray:
    """SyncTalk_2D's window, written out as its inference script does: rows index-8 .. index+7, zero-padded."""
    left, right, pad_left, pad_right = index - 8, index + 8, 0, 0
    if left < 0:
        pad_left, left = -left, 0
    if right > features.shape[0]:
        pad_right, right = right - features.shape[0], features.shape[0]
    auds = features[left:right]
    return np.concatenate([np.zeros((pad_left, features.shape[1]), np.float32), auds,
                           np.zeros((pad_right, features.shape[1]), np.float32)])


def test_features_mode_builds_synctalk_windows(server):
    features = np.random.default_rng(5).standard_normal((12, 512)).astype(np.float32)
    with Session(server.endpoint, "a", format="png", audio="features") as s:
        assert s.info["feature_shape"] == [512]
        frames_until(s, 0)   # the stream has started
        first = s.send_audio(features[:5])["first_frame"]
        assert s.send_audio(features[5:], last=True)["first_frame"] == first + 5   # contiguous
        got = {h["index"]: (h, img) for _, h, img in frames_until(s, first + 11) if h["kind"] == "speech"}
    assert sorted(got) == list(range(first, first + 12))
    with server.client() as c:
        for j in (0, 4, 11):
            header, image = got[first + j]
            window = get_audio_features(features, j).reshape(1, 32, 16, 16)
            _, (want,) = c.composite("a", window, start_frame=header["frame"], format="png")
            np.testing.assert_array_equal(decode_image(image, "png", {}), decode_image(want, "png", {}))


def test_interrupt_drops_unsent_speech_and_close_reports_totals(server):
    with Session(server.endpoint, "a") as s:
        frames_until(s, 0)   # the stream has started
        reply = s.send_audio(np.zeros((40, 32, 16, 16), np.float32))
        dropped = s.interrupt()
        assert 0 < dropped <= 40
        got = frames_until(s, reply["first_frame"] + 39)   # every frame the 40 were due in
        assert sum(h["kind"] == "speech" for _, h, _ in got) <= 40 - dropped
        totals = s.close()
        assert totals["frames_idle"] + totals["frames_speech"] >= len(got)
        assert s.next_frame(timeout_s=0.5) is None, "frames after session_close"
    assert reply["first_frame"] > 0


def test_bad_session_requests_are_refused(server):
    with Session(server.endpoint, "a") as s:
        with pytest.raises(ServerError) as err:
            s.send_audio(np.zeros((3, 7), np.float32))
        assert err.value.code == "bad_request" and "[n, 32, 16, 16]" in err.value.message
        with pytest.raises(ServerError) as err:
            s.send_audio(np.zeros((500, 32, 16, 16), np.float32))
        assert err.value.code == "bad_request" and "sessions.max_chunk_frames" in err.value.message
    with server.client() as c, pytest.raises(ServerError) as err:
        c.request("session_stats", session="nope")
    assert err.value.code == "bad_request" and "no open session" in err.value.message


def test_admission_past_max_sessions_is_busy(server):
    sessions = [Session(server.endpoint, "a") for _ in range(3)]
    try:
        with pytest.raises(ServerError) as err:
            Session(server.endpoint, "a")
        assert err.value.code == "busy" and "sessions.max_sessions" in err.value.message
        assert err.value.retry_after_s > 0
    finally:
        for s in sessions:
            s.__exit__(None, None, None)


def test_an_async_session_entered_twice_is_one_session(server):
    """`async with` on a session that is open already does not open a second one behind the caller's
    back (sessions.max_sessions is 3: two more must still get in)."""
    import asyncio

    from lipsync_client import AsyncSession

    async def scenario() -> None:
        s = AsyncSession(server.endpoint, "a")
        async with s:
            token = s.token
            async with s:
                assert s.token == token
                others = [Session(server.endpoint, "a") for _ in range(2)]
                for o in others:
                    o.__exit__(None, None, None)

    asyncio.run(scenario())


def test_a_disconnected_client_closes_its_sessions(server):
    s = Session(server.endpoint, "a")
    s._sock.close(linger=0)   # the client goes away without session_close
    deadline = time.monotonic() + 30
    while True:   # sessions.max_sessions is 3: three new ones open only once the gone client's is closed
        opened = []
        try:
            opened = [Session(server.endpoint, "a") for _ in range(3)]
            break
        except ServerError as err:
            assert err.code == "busy", err
            assert time.monotonic() < deadline, "the session outlived its client"
            time.sleep(0.1)
        finally:
            for o in opened:
                o.__exit__(None, None, None)


def test_only_the_connection_that_opened_a_session_drives_it(server):
    """Another client that knows a session's id can neither drive it nor read it, and learns nothing
    from trying: the answer is the one for an id that does not exist."""
    with Session(server.endpoint, "a") as owner, server.client() as other:
        frames_until(owner, 0)   # the stream has started
        reply = owner.send_audio(np.zeros((25, 32, 16, 16), np.float32))
        for op, payload in [("session_audio", [np.zeros((5, 32, 16, 16), np.float32)]), ("session_interrupt", []),
                            ("session_keyframe", []), ("session_stats", []), ("session_close", [])]:
            messages = []
            for session in (owner.token, "no-such-session"):
                with pytest.raises(ServerError) as err:
                    other.request(op, payload, session=session)
                assert err.value.code == "bad_request" and "no open session" in err.value.message, (op, err.value)
                messages.append(err.value.message.replace(session, "ID"))
            assert messages[0] == messages[1], messages
        speech = [h["index"] for _, h, _ in frames_until(owner, reply["first_frame"] + 24) if h["kind"] == "speech"]
        assert speech == list(range(reply["first_frame"], reply["first_frame"] + 25)), "the owner's speech was cut"
        assert owner.stats()["frames_speech"] == 25


@pytest.mark.parametrize("fps", [0.0001, 0.5, 61])
def test_a_rate_the_stream_cannot_keep_is_refused(server, fps):
    with server.client() as c, pytest.raises(ServerError) as err:
        c.request("session_open", model="a", fps=fps)
    assert err.value.code == "bad_request" and "header.fps" in err.value.message, err.value


def _session_frames(server, *kinds: str) -> float:
    """Live-session frames of `kinds` (idle, speech, dropped...) since the server started, from its metrics."""
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if any(line.startswith(f'lipsync_session_frames_total{{kind="{k}"}}') for k in kinds))


def test_a_client_that_does_not_read_loses_frames_not_memory(server):
    dropped_before, idle_dropped_before = _session_frames(server, "dropped"), _session_frames(server, "idle", "dropped")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 16 * 1024)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([b"", json.dumps({"op": "session_open", "id": 1, "model": "a", "format": "png"}).encode()])
        assert sock.poll(10_000)
        token = json.loads(sock.recv_multipart()[1])["session"]
        # Frames of ~150 KB, far more than the socket buffers hold: wait until the server has sent or
        # dropped 50 of them (its metrics: nothing is read from this connection meanwhile).
        deadline = time.monotonic() + 60
        while _session_frames(server, "dropped") == dropped_before or \
                _session_frames(server, "idle", "dropped") - idle_dropped_before < 50:
            assert time.monotonic() < deadline, "the session neither sent nor dropped 50 frames in 60 s"
            time.sleep(0.1)
        sock.send_multipart([b"", json.dumps({"op": "session_stats", "id": 2, "session": token}).encode()])
        while True:   # its reply comes after the frames still queued for this connection
            assert sock.poll(10_000), "no reply to session_stats"
            stats = json.loads(sock.recv_multipart()[1])
            if stats.get("id") == 2:
                break
        assert stats["dropped"] > 0 and stats["frames_idle"] + stats["dropped"] >= 50, stats
    finally:
        sock.close()
        ctx.term()


def test_a_killed_inference_worker_costs_frames_not_the_stream(server):
    with Session(server.endpoint, "a") as s:
        now = frames_until(s, 0)[-1][1]["index"]
        pid = server.pids("gpu")[0]
        os.kill(pid, signal.SIGKILL)
        s.send_audio(np.zeros((10, 32, 16, 16), np.float32))   # lands while the worker restarts
        got = frames_until(s, now + 3 * int(FPS))
        indices = [h["index"] for _, h, _ in got]
        assert indices == list(range(indices[0], indices[0] + len(indices))), "the stream stalled or skipped"
        assert all(h.get("event") == "frame" for _, h, _ in got)
        deadline = time.monotonic() + 60
        while server.health()["status"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        reply = s.send_audio(np.zeros((5, 32, 16, 16), np.float32))
        speech = [h["index"] for _, h, _ in frames_until(s, reply["first_frame"] + 4) if h["kind"] == "speech"]
        assert speech == list(range(reply["first_frame"], reply["first_frame"] + 5)), speech
        assert s.stats()["missed"] + s.stats()["frames_speech"] >= 10


def test_pcm_in_20_ms_chunks_equals_the_batch_on_the_whole_utterance(server, models):
    """A pcm16 session fed 20-ms chunks: its speech frames are the frames of the whole utterance's
    windows (mel -> encoder -> windows at once), and each frame carries its 40 ms of the PCM sent."""
    import onnxruntime as ort
    from tests.test_audio import speech_like

    pcm = np.clip(np.round(speech_like(1.2, seed=8) * 32767), -32768, 32767).astype("<i2")
    encoder = ort.InferenceSession(str(models / "a" / "audio_encoder.onnx"), providers=["CPUExecutionProvider"])
    windows = A.frame_windows(encoder.run(None, {"mel": A.encoder_inputs(A.melspectrogram(pcm / 32768.0))})[0])
    with Session(server.endpoint, "a", format="png", audio="pcm16") as s:
        frames_until(s, 0)   # the stream has started
        chunks = [pcm[k:k + 320] for k in range(0, len(pcm), 320)]
        replies = [s.send_audio(c, last=i == len(chunks) - 1) for i, c in enumerate(chunks)]
        start = replies[0]["first_frame"]
        assert [r["first_frame"] for r in replies[:4]] == [start, start, start + 1, start + 1]   # 640 samples a frame
        got = {}
        deadline = time.monotonic() + 60   # only a stalled stream takes this long
        while len(got) < len(windows) and time.monotonic() < deadline:
            frame = s.next_frame(timeout_s=1.0)
            if frame is not None and frame[0].get("event") == "frame":
                header, image, audio = frame
                assert audio is not None and len(audio) == 1280
                if header["kind"] == "speech":
                    got[header["index"] - start] = (header, image, audio)
    assert sorted(got) == list(range(len(windows))), sorted(got)
    with server.client() as c:
        for i in (0, 5, len(windows) - 1):
            header, image, audio = got[i]
            _, (want,) = c.composite("a", windows[i:i + 1], start_frame=header["frame"], format="png")
            np.testing.assert_array_equal(decode_image(image, "png", {}), decode_image(want, "png", {}))
            want_audio = pcm.tobytes()[i * 1280:(i + 1) * 1280]
            assert audio == want_audio + bytes(1280 - len(want_audio))


def test_stream_cli_speaks_a_wav_file(server, tmp_path):
    import subprocess
    import sys

    from config.audio import write_speech
    from tests.helpers import ROOT
    wav = write_speech(tmp_path / "speech.wav", seconds=1.5)
    out = subprocess.run([sys.executable, "-m", "lipsync_client", "--endpoint", server.endpoint, "stream", "a",
                          "--seconds", "4", "--duty", "0.9", "--pcm", str(wav)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    speech = int(line.split("(")[1].split(" speech")[0])
    assert speech > 0 and "dropped 0" in line, line


def test_a_host_past_its_cpu_share_answers_busy_and_its_sessions_go_on(models, tmp_path):
    """sessions.max_cpu_load so low that any measured session fills the host: the first sessions are let
    in (unmeasured), then session_open answers busy, with when to retry, naming the cores and the
    setting; the session already open keeps its 25 frames a second."""
    cfg = base_config(models, sessions={"max_cpu_load": 0.0001, "start_delay_ms": 300, "max_queued_frames": 5000})
    with run_server(tmp_path, cfg) as srv, Session(srv.endpoint, "a", format="jpeg") as first:
        opened, refusal = [], None
        try:
            for _ in range(100):   # a handful at most: the ramp lets in a few until their cost is measured
                try:
                    opened.append(Session(srv.endpoint, "a", format="jpeg"))
                except ServerError as err:
                    assert err.code == "busy" and err.retry_after_s > 0, err
                    if "cores" in err.message:
                        refusal = err
                        break
                    assert "measured" in err.message, err
                    time.sleep(err.retry_after_s)   # as the server says
        finally:
            for s in opened:
                s.__exit__(None, None, None)
        assert refusal is not None and "sessions.max_cpu_load" in refusal.message, refusal
        got = frames_until(first, int(FPS))
        got += frames_until(first, got[-1][1]["index"] + int(FPS))   # a second past the refusals
        assert [h["index"] for _, h, _ in got] == list(range(len(got))), "frames dropped or out of order"


def test_after_200_opens_and_closes_all_of_max_sessions_open_again(models, tmp_path):
    """Sessions opened and closed in a row, with one session open throughout (each open loads and warms
    up its model and renders its first idle frames; an idle JPEG session held costs little), paced over
    several of the capacity sampler's windows so that the server measures them while they go on.

    Their opening is not taken for the cost of a session held, and while that cost is not measured (every
    window had opens in it) the ramp counts only the sessions still open: more than the ramp lets in per
    window are opened and closed within one window, and none is refused. Then sessions.max_sessions idle
    sessions open again one after another: a refusal may say their cost is not measured yet, and only
    once as many as the ramp lets in are open (the client waits as the server says), never that the
    cores are full."""
    from frontend.live.capacity import RAMP, Capacity, host_cores
    # the server's Capacity measures over its default window; the server runs on (at most) two of this
    # host's cores, so that the ramp (RAMP a core) is below what the churn opens in a window on any host
    window_s = inspect.signature(Capacity).parameters["window_s"].default
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ramp = max(round(RAMP * min(len(cpus), host_cores())), 1)
    churn, windows = 200, 4
    cfg = base_config(models, sessions={"max_sessions": 25, "max_queued_frames": 10})
    refusals: list = []   # (the refusal, sessions open then)

    def opened(deadline: float, open_now: int) -> Session:
        while True:
            try:
                return Session(srv.endpoint, "a", format="jpeg")
            except ServerError as err:
                assert err.code == "busy" and time.monotonic() < deadline, (err, refusals)
                refusals.append((err, open_now))
                time.sleep(err.retry_after_s)   # as the server says

    with run_server(tmp_path, cfg, prefix=("taskset", "-c", ",".join(map(str, cpus)))) as srv, \
            Session(srv.endpoint, "a", format="jpeg"):
        # the churn over `windows` of the sampler's windows, (sent, answered) for each open let in
        start, times, churn_refused = time.monotonic(), [], []
        for i in range(churn):
            # NOTE: on a schedule, not a sleep after each: a slow open does not slow the churn's pace
            time.sleep(max(start + i * windows * window_s / churn - time.monotonic(), 0.0))
            sent = time.monotonic()
            try:
                with Session(srv.endpoint, "a", format="jpeg"):
                    times.append((sent, time.monotonic()))
            except ServerError as err:
                churn_refused.append((i, err))
        assert not churn_refused, f"{len(churn_refused)} of the churn's opens refused (with at most 2 sessions open; " \
                                  f"the ramp lets in {ramp}), the first: {churn_refused[0]}"
        fastest = min(times[i + ramp][1] - times[i][0] for i in range(churn - ramp))
        assert fastest < window_s, f"the churn let in {ramp + 1} opens in {fastest:.2f} s at best: not within " \
                                   f"one {window_s:g} s window, so it cannot show the ramp's pace"
        held = []
        try:
            deadline = time.monotonic() + 60
            while len(held) < cfg["sessions"]["max_sessions"] - 1:
                held.append(opened(deadline, len(held) + 1))
        finally:
            for s in held:
                s.__exit__(None, None, None)
    assert not [err for err, _ in refusals if "measured" not in err.message], refusals
    assert all(open_now >= ramp for _, open_now in refusals), (ramp, refusals)


def test_the_avatar_sdk_waits_for_room_on_a_full_server_as_the_server_says(models, tmp_path):
    """AvatarStream.open on a full server (sessions.max_sessions 1): asks again after each busy's
    retry_after_ms, and opens once the other session closes; with no time to wait, it fails naming busy."""
    import asyncio

    from lipsync_client.avatar import AvatarGone, AvatarStream
    import urllib.request
    cfg = base_config(models, sessions={"max_sessions": 1}, metrics={"port": free_port()})

    def refused() -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{cfg['metrics']['port']}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("lipsync_sessions_refused_total"))

    async def scenario(endpoint: str) -> None:
        hurried = AvatarStream(endpoint, "a", busy_wait_s=0)
        with pytest.raises(AvatarGone, match="busy"):
            await hurried.open()
        assert refused() == 1
        patient = AvatarStream(endpoint, "a", busy_wait_s=60)
        opening = asyncio.create_task(patient.open())
        while refused() < 3:    # refused, and asked again when the server said
            assert not opening.done()
            await asyncio.sleep(0.05)
        await asyncio.to_thread(holder.__exit__, None, None, None)   # the other session closes: room
        info = await opening
        assert info["session"] and patient.width == 320
        await patient.close()

    with run_server(tmp_path, cfg) as srv:
        holder = Session(srv.endpoint, "a")
        asyncio.run(scenario(srv.endpoint))


async def _played(stream, utterance: int) -> np.ndarray:
    """The samples the frames of `utterance` carry, up to its last frame (AvatarStream.next)."""
    said = []
    while True:
        frame = await stream.next()
        if frame.utterance == utterance:
            said.append(frame.audio)
            if frame.ended:
                return np.frombuffer(b"".join(said), "<i2")


def test_the_avatar_sdk_streams_audio_without_waiting_for_each_reply(server):
    """AvatarStream.say sends a chunk and returns without waiting for its reply (chunks in flight, in
    the socket's order), so that a TTS's pace is not the server's round trip: with the frontend
    stopped (SIGSTOP), five chunks are said all the same (one that waited would time out, AvatarGone);
    once it runs again, `end` has every reply, and the utterance's frames carry exactly the samples
    said."""
    import asyncio
    import os
    import signal

    from lipsync_client.avatar import AvatarStream
    pcm = (np.random.default_rng(5).standard_normal(5 * 8000) * 3000).astype("<i2")
    frontend = server.pids("frontend")[0]

    async def scenario() -> None:
        stream = AvatarStream(server.endpoint, "a", sample_rate=16000)
        await stream.open()
        try:
            u = stream.begin()
            os.kill(frontend, signal.SIGSTOP)
            try:
                for i in range(5):   # (each chunk past the model's look-ahead: each one is sent)
                    await stream.say(pcm[i * 8000:(i + 1) * 8000], u)
            finally:
                os.kill(frontend, signal.SIGCONT)
            assert await stream.end(u) == u
            got = await _played(stream, u)
            assert np.array_equal(got[:len(pcm)], pcm) and not got[len(pcm):].any()
        finally:
            await stream.close()

    asyncio.run(scenario())


def test_the_avatar_sdk_sends_a_tts_s_10_ms_frames_in_chunks_of_a_video_frame_at_least(server):
    """After the look-ahead, chunks of less than a frame's audio (LiveKit's 10-ms frames) wait for more:
    the server reads a quarter of the requests, and the frames carry exactly the samples said."""
    import asyncio
    import urllib.request

    from lipsync_client.avatar import AvatarStream
    pcm = (np.random.default_rng(6).standard_normal(8000 + 50 * 160) * 3000).astype("<i2")

    def audio_requests() -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("lipsync_requests_total{") and 'op="session_audio"' in line)

    async def scenario() -> None:
        stream = AvatarStream(server.endpoint, "a", sample_rate=16000)
        await stream.open()
        try:
            before = audio_requests()
            u = stream.begin()
            await stream.say(pcm[:8000], u)   # the look-ahead: one chunk
            for i in range(50):                # 10-ms frames, as LiveKit's TTS gives them
                await stream.say(pcm[8000 + i * 160:8000 + (i + 1) * 160], u)
            assert await stream.end(u) == u
            # the head, 500 ms in 40-ms chunks (12, 20 ms held), the end with what was held
            assert audio_requests() - before == 1 + 12 + 1
            got = await _played(stream, u)
            assert np.array_equal(got[:len(pcm)], pcm) and not got[len(pcm):].any()
        finally:
            await stream.close()

    asyncio.run(scenario())
