"""A live session, then another client, beside a client's batch work on the same inference worker:
the session speaks a 1-s chunk of window features every second, for 6 s, on the tests' small model,
while a client keeps N `composite` requests of 8 frames of the real-size unet_328 in flight (on the CPU
provider, about a second of the worker's time each). Then, with the same N in flight, another client
sends `composite` requests of one unet_328 frame, one after another, for 6 s. Per N: the session's
speech frames missed (and where they were when due), the other client's requests answered and how long
each took, and the first client's requests answered.

What it shows is whether one client's work can take a live session's or another client's device time
or room: a whole request as one step, a step's time judged by another model's, the worker's room held
by the client, one client's queued requests all run before another's.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

CHUNKS = 6            # 1-s chunks the session speaks, one a second
BATCH = 8             # frames of each of the client's requests


def _client(endpoint: str, in_flight: int, stop: threading.Event, answered: dict) -> None:
    """The batch client: `in_flight` requests always out, each sent again once answered."""
    from lipsync_client import AsyncClient, ServerError

    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=120) as client:
            audio = np.zeros((BATCH, 32, 16, 16), np.float32)

            async def one() -> None:
                while not stop.is_set():
                    try:
                        await client.composite("batch", audio)
                        answered["ok"] = answered.get("ok", 0) + 1
                    except ServerError as err:
                        answered[err.code] = answered.get(err.code, 0) + 1
                        await asyncio.sleep(0.01)
            await asyncio.gather(*(one() for _ in range(in_flight)))
    asyncio.run(main())


def _other(endpoint: str, seconds: float) -> list[float]:
    """Another client: one request of one unet_328 frame at a time for `seconds`; each one's seconds."""
    from lipsync_client import Client
    took: list[float] = []
    with Client(endpoint, timeout_s=120) as client:
        audio = np.zeros((1, 32, 16, 16), np.float32)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            client.composite("batch", audio)
            took.append(time.monotonic() - start)
    return took


def _level(srv, in_flight: int) -> dict:
    from lipsync_client import Session
    from tests.helpers import frames_until
    stop, answered = threading.Event(), {}
    thread = threading.Thread(target=_client, args=(srv.endpoint, in_flight, stop, answered))
    if in_flight:
        thread.start()
        time.sleep(3.0)   # the client's requests in flight, the worker's steps of them timed
    try:
        with Session(srv.endpoint, "live") as s:
            frames_until(s, 0)
            first = None
            for i in range(CHUNKS):
                reply = s.send_audio(np.zeros((25, 32, 16, 16), np.float32), last=i == CHUNKS - 1)
                first = reply["first_frame"] if first is None else first
                time.sleep(1.0)
            frames_until(s, first + 25 * CHUNKS)
            stats = s.stats()
        took = sorted(_other(srv.endpoint, float(CHUNKS)))
    finally:
        stop.set()
        if in_flight:
            thread.join()
    return {"missed": stats["missed"], "speech": stats["frames_speech"], "missed_in": stats["missed_in"],
            "late": stats["late"], "client": answered, "other_answered": len(took),
            "other_p50_ms": round(took[len(took) // 2] * 1000), "other_max_ms": round(took[-1] * 1000)}


def run(levels: tuple[int, ...] = (0, 1, 4)) -> dict:
    from tests.helpers import base_config, make_avatar, run_server
    root = Path(tempfile.mkdtemp(prefix="lsync-beside-"))
    out: dict = {}
    print(f"a live session, then another client, beside a client's batch work: {CHUNKS} 1-s chunks of speech "
          f"(tiny model), then {CHUNKS} s of 1-frame unet_328 requests one at a time, while the client keeps N "
          f"requests of {BATCH} frames of unet_328 in flight (limits.max_batch {BATCH}, shm.slots 4)")
    try:
        models = root / "models"
        make_avatar(models, "live", n_frames=5)
        make_avatar(models, "batch", n_frames=4, kind="unet328")
        cfg = base_config(models, **{"limits.max_batch": BATCH, "limits.queue_depth": 64, "shm.slots": 4,
                                     "sessions.max_cpu_load": 0})
        with run_server(root, cfg) as srv:
            with srv.client(timeout_s=120) as c:
                c.load("batch")
                c.load("live")
            for n in levels:
                figures = out[str(n)] = _level(srv, n)
                print(f"  N={n}: speech missed {figures['missed']} of {figures['missed'] + figures['speech']} "
                      f"(in {figures['missed_in']}), late {figures['late']}; another client's 1-frame requests: "
                      f"{figures['other_answered']} answered, {figures['other_p50_ms']} ms p50, "
                      f"{figures['other_max_ms']} ms at most; the client's requests: {figures['client']}",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out
