"""The WebRTC viewer (roles all and edge): a live H.264 session, watched in a browser.

`session_open` with `webrtc: true` gets a page URL with an unguessable token, valid while the session
is open. The page POSTs an SDP offer to `/whep/<token>` (WHEP style, no trickle: the offer carries
its candidates) and gets the answer. The session's access units go out as RTP as they are (aiortc
packs pre-encoded packets, no re-encoding); its 40 ms of PCM per frame go out as Opus, both stamped
from the frame index, so the browser keeps them in sync from the RTCP sender reports.

It runs on the frontend's event loop (aiohttp + aiortc): RTP packing and SRTP per frame are small
next to what the session costs elsewhere (docs/benchmarks.md). A new viewer, or a browser that asks
for a picture (PLI/FIR), gets the session's next frame as an IDR.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional, Sequence

import av
import numpy as np
from aiohttp import web
from aiortc import (MediaStreamTrack, RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender,
                    RTCSessionDescription)

from config.audio import SAMPLE_RATE, SAMPLES_PER_FRAME
from config.schema import ViewerConfig

log = logging.getLogger(__name__)
STATIC = Path(__file__).resolve().parent / "static"
VIDEO_CLOCK = 90000
MAX_PEERS = 4                 # browsers watching one session at once
QUEUE_FRAMES = 25             # frames a slow peer may lag before its oldest go
OFFER_MAX_BYTES = 64 * 1024


class _Track(MediaStreamTrack):
    """Frames pushed by the frontend, handed to aiortc's sender as they come."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_FRAMES * 2)

    def put(self, item) -> None:
        if self.queue.full():   # the peer is not keeping up: its oldest frame goes
            self.queue.get_nowait()
        self.queue.put_nowait(item)

    async def recv(self):
        return await self.queue.get()


@dataclass(eq=False)
class Peer:
    pc: RTCPeerConnection
    video: _Track
    audio: _Track
    started: bool = False      # has sent its first IDR (frames before it cannot be decoded)


@dataclass
class Watch:
    session: str
    fps: float
    peers: list[Peer] = field(default_factory=list)


class Viewer:
    def __init__(self, config: ViewerConfig):
        self.config = config
        # Asks a session for an IDR (a new browser, or one that lost a picture); live sessions set it.
        self.keyframe: Callable[[str], None] = lambda session_token: None
        self.tokens: dict[str, Watch] = {}
        self.by_session: dict[str, str] = {}
        self.base_url = ""
        self._runner: Optional[web.AppRunner] = None
        self._ice = RTCConfiguration(iceServers=[RTCIceServer(urls=list(s.urls), username=s.username,
                                                              credential=s.credential)
                                                 for s in config.ice_servers])

    async def start(self, sockets: Sequence[socket.socket]) -> None:
        """Serve on `sockets`, bound (and listening) by the host process before it reported READY, so that
        a taken viewer.port ends the start instead of failing here (shm/child.py listen_tcp)."""
        app = web.Application(client_max_size=OFFER_MAX_BYTES)
        app.router.add_get("/view/{token}", self._page)
        app.router.add_post("/whep/{token}", self._offer)
        app.router.add_static("/static/", STATIC, follow_symlinks=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        for sock in sockets:
            await web.SockSite(self._runner, sock).start()
        port = sockets[0].getsockname()[1]   # the one chosen for port 0
        self.base_url = (self.config.public_url or f"http://{self.config.host}:{port}").rstrip("/")
        log.info("WebRTC viewer on %s", self.base_url)

    async def stop(self) -> None:
        for token in list(self.tokens):
            self._drop(token)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- sessions -------------------------------------------------------------------------------

    def open(self, session) -> str:
        token = secrets.token_urlsafe(24)
        self.tokens[token] = Watch(session.token, session.fps)
        self.by_session[session.token] = token
        session.viewer = True
        return f"{self.base_url}/view/{token}"

    def close(self, session_token: str) -> None:
        token = self.by_session.pop(session_token, None)
        if token is not None:
            self._drop(token)

    def _drop(self, token: str) -> None:
        watch = self.tokens.pop(token, None)
        for peer in watch.peers if watch else ():
            asyncio.ensure_future(peer.pc.close())

    def push(self, session, frame, au: bytes, audio: Optional[bytes], keyframe: bool) -> None:
        """One frame of a session: its access unit and its 40 ms of PCM (None: silence)."""
        watch = self.tokens.get(self.by_session.get(session.token, ""))
        if watch is None or not watch.peers:
            return
        peers = [p for p in watch.peers if p.started or keyframe]
        if not peers:
            return
        packet = av.Packet(au)
        packet.pts = round(frame.index * VIDEO_CLOCK / watch.fps)
        packet.time_base = Fraction(1, VIDEO_CLOCK)
        pcm = np.frombuffer(audio, "<i2") if audio is not None else np.zeros(SAMPLES_PER_FRAME, np.int16)
        halves = []   # Opus packets of 20 ms: one RTP timestamp each
        for i, half in enumerate(pcm.reshape(2, -1)):
            samples = av.AudioFrame.from_ndarray(half.reshape(1, -1).copy(), format="s16", layout="mono")
            samples.sample_rate = SAMPLE_RATE
            samples.pts = round(frame.index * SAMPLE_RATE / watch.fps) + i * half.size
            samples.time_base = Fraction(1, SAMPLE_RATE)
            halves.append(samples)
        for peer in peers:   # the same packets for every peer: aiortc only reads them
            peer.started = True
            peer.video.put(packet)
            for samples in halves:
                peer.audio.put(samples)

    # -- HTTP -----------------------------------------------------------------------------------

    def _watch(self, request: web.Request) -> Watch:
        watch = self.tokens.get(request.match_info["token"])
        if watch is None:
            raise web.HTTPForbidden(text="unknown or expired viewer token (it ends with its session)\n")
        return watch

    async def _page(self, request: web.Request) -> web.StreamResponse:
        self._watch(request)
        return web.FileResponse(STATIC / "viewer.html", headers={"Cache-Control": "no-store"})

    async def _offer(self, request: web.Request) -> web.Response:
        watch = self._watch(request)
        if request.content_type != "application/sdp":
            raise web.HTTPUnsupportedMediaType(text="POST the SDP offer as application/sdp\n")
        if len(watch.peers) >= MAX_PEERS:
            raise web.HTTPServiceUnavailable(text=f"{MAX_PEERS} viewers already watch this session\n")
        offer = RTCSessionDescription(sdp=await request.text(), type="offer")
        pc = RTCPeerConnection(self._ice)
        peer = Peer(pc, _Track("video"), _Track("audio"))
        try:
            # NOTE: codecs are chosen as the offer is applied, so the transceivers (and the video's
            # codec preference: the stream is H.264 already) come first; the offer's m-lines take them.
            transceiver = pc.addTransceiver(peer.video, direction="sendonly")
            transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                             if c.mimeType == "video/H264"])
            pc.addTransceiver(peer.audio, direction="sendonly")
            await pc.setRemoteDescription(offer)
            await pc.setLocalDescription(await pc.createAnswer())
            video = transceiver.sender
        except Exception as err:   # an offer that cannot be answered (no H.264, no video): say why
            await pc.close()
            raise web.HTTPBadRequest(text=f"cannot answer this offer: {err}\n") from None
        # NOTE: aiortc's sender only notes a PLI/FIR for frames it encodes itself; these are encoded
        # already, so the request goes to the session's encoder instead.
        video._send_keyframe = lambda: self.keyframe(watch.session)
        watch.peers.append(peer)

        @pc.on("connectionstatechange")
        async def _state() -> None:
            if pc.connectionState == "connected":
                self.keyframe(watch.session)
            elif pc.connectionState in ("failed", "closed"):
                if peer in watch.peers:
                    watch.peers.remove(peer)
                await pc.close()

        self.keyframe(watch.session)
        return web.Response(status=201, content_type="application/sdp", text=pc.localDescription.sdp,
                            headers={"Location": str(request.url)})
