"""The echo avatar example (`python -m lipsync_client.examples.echo`) end to end: the example's own
process, a real server, and a headless Chromium whose fake microphone plays a speech file (silence,
speech, silence, looped). What a user would check: the page's video plays, the avatar's face is its
own in silence, its mouth moves while the file's speech comes back, and the voice the page hears is
the speech, on the frames whose mouth moves."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import cv2
import numpy as np
import pytest

pytest.importorskip("pipecat", reason="the pipecat extra: pip install -e .[pipecat]")

from tests.helpers import ROOT, free_port  # noqa: E402
from tests.voice import espeak_available, face_avatar, tts_speech, warm_server, write_wav  # noqa: E402

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
N_FRAMES = 6
MIC_RATE = 48000
LEAD_S, SPEECH_S, TAIL_S = 3.0, 3.0, 2.0   # the fake microphone's file: silence, speech, silence (it loops)
CAPTURE_S = 12.0                        # a whole loop of it (8 s), the quiet before an onset, the echo
QUIET = -50.0                           # dBFS: below it the microphone (or the page's sound) is quiet
CHANGED = 24                            # a pixel of the face box that differs by more than this (of 255) changed
SCALE = 2                               # the page reads each picture at half its size: reading it whole, at 25
                                        # a second, cost the browser as much CPU as the example itself

# Each new picture of the page's <video>: its luma (as cv2's BGR2GRAY weighs it), and the level of the
# audio the page hears (the avatar's voice) and of the microphone it sends, at that moment.
CAPTURE_JS = """
async ([seconds, scale]) => {
  const w = video.videoWidth / scale, h = video.videoHeight / scale;
  const canvas = document.createElement("canvas");
  canvas.width = w; canvas.height = h;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  const audio = new AudioContext();
  const meter = (track) => {
    const analyser = audio.createAnalyser();
    analyser.fftSize = 2048;
    audio.createMediaStreamSource(new MediaStream([track])).connect(analyser);
    const buffer = new Float32Array(analyser.fftSize);
    return () => {
      analyser.getFloatTimeDomainData(buffer);
      let sum = 0;
      for (const v of buffer) sum += v * v;
      return 10 * Math.log10(sum / buffer.length + 1e-12);
    };
  };
  const heard = meter(video.srcObject.getAudioTracks()[0]);
  const said = meter(mic.getAudioTracks()[0]);
  await audio.resume();
  const frames = [];
  const end = performance.now() + seconds * 1000;
  await new Promise((resolve) => {
    const grab = (now) => {
      ctx.drawImage(video, 0, 0, w, h);
      const rgba = ctx.getImageData(0, 0, w, h).data;
      const luma = new Uint8Array(w * h);
      for (let i = 0, j = 0; j < luma.length; i += 4, j++) {
        luma[j] = Math.round(0.299 * rgba[i] + 0.587 * rgba[i + 1] + 0.114 * rgba[i + 2]);
      }
      let binary = "";
      for (let j = 0; j < luma.length; j += 8192) binary += String.fromCharCode.apply(null, luma.subarray(j, j + 8192));
      frames.push({ t: now, heard: heard(), said: said(), luma: btoa(binary) });
      if (now < end) video.requestVideoFrameCallback(grab); else resolve();
    };
    video.requestVideoFrameCallback(grab);
  });
  await audio.close();
  return { w: video.videoWidth, h: video.videoHeight, frames };
}
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return face_avatar(tmp_path_factory, N_FRAMES)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with warm_server(models, tmp_path_factory, latency_budget_ms=600) as srv:
        yield srv


def own_frames(models) -> tuple[list[np.ndarray], list[list[int]]]:
    """The avatar's own frames (luma) and face boxes, at the size the page reads: what it shows in silence."""
    rects = json.loads((models / "face" / "crop_rects.json").read_text())
    lumas = [cv2.cvtColor(cv2.imread(str(models / "face" / "frames" / f"{k}.png")), cv2.COLOR_BGR2GRAY)
             for k in range(N_FRAMES)]
    return ([cv2.resize(luma, (luma.shape[1] // SCALE, luma.shape[0] // SCALE), interpolation=cv2.INTER_AREA)
             for luma in lumas], [[c // SCALE for c in rects[str(k)]["rect"]] for k in range(N_FRAMES)])


def face_change(luma: np.ndarray, own: list[np.ndarray], boxes: list[list[int]]) -> tuple[int, float]:
    """(pixels of the face box that differ from the avatar's own frame, mean difference outside every
    face box): the own frame is the one its background (outside the face boxes) matches best, as the
    mouth is only ever drawn inside the box."""
    outside = np.ones(luma.shape, bool)
    for x1, y1, x2, y2 in boxes:
        outside[y1:y2, x1:x2] = False
    diffs = [np.abs(luma.astype(np.int16) - o) for o in own]
    k = int(np.argmin([d[outside].mean() for d in diffs]))
    x1, y1, x2, y2 = boxes[k]
    return int((diffs[k][y1:y2, x1:x2] > CHANGED).sum()), float(diffs[k][outside].mean())


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return 0


@pytest.fixture
def echo(server, tmp_path):
    """The example as a user starts it, serving its page on a free port."""
    port = free_port()
    log = tmp_path / "echo.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lipsync_client.examples.echo", "--endpoint", server.endpoint,
                                 "--model", "face", "--port", str(port), "--wait", "30"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while get(url) != 200:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    try:
        yield url, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, f"the example exited with {code} on Ctrl-C:\n{log.read_text()[-3000:]}"


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: install Debian's chromium package (.ci/run does)")
def test_the_echo_avatar_says_the_microphones_speech_back_with_its_mouth_moving(echo, models, tmp_path):
    from playwright.sync_api import sync_playwright

    url, log = echo
    speech = tts_speech(MIC_RATE, seconds=SPEECH_S)
    lead, tail = (np.zeros(int(seconds * MIC_RATE), np.int16) for seconds in (LEAD_S, TAIL_S))
    wav = write_wav(tmp_path / "mic.wav", np.concatenate([lead, speech, tail]), MIC_RATE)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
            "--disable-features=WebRtcHideLocalIpsWithMdns",
            # the microphone: this file, looped; the permission prompt answered yes
            "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}"])
        try:
            page = browser.new_page(viewport={"width": 800, "height": 520})
            page.goto(url)
            page.click("#start")
            page.wait_for_function("document.getElementById('video').currentTime > 0.5", timeout=30000)
            first = page.evaluate("document.getElementById('video').currentTime")
            captured = page.evaluate(CAPTURE_JS, [CAPTURE_S, SCALE])
            second = page.evaluate("document.getElementById('video').currentTime")
            state = page.inner_text("#state")
            page.click("#start")   # Stop: the page leaves, and its pipeline and server session end
            deadline = time.monotonic() + 20
            while "its pipeline ended" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            browser.close()
    assert "the browser left" in log.read_text() and "its pipeline ended" in log.read_text(), \
        log.read_text()[-3000:]
    assert state == "connected", (state, log.read_text()[-3000:])
    assert (captured["w"], captured["h"]) == (320, 240), (captured["w"], captured["h"])
    assert second - first > 0.8 * CAPTURE_S, (first, second)       # it played on, not stalled
    frames = captured["frames"]
    assert len(frames) > 0.5 * 25 * CAPTURE_S, len(frames)          # new pictures kept coming (25 fps sent)
    own, boxes = own_frames(models)
    lumas = [np.frombuffer(base64.b64decode(f["luma"]), np.uint8).reshape(240 // SCALE, 320 // SCALE)
             for f in frames]
    changed, outside = np.array([face_change(luma, own, boxes) for luma in lumas]).T
    t = np.array([f["t"] for f in frames]) / 1000
    heard, said = np.array([f["heard"] for f in frames]), np.array([f["said"] for f in frames])
    report = tmp_path / "frames.json"   # kept for a failure's reader: one row per picture
    report.write_text(json.dumps([[round((f["t"] - frames[0]["t"]) / 1000, 3), round(f["heard"], 1),
                                   round(f["said"], 1), int(c)] for f, c in zip(frames, changed)]))
    box = (boxes[0][2] - boxes[0][0]) * (boxes[0][3] - boxes[0][1])
    idle, moving = changed <= 0.001 * box, changed >= 0.005 * box
    where = (f"(speech: {'espeak-ng' if espeak_available() else 'generated'}; one row per picture: {report}; "
             f"the example's log: {log})")
    # the picture is the avatar's: its own background everywhere outside the face box, at video quality
    assert outside.max() < 6, (outside.max(), where)
    # its own face in silence, a mouth in the face box while the speech comes back, opening and closing
    assert idle.mean() > 0.25 and moving.mean() > 0.15, (idle.mean(), moving.mean(), where)
    assert np.ptp(changed[moving]) > 0.5 * changed.max(), ("the mouth does not open and close", where)
    # ... said back: where the microphone starts speaking after a quiet second (the file's silences),
    # the face is still, and its mouth moves after
    onsets = [i for i in range(len(t)) if said[i] > QUIET and t[i] - t[0] >= 1.0
              and (said[(t >= t[i] - 1.0) & (t < t[i])] <= QUIET).all()]
    assert onsets, ("no onset of the file's speech in the capture", where)
    for i in onsets:
        assert idle[i] and moving[i:].any(), (round(t[i] - t[0], 2), where)
    # ... in sync with the voice the page hears: the speech on the frames whose mouth moves, silence on
    # the avatar's own face (medians: the demo mouth opens with the loudness ahead of each frame, so a
    # word's first frames move before its sound)
    assert heard.max() > -30, ("the avatar's voice did not reach the page", where)
    assert (moving[heard > -40]).mean() > 0.75, ("the voice plays on a still face", where)
    assert np.median(heard[moving]) > -40 and np.median(heard[idle]) < -80, (
        np.median(heard[moving]), np.median(heard[idle]), where)


def test_the_documented_agent_compiles_against_what_it_imports():
    """docs/integrations.md's STT/LLM/TTS agent is not run (it needs those services), but it compiles,
    and every name it imports from this project and from Pipecat's core exists (the services' modules
    need their own extras)."""
    import ast
    import importlib

    text = (ROOT / "docs" / "integrations.md").read_text()
    block = next(b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("python\n# agent.py"))
    tree = ast.parse(compile(block, "agent.py", "exec", flags=ast.PyCF_ONLY_AST))
    imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for alias in node.names]
    checked = [(m, n) for m, n in imports if m.startswith("frontend.") or
               (m.startswith("pipecat.") and not m.startswith("pipecat.services."))]
    assert len(checked) >= 10, imports
    missing = [f"{m}.{n}" for m, n in checked if not hasattr(importlib.import_module(m), n)]
    assert not missing, missing
