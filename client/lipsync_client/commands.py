"""The command line's work: `composite` and `bench` (requests), `stream` and `watch` (live sessions)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from lipsync_client.contract import SAMPLE_RATE
from lipsync_client.speech import speech
from lipsync_client.contract import VISUAL_SHAPE
from lipsync_client.requests import AsyncClient, Client
from lipsync_client.sessions import AsyncSession
from lipsync_client.wire import ClientTimeout, ServerError


def audio_shape(client: Client, model: str) -> tuple[int, ...]:
    info = next((m for m in client.models() if m["id"] == model), None)
    if info is None or info.get("audio_shape") is None:
        raise SystemExit(f"model {model!r} is not served here (or its files are broken): see `models`")
    return tuple(info["audio_shape"])


def composite(args) -> int:
    with Client(args.endpoint) as client:
        shape = audio_shape(client, args.model)
        rng = np.random.default_rng(args.seed)
        audio = rng.standard_normal((args.batch, *shape)).astype(np.float32)
        header, images = client.composite(args.model, audio, batch=args.batch, start_frame=args.start_frame,
                                          format=args.format)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ext = {"jpeg": "jpg", "png": "png", "raw": "bgr"}[header["format"]]
    for i, image in enumerate(images):
        (out / f"frame_{args.start_frame + i:05d}.{ext}").write_bytes(image)
    print(json.dumps({k: header[k] for k in ("batch", "format", "width", "height", "frames", "timing")}))
    print(f"wrote {len(images)} frames to {out}")
    return 0


async def bench(args) -> dict:
    probe = Client(args.endpoint)
    shapes = {m: audio_shape(probe, m) for m in args.models}
    probe.close()
    rng = np.random.default_rng(0)
    audio = {m: rng.standard_normal((args.batch, *s)).astype(np.float32) for m, s in shapes.items()}
    visual = rng.random((args.batch, *VISUAL_SHAPE), dtype=np.float32) if args.visual else None
    latencies, timings, errors = [], [], {}
    done = 0
    stop_at = time.monotonic() + args.duration if args.duration else None
    counter = itertools.count()

    async def one(client: AsyncClient) -> None:
        nonlocal done
        while True:
            n = next(counter)
            if (stop_at and time.monotonic() > stop_at) or (not stop_at and n >= args.count):
                return
            model = args.models[n % len(args.models)]
            t0 = time.perf_counter()
            try:
                header, _ = await client.composite(model, audio[model], visual, batch=args.batch,
                                                   start_frame=n * args.batch, format=args.format)
                latencies.append((time.perf_counter() - t0) * 1000)
                timings.append(header["timing"])
            except (ServerError, ClientTimeout) as err:
                key = getattr(err, "code", "client_timeout")
                errors[key] = errors.get(key, 0) + 1
            done += 1
            if not args.json:
                total = args.count if not stop_at else None
                sys.stderr.write(f"\r{done} requests" + (f"/{total}" if total else "") + f", {len(errors)} error kinds")

    async with AsyncClient(args.endpoint) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    if not args.json:
        sys.stderr.write("\n")
    lat = np.asarray(latencies) if latencies else np.zeros(1)
    breakdown = {k: float(np.mean([t[k] for t in timings])) if timings else 0.0
                 for k in ("queue_ms", "input_ms", "inference_ms", "composite_ms", "total_ms")}
    return {"requests": len(latencies), "errors": errors, "batch": args.batch, "seconds": elapsed,
            "frames_per_s": len(latencies) * args.batch / elapsed,
            "latency_ms": {p: float(np.percentile(lat, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "timing_ms_mean": breakdown}


def read_wav(path: str) -> np.ndarray:
    """A 16 kHz mono 16-bit WAV file's samples (int16), or a ValueError saying what to convert."""
    import wave
    with wave.open(path, "rb") as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (SAMPLE_RATE, 1, 2):
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
        burst_s = len(pcm) / SAMPLE_RATE
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
