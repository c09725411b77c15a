"""The Pipecat avatar service (lipsync_client/pipecat.py) in real Pipecat pipelines (pipecat-ai,
offline, `pipecat.tests.utils.run_test`) against a real server: a TTS's 24 kHz speech in, the avatar's
frames and the very same samples out, the stop after the last speech frame, barge-in, a missing server."""

from __future__ import annotations

import asyncio

import cv2
import numpy as np
import pytest

pytest.importorskip("pipecat", reason="the pipecat extra: pip install -e .[pipecat]")

from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    InterruptionFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402
from pipecat.transports.base_output import BaseOutputTransport  # noqa: E402
from pipecat.transports.base_transport import TransportParams  # noqa: E402

from lipsync_client.pipecat import LipsyncVideoService  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.voice import face_avatar, tts_speech, warm_server  # noqa: E402

pytestmark = pytest.mark.slow
N_FRAMES = 6
RATE = 24000
CHUNK = RATE // 50            # 20-ms TTS chunks
STALL_S = 1.0                 # how long the loaded host's audio output holds up (PlayingOutput)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return face_avatar(tmp_path_factory, N_FRAMES)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with warm_server(models, tmp_path_factory, latency_budget_ms=800, start_delay_ms=200) as srv:
        yield srv


@pytest.fixture(scope="module")
def backgrounds(models):
    """The avatar's own frames, RGB, and its face box (where the mouth is pasted)."""
    import json
    rects = json.loads((models / "face" / "crop_rects.json").read_text())
    return ([cv2.cvtColor(cv2.imread(str(models / "face" / "frames" / f"{k}.png")), cv2.COLOR_BGR2RGB)
             for k in range(N_FRAMES)], [rects[str(k)]["rect"] for k in range(N_FRAMES)])


def tts_frames(pcm: np.ndarray) -> list:
    return [TTSAudioRawFrame(audio=pcm[i:i + CHUNK].tobytes(), sample_rate=RATE, num_channels=1)
            for i in range(0, len(pcm), CHUNK)]


def image(frame: OutputImageRawFrame) -> np.ndarray:
    w, h = frame.size
    return np.frombuffer(frame.image, np.uint8).reshape(h, w, 3)


def own_frame(img: np.ndarray, backgrounds) -> bool:
    return any(np.array_equal(img, bg) for bg in backgrounds[0])


def outside_face_is_own(img: np.ndarray, backgrounds) -> bool:
    """Some background frame equals it everywhere outside that frame's face box."""
    for bg, (x1, y1, x2, y2) in zip(*backgrounds):
        a, b = img.copy(), bg.copy()
        a[y1:y2, x1:x2] = b[y1:y2, x1:x2] = 0
        if np.array_equal(a, b):
            return True
    return False


def test_tts_speech_becomes_frames_and_the_same_samples_and_the_stop_follows_the_face(server, backgrounds):
    pcm = tts_speech(RATE, seconds=2.5)
    service = LipsyncVideoService(model="face", endpoint=server.endpoint)
    down, up = asyncio.run(run_test(service, frames_to_send=[SleepFrame(0.5), TTSStartedFrame(), *tts_frames(pcm),
                                                             TTSStoppedFrame(), SleepFrame(4.5)],
                                    start_timeout=15))
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    images = [i for i, f in enumerate(down) if isinstance(f, OutputImageRawFrame)]
    audio = [i for i, f in enumerate(down) if isinstance(f, TTSAudioRawFrame)]
    stops = [i for i, f in enumerate(down) if isinstance(f, TTSStoppedFrame)]
    assert all(down[i].size == (320, 240) and down[i].format == "RGB" for i in images)
    # the samples out are the samples in, at their rate, 960 with each frame (then zeros to the frame's end)
    out = np.frombuffer(b"".join(down[i].audio for i in audio), "<i2")
    assert all(down[i].sample_rate == RATE and len(down[i].audio) == 2 * 960 for i in audio)
    np.testing.assert_array_equal(out[:len(pcm)], pcm)
    assert not out[len(pcm):].any() and len(out) - len(pcm) < 960
    # one image with each 40 ms of audio: every audio frame right after its image
    assert all(isinstance(down[i - 1], OutputImageRawFrame) for i in audio)
    # the stop after the utterance's last frame, once
    assert len(stops) == 1 and stops[0] > audio[-1], (stops, audio[-1])
    # the face: its own frames in silence (before and after), a mouth that moves while it speaks
    before = [image(down[i]) for i in images if i < audio[0] - 1]
    after = [image(down[i]) for i in images if i > stops[0]]
    assert len(before) >= 5 and len(after) >= 5 and all(own_frame(img, backgrounds) for img in before + after)
    speaking = [image(down[i - 1]) for i in audio]
    moved = [img for img in speaking if not own_frame(img, backgrounds)]
    assert len(moved) >= 0.5 * len(speaking), (len(moved), len(speaking))
    assert all(outside_face_is_own(img, backgrounds) for img in moved), "pixels changed outside the face box"
    assert len({img.tobytes() for img in moved}) > len(moved) // 2, "the mouth does not move"


class PlayingOutput(BaseOutputTransport):
    """An output transport as a loaded host runs one: a write of audio returns once its samples have
    played (in real time), and once, 0.8 s into the speech, the audio holds up STALL_S (its sender was
    not scheduled). What it shows is kept with the clock and the samples played by then."""

    def __init__(self, live: bool = False):
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE, video_out_enabled=True,
                                         video_out_is_live=live, video_out_width=320, video_out_height=240,
                                         video_out_framerate=25))
        self.played = 0
        self.stall: tuple[float, float] = (0.0, 0.0)   # (from, to) on the loop's clock
        self.shown: list[tuple[float, int, bytes]] = []

    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame) -> bool:
        loop = asyncio.get_running_loop()
        n = len(frame.audio) // 2
        if self.played < 0.8 * RATE <= self.played + n:
            start = loop.time()
            await asyncio.sleep(STALL_S)
            self.stall = (start, loop.time())
        await asyncio.sleep(n / RATE)
        self.played += n
        return True

    async def write_video_frame(self, frame) -> bool:
        self.shown.append((asyncio.get_running_loop().time(), self.played, frame.image))
        return True


def test_the_face_waits_for_the_voice_when_the_transports_audio_falls_behind(server, backgrounds):
    """The transport's audio output stalls mid-speech: the face holds while the voice is held up, and
    moves on with it after (each image is queued with the audio before it)."""
    pcm = tts_speech(RATE, seconds=2.5)
    output = PlayingOutput()
    down, up = asyncio.run(run_test(Pipeline([LipsyncVideoService(model="face", endpoint=server.endpoint), output]),
                                    frames_to_send=[SleepFrame(0.5), TTSStartedFrame(), *tts_frames(pcm),
                                                    TTSStoppedFrame(), SleepFrame(5.0)],
                                    start_timeout=15))
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    assert output.played >= len(pcm), (output.played, len(pcm))
    start, end = output.stall
    assert end - start >= STALL_S, output.stall
    own = {bg.tobytes() for bg in backgrounds[0]}
    mouths = [(t, played, img) for t, played, img in output.shown if img not in own]
    held = len({img for t, _, img in mouths if start < t < end})
    after = len({img for t, _, img in mouths if t > end})
    # the server sent ~25 new mouths during the stall: none of them was shown while the voice waited
    # (the one set before it may be drawn first inside it)
    assert held <= 2, (held, "mouths shown while the voice was held up")
    assert after >= 10, after
    # each mouth shown while its own frame's audio plays: not before the audio ahead of it (the samples
    # the transport wrote before it, in the order it handled them), nor past its own frame's (a mouth
    # may come again, in another frame: any of its frames will do)
    frame = RATE // 25
    ahead: dict[bytes, list[int]] = {}
    samples = 0
    for f in down:
        if isinstance(f, TTSAudioRawFrame):
            samples += len(f.audio) // 2
        elif isinstance(f, OutputImageRawFrame) and f.image not in own:
            ahead.setdefault(f.image, []).append(samples)
    off = [([k // frame for k in ahead[img]], played / frame) for _, played, img in mouths
           if not any(k <= played <= k + 2 * frame for k in ahead[img])]
    assert len(ahead) >= 20 and not off, (len(ahead), off[:10])


def test_a_live_video_output_is_named_as_showing_no_frames(server):
    """Images queued with the audio are never shown by a live video output: the service says what to set."""
    from loguru import logger
    said: list[str] = []
    sink = logger.add(lambda message: said.append(str(message)), level="WARNING")
    try:
        asyncio.run(run_test(Pipeline([LipsyncVideoService(model="face", endpoint=server.endpoint),
                                       PlayingOutput(live=True)]),
                             frames_to_send=[SleepFrame(0.2)], start_timeout=15))
    finally:
        logger.remove(sink)
    assert any("video_out_is_live=False" in line for line in said), said


def test_an_interruption_stops_speech_within_the_frames_already_sent(server, backgrounds):
    pcm = tts_speech(RATE, seconds=3.0)
    service = LipsyncVideoService(model="face", endpoint=server.endpoint)
    down, up = asyncio.run(run_test(service, frames_to_send=[SleepFrame(0.3), TTSStartedFrame(), *tts_frames(pcm),
                                                             SleepFrame(2.0), InterruptionFrame(), SleepFrame(1.0)],
                                    start_timeout=15))
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    heard = [f for f in down[:cut] if isinstance(f, TTSAudioRawFrame)]
    assert heard, "the utterance had not started playing when the user barged in"
    out = np.frombuffer(b"".join(f.audio for f in heard), "<i2")
    np.testing.assert_array_equal(out, pcm[:len(out)])          # what played was the start of what was said
    assert len(out) < len(pcm) - RATE // 2, "it had already finished: nothing to interrupt"
    later = [f for f in down[cut:] if isinstance(f, (OutputImageRawFrame, TTSAudioRawFrame))]
    assert not [f for f in later if isinstance(f, TTSAudioRawFrame)], "speech audio after the interruption"
    talking = [f for f in later if isinstance(f, OutputImageRawFrame) and not own_frame(image(f), backgrounds)]
    # NOTE: the server drops every speech frame not yet sent; frames it sent before the interrupt still
    # arrive, marked with the cut utterance, and the service shows the last idle frame in their place
    assert not talking, len(talking)
    assert len(later) >= 10 and not [f for f in down[cut:] if isinstance(f, TTSStoppedFrame)]


def test_no_server_is_a_pipeline_error_not_a_hang():
    service = LipsyncVideoService(model="face", endpoint=f"tcp://127.0.0.1:{free_port()}")
    down, up = asyncio.run(asyncio.wait_for(run_test(service, frames_to_send=[SleepFrame(0.1)], start_timeout=15),
                                            60))
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "tcp://127.0.0.1" in errors[0].error, up
