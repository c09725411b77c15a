"""Device steps on the stand-in device with a card's cost curve: live PCM sessions, each on an avatar of
its own (one architecture, other weights), all starting an utterance at once.

The stand-in runs the GPU path on the CPU provider and makes each model call cost what a card's would
(LIPSYNC_STAND_IN_COST_MS=fixed,per frame; on an H100, real-size unet_328 fp32: ~1.6 ms + 0.89 ms a
frame, so the default 10 ms + 1 ms makes a few sessions load this host's stand-in as a card's many load
the card). Avatars are the tests' small ones (320x240 frames, the tiny model, the demo's audio encoder) so
that the host's own work stays small beside the device's. Per level and `inference.mixed_steps` mode
(sub_calls: a call per avatar in a step; grouped / auto: the architecture's N-model form, gpu_actor/
mixed.py), each round prints the speech frames missed and late, the device calls and the frames they
held, and the steps by kind. The levels past what this host's CPU serves with no device cost at all
(`--cost-ms 0,0`) measure the host, not the steps: each round prints each process's CPU (the machine's
against its cores) and the inference process's CPU per frame it ran, the stand-in's own computing of
what a card would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

CHUNK = 320   # 20 ms at 16 kHz, as Pipecat and LiveKit send it


async def say(endpoint: str, model: str, seed: int, speech_s: float, delay_s: float = 0.0,
              started: Optional[asyncio.Event] = None) -> tuple[dict, int]:
    """One session: `delay_s` after it opens, an utterance in 20-ms chunks at real time (`started` set once
    its first chunk is sent); its stats once its last frame has gone out, and the speech frames the
    utterance yields."""
    from config.audio import frame_count, speech
    from lipsync_client import AsyncSession
    pcm = speech(speech_s, seed=seed)
    async with AsyncSession(endpoint, model, audio="pcm16", timeout_s=120) as s:
        await asyncio.sleep(delay_s)
        replies, t0 = [], time.monotonic()
        chunks = [pcm[k:k + CHUNK] for k in range(0, len(pcm), CHUNK)]
        for i, chunk in enumerate(chunks):
            replies.append(s.push_audio(chunk, last=i == len(chunks) - 1))
            if started is not None:
                started.set()
            await asyncio.sleep(max(t0 + (i + 1) * CHUNK / 16000 - time.monotonic(), 0))
        for reply in replies:
            await reply
        while not (await s.frames.get())[0].get("last"):
            pass
        return await s.close(), frame_count(len(pcm))


def _worker(srv) -> dict:
    with srv.client() as c:
        return c.stats()["workers"][0]


def _architecture(srv) -> dict:
    return next(iter(_worker(srv).get("architectures", {}).values()), {})


def _round(srv, models: list[str], speech_s: float, exe: Optional[str] = None, out: Optional[Path] = None) -> dict:
    """One utterance on each of `models` at once; `exe`: py-spy, recording the inference process into `out`."""
    from bench import pyspy
    from bench.procstat import CpuSampler, server_pids
    from bench.sessions import _stages
    worker = _worker(srv)
    before, steps_before = next(iter(worker.get("architectures", {}).values()), {}), worker.get("steps", {})
    procs = server_pids(srv)
    cpu = CpuSampler({**procs, "bench client": os.getpid()})
    recording = pyspy.Recording(exe, procs["gpu0"], out) if exe else None

    async def together() -> list:
        return await asyncio.gather(*(say(srv.endpoint, m, k, speech_s) for k, m in enumerate(models)))
    cpu.start()
    try:
        sessions = asyncio.run(together())
    finally:
        cpu.stop()
        failed = recording.stop() if recording else ""
    worker = _worker(srv)
    after, steps_after = next(iter(worker.get("architectures", {}).values()), {}), worker.get("steps", {})
    ran = {k: v - steps_before.get(k, 0) for k, v in steps_after.items()}
    rows = {int(k): v - before.get("frames_per_call_histogram", {}).get(k, 0)
            for k, v in after.get("frames_per_call_histogram", {}).items()}
    calls, held = sum(rows.values()), sum(k * v for k, v in rows.items())
    steps = {k: v - before.get("steps", {}).get(k, 0) for k, v in after.get("steps", {}).items()}
    frames = sum(n for _, n in sessions)
    missed = sum(s["missed"] for s, _ in sessions)
    used = cpu.result()
    wall_s = cpu.samples[-1][0] - cpu.samples[0][0]
    figures = {"frames": frames, "missed": missed, "missed_share": missed / max(frames, 1),
            "late": sum(s["late"] for s, _ in sessions), "calls": calls,
            # the stage each missed frame was still in when due (frontend/live/timeline.py; failed: its
            # request was answered with an error, as a worker's that would end past the deadline)
            "missed_in": dict(sum((Counter(s.get("missed_in", {})) for s, _ in sessions), Counter())),
            "stages_ms": _stages([s for s, _ in sessions]),
            "frames_per_call": held / calls if calls else 0.0,
            "steps": {k: v for k, v in steps.items() if v},
            # the worker's device thread: busy over the round, and the steps prepared while another ran
            "device_busy_share": ran.get("device_busy_s", 0.0) / wall_s if wall_s else 0.0,
            "prepared_during_a_step": f"{ran.get('prepared_during_a_step', 0):.0f} of {ran.get('steps', 0):.0f}",
            # where the host's two cores went: the stand-in computes on the CPU what a card would
            "cpu_percent": {k: round(v["cpu"]) for k, v in used.items()},
            "inference_ms_per_frame": 10 * used["gpu0"]["cpu"] * wall_s / max(held, 1),
            # what a card leaves on the host: the worker's main thread picks, prepares and answers steps
            "main_thread_ms_per_frame": 10 * used["gpu0"]["main_cpu"] * wall_s / max(held, 1)}
    if recording:   # per frame a call held, scaled by the busiest thread's CPU
        us = 1e4 * used["gpu0"]["thread_cpu"] * wall_s / max(held, 1)
        figures["profile"] = pyspy.figures(out, failed, held, us, "inference", "frame a call held")
    return figures


def run(levels: tuple[int, ...], modes: tuple[str, ...], cost_ms: str, speech_s: float, rounds: int,
        max_batch: int = 16, profile: Optional[Path] = None) -> dict:
    import onnx

    from gpu_actor.demo_model import build_demo_encoder
    from gpu_actor.device import STAND_IN_COST_ENV, STAND_IN_ENV
    from bench import pyspy
    from shm.store import entry_bytes
    from tests.helpers import base_config, make_avatar, run_server
    root = Path(tempfile.mkdtemp(prefix="lsync-steps-"))
    out: dict = {"cost_ms": cost_ms, "speech_s": speech_s, "levels": {}}
    exe = pyspy.executable(profile)
    print(f"device steps on the stand-in, each model call costing {cost_ms} ms (fixed, per frame): PCM sessions on "
          f"avatars of their own, all starting a {speech_s:g}-s utterance at once; limits.max_batch {max_batch}")
    try:
        models = root / "models"
        encoder = build_demo_encoder()
        names = [f"v{k:03d}" for k in range(max(levels))]
        for k, name in enumerate(names):
            onnx.save(encoder, make_avatar(models, name, n_frames=6, seed=k) / "audio_encoder.onnx")
        # every avatar's frames stay in the background store: an entry per frame (JPEG sessions), each
        # sized for the largest frame the config admits, not the avatar's (with 64 MiB: 53 of 72 frames)
        limits = base_config(models)["compositing"]
        store = 6 * len(names) * entry_bytes(limits["max_frame_width"], limits["max_frame_height"]) + (8 << 20)
        for mode in modes:
            cfg = base_config(models, **{
                "limits.max_batch": max_batch, "limits.queue_depth": 256, "shm.slots": 4,
                "sessions.max_cpu_load": 0, "sessions.shed_speech": False, "inference.mixed_steps": mode,
                "compositing.cache_bytes": store})
            with run_server(root, cfg, env={STAND_IN_ENV: "0", STAND_IN_COST_ENV: cost_ms}) as srv:
                with srv.client(timeout_s=300) as c:
                    for name in names:
                        c.load(name)
                ready_by = time.monotonic() + 300   # the N-model form, prepared beside the loads
                while mode != "sub_calls" and not _architecture(srv).get("grouped_ms") and time.monotonic() < ready_by:
                    time.sleep(0.2)
                # a round not counted, every avatar speaking: their frames decoded into the background
                # store and every size called once (else the first level measures the warm-up)
                _round(srv, names, speech_s)
                for n in levels:
                    for r in range(rounds):
                        recorded = profile / f"inference-{mode}-{n}-{r + 1}.txt" if exe else None
                        figures = _round(srv, names[:n], speech_s, exe, recorded)
                        out["levels"].setdefault(str(n), {}).setdefault(mode, []).append(figures)
                        print(f"  {n:3d} sessions, {mode:9} round {r + 1}: missed {figures['missed']} of "
                              f"{figures['frames']} ({100 * figures['missed_share']:.1f}%, in {figures['missed_in']}), "
                              f"late {figures['late']}; "
                              f"{figures['calls']} device calls, {figures['frames_per_call']:.2f} frames a call; "
                              f"steps {figures['steps']}; the device thread busy "
                              f"{100 * figures['device_busy_share']:.0f}% of the round, steps prepared while "
                              f"another ran {figures['prepared_during_a_step']}", flush=True)
                        print(f"      CPU, % of one core: {figures['cpu_percent']}; the inference process "
                              f"{figures['inference_ms_per_frame']:.1f} ms a frame it ran, its main thread "
                              f"{figures['main_thread_ms_per_frame']:.2f}", flush=True)
                        print("      speech frame stages, ms p50/p99/max: " + ", ".join(
                            f"{name} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}"
                            for name, v in figures["stages_ms"].items()), flush=True)
                        if "profile" in figures:
                            pyspy.print_summary(figures["profile"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out
