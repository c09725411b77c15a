"""The WebRTC viewer over real processes: an aiortc peer and a headless Chromium watch a live H.264
session (video and its speech as Opus) through the viewer's WHEP endpoint; tokens and files are
guarded."""

from __future__ import annotations

import asyncio
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest

from config.audio import speech
from lipsync_client import AsyncSession, Session
from tests.helpers import base_config, free_port, make_video_avatar, run_server

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    make_video_avatar(models, "a", 5)
    cfg = base_config(models, viewer={"port": free_port()}, sessions={"latency_budget_ms": 600})
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        yield srv


def http(url: str, method: str = "GET", body: bytes = b"", content_type: str = "application/sdp"):
    request = urllib.request.Request(url, data=body or None, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def speak(session: AsyncSession, seconds: float) -> None:
    """The demo utterance in real time, 20-ms chunks, then silence."""
    pcm = speech()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i, start in enumerate(range(0, min(len(pcm), int(seconds * 16000)), 320)):
        chunk = pcm[start:start + 320]
        await session.send_audio(chunk, last=start + 320 >= len(pcm))
        await asyncio.sleep(max(t0 + (i + 1) * 0.02 - loop.time(), 0))


async def watch(url: str, video_frames: int, timeout_s: float) -> tuple[list, list]:
    """An aiortc peer that receives `video_frames` pictures (and the audio meanwhile) from the viewer."""
    import aiohttp
    from aiortc import RTCPeerConnection, RTCSessionDescription

    base, token = url.split("/view/")
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    pc.addTransceiver("audio", direction="recvonly")
    tracks: dict = {}
    pc.on("track", lambda track: tracks.setdefault(track.kind, track))
    await pc.setLocalDescription(await pc.createOffer())
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{base}/whep/{token}", data=pc.localDescription.sdp,
                               headers={"Content-Type": "application/sdp"}) as response:
            assert response.status == 201, await response.text()
            answer = await response.text()
    assert "H264" in answer
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    video, audio = [], []

    async def read_video():
        while len(video) < video_frames:
            video.append(await tracks["video"].recv())

    async def read_audio():
        while True:
            audio.append(await tracks["audio"].recv())

    try:
        while len(tracks) < 2:
            await asyncio.sleep(0.01)
        reader = asyncio.create_task(read_audio())
        await asyncio.wait_for(read_video(), timeout_s)
        reader.cancel()
    finally:
        await pc.close()
    return video, audio


def test_an_aiortc_peer_receives_the_sessions_video_and_speech(server):
    async def main():
        async with AsyncSession(server.endpoint, "a", format="h264", audio="pcm16", webrtc=True) as s:
            url = s.info["viewer_url"]
            speaker = asyncio.create_task(speak(s, 4.0))
            video, audio = await watch(url, 60, 30.0)
            await speaker
            return video, audio, await s.stats()

    video, audio, stats = asyncio.run(main())
    assert len(video) == 60 and all((f.width, f.height) == (320, 240) for f in video)   # >= 2 s at 25 fps
    pictures = [f.to_ndarray(format="bgr24") for f in video]
    assert all(p.std() > 10 for p in pictures), "blank pictures"
    assert len(audio) >= 50, len(audio)   # 20-ms Opus frames, decoded
    loudest = max(np.abs(f.to_ndarray()).max() for f in audio)
    assert loudest > 1000, "the session's speech did not reach the peer"
    assert stats["frames_speech"] > 0, stats


def test_tokens_and_files_are_guarded(server):
    with Session(server.endpoint, "a", format="h264", webrtc=True) as s:
        url = s.info["viewer_url"]
        base, token = url.split("/view/")
        assert len(token) >= 32
        assert http(url)[0] == 200 and b"<video" in http(url)[1]
        assert http(f"{base}/view/{token[:-2]}xx")[0] == 403
        assert http(f"{base}/whep/{token[:-2]}xx", "POST", b"v=0\r\n")[0] == 403
        assert http(f"{base}/whep/{token}", "POST", b"not sdp", "text/plain")[0] == 415
        status, body = http(f"{base}/whep/{token}", "POST", b"v=0\r\n")
        assert status == 400 and b"cannot answer" in body
        for path in ("/static/../../config/default.yaml", "/static/%2e%2e/%2e%2e/config/default.yaml",
                     "/static/..%2f..%2fconfig%2fdefault.yaml", "/static/../server.py"):
            status, body = http(base + path)
            assert status in (403, 404) and b"sessions:" not in body and b"import" not in body, path
        assert http(f"{base}/static/viewer.html")[0] == 200
    assert http(url)[0] == 403, "a token ends with its session"
    assert http(f"{base}/whep/{token}", "POST", b"v=0\r\n")[0] == 403


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: install Debian's chromium package (.ci/run does)")
def test_the_viewer_page_plays_in_headless_chromium(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with Session(server.endpoint, "a", format="h264", webrtc=True) as s, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
            # Chromium hides its local addresses behind mDNS names by default, which the server cannot resolve
            "--disable-features=WebRtcHideLocalIpsWithMdns"])
        try:
            page = browser.new_page(viewport={"width": 800, "height": 520})
            page.goto(s.info["viewer_url"])
            page.wait_for_function("document.getElementById('video').currentTime > 1.0", timeout=30000)
            first = page.evaluate("document.getElementById('video').currentTime")
            page.wait_for_timeout(1000)
            second = page.evaluate("document.getElementById('video').currentTime")
            size = page.evaluate("[document.getElementById('video').videoWidth, "
                                 "document.getElementById('video').videoHeight]")
            shot = tmp_path / "viewer.png"
            page.locator("#video").screenshot(path=str(shot))
        finally:
            browser.close()
    assert second - first > 0.5, (first, second)   # playing, not stalled
    assert size == [320, 240]
    import cv2
    image = cv2.imread(str(shot))
    assert image is not None and image.std() > 10, "the screenshot of the video is blank"


def test_the_watch_command_prints_a_viewer_url_that_serves_the_page(server):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "lipsync_client", "--endpoint", server.endpoint, "watch", "a",
                             "--no-browser", "--wait", "30"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "/view/" in line, line
        url = line.split()[3]
        status, body = http(url)
        assert status == 200 and b"/whep/" in body
    finally:
        proc.terminate()
        proc.wait(timeout=10)
