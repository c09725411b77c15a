"""Device steps (gpu_actor/worker.py): the requests queued at a GPU worker share its device calls, each
request's mouths its own. Run through the stand-in device with a card's cost curve (a call lasts a fixed
part plus a part per frame, gpu_actor/device.py), so requests arriving while a call runs queue up as they
do on a busy card."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.steps import say
from config.assets import AssetError
from gpu_actor.device import STAND_IN_COST_ENV
from gpu_actor.own_session import OwnSessionRunner
from lipsync_client import AsyncClient, ClientClosed, ClientTimeout, ServerError
from shm.messages import InferTask
from tests.helpers import base_config, free_port, infer_at_once, make_avatar, one_beside_many, run_server

CALL_MS = 400   # a call's fixed part: long enough that the burst's requests all queue behind the first call
REQUESTS = 8    # 1 frame each, on two avatars of one architecture
LONG_CALL_MS = 1000   # a call during which requests reach the worker and a client goes, with time to spare


@pytest.mark.parametrize("mixed, kind", [("sub_calls", "sub_calls"), ("auto", "grouped")])
def test_requests_queued_at_a_worker_share_its_calls_and_each_gets_its_own_mouths(tmp_path, mixed, kind):
    """Two avatars' requests queued together: one step, run as a call per avatar (`sub_calls`), or as one
    call of the architecture's N-model form, which `auto` picks where a call's fixed cost dominates (a
    card's; here the stand-in's CALL_MS, measured so when the architecture was prepared)."""
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b")):
        make_avatar(root, model, kind="tiny", seed=seed)
    # NOTE: shm.slots 2: the rings hold two requests of max_batch (8) frames, or 16 of one frame each (a
    # request takes the slots its frames need), and one client's share, half, all 8 in flight at once
    cfg = base_config(root, **{"limits.max_batch": REQUESTS, "limits.queue_depth": 16, "shm.slots": 2,
                               "inference.mixed_steps": mixed, "metrics.port": free_port()})
    rng = np.random.default_rng(7)
    work = [("ab"[k % 3 == 2], rng.random((1, 6, 320, 320), np.float32),
             rng.standard_normal((1, 32, 16, 16)).astype(np.float32)) for k in range(REQUESTS)]
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_MS},1"}) as srv:
        with srv.client(timeout_s=120) as c:
            for model in ("a", "b"):
                c.load(model)
            if mixed != "sub_calls":   # the load thread prepares the N-model form after the second load
                give_up = time.monotonic() + 120
                while not next(iter(c.stats()["workers"][0]["architectures"].values()))["grouped_ms"]:
                    assert time.monotonic() < give_up, "the N-model form was never prepared"
                    time.sleep(0.1)
        answers = infer_at_once(srv.endpoint, work)
        with srv.client() as c:
            worker = c.stats()["workers"][0]
        (architecture,) = worker["architectures"].values()
        body = urllib.request.urlopen(f"http://127.0.0.1:{cfg['metrics']['port']}/metrics", timeout=30).read().decode()
    # each request's mouths are its own model's on its own frame (the CPU provider, the model alone)
    runners = {m: OwnSessionRunner(root / m / "model.onnx") for m in ("a", "b")}
    for (model, visual, audio), (_, frames) in zip(work, answers):
        mouths = np.frombuffer(frames[0], "<f4").reshape(1, 3, 320, 320)
        expected = np.empty((1, 3, 320, 320), np.float32)
        runners[model].run(visual, audio, expected)
        assert np.abs(mouths - expected).max() <= 1e-5, model
    # ... and they shared calls: all but the first request queued behind its call
    histogram = {int(rows): n for rows, n in architecture["frames_per_call_histogram"].items()}
    assert sum(rows * n for rows, n in histogram.items()) == REQUESTS, histogram
    assert max(histogram) >= 3 and architecture["frames_per_call"] > 1.5, architecture
    assert architecture["steps"].get(kind, 0) >= 1, architecture   # two avatars in one step
    assert set(architecture["steps"]) <= {"one_model", kind}, architecture
    # the worker prepared the second step while the first one's call ran, and topped it up as it started
    # with what came meanwhile: all the requests behind the first call ran in one step
    steps = worker["steps"]
    assert steps["steps"] == sum(architecture["steps"].values()) <= 2, steps
    assert steps["prepared_during_a_step"] == steps["steps"] - 1, steps
    assert steps["device_busy_s"] >= steps["steps"] * CALL_MS / 1000, steps
    # Prometheus tells the same: frames per device call (a histogram), rows held and padded, steps by kind
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    calls = sum(histogram.values())
    assert samples[("lipsync_device_call_frames_count", (("worker", "0"),))] == calls, samples
    assert samples[("lipsync_device_call_frames_sum", (("worker", "0"),))] == REQUESTS
    assert samples[("lipsync_device_call_rows_total", (("row", "frame"), ("worker", "0")))] == REQUESTS
    padding = sum(int(size) * n for size, n in architecture["calls_by_size"].items()) - REQUESTS
    assert samples[("lipsync_device_call_rows_total", (("row", "padding"), ("worker", "0")))] == padding
    assert architecture["padded_share"] == round(padding / (padding + REQUESTS), 3), architecture
    assert samples[("lipsync_device_busy_seconds_total", (("worker", "0"),))] == pytest.approx(steps["device_busy_s"])
    assert {k: v for (name, labels), v in samples.items() if name == "lipsync_device_steps_total"
            for key, k in labels if key == "kind"} == {k: float(n) for k, n in architecture["steps"].items()}


def test_a_request_that_would_end_past_its_deadline_is_not_run_and_the_one_behind_it_takes_its_step(tmp_path):
    """A step takes CALL_MS here (the stand-in's cost, as a busy card's): a request due sooner than a step
    would end is answered `timeout` at once, without a call (its frames would be of no use, and running
    them would make the request behind it late too); the request behind it runs in the step it would
    have held."""
    root = tmp_path / "models"
    make_avatar(root, "a", kind="tiny")
    cfg = base_config(root, **{"limits.max_batch": 1, "shm.slots": 2})
    rng = np.random.default_rng(3)
    visual, audio = rng.random((1, 6, 320, 320), np.float32), rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_MS},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            c.load("a")
            for _ in range(3):   # the worker times its steps (their median: what a step takes now)
                c.infer("a", visual, audio)

        async def both() -> list:
            async with AsyncClient(srv.endpoint, timeout_s=120) as client:
                return await asyncio.gather(client.infer("a", visual, audio, timeout_ms=CALL_MS // 2),
                                            client.infer("a", visual, audio), return_exceptions=True)

        doomed, served = asyncio.run(both())
        with srv.client() as c:
            (architecture,) = c.stats()["workers"][0]["architectures"].values()
    assert isinstance(doomed, ServerError) and doomed.code == "timeout", doomed
    assert "would end" in doomed.message and "past its deadline" in doomed.message, doomed.message
    assert not isinstance(served, BaseException), served
    assert architecture["frames_per_call_histogram"] == {"1": 4}, architecture   # (the doomed one never ran)


def test_a_request_prepared_behind_a_step_that_ran_long_is_weighed_again_and_not_run_past_its_deadline(tmp_path):
    """The worker prepares the next step while one runs, weighing each request's deadline against when
    that step should end (steps' usual length, one frame's FRAME_MS here). Here the running step lasts far
    longer (eight frames, as a card's first call at a new shape would stall):
    - a request sent as it begins, due before a usual step behind it would end, is answered `timeout` at
      once, not at its deadline (the client learns it now);
    - a request prepared behind it, due within a usual step of its end, is weighed again as that step starts,
      answered `timeout` and never run (run, it would end past its deadline)."""
    frame_ms = 600
    root = tmp_path / "models"
    make_avatar(root, "a", kind="tiny")
    cfg = base_config(root, **{"limits.max_batch": 8, "shm.slots": 4})
    rng = np.random.default_rng(9)

    def frames(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.random((n, 6, 320, 320), np.float32), rng.standard_normal((n, 32, 16, 16)).astype(np.float32)
    one, eight = frames(1), frames(8)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"0,{frame_ms}"}) as srv:
        with srv.client(timeout_s=120) as c:
            c.load("a")
            for _ in range(3):   # the worker times its steps: one frame, frame_ms, is what a step takes now
                c.infer("a", *one)

        async def timed(client: AsyncClient, timeout_ms: int) -> tuple[object, float]:
            sent = time.monotonic()
            try:
                return await client.infer("a", *one, timeout_ms=timeout_ms), time.monotonic() - sent
            except ServerError as err:
                return err, time.monotonic() - sent

        async def scenario() -> list:
            async with AsyncClient(srv.endpoint, timeout_s=120) as client:
                began = time.monotonic()
                long = asyncio.ensure_future(client.infer("a", *eight))   # 8 x frame_ms
                await asyncio.sleep(frame_ms / 4000)   # its call has begun (a hop takes milliseconds)
                # due 4/3 of a usual step from now: it would end past that behind the running step's usual
                # length, which is what is weighed (it would not behind a step ending now)
                at_once = await timed(client, round(frame_ms * 4 / 3))
                await asyncio.sleep(max(began + frame_ms / 1000 - time.monotonic(), 0))
                # due half a usual step after the long one ends: it fits behind a usual step, not this one
                prepared = asyncio.ensure_future(client.infer(
                    "a", *one, timeout_ms=round((began - time.monotonic()) * 1000 + 8.5 * frame_ms)))
                return [*await asyncio.gather(long, prepared, return_exceptions=True), at_once]

        served, doomed, (told, told_after_s) = asyncio.run(scenario())
        with srv.client() as c:
            c.infer("a", *one)   # a step after whatever ran behind the long one (stats answer beside a step)
            (architecture,) = c.stats()["workers"][0]["architectures"].values()
    assert not isinstance(served, BaseException), served
    assert isinstance(told, ServerError) and told.code == "timeout" and "would end" in told.message, told
    assert told_after_s < frame_ms / 2000, told_after_s   # at once: not at its deadline
    assert isinstance(doomed, ServerError) and doomed.code == "timeout", doomed
    assert architecture["frames_per_call_histogram"] == {"1": 4, "8": 1}, architecture   # (neither ran)


def test_a_step_serves_the_rest_when_a_client_goes_and_an_unload_meets_its_models_queued_frames(tmp_path):
    """While a call runs (the stand-in's LONG_CALL_MS, as a busy card's), two clients' requests queue at the
    worker for its next step: one client goes (its requests end; their inputs are freed while they wait,
    prepared into that step), and the other's model is asked to unload. The next step runs without the gone
    client's frames, the
    unload is refused while that model's frames wait, and the other client's mouths are its own model's.
    No output slot is left taken: a request needing every one of them is served after."""
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b")):
        make_avatar(root, model, kind="tiny", seed=seed)
    # shm.slots 1: the rings hold max_batch (8) frames in all, so a slot kept by a gone request would
    # leave the last request, of 8 frames, waiting until its deadline
    cfg = base_config(root, **{"limits.max_batch": REQUESTS, "limits.queue_depth": 16, "shm.slots": 1})
    rng = np.random.default_rng(11)

    def frames(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.random((n, 6, 320, 320), np.float32), rng.standard_normal((n, 32, 16, 16)).astype(np.float32)
    first, stays, gone, full = frames(1), [frames(1) for _ in range(3)], [frames(1) for _ in range(3)], frames(REQUESTS)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{LONG_CALL_MS},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            for model in ("a", "b"):
                c.load(model)

        async def scenario() -> tuple:
            async with AsyncClient(srv.endpoint, timeout_s=120) as one, AsyncClient(srv.endpoint, timeout_s=120) as two:
                leaving = AsyncClient(srv.endpoint, timeout_s=120)
                await leaving.__aenter__()
                running = asyncio.ensure_future(one.infer("a", *first))
                await asyncio.sleep(LONG_CALL_MS / 4000)   # its call has begun (a hop takes milliseconds)
                # the gone client's first: the worker prepares them into its next step while the call runs
                dropped = [asyncio.ensure_future(leaving.infer("a", *f)) for f in gone]
                await asyncio.sleep(LONG_CALL_MS / 8000)
                queued = [asyncio.ensure_future(two.infer("b", *f)) for f in stays]
                await asyncio.sleep(LONG_CALL_MS / 8000)   # all at the worker, behind the call
                await leaving.close()                 # the client goes: its requests end
                unloaded = await asyncio.gather(two.request("unload", model="b"), return_exceptions=True)
                answers = await asyncio.gather(running, *queued)
                ended = await asyncio.gather(*dropped, return_exceptions=True)
                after = await two.infer("a", *full)   # every output slot free again
                return answers, unloaded[0], ended, after

        answers, unloaded, ended, after = asyncio.run(scenario())
        with srv.client() as c:
            (architecture,) = c.stats()["workers"][0]["architectures"].values()
    runners = {m: OwnSessionRunner(root / m / "model.onnx") for m in ("a", "b")}

    def own(model: str, visual: np.ndarray, audio: np.ndarray) -> np.ndarray:
        out = np.empty((len(visual), 3, 320, 320), np.float32)
        for i in range(len(visual)):
            runners[model].run(visual[i:i + 1], audio[i:i + 1], out[i:i + 1])
        return out

    for (model, (visual, audio)), (_, mouths) in zip([("a", first), *(("b", f) for f in stays)], answers):
        got = np.frombuffer(mouths[0], "<f4").reshape(1, 3, 320, 320)
        assert np.abs(got - own(model, visual, audio)).max() <= 1e-5, model
    assert all(isinstance(e, ClientClosed) for e in ended), ended   # (at the close, not at their timeout)
    assert isinstance(unloaded, ServerError) and unloaded.code == "overloaded", unloaded
    assert "queued or running" in unloaded.message, unloaded.message
    got = np.stack([np.frombuffer(m, "<f4").reshape(3, 320, 320) for m in after[1]])
    assert np.abs(got - own("a", *full)).max() <= 1e-5
    # the gone client's frames never ran: the calls held the first, the other client's three, the last 8
    histogram = {int(rows): n for rows, n in architecture["frames_per_call_histogram"].items()}
    assert sum(rows * n for rows, n in histogram.items()) == 1 + len(stays) + REQUESTS, histogram


def test_a_sub_call_steps_requests_are_answered_as_their_own_models_call_ends(tmp_path):
    """A step of three avatars run as a call each (`sub_calls`): each avatar's request is answered as its
    own call ends, while the next avatar's call runs, not once the whole step is done (on a card, a step of
    sub-calls over many avatars lasts as many calls). (Three: the worker's loop also wakes once a second,
    which could answer one early request by chance, never two a call apart.)"""
    root = tmp_path / "models"
    models = ("a", "b", "c")
    for seed, model in enumerate(models):
        make_avatar(root, model, kind="tiny", seed=seed)
    cfg = base_config(root, **{"limits.max_batch": REQUESTS, "inference.mixed_steps": "sub_calls"})
    rng = np.random.default_rng(5)
    visual, audio = rng.random((1, 6, 320, 320), np.float32), rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_MS},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            for model in models:
                c.load(model)

        async def answered(client: AsyncClient, model: str) -> float:
            await client.infer(model, visual, audio)
            return time.monotonic()

        async def scenario() -> list:
            async with AsyncClient(srv.endpoint, timeout_s=120) as client:
                running = asyncio.ensure_future(client.infer("a", visual, audio))
                await asyncio.sleep(CALL_MS / 4000)   # its call has begun (a hop takes milliseconds)
                ends = await asyncio.gather(*(answered(client, model) for model in models))
                await running
                return ends

        ends = sorted(asyncio.run(scenario()))
        with srv.client() as c:
            (architecture,) = c.stats()["workers"][0]["architectures"].values()
    assert architecture["steps"] == {"one_model": 1, "sub_calls": 1}, architecture   # all queued: one step
    # a call apart (each lasts CALL_MS at least): each answered while the next one's call ran
    gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
    assert min(gaps) >= CALL_MS / 2000, gaps


def test_a_request_on_a_background_frame_that_does_not_decode_fails_alone_and_at_once(tmp_path):
    """An avatar's frame file is broken. While a call runs, requests on it queue with others of two
    avatars: the one that needs the broken frame is answered bad_request, naming the file, long before its
    deadline (its frame is read off the main thread, fails, and the task's own read then meets the
    error); the others are served, and no call ever held its frame."""
    root = tmp_path / "models"
    make_avatar(root, "a", kind="tiny")
    broken = make_avatar(root, "c", kind="tiny", seed=1) / "frames" / "2.png"
    broken.write_bytes(b"not an image")
    cfg = base_config(root, **{"limits.max_batch": REQUESTS})
    audio = np.zeros((3, 32, 16, 16), np.float32)
    deadline_ms = 60_000
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{LONG_CALL_MS},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            for model in ("a", "c"):
                c.load(model)
            c.composite("c", audio[:2], start_frame=0)   # its good frames read (the store), one call

        async def scenario() -> tuple:
            async with AsyncClient(srv.endpoint, timeout_s=120) as client:
                running = asyncio.ensure_future(client.composite("a", audio[:1], start_frame=0))
                await asyncio.sleep(LONG_CALL_MS / 4000)   # its call has begun
                t0 = time.monotonic()
                bad = asyncio.ensure_future(client.composite("c", audio[:1], start_frame=2, timeout_ms=deadline_ms))
                good = [asyncio.ensure_future(client.composite("c", audio[:2], start_frame=0)),
                        asyncio.ensure_future(client.composite("a", audio[:3], start_frame=3))]
                failed = (await asyncio.gather(bad, return_exceptions=True))[0]
                took = time.monotonic() - t0
                return failed, took, await asyncio.gather(running, *good)

        failed, took, served = asyncio.run(scenario())
        with srv.client() as c:
            (architecture,) = c.stats()["workers"][0]["architectures"].values()
    assert isinstance(failed, ServerError) and failed.code == "bad_request", failed
    assert "2.png" in failed.message and "neither a PNG nor a JPEG" in failed.message, failed.message
    assert took < deadline_ms / 2000, took   # (before: decoded again and again until its deadline)
    assert [len(images) for _, images in served] == [1, 2, 3]
    histogram = {int(rows): n for rows, n in architecture["frames_per_call_histogram"].items()}
    assert sum(rows * n for rows, n in histogram.items()) == 2 + 1 + 2 + 3, histogram   # (the broken one: none)


def _device_frames_per_s(port: int) -> tuple[float, ...]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return tuple(s.value for family in text_string_to_metric_families(body) for s in family.samples
                 if s.name == "lipsync_device_frames_per_s")


def test_admission_holds_speech_within_what_the_steps_of_the_avatars_loaded_run(tmp_path):
    """The frames/s a GPU worker says its device runs (admission's limit, live/capacity.py) is what its
    steps run with the avatars it holds, from the calls measured per prepared size: one avatar, calls of
    the largest size; two of one architecture, a step holding half of it from each, as a call per avatar
    at that size (half the frames a call, as long a call where the fixed part dominates), until the
    N-model form is ready and holds them all in one call again."""
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b")):
        make_avatar(root, model, kind="tiny", seed=seed)
    cfg = base_config(root, **{"limits.max_batch": REQUESTS, "inference.mixed_steps": "auto",
                               "metrics.port": free_port()})
    port = cfg["metrics"]["port"]
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_MS},1"}) as srv:
        with srv.client(timeout_s=120) as c:
            def figure() -> float:
                (architecture,) = c.stats()["workers"][0]["architectures"].values()
                return architecture["frames_per_s"]
            c.load("a")
            one = figure()
            assert _device_frames_per_s(port) == (pytest.approx(one, abs=0.05),)   # (stats round it)
            # NOTE: the worker's model event comes before its answer to the load: the frontend has it
            c.load("b")   # (its N-model form takes seconds of CALL_MS calls to prepare after this)
            sub_calls = _device_frames_per_s(port)[0]
            give_up = time.monotonic() + 120
            while not next(iter(c.stats()["workers"][0]["architectures"].values()))["grouped_ms"]:
                assert time.monotonic() < give_up, "the N-model form was never prepared"
                time.sleep(0.1)
            said_by = time.monotonic() + 30   # (the worker says so once its loop next turns)
            while _device_frames_per_s(port)[0] == sub_calls and time.monotonic() < said_by:
                time.sleep(0.1)
            grouped = _device_frames_per_s(port)[0]
            assert grouped == pytest.approx(figure(), abs=0.05)
    # calls of REQUESTS / 2 frames at a call's cost instead of REQUESTS: about half as many frames a second
    assert 0.35 < sub_calls / one < 0.65, (one, sub_calls)
    assert grouped > 1.5 * sub_calls, (sub_calls, grouped)


LIVE_AVATARS = 3          # PCM sessions, one avatar each, all speaking at once
LIVE_COST = "20,1"        # each model call: 20 ms + 1 ms a frame (a card's curve, scaled to this host's few sessions)
LIVE_SPEECH_S = 2.0
LIVE_BUDGET_MS = 600


def test_live_pcm_sessions_each_on_its_own_avatar_share_calls_and_miss_nothing(tmp_path):
    """PCM sessions, each on an avatar of its own (one architecture), start speaking at once on a device
    whose every model call costs a fixed part: each session's frames come a request a frame, so calls of
    one request each would lose speech (21 ms a call, 3 avatars at 25 frames/s); steps hold the frames that
    queued meanwhile, of every avatar, and every speech frame is on time, also while a further avatar loads."""
    import onnx

    from gpu_actor.demo_model import build_demo_encoder
    root = tmp_path / "models"
    names = [f"v{k}" for k in range(LIVE_AVATARS + 1)]   # the last one loads while the others speak
    for seed, name in enumerate(names):
        onnx.save(build_demo_encoder(), make_avatar(root, name, kind="tiny", seed=seed) / "audio_encoder.onnx")
    # NOTE: a latency budget of LIVE_BUDGET_MS: a host half as fast as this one still composites in time,
    # while calls of one request each fall further behind every second whatever the budget
    cfg = base_config(root, **{"limits.max_batch": 16, "limits.queue_depth": 64, "shm.slots": 4,
                               "sessions.max_cpu_load": 0, "sessions.shed_speech": False,
                               "sessions.latency_budget_ms": LIVE_BUDGET_MS,
                               "compositing.cache_bytes": 128 << 20})   # (every avatar's frames stay in the store)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: LIVE_COST}) as srv:
        with srv.client(timeout_s=120) as c:
            for name in names[:-1]:
                c.load(name)
            (before,) = c.stats()["workers"][0]["architectures"].values()

        async def scenario() -> list:
            speakers = [asyncio.create_task(say(srv.endpoint, name, k, LIVE_SPEECH_S)) for k, name in enumerate(names[:-1])]
            await asyncio.sleep(LIVE_SPEECH_S / 2)
            with srv.client(timeout_s=120) as c:   # a further avatar loads while they speak
                await asyncio.get_running_loop().run_in_executor(None, c.load, names[-1])
            return await asyncio.gather(*speakers)

        sessions = asyncio.run(scenario())
        with srv.client() as c:
            (after,) = c.stats()["workers"][0]["architectures"].values()
    for stats, frames in sessions:
        summary = {k: v for k, v in stats.items() if k not in ("stages_ms", "latency_ms")}
        assert (stats["frames_speech"], stats["missed"], stats["late"]) == (frames, 0, 0), (frames, summary)
    calls = {int(k): n - before["frames_per_call_histogram"].get(k, 0)
             for k, n in after["frames_per_call_histogram"].items()}
    held = sum(k * n for k, n in calls.items()) / sum(calls.values())
    assert held > 1.5, calls   # calls held the frames that queued behind the one before
    assert after["models"] == LIVE_AVATARS + 1



CALL_S = 0.5   # the stand-in's cost of a call (of one frame: the models below run one frame a call)


def _slots_in_use(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(s.value for family in text_string_to_metric_families(body) for s in family.samples
               if s.name == "lipsync_shm_slots_in_use")


def test_a_restarted_frontends_requests_get_their_own_mouths_not_those_run_for_the_dead_one(tmp_path):
    """The frontend dies while its request runs on the device (a frame a step), two more queued behind it at
    the worker, and its successor's requests reach the worker while that request would still run: each is
    answered with its own model's mouths on its own inputs, never with what the worker computed for the
    dead frontend's requests (left unanswered); the dead one's request stops at the part running when its
    successor starts, its queued requests never run, and every slot is free again after."""
    root = tmp_path / "models"
    for seed, model in enumerate(("a", "b")):   # (a batch of one: a request of n frames runs as n calls)
        make_avatar(root, model, kind="tiny", seed=seed, batch=1)
    # (shm.slots 6: one client's share of the room, half, holds three requests of max_batch frames)
    cfg = base_config(root, **{"limits.max_batch": 8, "shm.slots": 6, "metrics.port": free_port()})
    port = cfg["metrics"]["port"]
    rng = np.random.default_rng(11)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_S * 1000:g},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            for model in ("a", "b"):
                c.load(model)
        # how long the frontend takes to come back on this host: the dead one's step lasts six times that
        started = time.monotonic()
        old = srv.pids("frontend")[0]
        os.kill(old, signal.SIGKILL)
        _, proc = srv.restarted("frontend", old)
        restart_s = time.monotonic() - started
        frames = min(8, max(4, math.ceil(6 * restart_s / CALL_S)))

        def dead_frontends_requests() -> None:   # never answered: their frontend dies
            try:
                infer_at_once(srv.endpoint, [("a", rng.random((frames, 6, 320, 320), np.float32),
                                              rng.standard_normal((frames, 32, 16, 16)).astype(np.float32))] * 3,
                              timeout_s=6 * restart_s + frames * CALL_S)
            except (ClientTimeout, ClientClosed):
                pass

        sender = threading.Thread(target=dead_frontends_requests)
        sender.start()
        give_up = time.monotonic() + 60
        with srv.client() as c:   # all three at the worker: the first one runs, one prepared, one queued
            while c.stats()["workers"][0]["queue"] < 1:
                assert time.monotonic() < give_up, "the requests never reached the worker"
                time.sleep(0.05)
        running_since = time.monotonic()
        work = [("b", rng.random((1, 6, 320, 320), np.float32),
                 rng.standard_normal((1, 32, 16, 16)).astype(np.float32)) for _ in range(4)]
        os.kill(proc["pid"], signal.SIGKILL)
        srv.restarted("frontend", proc["pid"])
        sent_at = time.monotonic()
        answers = infer_at_once(srv.endpoint, work)   # (sent once: a request given up on still runs)
        sender.join()
        with srv.client() as c:
            worker = c.stats()["workers"][0]
        (architecture,) = worker["architectures"].values()
        ran = sum(int(rows) * n for rows, n in architecture["frames_per_call_histogram"].items())
        give_up = time.monotonic() + 30   # (the gauge is set every few seconds)
        while _slots_in_use(port):
            assert time.monotonic() < give_up, "input slots are still held"
            time.sleep(0.1)
    runner = OwnSessionRunner(root / "b" / "model.onnx")
    for (_, visual, audio), (header, images) in zip(work, answers):
        assert header["ok"] and header["batch"] == 1, header
        mouths = np.frombuffer(images[0], "<f4").reshape(1, 3, 320, 320)
        expected = np.empty((1, 3, 320, 320), np.float32)
        runner.run(visual, audio, expected)
        assert np.abs(mouths - expected).max() <= 1e-5
    # the new frontend's requests were sent while the dead one's step still ran (what this test is about)
    assert sent_at < running_since + frames * CALL_S, (sent_at - running_since, frames)
    # the new ones, and of the dead frontend's: its first request's parts (a frame a step, gpu_actor/worker.py)
    # up to its successor's start, not the rest of it, nor its queued requests
    assert len(work) + 1 <= ran < frames + len(work), (ran, frames)


def test_a_client_with_many_requests_at_the_worker_shares_it_with_anothers_one(tmp_path):
    """One client's eight requests reach the worker at once, each a step of its own (limits.max_batch
    frames, a step CALL_MS long); another client's request, sent once the first of them is answered,
    runs after the step running then and the one prepared behind it (gpu_actor/turns.py), not after
    all of the first client's."""
    root = tmp_path / "models"
    make_avatar(root, "a", kind="tiny")
    # (shm.slots 16: a client's share of the rings, half, holds all eight requests of max_batch frames)
    cfg = base_config(root, **{"limits.max_batch": 2, "limits.queue_depth": 16, "shm.slots": 16})
    rng = np.random.default_rng(5)
    audio = rng.standard_normal((2, 32, 16, 16)).astype(np.float32)
    with run_server(tmp_path, cfg, env={STAND_IN_COST_ENV: f"{CALL_MS},0"}) as srv:
        with srv.client(timeout_s=120) as c:
            c.load("a")

        order = one_beside_many(srv.endpoint, srv.endpoint, "a", audio)
    # answered before it: the first, the one running when it came, the one prepared behind that (and one
    # more where this host took a whole step to send it); in deadline order it came after all eight
    assert order.index("one") <= 4, order


def test_turns_share_the_device_by_frames_between_clients_and_put_speech_first():
    """gpu_actor/turns.py alone: two clients that keep tasks queued get equal frames whatever their tasks'
    sizes; a client's tasks run in deadline order; a newcomer's first task goes before the queued tasks
    of a client that has been served; a live session's speech goes before all, due soonest first; a
    client is a frontend's number for it within that frontend."""
    from gpu_actor.turns import Turns
    from shm.messages import InferTask
    from shm.requests import first_id
    from shm.ring import TensorRef

    ids = iter(range(first_id(1, 0), first_id(1, 0) + 100_000))

    def task(client: int, batch: int, deadline: float = 100.0, due: float = 0.0, owner: int = 1) -> InferTask:
        req = next(ids) if owner == 1 else first_id(owner, 0)
        return InferTask(req=req, model="m", batch=batch, audio=TensorRef("r", 0, 0, 0, "float32", (batch,)), visual=None,
                         frames=[0] * batch, plan=[], deadline=deadline, due=due, client=client)

    turns = Turns()
    queue = [task(1, 8, deadline=50.0 + k) for k in range(10)] + [task(2, 2, deadline=90.0 + k) for k in range(40)]
    served = {1: 0, 2: 0}
    for _ in range(20):
        first = turns.order(queue, lambda t: t.batch)[0]
        queue.remove(first)
        turns.taken(first, first.batch)
        served[first.client] += first.batch
    assert abs(served[1] - served[2]) <= 8, served
    # deadline order within a client; a newcomer, and another frontend's client of the same number, next
    mine = [task(1, 8, deadline=80.0), task(1, 8, deadline=60.0)]
    newcomer, elsewhere = task(3, 4, deadline=200.0), task(1, 4, deadline=300.0, owner=2)
    speech = [task(0, 1, due=7.0), task(0, 1, due=5.0)]
    order = turns.order(queue + mine + [newcomer, elsewhere] + speech, lambda t: t.batch)
    assert order[:2] == [speech[1], speech[0]]
    assert order.index(newcomer) <= 3 and order.index(elsewhere) <= 3, [t.client for t in order]
    assert order.index(mine[1]) < order.index(mine[0])
    # a client's queued tasks each start where the one before it ends, by its frames: one 8-frame task
    # goes behind another client's four 1-frame tasks, not after the first of them
    fresh = Turns()
    big, small = [task(9, 8, deadline=1.0 + k) for k in range(2)], [task(10, 1, deadline=2.0 + k) for k in range(4)]
    assert fresh.order(big + small, lambda t: t.batch) == [big[0], *small, big[1]]
    # live speech taken beside them is nobody's share: the served client stays behind the newcomer
    fresh = Turns()
    backlog = [task(11, 8, deadline=1.0 + k) for k in range(6)]
    for k in range(3):
        fresh.taken(fresh.order(backlog, lambda t: t.batch)[0], 8)
        backlog.pop(0)
        for j in range(4):
            fresh.taken(task(0, 8, due=10.0 * k + j), 8)
    late = task(12, 8, deadline=99.0)
    assert fresh.order(backlog + [late], lambda t: t.batch)[0] is late
    # a newcomer with many tasks gets its share from now on, not the whole past's worth
    burst = [task(4, 8, deadline=40.0 + k) for k in range(5)]
    order = turns.order(queue + burst, lambda t: t.batch)
    assert {t.client for t in order[:4]} != {4}, [t.client for t in order]
    # a client whose task runs (a part of it: not waiting) keeps its service: its next task, due first,
    # still goes after another client's
    turns = Turns()
    running = task(7, 8, deadline=10.0)
    turns.taken(running, 8)
    turns.taken(turns.order([task(8, 1, deadline=50.0)], lambda t: t.batch)[0], 1)
    again, other = task(7, 8, deadline=11.0), task(8, 1, deadline=51.0)
    assert turns.order([again, other], lambda t: t.batch)[0] is other
    # clients that each send one request and go leave at most MAX_CLIENTS tags behind, and the
    # backlogged client's tag is not among those forgotten
    from gpu_actor.turns import MAX_CLIENTS
    backlog = task(5, 8, deadline=1e9)
    turns.taken(backlog, 8 * 64)
    for client in range(100, 100 + 2 * MAX_CLIENTS):
        one = task(client, 2)
        turns.taken(turns.order([one, backlog], lambda t: t.batch)[0], 2)
    assert len(turns._ends) <= MAX_CLIENTS, len(turns._ends)
    assert turns.order([task(6, 2, deadline=2e9), backlog], lambda t: t.batch)[0].client == 6


def test_a_tenant_through_several_frontends_is_one_client_of_the_worker():
    """A tenant's requests spread over two client-facing processes (each numbers its own connections):
    the worker gives it one client's share beside another client, not one share per process; a
    connection's number stays its own process's."""
    from gpu_actor.turns import Turns
    from shm.messages import InferTask
    from shm.requests import client_key, first_id, tenant_client
    from shm.ring import TensorRef

    ids = {owner: iter(range(first_id(owner, 0), first_id(owner, 0) + 1000)) for owner in (1, 2)}

    def task(client: int, owner: int) -> InferTask:
        return InferTask(req=next(ids[owner]), model="m", batch=4, audio=TensorRef("r", 0, 0, 0, "float32", (4,)),
                         visual=None, frames=[0] * 4, plan=[], deadline=100.0, client=client)

    acme = tenant_client("acme")
    assert acme == tenant_client("acme") != tenant_client("acme2")
    assert client_key(first_id(1, 0), acme) == client_key(first_id(2, 0), acme)
    assert client_key(first_id(1, 0), 1) != client_key(first_id(2, 0), 1)
    turns = Turns()
    queue = [task(acme, 1 + k % 2) for k in range(40)] + [task(1, 1) for _ in range(40)]
    served = {"acme": 0, "other": 0}
    for _ in range(30):
        first = turns.order(queue, lambda t: t.batch)[0]
        queue.remove(first)
        turns.taken(first, first.batch)
        served["acme" if first.client == acme else "other"] += first.batch
    assert abs(served["acme"] - served["other"]) <= 4, served


def test_a_calls_inference_time_leaves_out_the_visual_input_built_during_it(monkeypatch):
    """A task's visual input is built from the avatar's crops per call (VisualFrames), its time counted
    as the request's input time: the call's inference time leaves it out, for a whole task and for a part
    of one (a task over several steps), else the two stages count it twice and add up past the total."""
    from gpu_actor import step as steps
    from gpu_actor import visual
    from shm.ring import TensorRef

    build_s = 0.05   # what building takes here (the test's own cost): the calls do nothing else
    monkeypatch.setattr(visual, "build_visual", lambda crops, out: time.sleep(build_s))
    task = InferTask(req=1, model="m", batch=4, audio=TensorRef("r", 0, 0, 0, "float32", (4,)), visual=None,
                     frames=[0] * 4, plan=[])
    frames = visual.VisualFrames([None] * 4, np.zeros((4, 1), np.float32))
    whole = steps.Job(task, 0, np.zeros((4, 1), np.float32), frames, np.zeros(4), None, 0.0)
    for job, rows in ((whole, 4), (whole.part(1, 3), 2), (whole.part(3, 4), 1)):
        step = steps.WorkerStep([job])
        steps._run(step, [job], "m", lambda: job.visual(0, rows))
        ((_, inference_ms),) = step.ran
        assert inference_ms < build_s * 1000 / 2, (job.rows, inference_ms)
    assert frames.spent_s >= 3 * build_s


def test_a_pcm_tasks_window_rows_outside_its_encoder_inputs_fail_that_task_with_what_does_not_fit():
    """A pcm16 task's frames name rows of its encoder inputs' outputs (-1: zeros). A row past the last
    input, or below -1, fails that task with a bad request (run_step fails it alone) rather than reading
    outside its inputs; the first and last rows and -1 are its own."""
    from gpu_actor import step as steps
    from shm.ring import TensorRef

    inputs = 5   # encoder inputs sent, and their outputs [inputs, 512]
    features = np.random.default_rng(0).standard_normal((inputs, 512)).astype(np.float32)
    sent = np.zeros((inputs, 1, 80, 16), np.float32)

    def windows(rows: list[list[int]]) -> np.ndarray:
        task = InferTask(req=1, model="m", batch=len(rows), audio=TensorRef("r", 0, 0, 0, "float32", (inputs,)),
                         visual=None, frames=[0] * len(rows), plan=[], rows=rows)
        return steps._audio_input(task, sent, features, None)

    got = windows([[0] * 8 + [inputs - 1] * 7 + [-1]])
    expected = np.concatenate([np.repeat(features[:1], 8, 0), np.repeat(features[-1:], 7, 0), np.zeros((1, 512))])
    assert np.array_equal(got.reshape(16, 512), expected)
    for bad in (inputs, -2):
        with pytest.raises(AssetError, match=rf"window rows \(1, 16\) do not fit {inputs} encoder inputs"):
            windows([[0] * 15 + [bad]])
    with pytest.raises(AssetError, match="do not fit"):   # a frame's rows not 16
        windows([[0] * 15])
