"""The LiveKit video generator (lipsync_client/livekit.py) through its public contract, with real
`livekit.rtc` frames and LiveKit's own `QueueAudioOutput` feeding it as `AvatarRunner` does, against
a real server. No LiveKit server can run here (it is a Go binary with its own network setup), so the
runner's room side (publishing tracks) is not exercised: everything up to it is."""

from __future__ import annotations

import asyncio

import cv2
import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason="the livekit extra: pip install -e .[livekit]")

from livekit import rtc  # noqa: E402
from livekit.agents.voice.avatar import AudioSegmentEnd, QueueAudioOutput  # noqa: E402

from lipsync_client.livekit import LipsyncVideoGenerator  # noqa: E402
from tests.voice import face_avatar, tts_speech, warm_server  # noqa: E402

pytestmark = pytest.mark.slow
N_FRAMES = 6
RATE = 24000
CHUNK = RATE // 50


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return face_avatar(tmp_path_factory, N_FRAMES)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with warm_server(models, tmp_path_factory, latency_budget_ms=800, start_delay_ms=200) as srv:
        yield srv


@pytest.fixture(scope="module")
def idle_i420(models):
    return [cv2.cvtColor(cv2.imread(str(models / "face" / "frames" / f"{k}.png")), cv2.COLOR_BGR2YUV_I420).tobytes()
            for k in range(N_FRAMES)]


def audio_frames(pcm: np.ndarray) -> list:
    return [rtc.AudioFrame(pcm[i:i + CHUNK].tobytes(), RATE, 1, len(pcm[i:i + CHUNK]))
            for i in range(0, len(pcm), CHUNK)]


async def collect(generator, until, extra: int = 0, timeout_s: float = 20.0) -> list:
    """Items the generator yields until `until(items)` holds, then `extra` more video frames."""
    out, more = [], None

    async def run():
        nonlocal more
        async for item in generator:
            out.append(item)
            if more is None and until(out):
                more = extra
            if more is not None and isinstance(item, rtc.VideoFrame):
                if more == 0:
                    return
                more -= 1
    await asyncio.wait_for(run(), timeout_s)
    return out


def test_audio_in_frames_and_the_same_audio_out_and_the_segment_end_after_the_last_frame(server, idle_i420):
    pcm = tts_speech(RATE, seconds=2.5)

    async def main():
        generator = LipsyncVideoGenerator(server.endpoint, "face", sample_rate=RATE)
        options = await generator.start()
        assert (options.video_width, options.video_height, options.video_fps) == (320, 240, 25.0)
        assert (options.audio_sample_rate, options.audio_channels) == (RATE, 1)
        # the agent side, as LiveKit's in-process wiring has it: its audio output is a queue ...
        agent_out = QueueAudioOutput(sample_rate=RATE)

        async def agent_speaks():
            await asyncio.sleep(0.4)
            for frame in audio_frames(pcm):
                await agent_out.capture_frame(frame)
            agent_out.flush()                      # -> AudioSegmentEnd

        async def runner_reads():                  # ... that AvatarRunner._read_audio feeds the generator from
            async for frame in agent_out:
                await generator.push_audio(frame)

        tasks = [asyncio.create_task(agent_speaks()), asyncio.create_task(runner_reads())]
        try:
            return await collect(generator, lambda items: isinstance(items[-1], AudioSegmentEnd), extra=8)
        finally:
            for t in tasks:
                t.cancel()
            await generator.aclose()

    items = asyncio.run(main())
    video = [i for i, f in enumerate(items) if isinstance(f, rtc.VideoFrame)]
    audio = [i for i, f in enumerate(items) if isinstance(f, rtc.AudioFrame)]
    ends = [i for i, f in enumerate(items) if isinstance(f, AudioSegmentEnd)]
    assert all(items[i].type == rtc.VideoBufferType.I420 and (items[i].width, items[i].height) == (320, 240)
               and len(items[i].data) == 320 * 240 * 3 // 2 for i in video)
    out = np.frombuffer(b"".join(bytes(items[i].data) for i in audio), "<i2")
    assert all(items[i].sample_rate == RATE and items[i].samples_per_channel == 960 for i in audio)
    np.testing.assert_array_equal(out[:len(pcm)], pcm)
    assert not out[len(pcm):].any() and len(out) - len(pcm) < 960
    assert all(isinstance(items[i - 1], rtc.VideoFrame) for i in audio), "each audio frame follows its video frame"
    assert ends == [audio[-1] + 1], (ends, audio[-1])
    silent = [bytes(items[i].data) for i in video if i < audio[0] - 1 or i > ends[0]]
    assert len(silent) >= 10 and all(f in idle_i420 for f in silent), "idle frames are not the avatar's own"
    speaking = [bytes(items[i - 1].data) for i in audio]
    moved = [f for f in speaking if f not in idle_i420]
    assert len(moved) >= 0.5 * len(speaking) and len(set(moved)) > len(moved) // 2, "".join("x" if f in idle_i420 else "." for f in speaking)
    rgba = items[audio[0] - 1].convert(rtc.VideoBufferType.RGBA)   # a frame LiveKit itself can convert
    assert rgba.type == rtc.VideoBufferType.RGBA and len(rgba.data) == 320 * 240 * 4


def test_clear_buffer_stops_speech_within_the_frames_already_sent(server, idle_i420):
    pcm = tts_speech(RATE, seconds=3.0)

    async def main():
        generator = LipsyncVideoGenerator(server.endpoint, "face", sample_rate=RATE)
        await generator.start()
        try:
            for frame in audio_frames(pcm):
                await generator.push_audio(frame)
            before = await collect(generator, lambda items: sum(isinstance(f, rtc.AudioFrame) for f in items) >= 20)
            await generator.clear_buffer()
            after = await collect(generator, lambda items: True, extra=25)
            return before, after
        finally:
            await generator.aclose()

    before, after = asyncio.run(main())
    heard = np.frombuffer(b"".join(bytes(f.data) for f in before if isinstance(f, rtc.AudioFrame)), "<i2")
    np.testing.assert_array_equal(heard, pcm[:len(heard)])
    assert not [f for f in after if isinstance(f, (rtc.AudioFrame, AudioSegmentEnd))], "audio after clear_buffer"
    talking = [f for f in after if isinstance(f, rtc.VideoFrame) and bytes(f.data) not in idle_i420]
    # the server drops every speech frame not yet sent; those already on their way come marked with the
    # cut utterance, and the generator shows the last idle frame in their place
    assert not talking, len(talking)


def test_rgba_frames_and_a_rate_other_than_the_sessions_is_refused(server, models):
    async def main():
        generator = LipsyncVideoGenerator(server.endpoint, "face", sample_rate=RATE, pixel_format="rgba")
        await generator.start()
        try:
            with pytest.raises(ValueError, match="24000 Hz"):
                await generator.push_audio(rtc.AudioFrame(bytes(640), 16000, 1, 320))
            return await collect(generator, lambda items: len(items) >= 3)
        finally:
            await generator.aclose()

    frames = asyncio.run(main())
    backgrounds = [cv2.cvtColor(cv2.imread(str(models / "face" / "frames" / f"{k}.png")), cv2.COLOR_BGR2RGBA).tobytes()
                   for k in range(N_FRAMES)]
    assert all(f.type == rtc.VideoBufferType.RGBA and bytes(f.data) in backgrounds for f in frames)
