"""One live session as a voice agent's avatar, with no framework in it: the part the Pipecat service
(pipecat.py) and the LiveKit video generator (livekit.py) share.

    stream = AvatarStream(endpoint, "demo", sample_rate=24000, pixel_format="rgb24")
    await stream.open()
    u = stream.begin()             # an utterance starts (say() without one starts one too)
    await stream.say(pcm, u)       # int16 mono at sample_rate, as the TTS gives it
    await stream.end(u)            # the TTS finished it
    await stream.interrupt()       # barge-in: every utterance so far is retired
    frame = await stream.next()    # every frame the server paces out: image, and its audio while speaking

Each utterance has an id given here and sent with each of its chunks (docs/protocol.md, "utterance"),
so each frame says which utterance it plays, and `frame.ended` marks the one after which that
utterance has played to its end. An interrupt retires every utterance so far, here and at the
server: samples of a retired utterance said later (audio that was on its way when the user barged
in) are dropped, and its frames still on their way from the server come out with no audio and, in
place of its speech image, the avatar's last idle frame. A full server (`busy`) is asked again when
it says, for up to `busy_wait_s`. The first ~453 ms of an utterance (the
model's look-ahead) is sent as one chunk: the server then places its first frame by the audio in
hand, the latency budget ahead (a TTS faster than real time has it sooner than that). After it, a
chunk of less than a video frame's audio (40 ms; LiveKit's frames are 10 ms) waits here for more: each
chunk is a request the server reads and answers, and fewer, larger ones cost its event loop less; the
samples held are sent at `end` whatever their length.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lipsync_client.contract import SAMPLE_RATE
from lipsync_client.sessions import AsyncSession
from lipsync_client.wire import DEFAULT_ENDPOINT, ClientTimeout, ServerError

LOOKAHEAD_SAMPLES = 7240     # at 16 kHz: what frame 0 of an utterance needs before it can be inferred
STALL_S = 3.0                # no frame for this long (the server sends 25 a second): the server is gone
REQUEST_TIMEOUT_S = 5.0
MAX_IN_FLIGHT = 16           # audio chunks sent and not yet answered (then `say` waits for the oldest)
BUSY_WAIT_S = 10.0           # a full server (`busy`): how long `open` asks again for room before giving up

log = logging.getLogger(__name__)


class AvatarGone(ConnectionError):
    """The server did not answer or stopped sending frames; the message names the endpoint."""


@dataclass
class AvatarFrame:
    index: int
    image: bytes                  # width x height in the stream's pixel_format
    audio: Optional[bytes]        # the frame's 1/25 s of the utterance's samples (int16); None: silence
    utterance: Optional[int]      # the utterance it plays (None: silence, or one that was interrupted)
    ended: bool                   # the utterance's last frame: it has played to its end


class AvatarStream:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, model: str = "demo", *, sample_rate: int = 24000,
                 pixel_format: str = "rgb24", curve: Optional[dict] = None, start_frame: int = 0,
                 stall_s: float = STALL_S, timeout_s: float = REQUEST_TIMEOUT_S, busy_wait_s: float = BUSY_WAIT_S):
        """`busy_wait_s`: how long `open` keeps asking a full server (`busy`) for room, as often as it says."""
        self.endpoint, self.model, self.sample_rate, self.pixel_format = endpoint, model, sample_rate, pixel_format
        self._new_session = lambda: AsyncSession(endpoint, model, curve=curve, timeout_s=timeout_s, format="raw",
                                                 pixel_format=pixel_format, audio="pcm16", sample_rate=sample_rate,
                                                 start_frame=start_frame)
        self._session = self._new_session()
        self.busy_wait_s = busy_wait_s
        self.stall_s = stall_s
        self.width = self.height = 0
        self.fps = 25.0
        self._opened = False
        self._last_id = 0                     # the highest utterance id given out
        self.retired = 0                      # every utterance up to this id was interrupted
        self._id: Optional[int] = None        # the utterance being said
        self._sent = False                    # ... whether any of it went to the server
        self._held = bytearray()              # ... its samples not sent yet: fewer than `_need`
        self._lookahead = -(-LOOKAHEAD_SAMPLES * sample_rate // SAMPLE_RATE)   # the first chunk's samples
        self._chunk = sample_rate // 25       # the least a later chunk sends: one video frame's audio (40 ms)
        self._need = self._lookahead          # ... the least its next chunk sends
        self.playing: set[int] = set()        # said, and not yet played to its last frame
        # NOTE: chunks go out without waiting for each reply (their order is the socket's), so that the
        # TTS's pace is not the server's round trip; what a reply says is raised at the next say or end
        self._in_flight: deque[asyncio.Task] = deque()
        self._idle_image: Optional[bytes] = None   # the last idle frame (shown in place of cut speech)

    async def open(self) -> dict:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.busy_wait_s
        while True:
            try:
                await self._session.__aenter__()
                break
            except (ServerError, ClientTimeout, asyncio.CancelledError) as err:
                await self._session.__aexit__(None, None, None)
                if isinstance(err, asyncio.CancelledError):
                    raise
                retry = err.retry_after_s if isinstance(err, ServerError) and err.code == "busy" else None
                if retry is None or loop.time() + retry > give_up:
                    raise AvatarGone(f"lip-sync server {self.endpoint}: opening a session of model {self.model!r} "
                                     f"failed: {err}") from err
                log.info("lip-sync server %s is full (%s); asking again in %.1f s", self.endpoint, err.message, retry)
                await asyncio.sleep(retry)   # as the server says: its room is measured, not guessed here
                self._session = self._new_session()
        self._opened = True
        info = self._session.info
        self.width, self.height, self.fps = info["width"], info["height"], info["fps"]
        return info

    async def close(self) -> None:
        for task in self._in_flight:
            task.cancel()
        self._in_flight.clear()
        if self._opened:
            self._opened = False
            await self._session.__aexit__(None, None, None)

    @property
    def speaking(self) -> Optional[int]:
        """The utterance being said (begun, not yet ended or interrupted)."""
        return self._id

    def begin(self) -> int:
        """A new utterance; the one being said, if any, is left for `end` (its chunks are refused now)."""
        self._last_id += 1
        self._id, self._sent, self._held, self._need = self._last_id, False, bytearray(), self._lookahead
        return self._id

    async def say(self, pcm: np.ndarray, utterance: Optional[int] = None) -> bool:
        """More of `utterance` (default: the one being said, else a new one). False when it is not being
        said (interrupted, or ended): its samples are dropped."""
        if utterance is None:
            utterance = self._id if self._id is not None else self.begin()
        if utterance != self._id:
            return False
        pcm = np.ascontiguousarray(pcm, "<i2")
        if not len(pcm):
            return True
        if self._held or len(pcm) < self._need:
            self._held += pcm.tobytes()
            if len(self._held) // 2 < self._need:
                return True
            pcm, self._held = np.frombuffer(bytes(self._held), "<i2"), bytearray()
        self._need = self._chunk
        await self._send(utterance, pcm, last=False)
        return True

    async def end(self, utterance: Optional[int] = None) -> Optional[int]:
        """The TTS finished `utterance` (default: the one being said): the server marks its last frame.
        Returns its id (None: it said nothing, or it was not being said: nothing will mark it)."""
        if self._id is None or utterance not in (None, self._id):
            return None
        utterance, sent = self._id, self._sent
        head = np.frombuffer(bytes(self._held), "<i2")
        # NOTE: the state changes before the await: what comes meanwhile (more audio, an interrupt) sees
        # the utterance ended
        self._id, self._held = None, bytearray()
        if not sent and not len(head):
            return None
        await self._send(utterance, head, last=True)
        await self._answered(0)   # every chunk of it answered, as when each was awaited
        return utterance

    async def interrupt(self) -> None:
        """Barge-in: every utterance so far is retired, here and at the server: what was said and has
        not played is dropped, and so is whatever of them is said later; idle frames follow."""
        # NOTE: retired here before the request goes: a frame read meanwhile already counts as cut
        self.retired = self._last_id
        self._id, self._held = None, bytearray()
        self.playing.clear()
        for task in self._in_flight:   # what their replies say no longer matters: they are retired
            task.cancel()
        self._in_flight.clear()
        await self._call(self._session.interrupt(self.retired or None))

    async def _send(self, utterance: int, pcm: np.ndarray, last: bool) -> None:
        self._sent = True
        self.playing.add(utterance)
        await self._answered(MAX_IN_FLIGHT - 1)
        self._in_flight.append(self._session.push_audio(pcm, last=last, utterance=utterance))

    async def _answered(self, most: int) -> None:
        """Wait until at most `most` chunks are unanswered; raise what an answered one said (ServerError;
        AvatarGone when the server did not answer)."""
        while self._in_flight and (len(self._in_flight) > most or self._in_flight[0].done()):
            await self._call(self._in_flight.popleft())

    async def next(self) -> AvatarFrame:
        """The next frame, as the server paces it (25 fps); AvatarGone when none comes for stall_s."""
        while True:
            try:
                header, image, pcm = await asyncio.wait_for(self._session.frames.get(), self.stall_s)
            except asyncio.TimeoutError:
                raise AvatarGone(f"lip-sync server {self.endpoint} sent no frame for {self.stall_s:g}s: "
                                 "is it running?") from None
            utterance = header.get("utterance")
            if header.get("kind") != "speech":
                self._idle_image = image
            elif utterance is not None and utterance <= self.retired:
                # sent before the server had the interrupt: its speech image must not come out now
                if self._idle_image is None:
                    continue
                image = self._idle_image
            if utterance not in self.playing:
                return AvatarFrame(header["index"], image, None, None, False)
            ended = bool(header.get("last"))
            if ended:
                self.playing.discard(utterance)
            return AvatarFrame(header["index"], image, pcm, utterance, ended)

    async def _call(self, request) -> None:
        try:
            await request
        except ClientTimeout as err:
            raise AvatarGone(f"lip-sync server {self.endpoint}: {err}") from err
