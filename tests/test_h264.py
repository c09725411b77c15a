"""H.264 live sessions over real processes: access units that decode (PyAV) to the raw session's
pixels, one per frame, IDR on request, the idle loop, a compositor killed mid-session."""

from __future__ import annotations

import os
import signal
import time

import av
import cv2
import numpy as np
import pytest

from cpu_actor.h264 import KeptBoxes
from lipsync_client import ServerError
from lipsync_client import Session
from tests.helpers import (base_config, decode_image, frames_until, free_port, make_video_avatar, mirror_index,
                           run_server)

pytestmark = pytest.mark.slow
N_FRAMES = 5
GOP = 10
LOOP_CHUNK = 5   # shorter than the GOP: a session rejoins the idle loop at its own chunk starts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_video_avatar(root, "a", N_FRAMES)
    return root


def h264_config(models, **h264):
    # A generous latency budget keeps every speech frame in time on a loaded machine.
    return base_config(models, sessions={"latency_budget_ms": 1200, "start_delay_ms": 300,
                                         "h264": {"gop": GOP, "loop_chunk": LOOP_CHUNK, **h264}})


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("srv"), h264_config(models)) as srv:
        yield srv


def units_until(session: Session, index: int) -> list:
    """(header, access unit) of every frame up to the one numbered `index` (the stream's own clock)."""
    return [(header, au) for _, header, au in frames_until(session, index)]


def nal_types(au: bytes) -> list[int]:
    """The NAL unit types of an Annex-B access unit (5: IDR slice, 7: SPS, 8: PPS, 1: non-IDR slice)."""
    types, i = [], 0
    while (i := au.find(b"\x00\x00\x01", i)) >= 0:
        types.append(au[i + 3] & 0x1F)
        i += 3
    return types


def decode(units: list[bytes]) -> list[np.ndarray]:
    decoder = av.CodecContext.create("h264", "r")
    out = []
    for au in units:
        out += [f.to_ndarray(format="bgr24") for f in decoder.decode(av.Packet(au))]
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def test_h264_frames_decode_to_the_raw_sessions_pixels(server, models):
    windows = np.random.default_rng(3).standard_normal((8, 32, 16, 16)).astype(np.float32)
    with Session(server.endpoint, "a", format="h264", start_frame=2) as s:
        assert s.info["format"] == "h264"
        units_until(s, 0)   # the stream has started
        first = s.send_audio(windows)["first_frame"]
        got = units_until(s, first + 7)
        stats = s.stats()
    headers = [h for h, _ in got]
    assert [h["index"] for h in headers] == list(range(headers[0]["index"], headers[0]["index"] + len(got)))
    units = [au for _, au in got]
    assert all(nal_types(au)[-1] in (1, 5) for au in units), "one access unit (ending in a picture) per frame"
    pictures = decode(units[next(i for i, h in enumerate(headers) if h["keyframe"]):])
    by_index = dict(zip([h["index"] for h in headers][-len(pictures):], zip(headers[-len(pictures):], pictures)))
    assert len(pictures) == len(units) - next(i for i, h in enumerate(headers) if h["keyframe"]), \
        "a frame in, an access unit out, a picture decoded: no frame delay"
    speech = [k for k, (h, _) in by_index.items() if h["kind"] == "speech"]
    assert sorted(speech) == list(range(first, first + 8)) and stats["missed"] == 0
    with server.client() as c:
        for k, (header, picture) in by_index.items():
            if header["kind"] == "speech":
                _, (want,) = c.composite("a", windows[k - first:k - first + 1], start_frame=header["frame"],
                                         format="png")
                want = decode_image(want, "png", {})
            else:
                assert header["frame"] == mirror_index(2 + k, N_FRAMES)
                want = cv2.imread(str(models / "a" / "frames" / f"{header['frame']}.png"))
            assert psnr(picture, want) >= 35.0, (k, header["kind"], psnr(picture, want))


def test_keyframe_on_request_and_silence_from_the_idle_loop(server):
    with Session(server.endpoint, "a", format="h264") as s:
        got = units_until(s, 36)
        at = s.keyframe()
        got += units_until(s, max(at, 52))
        stats = s.stats()
    first = got[0][0]
    types = nal_types(got[0][1])
    assert first["index"] == 0 and first["keyframe"] and types[:2] == [7, 8] and 5 in types, \
        "a session starts with SPS, PPS and an IDR"
    sps = got[0][1][got[0][1].find(b"\x00\x00\x01") + 3:]
    assert sps[1] == 66 and sps[2] & 0x40, "constrained baseline (profile_idc 66, constraint_set1): what browsers decode"
    after = {h["index"]: (h, au) for h, au in got if h["index"] >= at}
    header, au = after[min(after)]
    assert header["keyframe"] and 5 in nal_types(au) and 7 in nal_types(au), "the frame after session_keyframe is an IDR"
    # Silent: nearly every frame came from the avatar's idle loop, not the session's own encoder.
    assert stats["frames_encoded"] <= LOOP_CHUNK + 2 and stats["frames_idle"] >= 40, stats
    for h, au in got:
        assert h["keyframe"] == (5 in nal_types(au)), h


def test_h264_is_refused_where_it_cannot_apply(server):
    with server.client() as c, pytest.raises(ServerError) as err:
        c.composite("a", np.zeros((1, 32, 16, 16), np.float32), format="h264")
    assert err.value.code == "bad_request" and "live sessions" in err.value.message
    with Session(server.endpoint, "a", format="jpeg") as s, pytest.raises(ServerError) as err:
        s.keyframe()
    assert err.value.code == "bad_request" and "format: h264" in err.value.message
    with pytest.raises(ServerError) as err:
        Session(server.endpoint, "a", format="h264", webrtc=True)
    assert err.value.code == "bad_request" and "viewer.port" in err.value.message


def test_a_killed_compositor_resumes_with_an_idr(models, tmp_path):
    # Without the idle loop every frame goes through the session's encoder, in its compositor.
    with run_server(tmp_path, h264_config(models, idle_loop=False)) as srv, \
            Session(srv.endpoint, "a", format="h264") as s:
        before = units_until(s, 24)
        assert before and all(not h["keyframe"] for h, _ in before[1:6])
        with srv.client() as c:
            pids = [p["pid"] for p in c.health()["processes"] if p["role"] == "cpu"]
        for pid in pids:   # the session's compositor among them
            os.kill(pid, signal.SIGKILL)
        after = units_until(s, before[-1][0]["index"] + 75)
        stats = s.stats()
    indices = [h["index"] for h, _ in before + after]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    resumed = next(i for i, (h, _) in enumerate(after) if h["keyframe"])
    assert all(h["index"] > before[-1][0]["index"] for h, _ in after)
    # From the IDR on, every access unit decodes, and the frames keep coming.
    pictures = decode([au for _, au in after[resumed:]])
    assert len(pictures) == len(after) - resumed >= 25, (len(pictures), len(after), resumed)
    assert stats["frames_encoded"] >= stats["frames_idle"] - stats["dropped"] - 2


def test_speech_survives_its_compositor_dying_with_the_boxes_it_kept(models, tmp_path):
    """An utterance comes in one chunk, 1.6 s of speech: the face boxes of the frames due within the
    latency budget stay in the session's compositor, the later ones come back to the frontend. That
    compositor is killed before the first is due: the stream goes on from an IDR on the other one,
    the frames whose boxes died go out idle, each counted missed, the rest of the utterance is speech,
    every access unit from the IDR on decodes, and no frame goes out twice."""
    import urllib.request
    cfg = h264_config(models)
    cfg["metrics"] = {"port": free_port()}

    def placed() -> dict:
        body = urllib.request.urlopen(f"http://127.0.0.1:{cfg['metrics']['port']}/metrics", timeout=10).read().decode()
        return {int(line.split('"')[1]): float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                if line.startswith("lipsync_h264_sessions{")}

    windows = np.random.default_rng(5).standard_normal((40, 32, 16, 16)).astype(np.float32)
    with run_server(tmp_path, cfg) as srv, Session(srv.endpoint, "a", format="h264") as s:
        units_until(s, 0)
        first = s.send_audio(windows)["first_frame"]
        before = units_until(s, first - 10)   # the utterance has been composited; none of it is out
        [index] = [i for i, n in placed().items() if n == 1]
        with srv.client() as c:
            [pid] = [p["pid"] for p in c.health()["processes"] if p["role"] == "cpu" and p["index"] == index]
        os.kill(pid, signal.SIGKILL)
        after = units_until(s, first + 40 + GOP)
        stats = s.stats()
    indices = [h["index"] for h, _ in before + after]
    assert indices == sorted(set(indices)), "no frame goes out twice, none out of order"
    skipped = set(range(indices[0], indices[-1] + 1)) - set(indices)
    assert len(skipped) == stats["dropped"], "a frame not sent (its encode died with the process) is counted"
    resumed = next(i for i, (h, _) in enumerate(after) if h["keyframe"])
    pictures = decode([au for _, au in after[resumed:]])
    assert len(pictures) == len(after) - resumed, "every access unit from the IDR on decodes"
    kinds = {h["index"]: h["kind"] for h, _ in after if first <= h["index"] < first + 40}
    lost = [k for k, kind in kinds.items() if kind == "idle"]
    # (the frames due within 1.2 s, 30 frames, of the send: the first ones, the utterance starting
    # about the latency budget ahead)
    assert lost and max(lost) < first + 8, lost
    assert stats["missed"] == len(lost) and stats["missed_in"] == {"failed": len(lost)}, (stats, lost)
    assert all(kinds[k] == "speech" for k in range(max(lost) + 1, first + 40)), kinds


def test_h264_sessions_opened_at_once_share_the_compositors(models, tmp_path):
    """Six H.264 sessions opened at once: the server's lipsync_h264_sessions gauge shows them three and
    three on its two compositing processes (all six went to the first before), and the depth gauges are
    set while the server runs, not only on process events."""
    import asyncio
    import urllib.request

    from lipsync_client import AsyncSession
    cfg = h264_config(models)
    cfg["metrics"] = {"port": free_port()}

    def gauges(name: str) -> dict:
        body = urllib.request.urlopen(f"http://127.0.0.1:{cfg['metrics']['port']}/metrics", timeout=10).read().decode()
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                if line.startswith(name + "{")}

    async def scenario(endpoint: str) -> None:
        sessions = [AsyncSession(endpoint, "a", format="h264") for _ in range(6)]
        await asyncio.gather(*(s.__aenter__() for s in sessions))
        try:
            deadline = time.monotonic() + 30
            while sum((placed := gauges("lipsync_h264_sessions")).values()) != 6:
                assert time.monotonic() < deadline, placed
                await asyncio.sleep(0.1)
            assert sorted(placed.values()) == [3, 3], placed
            assert set(gauges("lipsync_compositor_depth")) == {"0", "1"}
        finally:
            for s in sessions:
                await s.__aexit__(None, None, None)

    with run_server(tmp_path, cfg) as srv:
        asyncio.run(scenario(srv.endpoint))


def test_kept_face_boxes_are_taken_in_order_repeated_once_taken_and_bounded():
    kept = KeptBoxes(per_session=4)
    for k in range(10, 14):
        kept.put("s", k, b"box%d" % k)
    kept.put("t", 10, b"other")
    assert kept.take("s", 12) == b"box12" and kept.take("s", 10) is None, "frames before a taken one are dropped"
    assert kept.take("s", 12) == b"box12", "a repeated frame takes the last box again"
    assert kept.take("s", 13) == b"box13" and kept.take("s", 12) is None and len(kept) == 1
    for k in range(20, 26):
        kept.put("s", k, b"x")
    assert kept.take("s", 21) is None and kept.take("s", 22) == b"x", "past per_session, the oldest go"
    kept.drop("s")
    assert kept.take("s", 23) is None and kept.take("t", 10) == b"other" and len(kept) == 0
