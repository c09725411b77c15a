"""One live session as a voice agent's avatar, with no framework in it: the part the Pipecat service
(pipecat.py) and the LiveKit video generator (livekit.py) share.

    stream = AvatarStream(endpoint, "demo", sample_rate=24000, pixel_format="rgb24")
    await stream.open()
    await stream.say(pcm)          # int16 mono at sample_rate, as the TTS gives it: an utterance starts
    await stream.end()             # the TTS finished it
    frame = await stream.next()    # every frame the server paces out: image, and its audio while speaking

The TTS's utterances are counted as the server counts them (docs/protocol.md, "utterance"), so each
frame says which utterance it plays, and `frame.ended` marks the one after which that utterance has
played to its end. Frames of an interrupted utterance carry no audio. The first ~453 ms of an
utterance (the model's look-ahead) is sent as one chunk: the server then places its first frame by
the audio in hand, the latency budget ahead (a TTS faster than real time has it sooner than that).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

import numpy as np

from config.audio import SAMPLE_RATE
from frontend.client.sessions import AsyncSession
from frontend.client.wire import DEFAULT_ENDPOINT, ClientTimeout, ServerError

LOOKAHEAD_SAMPLES = 7240     # at 16 kHz: what frame 0 of an utterance needs before it can be inferred
STALL_S = 3.0                # no frame for this long (the server sends 25 a second): the server is gone
REQUEST_TIMEOUT_S = 5.0


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
                 stall_s: float = STALL_S, timeout_s: float = REQUEST_TIMEOUT_S):
        self.endpoint, self.model, self.sample_rate, self.pixel_format = endpoint, model, sample_rate, pixel_format
        self._session = AsyncSession(endpoint, model, curve=curve, timeout_s=timeout_s, format="raw",
                                     pixel_format=pixel_format, audio="pcm16", sample_rate=sample_rate,
                                     start_frame=start_frame)
        self.stall_s = stall_s
        self.width = self.height = 0
        self.fps = 25.0
        self._opened = False
        self._utterances = 0                  # the server's utterance ids, counted as it counts them
        self._speaking = False                # the TTS is in an utterance
        self._id: Optional[int] = None        # ... its id, once its first chunk went to the server
        self._head: Optional[bytearray] = None   # ... its first samples, until the look-ahead is in hand
        self._head_needed = -(-LOOKAHEAD_SAMPLES * sample_rate // SAMPLE_RATE)
        self.playing: set[int] = set()        # said, and not yet played to its last frame

    async def open(self) -> dict:
        try:
            await self._session.__aenter__()
        except (ServerError, ClientTimeout) as err:
            await self._session.__aexit__(None, None, None)
            raise AvatarGone(f"lip-sync server {self.endpoint}: opening a session of model {self.model!r} "
                             f"failed: {err}") from err
        self._opened = True
        info = self._session.info
        self.width, self.height, self.fps = info["width"], info["height"], info["fps"]
        return info

    async def close(self) -> None:
        if self._opened:
            self._opened = False
            await self._session.__aexit__(None, None, None)

    async def say(self, pcm: np.ndarray) -> None:
        """More of the utterance being spoken (a new one if none is)."""
        pcm = np.ascontiguousarray(pcm, "<i2")
        if not len(pcm):
            return
        if not self._speaking:
            self._speaking, self._id, self._head = True, None, bytearray()
        if self._head is not None:
            self._head += pcm.tobytes()
            if len(self._head) // 2 < self._head_needed:
                return
            pcm, self._head = np.frombuffer(bytes(self._head), "<i2"), None
        await self._send(pcm, last=False)

    async def end(self) -> Optional[int]:
        """The TTS finished the utterance: the server marks its last frame. Returns its id (None: it
        was empty, nothing will mark it)."""
        if not self._speaking:
            return None
        head = np.frombuffer(bytes(self._head or b""), "<i2")
        if self._id is None and not len(head):
            self._speaking = False
            return None
        await self._send(head, last=True)
        self._speaking, self._head = False, None
        return self._id

    async def interrupt(self) -> None:
        """Barge-in: what was said and has not played yet is dropped; idle frames follow."""
        self._speaking, self._head = False, None
        self.playing.clear()
        await self._call(self._session.interrupt())

    async def _send(self, pcm: np.ndarray, last: bool) -> None:
        if self._id is None:   # the utterance's first chunk: the server opens its next utterance
            self._utterances += 1
            self._id = self._utterances
            self.playing.add(self._id)
        await self._call(self._session.send_audio(pcm, last=last))

    async def next(self) -> AvatarFrame:
        """The next frame, as the server paces it (25 fps); AvatarGone when none comes for stall_s."""
        try:
            header, image, pcm = await asyncio.wait_for(self._session.frames.get(), self.stall_s)
        except asyncio.TimeoutError:
            raise AvatarGone(f"lip-sync server {self.endpoint} sent no frame for {self.stall_s:g}s: "
                             "is it running?") from None
        utterance = header.get("utterance")
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
