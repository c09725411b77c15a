"""The GPU path's batching, run on the CPU through the stand-in device (gpu_actor/device.py): the real
server around it, every batch the worker would hand a GPU run at a prepared size, and the device stopping
for STALL_S on the first call of each (session, batch size), as cuDNN does on a card.

On the CPU provider a worker runs one frame per call, so no CPU test would show a GPU worker stopping
for seconds at each new batch size while live speech falls due: this one does."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import onnx

from bench.steps import say
from gpu_actor.device import STAND_IN_ENV
from gpu_actor.demo_model import build_demo_encoder
from gpu_actor.shapes import prepared_sizes
from lipsync_client import AsyncSession
from tests.helpers import base_config, make_avatar, run_server

STALL_S = 1.0
MAX_BATCH = 8
BUDGET_MS = 600   # a host half as fast as this one still composites in time; a stall still misses frames
FPS = 25.0


async def _speak(endpoint: str, model: str, every: int, seconds: float, load_at: asyncio.Event) -> tuple[dict, int]:
    """One session speaking `seconds`, `every` frames' windows sent together every `every` frame periods
    (the batches the worker sees then vary in size); sets `load_at` once it has spoken a second. Its stats,
    and the speech frames it sent."""
    window = np.random.default_rng(every).standard_normal((1, 32, 16, 16)).astype(np.float32)
    async with AsyncSession(endpoint, model, timeout_s=120) as s:
        async def drain() -> None:
            while True:
                await s.frames.get()
        reader = asyncio.create_task(drain())
        replies, t0, tick = [], time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if tick % every == 0:
                replies.append(s.push_audio(np.repeat(window, every, 0)))
            if time.monotonic() - t0 > 1.0:
                load_at.set()
            tick += 1
            await asyncio.sleep(max(t0 + tick / FPS - time.monotonic(), 0))
        for reply in replies:
            await reply
        sent = every * len(replies)
        # NOTE: the frames of the last chunk are due up to the latency budget after it was sent: until
        # every frame spoken went out (as speech, or not), or a budget past the last one's due time
        last_due = time.monotonic() + BUDGET_MS / 1000 + every / FPS
        while time.monotonic() < last_due + BUDGET_MS / 1000:
            st = await s.stats()
            if st["frames_speech"] + st["missed"] + st["shed"] >= sent:
                break
            await asyncio.sleep(1 / FPS)
        stats = await s.close()
        reader.cancel()
        return stats, sent


def test_live_speech_on_a_stalling_gpu_is_on_time_and_a_new_avatars_load_stalls_no_one(tmp_path):
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b", "c")):   # one architecture, three avatars
        make_avatar(root, model, n_frames=6, kind="tiny", seed=seed)
    # NOTE: as the PCM test's below: a budget and no shedding that leave a slow host room, a stall (STALL_S,
    # longer than the budget) on the worker's main thread still late
    cfg = base_config(root, **{"limits.max_batch": MAX_BATCH, "sessions.max_cpu_load": 0,
                               "sessions.latency_budget_ms": BUDGET_MS, "sessions.shed_speech": False})
    with run_server(tmp_path, cfg, env={STAND_IN_ENV: str(STALL_S)}) as srv:
        async def scenario() -> tuple[list[dict], float]:
            load_at = asyncio.Event()
            speakers = [asyncio.create_task(_speak(srv.endpoint, model, every, 5.0, load_at))
                        for model, every in (("a", 1), ("a", 3), ("b", 2))]
            await load_at.wait()
            loop = asyncio.get_running_loop()
            with srv.client(timeout_s=120) as c:   # a new avatar loads while three sessions speak
                t0 = time.monotonic()
                await loop.run_in_executor(None, c.load, "c")
                load_s = time.monotonic() - t0
            return await asyncio.gather(*speakers), load_s

        sessions, load_s = asyncio.run(scenario())
        with srv.client() as c:
            stats = c.stats()
            models = stats["models"]
    for s, sent in sessions:   # every frame sent was spoken, on time
        assert (s["frames_speech"], s["missed"], s["late"], s["shed"]) == (sent, 0, 0, 0), (sent, s)
    sizes = prepared_sizes(MAX_BATCH)
    (architecture,) = stats["workers"][0]["architectures"].values()   # three avatars, one architecture
    assert architecture["sizes"] == list(sizes) and architecture["models"] == 3 and architecture["frames_per_s"] > 0
    # the stand-in really stalled: the architecture's first model prepared every size, one stall each
    assert models["a"]["load_ms"] >= len(sizes) * STALL_S * 1000 or models["b"]["load_ms"] >= len(sizes) * STALL_S * 1000
    # ... and a later avatar of it met no new shape: its load is its weights
    assert load_s < STALL_S and models["c"]["load_ms"] < STALL_S * 1000, (load_s, models["c"])
    weights = models["c"]["nbytes"]
    assert 0 < weights <= 2 * (tmp_path / "models" / "c" / "model.onnx").stat().st_size


PCM_SESSIONS = 6
PCM_MAX_BATCH = 16
PCM_SPEECH_S = 1.2
PCM_EVERY_S = 0.6   # session k starts at k * PCM_EVERY_S: two speak at a time (each sends a request a frame)
PCM_STALL_S = 1.0   # a session meeting one would miss 25 frames


def test_pcm_speech_on_a_device_that_stalls_every_session_per_shape_misses_nothing(tmp_path):
    """PCM sessions speaking at real time, on two avatars with an audio encoder, through the GPU path on a
    device where every session (the models', the crops graph's, the encoder's) stops PCM_STALL_S at its first
    call at each input shape, as cuDNN does on a card: the encoder runs at prepared sizes warmed before its
    model counts as loaded, so no session misses a speech frame, also while a third avatar, with an encoder
    of its own, loads meanwhile (its encoder's sizes stall on the load thread, never on the main one)."""
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b", "c")):
        # the demo's encoder (small: this host's two cores run the sessions' mel and encoder too); a and b
        # share one file's content, c has its own
        encoder = build_demo_encoder()
        encoder.doc_string = "c's own" if model == "c" else ""
        onnx.save(encoder, make_avatar(root, model, n_frames=6, seed=seed) / "audio_encoder.onnx")
    # NOTE: what this test holds to account is a stall on the worker's main thread (PCM_STALL_S, longer
    # than the latency budget), not the host's speed: its budget and no shedding leave a slow host room
    cfg = base_config(root, **{"limits.max_batch": PCM_MAX_BATCH, "sessions.max_cpu_load": 0,
                               "sessions.latency_budget_ms": BUDGET_MS, "sessions.shed_speech": False})
    with run_server(tmp_path, cfg, env={STAND_IN_ENV: str(PCM_STALL_S)}) as srv:
        with srv.client(timeout_s=300) as c:
            for model in ("a", "b"):
                c.load(model)

        async def scenario() -> tuple[list, float]:
            started = asyncio.Event()
            speakers = [asyncio.create_task(say(srv.endpoint, "ab"[k % 2], k, PCM_SPEECH_S, k * PCM_EVERY_S, started))
                        for k in range(PCM_SESSIONS)]
            await started.wait()
            loop = asyncio.get_running_loop()
            with srv.client(timeout_s=300) as c:   # a new avatar, with its own encoder, loads meanwhile
                t0 = time.monotonic()
                await loop.run_in_executor(None, c.load, "c")
                load_s = time.monotonic() - t0
            return await asyncio.gather(*speakers), load_s

        sessions, load_s = asyncio.run(scenario())
    # the load was long enough to be seen: its encoder's sizes each stalled (on the load thread)
    assert load_s >= len(prepared_sizes(PCM_MAX_BATCH)) * PCM_STALL_S, load_s
    for stats, frames in sessions:
        summary = {k: v for k, v in stats.items() if k not in ("stages_ms", "latency_ms")}
        assert stats["frames_speech"] == frames and stats["missed"] == 0, (frames, summary)
        assert stats["late"] == 0 and stats["shed"] == 0, stats
