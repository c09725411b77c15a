"""python -m bench.avatars [--seconds S]: the voice-agent integrations (lipsync_client/pipecat.py,
livekit.py) against a server on the 1280x720 demo avatar.

- What each adds per frame in the agent's process: its CPU time per frame (receiving the raw frame,
  building the framework's frames, the audio) against the 40 ms a frame lasts, while the avatar speaks.
- Speech latency: from a TTS's first chunk to the first speech frame received, with the default
  latency budget: a TTS that sends a second at once, one that streams 20-ms chunks in real time, and
  one that streams them at 2x real time (through the integrations' AvatarStream, which sends the
  model's look-ahead as one chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from config import parse_config
from config.audio import SAMPLE_RATE, speech
from lipsync_client import AsyncSession
from lipsync_client.avatar import AvatarStream
from tests.helpers import base_config, run_server

RATE = 24000


def _cpu() -> float:
    """CPU seconds of this process (all its threads: the frameworks' native code included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tts(seconds: float) -> np.ndarray:
    import soxr
    pcm = speech(seconds, seed=5).astype(np.float32) / 32768
    return np.clip(np.round(soxr.resample(pcm, SAMPLE_RATE, RATE) * 32767), -32768, 32767).astype("<i2")


async def _feed(say, pcm: np.ndarray, speed: float, chunk: int) -> None:
    """Send pcm in chunks at `speed` x real time (inf: all at once)."""
    t0 = time.monotonic()
    for i in range(0, len(pcm), chunk):
        if speed != float("inf"):
            await asyncio.sleep(max(t0 + i / RATE / speed - time.monotonic(), 0))
        await say(pcm[i:i + chunk])


async def first_speech_ms(endpoint: str, model: str, how: str) -> float:
    """From the first chunk sent to the first speech frame received."""
    pcm = _tts(2.0)
    if how == "2x, AvatarStream":
        stream = AvatarStream(endpoint, model, sample_rate=RATE, pixel_format="i420")
        await stream.open()
        try:
            for _ in range(10):
                await stream.next()
            t0 = time.monotonic()
            feeding = asyncio.create_task(_feed(stream.say, pcm, 2.0, RATE // 50))
            while (await stream.next()).utterance is None:
                pass
            ms = (time.monotonic() - t0) * 1000
            feeding.cancel()
            return ms
        finally:
            await stream.close()
    speed, chunk = {"1 s at once": (float("inf"), RATE), "real time, 20 ms": (1.0, RATE // 50),
                    "2x, 20 ms, bare session": (2.0, RATE // 50)}[how]
    async with AsyncSession(endpoint, model, format="raw", pixel_format="i420", audio="pcm16",
                            sample_rate=RATE) as s:
        for _ in range(10):
            await s.frames.get()
        t0 = time.monotonic()
        feeding = asyncio.create_task(_feed(s.send_audio, pcm, speed, chunk))
        while (await s.frames.get())[0]["kind"] != "speech":
            pass
        ms = (time.monotonic() - t0) * 1000
        feeding.cancel()
        await s.interrupt()
        return ms


def run(models_dir, seconds: float = 8.0) -> dict:
    """First speech frame after the first chunk, by how the TTS sends, and each integration's CPU per
    frame in this process."""
    cfg = base_config(Path(models_dir), sessions={"latency_budget_ms": 280},
                      compositing={"workers": 1, "cache_bytes": 512 * 1024 * 1024, "max_frame_width": 1920,
                                   "max_frame_height": 1080})
    results: dict = {"first_speech_ms": {}, "per_frame": {}}
    with tempfile.TemporaryDirectory() as tmp, run_server(Path(tmp), cfg) as server:
        print(f"voice-agent integrations: server {server.endpoint}, demo avatar 1280x720, latency budget 280 ms")
        for how in ("1 s at once", "real time, 20 ms", "2x, 20 ms, bare session", "2x, AvatarStream"):
            ms = sorted(asyncio.run(first_speech_ms(server.endpoint, "demo", how)) for _ in range(3))
            results["first_speech_ms"][how] = ms
            print(f"  first speech frame after the first chunk, {how:>24}: {ms[1]:6.0f} ms (median of 3; "
                  f"{ms[0]:.0f}-{ms[2]:.0f})")
        for name, measure in (("pipecat", _pipecat_per_frame), ("livekit", _livekit_per_frame)):
            try:
                frames, cpu_s, wall_s = asyncio.run(measure(server.endpoint, "demo", seconds))
            except ImportError as err:
                print(f"  {name}: not installed ({err})")
                continue
            results["per_frame"][name] = {"frames": frames, "cpu_ms": cpu_s / frames * 1000}
            print(f"  {name}: {frames} frames in {wall_s:.1f} s ({frames / wall_s:.1f}/s, the server's 25), "
                  f"{cpu_s / frames * 1000:.2f} ms CPU per frame in this process = "
                  f"{cpu_s / frames * 25 * 100:.1f} % of one core at 25 fps")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.avatars", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "lipsync-bench"))
    args = parser.parse_args()
    from supervisor.demo import build_demo
    run(build_demo(parse_config({"demo": {"cache_dir": args.cache_dir, "frames": 24}}, base_dir="/")), args.seconds)
    return 0


async def _pipecat_per_frame(endpoint: str, model: str, seconds: float) -> tuple[int, float, float]:
    """A pipeline of the service and a sink that counts, fed a TTS in real time."""
    from pipecat.frames.frames import OutputImageRawFrame, TTSAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    from lipsync_client.pipecat import LipsyncVideoService
    counted = {"frames": 0}

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, OutputImageRawFrame):
                counted["frames"] += 1
            await self.push_frame(frame, direction)

    worker = PipelineWorker(Pipeline([LipsyncVideoService(model=model, endpoint=endpoint), Sink()]),
                            params=PipelineParams(), cancel_on_idle_timeout=False)
    pcm = _tts(seconds + 1)
    result = {}

    async def drive():
        await asyncio.sleep(2.0)   # the session opens, idle frames flow
        counted["frames"], cpu0, t0 = 0, _cpu(), time.monotonic()
        for i in range(0, len(pcm), RATE // 50):
            await asyncio.sleep(max(t0 + i / RATE - time.monotonic(), 0))
            await worker.queue_frame(TTSAudioRawFrame(audio=pcm[i:i + RATE // 50].tobytes(), sample_rate=RATE,
                                                      num_channels=1))
            if time.monotonic() - t0 >= seconds:
                break
        result.update(frames=counted["frames"], cpu=_cpu() - cpu0, wall=time.monotonic() - t0)
        await worker.cancel()

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return result["frames"], result["cpu"], result["wall"]


async def _livekit_per_frame(endpoint: str, model: str, seconds: float) -> tuple[int, float, float]:
    from livekit import rtc

    from lipsync_client.livekit import LipsyncVideoGenerator
    generator = LipsyncVideoGenerator(endpoint, model, sample_rate=RATE)
    await generator.start()
    pcm = _tts(seconds + 1)
    frames = 0

    async def consume():
        nonlocal frames
        async for item in generator:
            if isinstance(item, rtc.VideoFrame):
                frames += 1

    try:
        consumer = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        frames, cpu0, t0 = 0, _cpu(), time.monotonic()
        for i in range(0, len(pcm), RATE // 50):
            await asyncio.sleep(max(t0 + i / RATE - time.monotonic(), 0))
            chunk = pcm[i:i + RATE // 50]
            await generator.push_audio(rtc.AudioFrame(chunk.tobytes(), RATE, 1, len(chunk)))
            if time.monotonic() - t0 >= seconds:
                break
        result = frames, _cpu() - cpu0, time.monotonic() - t0
        consumer.cancel()
        return result
    finally:
        await generator.aclose()


if __name__ == "__main__":
    raise SystemExit(main())
