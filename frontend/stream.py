"""Live sessions from Python: `Session` (sync) and `AsyncSession` (asyncio), and the `stream` command.

    from frontend.stream import Session
    with Session("tcp://127.0.0.1:5555", "demo") as s:
        s.send_audio(windows)                 # [n, 32, 16, 16] float32: frames first_frame .. +n-1
        header, image, pcm = s.next_frame()   # {"event": "frame", "index", "pts_ms", "kind", "frame"}

Each session has its own DEALER socket: the server pushes its frames there, between the replies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np
import zmq
import zmq.asyncio

from config.audio import speech
from frontend.client import ClientTimeout, ServerError, _header, _new_socket, _parse

Frame = tuple[dict, bytes, Optional[bytes]]   # header, image, and its 40 ms of PCM (audio: "pcm16" sessions)


def _audio_frame(audio: np.ndarray) -> np.ndarray:
    """int16 PCM stays int16 (audio: "pcm16"); windows and features are float32."""
    return np.ascontiguousarray(audio, "<i2" if np.asarray(audio).dtype == np.int16 else "<f4")


def _frame(frames: list) -> Frame:
    return json.loads(frames[0]), frames[1] if len(frames) > 1 else b"", frames[2] if len(frames) > 2 else None


def _open_fields(model: str, format: str, quality: Optional[int], fps: Optional[float], start_frame: int,
                 audio: str, webrtc: bool = False) -> dict:
    return {"model": model, "format": format, "quality": quality, "fps": fps, "start_frame": start_frame,
            "audio": audio, "webrtc": webrtc or None}


class Session:
    """One live session (synchronous)."""

    def __init__(self, endpoint: str, model: str, *, format: str = "jpeg", quality: Optional[int] = None,
                 fps: Optional[float] = None, start_frame: int = 0, audio: str = "window", timeout_s: float = 30.0,
                 curve: Optional[dict] = None, webrtc: bool = False):
        self.timeout_s = timeout_s
        self._sock = _new_socket(zmq.Context.instance(), endpoint, curve)
        self._ids = itertools.count(1)
        self._frames: deque[Frame] = deque()
        self.info = self._request("session_open", **_open_fields(model, format, quality, fps, start_frame, audio,
                                                                  webrtc))
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
        self._sock.send_multipart([b"", _header(op, rid, **fields), *payload], copy=False)
        deadline = time.monotonic() + self.timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            frames = self._recv(remaining)
            if frames is None:
                break
            header = json.loads(frames[0])
            if header.get("event") == "frame":
                self._frames.append(_frame(frames))
            elif header.get("id") in (rid, None):
                return _parse(frames)[0]
        raise ClientTimeout(f"no reply to {op} within {self.timeout_s:g}s")

    def send_audio(self, audio: np.ndarray, last: bool = False) -> dict:
        """Audio for n frames (or int16 PCM); the reply's `first_frame` says where it landed on the stream."""
        return self._request("session_audio", [_audio_frame(audio)], session=self.token, last=last or None)

    def next_frame(self, timeout_s: Optional[float] = None) -> Optional[Frame]:
        if self._frames:
            return self._frames.popleft()
        frames = self._recv(self.timeout_s if timeout_s is None else timeout_s)
        if frames is None:
            return None
        return _frame(frames)   # a frame, or another push (closed, error) with no image

    def interrupt(self) -> int:
        return self._request("session_interrupt", session=self.token)["dropped"]

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
        self._sock = _new_socket(zmq.asyncio.Context.instance(), endpoint, curve)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()
        self._reader: Optional[asyncio.Task] = None
        self.info: dict = {}
        self.token = ""

    async def __aenter__(self) -> "AsyncSession":
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
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        await self._sock.send_multipart([b"", _header(op, rid, **fields), *payload], copy=False)
        try:
            return _parse(await asyncio.wait_for(future, self.timeout_s))[0]
        except asyncio.TimeoutError:
            self._waiting.pop(rid, None)
            raise ClientTimeout(f"no reply to {op} within {self.timeout_s:g}s") from None

    async def send_audio(self, audio: np.ndarray, last: bool = False) -> dict:
        return await self._request("session_audio", [_audio_frame(audio)], session=self.token, last=last or None)

    async def interrupt(self) -> int:
        return (await self._request("session_interrupt", session=self.token))["dropped"]

    async def keyframe(self) -> int:
        return (await self._request("session_keyframe", session=self.token))["frame"]

    async def stats(self) -> dict:
        return await self._request("session_stats", session=self.token)

    async def close(self) -> dict:
        if not self.token:
            return {}
        token, self.token = self.token, ""
        return await self._request("session_close", session=token)


# -- the `stream` command ---------------------------------------------------------------------------

def read_wav(path: str) -> np.ndarray:
    """A 16 kHz mono 16-bit WAV file's samples (int16), or a ValueError saying what to convert."""
    import wave
    with wave.open(path, "rb") as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (16000, 1, 2):
            raise ValueError(f"{path}: {w.getframerate()} Hz, {w.getnchannels()} channel(s), {8 * w.getsampwidth()} "
                             "bit; needs 16 kHz mono 16-bit (e.g. ffmpeg -i IN -ar 16000 -ac 1 OUT.wav)")
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


async def _one_stream(endpoint: str, model: str, seconds: float, duty: float, burst_s: float, seed: int,
                      out: Optional[Path], progress: dict, pcm: Optional[np.ndarray] = None, format: str = "jpeg",
                      webrtc: bool = False) -> dict:
    """A session that speaks `duty` of the time in bursts of about `burst_s`, audio sent in real time
    (one frame's window per frame period; or with `pcm`, the utterance in 20-ms chunks, once per
    burst), frames read as they come."""
    rng = np.random.default_rng(seed)
    if pcm is not None:
        burst_s = len(pcm) / 16000
    async with AsyncSession(endpoint, model, audio="pcm16" if pcm is not None else "window", format=format,
                            webrtc=webrtc) as s:
        if webrtc:
            print(f"session {seed}: watch it at {s.info['viewer_url']}", flush=True)
        fps = s.info["fps"]
        video = (out / f"s{seed}.h264").open("wb") if out is not None and format == "h264" else None
        shape = s.info["audio_shape"]
        on_time = late = received = 0
        first: Optional[tuple[float, int]] = None

        async def reader():
            nonlocal on_time, late, received, first
            while True:
                header, image, _ = await s.frames.get()
                now = time.monotonic()
                received += 1
                if first is None:
                    first = (now, header["index"])
                due = first[0] + (header["index"] - first[1]) / fps
                if now - due <= 0.040:
                    on_time += 1
                else:
                    late += 1
                progress[seed] = received
                if video is not None:
                    video.write(image)
                elif out is not None:
                    ext = "jpg" if format == "jpeg" else format
                    (out / f"s{seed}-{header['index']:06d}-{header['kind']}.{ext}").write_bytes(image)

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        speaking_until = 0.0
        next_burst = t0 + rng.uniform(0, 1.0) if duty > 0 else float("inf")   # speak within the first second
        tick, sent = 0, 0
        step = 1 / fps if pcm is None else 0.02
        while (now := time.monotonic()) - t0 < seconds:
            if now >= next_burst and now >= speaking_until:
                speaking_until = now + (burst_s * rng.uniform(0.5, 1.5) if pcm is None else burst_s + 1.0)
                next_burst = speaking_until + rng.exponential(burst_s * (1 - duty) / duty)
                sent = 0
            if pcm is not None and sent < len(pcm) and now < speaking_until:
                chunk = pcm[sent:sent + 320]
                sent += len(chunk)
                await s.send_audio(chunk, last=sent >= len(pcm))
            elif pcm is None and now < speaking_until:
                await s.send_audio(rng.standard_normal((1, *shape)).astype(np.float32))
            tick += 1
            await asyncio.sleep(max(t0 + tick * step - time.monotonic(), 0))
        stats = await s.close()
        task.cancel()
        if video is not None:
            video.close()
    return {"received": received, "on_time": on_time, "late": late, **stats}


async def run_stream(endpoint: str, model: str, seconds: float, duty: float, sessions: int = 1,
                     out: Optional[str] = None, burst_s: float = 3.0, quiet: bool = False,
                     pcm: Optional[str] = None, format: str = "jpeg", webrtc: bool = False) -> list[dict]:
    folder = Path(out) if out else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    progress: dict[int, int] = {}

    async def show():
        while True:
            await asyncio.sleep(1.0)
            if not quiet:
                sys.stderr.write(f"\r{len(progress)} session(s), {sum(progress.values())} frames received")

    shower = asyncio.create_task(show())
    samples = (speech() if pcm == "demo" else read_wav(pcm)) if pcm else None
    results = await asyncio.gather(*(_one_stream(endpoint, model, seconds, duty, burst_s, i, folder, progress, samples,
                                                 format, webrtc) for i in range(sessions)))
    shower.cancel()
    if not quiet:
        sys.stderr.write("\n")
    return results


def print_stream(results: list[dict]) -> None:
    for i, r in enumerate(results):
        on_time = 100 * r["on_time"] / max(r["received"], 1)
        print(f"session {i}: {r['received']} frames ({r['frames_speech']} speech, {r['frames_idle']} idle), "
              f"{on_time:.1f}% on time, missed {r['missed']}, dropped {r['dropped']}, server late {r['late']}, "
              f"speech latency p50 {r['latency_ms_p50']} ms, p99 {r['latency_ms_p99']} ms")


async def run_watch(endpoint: str, model: str, wait_s: float = 0.0, open_browser: bool = True) -> None:
    """A live H.264 session watched in a browser: prints its viewer URL (and opens it where there is
    a browser), then speaks the demo utterance every few seconds until interrupted."""
    from frontend.client import AsyncClient
    deadline = time.monotonic() + wait_s
    while True:   # the server may still be starting (building the demo on its first run)
        try:
            async with AsyncClient(endpoint, timeout_s=5) as client:
                if (await client.request("health"))[0]["status"] == "ready":
                    break
        except (ServerError, ClientTimeout, OSError):
            pass
        if time.monotonic() > deadline:
            raise ClientTimeout(f"no ready server at {endpoint}; start one with `python3 dev.py run`")
        await asyncio.sleep(1.0)
    pcm = speech()
    async with AsyncSession(endpoint, model, format="h264", audio="pcm16", webrtc=True) as s:
        url = s.info["viewer_url"]
        print(f"watch {model} talking: {url}   (Ctrl-C to stop)", flush=True)
        if open_browser:
            import webbrowser
            webbrowser.open(url)
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            for i, start in enumerate(range(0, len(pcm), 320)):
                await s.send_audio(pcm[start:start + 320], last=start + 320 >= len(pcm))
                await asyncio.sleep(max(t0 + (i + 1) * 0.02 - loop.time(), 0))
            await asyncio.sleep(2.0)

