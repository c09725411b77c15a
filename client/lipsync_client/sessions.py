"""Live sessions from Python: `Session` (sync) and `AsyncSession` (asyncio), and the `stream` command.

    from lipsync_client import Session
    with Session("tcp://127.0.0.1:5555", "demo") as s:
        s.send_audio(windows)                 # [n, 32, 16, 16] float32: frames first_frame .. +n-1
        header, image, pcm = s.next_frame()   # {"event": "frame", "index", "pts_ms", "kind", "frame"}

Each session has its own DEALER socket: the server pushes its frames there, between the replies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import deque
from typing import Optional

import numpy as np
import zmq
import zmq.asyncio

from lipsync_client import wire
from lipsync_client.wire import ClientTimeout, ServerError

Frame = tuple[dict, bytes, Optional[bytes]]   # header, image, and its 40 ms of PCM (audio: "pcm16" sessions)


def _audio_frame(audio: np.ndarray) -> np.ndarray:
    """int16 PCM stays int16 (audio: "pcm16"); windows and features are float32."""
    return np.ascontiguousarray(audio, "<i2" if np.asarray(audio).dtype == np.int16 else "<f4")


def _frame(frames: list) -> Frame:
    return json.loads(frames[0]), frames[1] if len(frames) > 1 else b"", frames[2] if len(frames) > 2 else None


def _open_fields(model: str, format: str, quality: Optional[int], fps: Optional[float], start_frame: int,
                 audio: str, webrtc: bool = False, sample_rate: Optional[int] = None,
                 pixel_format: Optional[str] = None) -> dict:
    return {"model": model, "format": format, "quality": quality, "fps": fps, "start_frame": start_frame,
            "audio": audio, "webrtc": webrtc or None, "sample_rate": sample_rate, "pixel_format": pixel_format}


class Session:
    """One live session (synchronous)."""

    def __init__(self, endpoint: str, model: str, *, format: str = "jpeg", quality: Optional[int] = None,
                 fps: Optional[float] = None, start_frame: int = 0, audio: str = "window", timeout_s: float = 30.0,
                 curve: Optional[dict] = None, webrtc: bool = False, sample_rate: Optional[int] = None,
                 pixel_format: Optional[str] = None):
        self.timeout_s = timeout_s
        self._sock = wire.new_socket(zmq.Context.instance(), endpoint, curve)
        self._ids = itertools.count(1)
        self._frames: deque[Frame] = deque()
        self.info = self._request("session_open", **_open_fields(model, format, quality, fps, start_frame, audio,
                                                                  webrtc, sample_rate, pixel_format))
        self.token: str = self.info["session"]
        self.closed = False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        if not self.closed:
            try:
                self.close()
            except (ServerError, ClientTimeout):
                pass
        self._sock.close(linger=0)

    def _recv(self, timeout_s: float) -> Optional[list]:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return self._sock.recv_multipart()[1:]

    def _request(self, op: str, payload=(), **fields) -> dict:
        rid = next(self._ids)
        wire.send_within(self._sock, [b"", wire.header(op, rid, **fields), *payload], self.timeout_s, op)
        deadline = time.monotonic() + self.timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            frames = self._recv(remaining)
            if frames is None:
                break
            header = json.loads(frames[0])
            if header.get("event") == "frame":
                self._frames.append(_frame(frames))
            elif header.get("id") in (rid, None):
                return wire.parse(frames)[0]
        raise ClientTimeout(f"no reply to {op} within {self.timeout_s:g}s")

    def send_audio(self, audio: np.ndarray, last: bool = False, utterance: Optional[int] = None) -> dict:
        """Audio for n frames (or int16 PCM); the reply's `first_frame` says where it landed on the stream.
        `utterance`: the client's id for the utterance it belongs to (1, 2, ...: docs/protocol.md)."""
        return self._request("session_audio", [_audio_frame(audio)], session=self.token, last=last or None,
                             utterance=utterance)

    def next_frame(self, timeout_s: Optional[float] = None) -> Optional[Frame]:
        if self._frames:
            return self._frames.popleft()
        frames = self._recv(self.timeout_s if timeout_s is None else timeout_s)
        if frames is None:
            return None
        return _frame(frames)   # a frame, or another push (closed, error) with no image

    def interrupt(self, utterance: Optional[int] = None) -> int:
        """Barge-in: retire every utterance up to `utterance` (default: all so far); returns the frames dropped."""
        return self._request("session_interrupt", session=self.token, utterance=utterance)["dropped"]

    def keyframe(self) -> int:
        """h264: the next frame decided is an IDR; returns its index."""
        return self._request("session_keyframe", session=self.token)["frame"]

    def stats(self) -> dict:
        return self._request("session_stats", session=self.token)

    def close(self) -> dict:
        self.closed = True
        return self._request("session_close", session=self.token)


class AsyncSession:
    """One live session (asyncio): frames arrive on `self.frames` (an asyncio.Queue) as they come."""

    def __init__(self, endpoint: str, model: str, *, curve: Optional[dict] = None, timeout_s: float = 30.0,
                 **open_fields):
        self.endpoint, self.model, self.timeout_s = endpoint, model, timeout_s
        self._open_fields = {"format": "jpeg", "quality": None, "fps": None, "start_frame": 0, "audio": "window",
                             **open_fields}
        self._sock = wire.new_socket(zmq.asyncio.Context.instance(), endpoint, curve)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()
        self._reader: Optional[asyncio.Task] = None
        self.info: dict = {}
        self.token = ""

    async def __aenter__(self) -> "AsyncSession":
        if self.token:   # open already: entering it again is the same session, not a second one
            return self
        self._reader = asyncio.create_task(self._read())
        self.info = await self._request("session_open", **_open_fields(self.model, **self._open_fields))
        self.token = self.info["session"]
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.close()
        except (ServerError, ClientTimeout):
            pass
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        wire.fail_waiting(self._waiting, "the session")   # (chunks pushed and not yet answered)

    async def _read(self) -> None:
        while True:
            frames = (await self._sock.recv_multipart())[1:]
            header = json.loads(frames[0])
            if header.get("event") == "frame":
                self.frames.put_nowait(_frame(frames))
                continue
            future = self._waiting.pop(header.get("id"), None)
            if future is not None and not future.done():
                future.set_result(frames)

    async def _request(self, op: str, payload=(), **fields) -> dict:
        return await self._reply(op, *self._send(op, payload, fields))

    def _send(self, op: str, payload, fields: dict) -> tuple:
        """Send a request now, in order with every other request of the session (pyzmq queues a send it
        cannot make at once, in order); `_reply` waits for its answer."""
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        sent = self._sock.send_multipart([b"", wire.header(op, rid, **fields), *payload], copy=False)
        return rid, sent, future

    async def _reply(self, op: str, rid: int, sent: asyncio.Future, future: asyncio.Future) -> dict:
        async def answer() -> list:
            # NOTE: the send too: a socket whose handshake failed (keys the server refuses) never sends
            await sent
            return await future

        try:
            return wire.parse(await asyncio.wait_for(answer(), self.timeout_s))[0]
        except asyncio.TimeoutError:
            raise ClientTimeout(f"no reply to {op} within {self.timeout_s:g}s") from None
        finally:   # answered, timed out, or the caller was cancelled (a barge-in cancels a pending send)
            self._waiting.pop(rid, None)

    async def send_audio(self, audio: np.ndarray, last: bool = False, utterance: Optional[int] = None) -> dict:
        return await self.push_audio(audio, last, utterance)

    def push_audio(self, audio: np.ndarray, last: bool = False, utterance: Optional[int] = None) -> asyncio.Task:
        """Send a chunk now, without waiting for its reply: the reply comes in the returned task. A client
        that streams audio keeps several chunks in flight, so that its pace is not the server's round
        trip (a remote server's: a TTS's 20-ms chunks, each awaited, would stream at most at 20 ms /
        round trip of real time)."""
        fields = {"session": self.token, "last": last or None, "utterance": utterance}
        return asyncio.ensure_future(self._reply("session_audio", *self._send("session_audio", [_audio_frame(audio)],
                                                                                 fields)))

    async def interrupt(self, utterance: Optional[int] = None) -> int:
        return (await self._request("session_interrupt", session=self.token, utterance=utterance))["dropped"]

    async def keyframe(self) -> int:
        return (await self._request("session_keyframe", session=self.token))["frame"]

    async def stats(self) -> dict:
        return await self._request("session_stats", session=self.token)

    async def close(self) -> dict:
        if not self.token:
            return {}
        token, self.token = self.token, ""
        return await self._request("session_close", session=token)
