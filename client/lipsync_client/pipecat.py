"""A Pipecat avatar service backed by this server: your own avatars at the end of any Pipecat voice
agent (extra `pipecat`: `pip install lipsync-serve[pipecat]`), in place of a cloud avatar service.

    from lipsync_client.pipecat import LipsyncVideoService
    avatar = LipsyncVideoService(model="demo", endpoint="tcp://127.0.0.1:5555")
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, avatar, transport.output(), assistant_agg])
    # transport: video_out_enabled=True, video_out_is_live=False, video_out_width/height = the avatar's
    # size (avatar.size once started, or `python -m lipsync_client models`), video_out_framerate=25

It opens one live session (docs/protocol.md#live-sessions) when the pipeline starts and closes it at
its end. It takes the TTS's audio (`TTSAudioRawFrame`, at the TTS's own rate), `TTSStartedFrame` /
`TTSStoppedFrame` (an utterance's start and end) and `InterruptionFrame` (barge-in: every utterance so
far is retired, `session_interrupt`), and passes every other frame on. Audio of an interrupted
utterance that comes after the interruption (the TTS's frames still on their way) is dropped: audio
of a TTS context that was cut, and, from a TTS that announces its utterances with `TTSStartedFrame`,
any audio before its next one. Out, at the session's 25 fps: one `OutputImageRawFrame` (RGB) per frame, idle frames
included, and with each frame of an utterance that frame's own samples as a `TTSAudioRawFrame` (the
samples that came in, at their rate). Each image goes with `sync_with_audio`: the output transport
queues it with the audio and shows it once the audio before it has played, so the face stays on the
voice when the transport's audio falls behind (a loaded host: an output that runs dry plays silence,
and what follows plays that much later); the transport's video is then not live
(`video_out_is_live=False`: it shows the latest image at `video_out_framerate`). The `TTSStoppedFrame`
is pushed after the utterance's last frame, so the bot "speaks" while its face does.
A server that stops sending frames is a pipeline error (`ErrorFrame`), not a hang.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.ai_service import AIService
from pipecat.services.settings import ServiceSettings
from pipecat.transports.base_output import BaseOutputTransport

from lipsync_client.avatar import STALL_S, AvatarGone, AvatarStream
from lipsync_client.wire import DEFAULT_ENDPOINT

DRAIN_S = 30.0       # at the pipeline's end, how long what was said may still take to play
CUT_CONTEXTS = 64    # TTS contexts remembered as cut (their late audio is dropped)


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
        self._announced = False            # the TTS starts its utterances with TTSStartedFrame
        self._cut = False                  # interrupted, and no TTSStartedFrame since
        self._contexts: dict[str, None] = {}       # TTS contexts heard since the last stop (ordered set)
        self._cut_contexts: dict[str, None] = {}   # TTS contexts an interruption cut (the latest CUT_CONTEXTS)
        self._played = asyncio.Event()     # set whenever nothing is left to play
        self.size: Optional[tuple[int, int]] = None    # the avatar's (width, height), once started

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._rate = setup.audio_out_sample_rate or self._rate

    async def start(self, frame: StartFrame):
        await super().start(frame)
        self._check_transport()
        await self._connect(self._rate)

    def _check_transport(self) -> None:
        """A live video output never shows images queued with the audio: say so, rather than a still face."""
        processor = self.next
        while processor is not None:
            params = getattr(processor, "_params", None)
            if isinstance(processor, BaseOutputTransport) and getattr(params, "video_out_is_live", False):
                logger.warning(f"{self}: {processor} has video_out_is_live=True, and shows none of the avatar's "
                               "frames (each is queued with its audio): set video_out_is_live=False on the "
                               "transport's TransportParams")
            processor = processor.next

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
            await stream.open()   # (cancelled by an interruption, it closes what it opened)
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
            image = OutputImageRawFrame(image=frame.image, size=size, format="RGB")
            image.sync_with_audio = True   # shown when the audio pushed before it has played
            await self.push_frame(image)
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
        elif isinstance(frame, TTSStartedFrame) and direction == FrameDirection.DOWNSTREAM:
            self._announced, self._cut = True, False
            self._heard(frame.context_id)
            if self._stream is not None and self._stream.speaking is None:
                self._stream.begin()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSStoppedFrame) and direction == FrameDirection.DOWNSTREAM:
            self._contexts.clear()
            await self._guard(self._end_utterance(frame))
        elif isinstance(frame, InterruptionFrame):
            self._interrupted()
            if self._stream is not None:
                await self._guard(self._stream.interrupt())
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    def _interrupted(self) -> None:
        """What was said and not yet played is dropped, its stops with it; the contexts heard since the
        last stop are cut, and (from a TTS that announces its utterances) so is all audio until the next
        TTSStartedFrame."""
        self._stops.clear()
        self._cut = True
        self._cut_contexts.update(self._contexts)
        self._contexts.clear()
        while len(self._cut_contexts) > CUT_CONTEXTS:
            del self._cut_contexts[next(iter(self._cut_contexts))]

    def _heard(self, context: Optional[str]) -> None:
        if context is not None:
            self._contexts[context] = None

    def _is_cut(self, frame: TTSAudioRawFrame) -> bool:
        """Audio of an interrupted utterance, arriving after the interruption."""
        if frame.context_id is not None:
            return frame.context_id in self._cut_contexts
        return self._cut and self._announced

    async def _speak(self, frame: TTSAudioRawFrame) -> None:
        if self._is_cut(frame):
            return
        self._heard(frame.context_id)
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
