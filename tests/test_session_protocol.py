"""What the voice-agent integrations need from live sessions, over a real server: PCM at a TTS's own
rate (the mel on a 16 kHz copy, every frame carrying its 1/25 s of the samples sent, every sample
back), frames that say which utterance they carry and mark its last, raw frames in the pixel layout
the framework plays, and speech placed by the audio in hand."""

from __future__ import annotations

import time

import cv2
import numpy as np
import pytest
import soxr

from config import audio as A
from lipsync_client import ServerError, Session
from gpu_actor.model_builder import write_audio_encoder
from tests.helpers import base_config, decode_image, frames_for, make_avatar, run_server
from tests.voice import tts_speech

pytestmark = pytest.mark.slow
BUDGET_MS = 1200            # generous: on a loaded test machine every speech frame is still in time
LEAD = round(BUDGET_MS / 1000 * 25) - 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_audio_encoder(make_avatar(root, "a", n_frames=5) / "audio_encoder.onnx", seed=2)
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    cfg = base_config(models, sessions={"latency_budget_ms": BUDGET_MS, "start_delay_ms": 300})
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        yield srv


def utterance_frames(session, utterance: int, timeout_s: float = 15.0) -> list:
    """(header, image, pcm) of every frame from the first of `utterance` to the one marked its last."""
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frame = session.next_frame(timeout_s=1.0)
        if frame is None or frame[0].get("event") != "frame":
            continue
        if frame[0].get("utterance") == utterance or out:
            out.append(frame)
        if frame[0].get("utterance") == utterance and frame[0].get("last"):
            return out
    raise AssertionError(f"no frame marked the end of utterance {utterance} in {timeout_s}s ({len(out)} frames)")


def windows_of(models, pcm16k: np.ndarray) -> np.ndarray:
    import onnxruntime as ort
    encoder = ort.InferenceSession(str(models / "a" / "audio_encoder.onnx"), providers=["CPUExecutionProvider"])
    return A.frame_windows(encoder.run(None, {"mel": A.encoder_inputs(A.melspectrogram(pcm16k))})[0])


def test_pcm_at_24khz_comes_back_sample_for_sample_with_frames_of_its_16khz_copy(server, models):
    """A TTS's 24 kHz speech in 20-ms chunks: every frame carries 960 samples, the utterance's frames
    carry exactly the samples sent (the tail past the last video frame included, zeros after), one frame
    marks its end, and the speech frames are those of the whole utterance resampled to 16 kHz."""
    pcm = tts_speech(24000, seconds=2.0)
    with Session(server.endpoint, "a", format="png", audio="pcm16", sample_rate=24000) as s:
        assert s.info["sample_rate"] == 24000
        frames_for(s, 0.3)
        chunks = [pcm[i:i + 480] for i in range(0, len(pcm), 480)]
        replies = [s.send_audio(c, last=i == len(chunks) - 1) for i, c in enumerate(chunks)]
        got = utterance_frames(s, 1)
    start = replies[0]["first_frame"]
    assert [r["first_frame"] for r in replies[:4]] == [start, start, start + 1, start + 1]   # 960 samples a frame
    assert [h["index"] for h, _, _ in got] == list(range(start, start + len(got))), "gaps in the utterance"
    assert all(h["utterance"] == 1 for h, _, _ in got) and [h["last"] for h, _, _ in got].count(True) == 1
    assert all(len(audio) == 2 * 960 for _, _, audio in got)
    back = np.frombuffer(b"".join(audio for _, _, audio in got), "<i2")
    np.testing.assert_array_equal(back[:len(pcm)], pcm)          # every sample, in order, at its rate
    assert not back[len(pcm):].any() and len(back) - len(pcm) < 2 * 960
    copy16k = soxr.resample(pcm.astype(np.float32) / 32768, 24000, 16000)
    windows = windows_of(models, copy16k)
    speech = {h["index"] - start: (h, img) for h, img, _ in got if h["kind"] == "speech"}
    assert len(got) == max(len(windows), -(-len(pcm) // 960)) > len(windows), "the tail went nowhere"
    assert max(speech) < len(windows) and len(speech) >= 0.9 * len(windows), (sorted(speech), len(windows))
    with server.client() as c:
        for i in sorted(speech)[::len(speech) // 3][:3] + [max(speech)]:
            header, image = speech[i]
            _, (want,) = c.composite("a", windows[i:i + 1], start_frame=header["frame"], format="png")
            np.testing.assert_array_equal(decode_image(image, "png", {}), decode_image(want, "png", {}))


def test_an_interrupt_marks_the_frame_where_it_took_effect_and_silence_follows(server):
    pcm = tts_speech(48000, seconds=1.8)
    with Session(server.endpoint, "a", audio="pcm16", sample_rate=48000) as s:
        frames_for(s, 0.3)
        s.send_audio(pcm)                        # no `last`: the TTS is still talking
        got = []
        while not any(h.get("utterance") == 1 for h, _, _ in got):   # its first frames go out
            frame = s.next_frame(timeout_s=5.0)
            assert frame is not None, "the utterance never started"
            got.append(frame)
        assert s.interrupt() > 0
        got += [f for _, h, _ in frames_for(s, 1.0) for f in [(h, None, None)]]
    marks = [i for i, (h, _, _) in enumerate(got) if h.get("last")]
    assert len(marks) == 1 and got[marks[0]][0]["utterance"] == 1, [h for h, _, _ in got]
    assert not any(h.get("utterance") for h, _, _ in got[marks[0] + 1:]), "frames of the utterance after its cut"


def test_raw_speech_held_until_due_keeps_its_pixels_while_its_image_slots_serve_the_frames_after_it(server):
    """Raw BGR frames come back in the compositors' image slots (shm.slots each), freed as a batch is
    answered; speech sent ahead waits in the session until due. 40 frames at once are five batches, and the slots of
    the first serve the third while the first's frames still wait: every frame goes out with its own
    pixels, those of the batch API for the same window and background frame."""
    n = 40
    windows = np.random.default_rng(8).standard_normal((n, 32, 16, 16)).astype(np.float32)
    with Session(server.endpoint, "a", format="raw") as s:
        assert s.info["pixel_format"] == "bgr24"
        frames_for(s, 0.2)
        reply = s.send_audio(windows, last=True)
        got = {}
        deadline = time.monotonic() + n / 25 + BUDGET_MS / 1000 + 15
        while len(got) < n and time.monotonic() < deadline:
            frame = s.next_frame(timeout_s=1.0)
            if frame is not None and frame[0].get("kind") == "speech":
                got[frame[0]["index"]] = frame
    assert sorted(got) == list(range(reply["first_frame"], reply["first_frame"] + n)), sorted(got)
    with server.client() as c:
        for i, k in enumerate(sorted(got)):
            header, image, _ = got[k]
            _, (want,) = c.composite("a", windows[i:i + 1], start_frame=header["frame"], format="png")
            want = decode_image(want, "png", {})
            np.testing.assert_array_equal(np.frombuffer(image, np.uint8).reshape(want.shape), want, err_msg=f"frame {i}")


@pytest.mark.parametrize("layout", ["rgb24", "rgba", "i420"])
def test_raw_frames_in_the_layout_the_framework_plays(server, models, layout):
    w, h = 320, 240
    size = {"rgb24": w * h * 3, "rgba": w * h * 4, "i420": w * h * 3 // 2}[layout]
    windows = np.random.default_rng(4).standard_normal((3, 32, 16, 16)).astype(np.float32)
    with Session(server.endpoint, "a", format="raw", pixel_format=layout) as s:
        assert s.info["pixel_format"] == layout
        idle = frames_for(s, 0.4)
        reply = s.send_audio(windows, last=True)
        got = {}
        deadline = time.monotonic() + 8
        while len(got) < 3 and time.monotonic() < deadline:
            frame = s.next_frame(timeout_s=1.0)
            if frame is not None and frame[0].get("kind") == "speech":
                got[frame[0]["index"]] = frame
    assert sorted(got) == list(range(reply["first_frame"], reply["first_frame"] + 3))
    assert [got[k][0]["last"] for k in sorted(got)] == [False, False, True]
    assert {got[k][0]["utterance"] for k in got} == {1}

    def convert(bgr):
        if layout == "i420":
            return cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB if layout == "rgb24" else cv2.COLOR_BGR2RGBA)

    shape = (h * 3 // 2, w) if layout == "i420" else (h, w, 4 if layout == "rgba" else 3)
    for _, header, image in idle[:3]:
        assert len(image) == size
        background = cv2.imread(str(models / "a" / "frames" / f"{header['frame']}.png"))
        np.testing.assert_array_equal(np.frombuffer(image, np.uint8).reshape(shape), convert(background))
    with server.client() as c:
        for i, k in enumerate(sorted(got)):
            header, image, _ = got[k]
            assert len(image) == size
            _, (want,) = c.composite("a", windows[i:i + 1], start_frame=header["frame"], format="png")
            frame, want = np.frombuffer(image, np.uint8).reshape(shape), convert(decode_image(want, "png", {}))
            if layout == "i420":   # the face box alone is converted; its 1-pixel border to even coordinates
                # comes from the I420 background through BGR and back (a few levels; more where BGR clips)
                off = np.abs(frame.astype(int) - want) > 4
                assert off.mean() < 0.001 and (frame != want).mean() < 0.02, (off.sum(), (frame != want).mean())
            else:
                np.testing.assert_array_equal(frame, want)


def test_a_second_of_speech_at_once_lands_at_the_latency_budget(server):
    """Where the samples frame 0's window needs are in hand, it needs only the latency budget; trickled
    in real time, no later than the look-ahead rule placed it before."""
    pcm = tts_speech(16000, seconds=1.0)
    for chunk, most in ((pcm, LEAD + 3), (pcm[:320], LEAD + 12 + 3)):
        with Session(server.endpoint, "a", audio="pcm16") as s:
            seen = [h["index"] for _, h, _ in frames_for(s, 0.6)]
            first = s.send_audio(chunk)["first_frame"]
            assert first - seen[-1] <= most, (len(chunk), first, seen[-1], most)
            s.interrupt()


@pytest.mark.parametrize("fields, wrong", [
    ({"audio": "window", "sample_rate": 24000}, "header.sample_rate"),
    ({"audio": "pcm16", "sample_rate": 44101}, "header.sample_rate"),
    ({"audio": "pcm16", "sample_rate": 7999}, "header.sample_rate"),
    ({"format": "jpeg", "pixel_format": "rgb24"}, "header.pixel_format"),
    ({"format": "h264", "pixel_format": "i420"}, "header.pixel_format"),
    ({"format": "raw", "pixel_format": "yuyv"}, "header.pixel_format"),
])
def test_keys_that_do_not_apply_are_refused(server, fields, wrong):
    with server.client() as c, pytest.raises(ServerError) as err:
        c.request("session_open", model="a", **fields)
    assert err.value.code == "bad_request" and wrong in err.value.message, err.value
