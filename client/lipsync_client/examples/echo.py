"""Echo avatar: your microphone, spoken back by your avatar in the browser. No cloud account, no API
key: Pipecat's SmallWebRTCTransport (aiortc) carries the browser's microphone in and the avatar's
video and voice out, and the lip-sync server makes the face.

    python3 dev.py run                                  # the lip-sync server (demo avatar), one terminal
    .venv/bin/python -m lipsync_client.examples.echo   # this, another: open http://127.0.0.1:7860

The pipeline is a voice agent with the STT, LLM and TTS taken out: what the microphone hears goes to
`LipsyncVideoService` as if a TTS had said it, cut into utterances at pauses (`MicAsSpeech`), and the
avatar says it back, its lips moving, under a second later (the model's 453 ms look-ahead, the
server's latency budget, WebRTC both ways: docs/integrations.md, "Latency to expect"):

    transport.input() -> MicAsSpeech -> LipsyncVideoService -> transport.output()

Each browser that connects gets its own pipeline and its own live session on the server. The page
asks for the microphone, which a browser allows on http://127.0.0.1 or localhost and otherwise only
over https. Use headphones, or leave the browser's echo cancellation on (the page does), or the
avatar hears itself and repeats what it said.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Optional

import numpy as np
from aiohttp import web
from loguru import logger
from pipecat.frames.frames import Frame, InputAudioRawFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.workers.runner import WorkerRunner

from lipsync_client.pipecat import LipsyncVideoService
from lipsync_client.requests import Client
from lipsync_client.wire import DEFAULT_ENDPOINT, ClientTimeout, ServerError

RATE = 16000            # the microphone's audio in the pipeline, and so the avatar's session and its audio out
FPS = 25
OPEN_DBFS = -45.0       # a 20-ms frame louder than this (RMS) opens an utterance or keeps it going
PAUSE_S = 0.6           # this long below it ends the utterance
PRE_ROLL_S = 0.3        # the quiet audio just before it opened goes with it (a word's soft start)
MAX_UTTERANCE_S = 10.0  # the server keeps an utterance's samples until it ends: talk past this is cut
MAX_OFFER_BYTES = 64 * 1024


class MicAsSpeech(FrameProcessor):
    """The microphone's audio (`InputAudioRawFrame`) as a TTS would give it: `TTSStartedFrame`,
    `TTSAudioRawFrame`s, `TTSStoppedFrame`, one utterance per stretch of sound. A level gate, not a
    VAD: it needs no model, and what it passes is spoken back as it came, silence inside included.
    Every other frame passes on."""

    def __init__(self, *, open_dbfs: float = OPEN_DBFS, pause_s: float = PAUSE_S, pre_roll_s: float = PRE_ROLL_S,
                 max_utterance_s: float = MAX_UTTERANCE_S, **kwargs):
        super().__init__(**kwargs)
        self._open, self._pause_s, self._max_s = open_dbfs, pause_s, max_utterance_s
        self._pre_roll_s = pre_roll_s
        self._before: deque[InputAudioRawFrame] = deque()   # quiet frames while no utterance is open
        self._speaking = False
        self._quiet_s = self._spoken_s = 0.0

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
            await self._hear(frame)
        else:
            await self.push_frame(frame, direction)

    async def _hear(self, frame: InputAudioRawFrame) -> None:
        loud = level_dbfs(np.frombuffer(frame.audio, "<i2")) > self._open
        if self._speaking:
            await self._say(frame)
            self._quiet_s = 0.0 if loud else self._quiet_s + duration(frame)
            if self._quiet_s >= self._pause_s or self._spoken_s >= self._max_s:
                self._speaking = False
                await self.push_frame(TTSStoppedFrame())
            return
        self._before.append(frame)
        while sum(map(duration, self._before)) > self._pre_roll_s + duration(frame):
            self._before.popleft()
        if loud:
            self._speaking, self._quiet_s, self._spoken_s = True, 0.0, 0.0
            await self.push_frame(TTSStartedFrame())
            while self._before:
                await self._say(self._before.popleft())

    async def _say(self, frame: InputAudioRawFrame) -> None:
        self._spoken_s += duration(frame)
        await self.push_frame(TTSAudioRawFrame(audio=frame.audio, sample_rate=frame.sample_rate,
                                               num_channels=frame.num_channels))


def duration(frame: InputAudioRawFrame) -> float:
    return len(frame.audio) / 2 / frame.num_channels / frame.sample_rate


def level_dbfs(pcm: np.ndarray) -> float:
    """RMS level of int16 samples in dB below full scale (-inf for digital silence)."""
    if not len(pcm):
        return float("-inf")
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    return 20 * np.log10(rms / 32768) if rms else float("-inf")


def avatar_size(endpoint: str, model: str, wait_s: float) -> tuple[int, int]:
    """The avatar's frame size, asked of the server (the transport's video size is fixed before the
    pipeline starts, and a frame of another size would be resized in Python for every frame)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with Client(endpoint, timeout_s=5) as client:
                info = next((m for m in client.models() if m["id"] == model), None)
            break
        except (ClientTimeout, ServerError, OSError) as err:
            if time.monotonic() > deadline:
                raise SystemExit(f"no lip-sync server at {endpoint} ({err}): start one with `python3 dev.py run`, "
                                 "or pass --endpoint (and --wait SECONDS while it starts)") from None
            time.sleep(0.5)
    if info is None or not info.get("width"):
        raise SystemExit(f"model {model!r} is not served at {endpoint} (or its files are broken): "
                         "`python -m lipsync_client models` lists them")
    return info["width"], info["height"]


def transport_params(size: tuple[int, int], rate: int = RATE) -> TransportParams:
    """SmallWebRTCTransport's settings for an avatar of `size` whose voice goes out at `rate`."""
    width, height = size
    return TransportParams(audio_in_enabled=True, audio_in_sample_rate=rate, audio_out_enabled=True,
                           audio_out_sample_rate=rate, video_out_enabled=True, video_out_is_live=False,
                           video_out_width=width, video_out_height=height, video_out_framerate=FPS)


async def run_echo(connection: SmallWebRTCConnection, *, endpoint: str, model: str, size: tuple[int, int],
                   gate: dict) -> None:
    """One browser's pipeline, until it leaves."""
    transport = SmallWebRTCTransport(webrtc_connection=connection, params=transport_params(size))
    avatar = LipsyncVideoService(model=model, endpoint=endpoint)
    pipeline = Pipeline([transport.input(), MicAsSpeech(**gate), avatar, transport.output()])
    # NOTE: no RTVI (the page is no Pipecat client), no idle timeout (a listener may stay quiet).
    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
                            enable_rtvi=False, idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=False)

    @transport.event_handler("on_client_disconnected")
    async def on_client_disconnected(transport, client):
        logger.info(f"{connection.pc_id}: the browser left")
        await runner.cancel()

    await runner.add_workers(worker)
    await runner.run()
    logger.info(f"{connection.pc_id}: its pipeline ended, its session closed")


def make_app(bot: Callable[[SmallWebRTCConnection], Awaitable[None]]) -> web.Application:
    """The page (static/echo.html) and its offer/answer endpoint; `bot(connection)` runs each browser's
    pipeline (this echo's, or any agent's: docs/integrations.md)."""
    page = resources.files(__package__).joinpath("static/echo.html").read_bytes()
    bots: set[asyncio.Task] = set()
    connections: dict[str, SmallWebRTCConnection] = {}   # by pc_id, while their pipelines run

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html")

    async def offer(request: web.Request) -> web.Response:
        """The page's SDP offer (its ICE candidates in it) -> our answer; a pipeline for the browser."""
        try:
            body = await request.json()
            sdp, kind = body["sdp"], body["type"]
        except (ValueError, KeyError, TypeError):
            raise web.HTTPBadRequest(text='expected JSON {"sdp": "v=0...", "type": "offer"}') from None
        if kind != "offer" or not isinstance(sdp, str) or not sdp.startswith("v=0"):
            raise web.HTTPBadRequest(text='expected JSON {"sdp": "v=0...", "type": "offer"}')
        connection = SmallWebRTCConnection()
        try:
            await connection.initialize(sdp=sdp, type=kind)
        except Exception as err:   # aiortc refuses an SDP it cannot answer with ValueError and others
            await connection.disconnect()
            raise web.HTTPBadRequest(text=f"cannot answer this offer: {err}") from None
        task = asyncio.create_task(bot(connection))
        bots.add(task)
        connections[connection.pc_id] = connection
        task.add_done_callback(lambda _: (bots.discard(task), connections.pop(connection.pc_id, None)))
        return web.json_response(connection.get_answer())

    async def leave(request: web.Request) -> web.Response:
        """The page leaves (Stop, or closed): its pipeline ends now. Without this, a peer that went away
        is noticed only when ICE gives up on it (~30 s), its session on the server running meanwhile."""
        try:
            pc_id = json.loads(await request.text())["pc_id"]
        except (ValueError, KeyError, TypeError):
            raise web.HTTPBadRequest(text='expected JSON {"pc_id": "..."}') from None
        connection = connections.get(pc_id) if isinstance(pc_id, str) else None
        if connection is not None:
            await connection.disconnect()   # "closed": the transport's on_client_disconnected
        return web.Response(status=204)

    async def on_shutdown(app: web.Application) -> None:
        for task in list(bots):
            task.cancel()
        await asyncio.gather(*bots, return_exceptions=True)

    # NOTE: client_max_size bounds what a request body may be (an offer is a few KB)
    app = web.Application(client_max_size=MAX_OFFER_BYTES)
    app.router.add_get("/", index)
    app.router.add_post("/api/offer", offer)
    app.router.add_post("/api/leave", leave)
    app.on_shutdown.append(on_shutdown)
    return app


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lipsync_client.examples.echo",
                                     description="your microphone, spoken back by your avatar in the browser")
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the lip-sync server")
    parser.add_argument("--model", default="demo", help="the avatar (`python -m lipsync_client models`)")
    parser.add_argument("--host", default="127.0.0.1", help="where the page is served (a browser allows the "
                                                            "microphone on localhost, else over https only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--wait", type=float, default=0.0, help="wait this many seconds for the server")
    parser.add_argument("--open-dbfs", type=float, default=OPEN_DBFS,
                        help="microphone level (RMS, dBFS) that starts an utterance")
    parser.add_argument("--pause", type=float, default=PAUSE_S, help="seconds of quiet that end an utterance")
    parser.add_argument("-v", "--verbose", action="store_true", help="Pipecat's debug log")
    args = parser.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "INFO")
    size = avatar_size(args.endpoint, args.model, args.wait)
    gate = {"open_dbfs": args.open_dbfs, "pause_s": args.pause}
    app = make_app(functools.partial(run_echo, endpoint=args.endpoint, model=args.model, size=size, gate=gate))
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/"
    print(f"echo avatar {args.model} ({size[0]}x{size[1]}) of {args.endpoint}: open {url}   (Ctrl-C to stop)",
          flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
