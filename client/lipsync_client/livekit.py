"""A LiveKit Agents video generator backed by this server: your own avatars for any LiveKit voice agent
(extra `livekit`: `pip install lipsync-serve[livekit]`), driven by LiveKit's own `AvatarRunner`.

    gen = LipsyncVideoGenerator("tcp://127.0.0.1:5555", "demo", sample_rate=24000)
    await gen.start()
    runner = AvatarRunner(room, audio_recv=audio_in, video_gen=gen, options=gen.options())

`push_audio(rtc.AudioFrame)` feeds the session's current utterance (at the session's rate: the agent
TTS's), `push_audio(AudioSegmentEnd())` ends it, `clear_buffer()` interrupts (barge-in): every
utterance so far is retired, at the server too, so nothing of it is played after the runner reports
`playback_finished(interrupted=True)`, and the position it reports is the audio this generator
yielded. In the agent's own process (`start_in_process`) the agent's audio output stamps each frame
with how many times it was cleared before it captured it: a frame captured before a clear and pushed
here after it (the runner had it in hand) is dropped, not said as a new utterance. Iterating
it yields, at 25 fps, an `rtc.VideoFrame` for every frame (I420 straight from the server's I420
backgrounds, or RGBA: no conversion here), after each frame of an utterance that frame's own
`rtc.AudioFrame` (the samples the TTS made), and `AudioSegmentEnd` after the utterance's last frame,
on which the runner tells the agent `playback_finished`.

The two wirings LiveKit documents, as helpers (docs/integrations.md has both worked through):
`start_in_process` (the agent's own process: `QueueAudioOutput` + `AvatarRunner`) and `run_avatar_worker`
(a separate participant: `DataStreamAudioReceiver` here, `DataStreamAudioOutput` on the agent).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Optional, Union

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import (
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    DataStreamAudioReceiver,
    QueueAudioOutput,
    VideoGenerator,
)

from lipsync_client.avatar import AvatarStream
from lipsync_client.wire import DEFAULT_ENDPOINT

BUFFER = {"i420": rtc.VideoBufferType.I420, "rgba": rtc.VideoBufferType.RGBA}
CLEARS = "lipsync.clears"   # rtc.AudioFrame.userdata: how many clear_buffer calls came before its capture


class ClearCountingAudioOutput(QueueAudioOutput):
    """The agent's audio output for an in-process avatar (QueueAudioOutput), stamping each frame it
    captures with how many times its buffer was cleared before: what the generator needs to tell cut
    speech from new speech whatever the order in which the runner's tasks run."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.clears = 0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        frame.userdata[CLEARS] = self.clears
        await super().capture_frame(frame)

    def clear_buffer(self) -> None:
        self.clears += 1   # NOTE: before the runner hears of it (it calls the generator from a task)
        super().clear_buffer()


class LipsyncVideoGenerator(VideoGenerator):
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, model: str = "demo", *, sample_rate: int = 24000,
                 pixel_format: str = "i420", curve: Optional[dict] = None, start_frame: int = 0):
        if pixel_format not in BUFFER:
            raise ValueError(f"pixel_format {pixel_format!r}: LiveKit takes i420 or rgba from this server")
        self._stream = AvatarStream(endpoint, model, sample_rate=sample_rate, pixel_format=pixel_format,
                                    curve=curve, start_frame=start_frame)
        self._buffer = BUFFER[pixel_format]
        self._out: asyncio.Queue = asyncio.Queue()   # AudioSegmentEnd for utterances that said nothing
        self._source: Optional[ClearCountingAudioOutput] = None   # start_in_process: the agent's audio output
        self._cleared = 0          # clears applied to the session (the source's count, when there is one)

    @property
    def sample_rate(self) -> int:
        return self._stream.sample_rate

    async def start(self) -> AvatarOptions:
        """Open the session (the avatar's size and rate come from the server)."""
        await self._stream.open()
        return self.options()

    def options(self) -> AvatarOptions:
        s = self._stream
        return AvatarOptions(video_width=s.width, video_height=s.height, video_fps=s.fps,
                             audio_sample_rate=s.sample_rate, audio_channels=1)

    async def aclose(self) -> None:
        await self._stream.close()

    def follow(self, source: ClearCountingAudioOutput) -> None:
        """Take the clear count of the audio output that feeds this generator (start_in_process)."""
        self._source = source

    async def push_audio(self, frame: Union[rtc.AudioFrame, AudioSegmentEnd]) -> None:
        if isinstance(frame, rtc.AudioFrame) and self._source is not None and CLEARS in frame.userdata:
            stamp = frame.userdata[CLEARS]
            if stamp < self._source.clears:   # captured before a clear: the cut speech
                return
            await self._apply_clears(stamp)   # a clear the runner has not passed on yet: before this audio
        if isinstance(frame, AudioSegmentEnd):
            if await self._stream.end() is None:   # nothing of it was said: it has ended already
                self._out.put_nowait(AudioSegmentEnd())
            return
        if frame.sample_rate != self._stream.sample_rate:
            raise ValueError(f"audio at {frame.sample_rate} Hz; this avatar's session takes "
                             f"{self._stream.sample_rate} Hz (LipsyncVideoGenerator(sample_rate=...), "
                             "the agent's TTS rate)")
        pcm = np.frombuffer(frame.data, "<i2")
        if frame.num_channels > 1:
            pcm = pcm.reshape(-1, frame.num_channels).mean(axis=1).astype("<i2")
        await self._stream.say(pcm)

    async def clear_buffer(self) -> None:
        await self._apply_clears(self._source.clears if self._source is not None else self._cleared + 1)

    async def _apply_clears(self, clears: int) -> None:
        if clears > self._cleared:
            self._cleared = clears
            await self._stream.interrupt()

    def __aiter__(self) -> AsyncIterator[Union[rtc.VideoFrame, rtc.AudioFrame, AudioSegmentEnd]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[Union[rtc.VideoFrame, rtc.AudioFrame, AudioSegmentEnd]]:
        s = self._stream
        while True:
            while not self._out.empty():
                yield self._out.get_nowait()
            frame = await s.next()
            yield rtc.VideoFrame(s.width, s.height, self._buffer, frame.image)
            if frame.utterance is not None:
                yield rtc.AudioFrame(frame.audio, s.sample_rate, 1, len(frame.audio) // 2)
                if frame.ended:
                    yield AudioSegmentEnd()


async def start_in_process(agent_session, room: rtc.Room, *, endpoint: str = DEFAULT_ENDPOINT, model: str = "demo",
                           sample_rate: int = 24000, pixel_format: str = "i420") -> AvatarRunner:
    """The avatar in the agent's own process: the agent's audio output becomes a queue the runner reads,
    and the runner publishes the avatar's video and audio in the agent's room. Call before
    `agent_session.start(...)`; close the returned runner (`aclose`) when the job ends."""
    generator = LipsyncVideoGenerator(endpoint, model, sample_rate=sample_rate, pixel_format=pixel_format)
    options = await generator.start()
    audio = ClearCountingAudioOutput(sample_rate=sample_rate)
    generator.follow(audio)
    agent_session.output.audio = audio
    runner = AvatarRunner(room, audio_recv=audio, video_gen=generator, options=options)
    await runner.start()
    return runner


async def run_avatar_worker(room: rtc.Room, *, endpoint: str = DEFAULT_ENDPOINT, model: str = "demo",
                            sample_rate: int = 24000, pixel_format: str = "i420") -> None:
    """The avatar as its own participant (a separate worker joined to the room): audio comes from the
    agent over a LiveKit data stream (`DataStreamAudioOutput(room, destination_identity=<this
    participant's identity>)` on the agent), video and audio go out as this participant's tracks.
    Returns when the room closes."""
    generator = LipsyncVideoGenerator(endpoint, model, sample_rate=sample_rate, pixel_format=pixel_format)
    options = await generator.start()
    runner = AvatarRunner(room, audio_recv=DataStreamAudioReceiver(room), video_gen=generator, options=options)
    try:
        await runner.start()
        await runner.wait_for_complete()
    finally:
        await runner.aclose()
        await generator.aclose()
