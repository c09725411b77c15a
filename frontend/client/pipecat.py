"""A Pipecat avatar service backed by this server: your own avatars at the end of any Pipecat voice
agent (extra `pipecat`: `pip install lipsync-serve[pipecat]`), in place of a cloud avatar service.

    from frontend.client.pipecat import LipsyncVideoService
    avatar = LipsyncVideoService(model="demo", endpoint="tcp://127.0.0.1:5555")
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, avatar, transport.output(), assistant_agg])
    # transport: video_out_enabled=True, video_out_is_live=True, video_out_width/height = the avatar's
    # size (avatar.size once started, or `python -m frontend.client models`), video_out_framerate=25

It opens one live session (docs/protocol.md#live-sessions) when the pipeline starts and closes it at
its end. It takes the TTS's audio (`TTSAudioRawFrame`, at the TTS's own rate), `TTSStartedFrame` /
`TTSStoppedFrame` and `InterruptionFrame` (barge-in: `session_interrupt`), and passes every other
frame on. Out, at the session's 25 fps: one `OutputImageRawFrame` (RGB) per frame, idle frames
included, and with each frame of an utterance that frame's own samples as a `TTSAudioRawFrame` (the
samples that came in, at their rate), so audio and video leave together and cannot drift; the
`TTSStoppedFrame` is pushed after the utterance's last frame, so the bot "speaks" while its face does.
A server that stops sending frames is a pipeline error (`ErrorFrame`), not a hang.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.ai_service import AIService
from pipecat.services.settings import ServiceSettings

from frontend.client.avatar import STALL_S, AvatarGone, AvatarStream
from frontend.client.wire import DEFAULT_ENDPOINT

DRAIN_S = 30.0       # at the pipeline's end, how long what was said may still take to play


class LipsyncVideoService(AIService):
    """Pipecat avatar service: TTS audio in, the avatar's frames and the same audio out, paced by the server."""

    def __init__(self, *, model: str, endpoint: str = DEFAULT_ENDPOINT, curve: Optional[dict] = None,
                 start_frame: int = 0, stall_s: float = STALL_S, **kwargs):
        super().__init__(settings=ServiceSettings(model=model), **kwargs)
        self._model, self._endpoint, self._curve = model, endpoint, curve
        self._start_frame, self._stall_s = start_frame, stall_s
        self._rate = 24000                 # the pipeline's output rate until a TTS frame says otherwise
        self._stream: Optional[AvatarStream] = None
        self._reader: Optional[asyncio.Task] = None
        self._stops: dict[int, TTSStoppedFrame] = {}   # held until that utterance's last frame is out
        self._played = asyncio.Event()     # set whenever nothing is left to play
        self.size: Optional[tuple[int, int]] = None    # the avatar's (width, height), once started

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._rate = setup.audio_out_sample_rate or self._rate

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self._connect(self._rate)

    async def stop(self, frame: EndFrame):
        """The pipeline ends: what was said plays to its end first (at most DRAIN_S)."""
        await super().stop(frame)
        if self._stream is not None:
            await self._guard(self._end_utterance(None))
            if self._stream is not None and self._stream.playing:
                self._played.clear()
                try:
                    await asyncio.wait_for(self._played.wait(), DRAIN_S)
                except asyncio.TimeoutError:
                    pass
        await self._disconnect()

    async def cancel(self, frame: CancelFrame):
        await super().cancel(frame)
        await self._disconnect()

    async def cleanup(self):
        await super().cleanup()
        await self._disconnect()

    # -- the session --------------------------------------------------------------------------------

    async def _connect(self, rate: int) -> None:
        stream = AvatarStream(self._endpoint, self._model, sample_rate=rate, pixel_format="rgb24",
                              curve=self._curve, start_frame=self._start_frame, stall_s=self._stall_s)
        try:
            await stream.open()
        except AvatarGone as err:
            await self.push_error(error_msg=str(err), exception=err, force_treat_as_permanent=True)
            return
        self._stream, self._rate = stream, rate
        self.size = (stream.width, stream.height)
        self._reader = self.create_task(self._read(stream))

    async def _disconnect(self) -> None:
        if self._reader is not None:
            await self.cancel_task(self._reader)
            self._reader = None
        if self._stream is not None:
            stream, self._stream = self._stream, None
            self._played.set()
            await stream.close()

    async def _read(self, stream: AvatarStream) -> None:
        """The server's frames, as they come (it paces them): image, and the utterance's audio with it."""
        size = (stream.width, stream.height)
        while True:
            try:
                frame = await stream.next()
            except AvatarGone as err:
                self._played.set()
                await self.push_error(error_msg=str(err), exception=err, force_treat_as_permanent=True)
                return
            await self.push_frame(OutputImageRawFrame(image=frame.image, size=size, format="RGB"))
            if frame.utterance is None:
                continue
            await self.push_frame(TTSAudioRawFrame(audio=frame.audio, sample_rate=stream.sample_rate,
                                                   num_channels=1))
            if frame.ended:
                stop = self._stops.pop(frame.utterance, None)
                if stop is not None:
                    await self.push_frame(stop)
                if not stream.playing:
                    self._played.set()

    # -- frames in ----------------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
            await self._guard(self._speak(frame))
        elif isinstance(frame, TTSStoppedFrame) and direction == FrameDirection.DOWNSTREAM:
            await self._guard(self._end_utterance(frame))
        elif isinstance(frame, InterruptionFrame):
            self._stops.clear()   # what was said and not yet played is dropped, its stops with it
            if self._stream is not None:
                await self._guard(self._stream.interrupt())
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _speak(self, frame: TTSAudioRawFrame) -> None:
        pcm = np.frombuffer(frame.audio, "<i2")
        if frame.num_channels > 1:   # the server takes mono: the channels' mean
            pcm = pcm.reshape(-1, frame.num_channels).mean(axis=1).astype("<i2")
        if self._stream is not None and frame.sample_rate != self._stream.sample_rate:
            # a TTS at another rate than the pipeline's: a session at its rate (what was queued is dropped)
            await self._disconnect()
            await self._connect(frame.sample_rate)
        if self._stream is not None:
            await self._stream.say(pcm)

    async def _end_utterance(self, stop: Optional[TTSStoppedFrame]) -> None:
        """The TTS finished: the stop goes out with the utterance's last frame (at once if it said nothing)."""
        utterance = await self._stream.end() if self._stream is not None else None
        if stop is None:
            return
        if utterance is None:
            await self.push_frame(stop)
        else:
            self._stops[utterance] = stop

    async def _guard(self, call) -> None:
        try:
            await call
        except AvatarGone as err:
            await self.push_error(error_msg=str(err), exception=err, force_treat_as_permanent=True)
