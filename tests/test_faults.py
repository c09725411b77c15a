"""Backpressure, deadlines, and kill -9 of each kind of process under load: typed errors, then recovery.
Every server here is stopped with SIGTERM and checked for leftover processes and /dev/shm entries."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import zmq

from lipsync_client import AsyncClient, ClientTimeout, ServerError, Session
from tests.helpers import base_config, frames_until, free_port, make_avatar, run_server, speech_beside_a_flood

pytestmark = pytest.mark.slow
AUDIO = np.zeros((4, 32, 16, 16), np.float32)
# A request is answered by its deadline (limits.request_timeout_s, 60 s in these configs) at the latest:
# an answer that takes a third of that means a death or a departure went unnoticed, not a slow machine.
UNNOTICED_S = 20.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "slow", n_frames=4, kind="unet328")   # ~0.15 s per frame here: work stays in flight
    make_avatar(root, "fast", n_frames=4)
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    # (a worker holds limits.max_batch (8) frames in flight per shm.slots)
    # (admission by CPU off: the live sessions here open beside this module's bursts, on one core too)
    cfg = base_config(models, **{"limits.queue_depth": 2, "shm.slots": 1, "metrics.port": free_port(),
                                 "sessions.max_cpu_load": 0})
    with run_server(tmp_path_factory.mktemp("srv"), cfg) as srv:
        srv.metrics_port = cfg["metrics"]["port"]
        with srv.client() as c:
            c.load("slow")
        yield srv


async def _burst(endpoint: str, n: int, model: str = "slow", audio: np.ndarray = AUDIO, **kw) -> list:
    """n concurrent requests; each result is a header dict or the ServerError / ClientTimeout raised."""
    async with AsyncClient(endpoint, timeout_s=60) as client:
        async def one(k):
            t0 = time.monotonic()
            try:
                header, _ = await client.composite(model, audio, start_frame=k, **kw)
                return header, time.monotonic() - t0
            except (ServerError, ClientTimeout) as err:
                return err, time.monotonic() - t0
        return await asyncio.gather(*(one(k) for k in range(n)))


def _cost_s(server, batch: int = 4, model: str = "slow") -> float:
    """Seconds one request takes on this machine, end to end (the fastest of two, since anything else
    running here only adds): what a test that needs work in flight waits, or sets deadlines, in."""
    times = []
    with server.client(timeout_s=60) as c:
        for _ in range(2):
            start = time.monotonic()
            c.composite(model, np.zeros((batch, 32, 16, 16), np.float32))
            times.append(time.monotonic() - start)
    return min(times)


def _fast_beside(endpoint: str, slow, wait_s: float, audio: np.ndarray, **kw) -> tuple[float, float]:
    """`slow(client)` sent on one client, then, `wait_s` later, a `fast` request of `audio` on another:
    the seconds the fast one took, and the seconds until both were done."""
    async def main() -> tuple[float, float]:
        async with AsyncClient(endpoint, timeout_s=60) as client, AsyncClient(endpoint, timeout_s=60) as other:
            t0 = time.monotonic()
            running = asyncio.ensure_future(slow(client))
            await asyncio.sleep(wait_s)
            t1 = time.monotonic()
            await other.composite("fast", audio, **kw)
            fast_s = time.monotonic() - t1
            await running
            return fast_s, time.monotonic() - t0
    return asyncio.run(main())


def _codes(results) -> list[str]:
    return sorted("ok" if isinstance(r, dict) else getattr(r, "code", "client_timeout") for r, _ in results)


def test_full_queue_answers_overloaded_at_once(server):
    # One request of limits.max_batch frames in flight + a queue of 2: of 8 at once, 5 must be refused
    # immediately.
    results = asyncio.run(_burst(server.endpoint, 8, audio=np.zeros((8, 32, 16, 16), np.float32)))
    codes = _codes(results)
    assert codes.count("overloaded") == 5 and codes.count("ok") == 3, codes
    refused = [t for r, t in results if getattr(r, "code", None) == "overloaded"]
    served = [t for r, t in results if isinstance(r, dict)]
    assert max(refused) < min(served), "overloaded must be answered before the queued work finishes"
    assert "limits.queue_depth" in next(r for r, _ in results if not isinstance(r, dict)).message


def test_a_clients_flood_of_requests_costs_a_live_session_none_of_its_speech(server):
    """One client keeps the worker's queue full (limits.queue_depth 2 here) and gets `overloaded` for
    the rest; a live session speaking meanwhile has every speech frame taken, none refused with it (a
    refusal is a frame missed for sure: admission, not the queue of clients' requests, bounds speech)."""
    stats, before, after = speech_beside_a_flood(server.endpoint, "fast", 1, 12,
                                                 lambda err: err.code == "overloaded", UNNOTICED_S)
    assert after > before, "the queue was not full while the session spoke"
    assert "failed (overloaded)" not in stats["missed_in"], stats
    assert stats["frames_speech"] + stats["missed"] == 50, stats


def test_a_slow_models_steps_do_not_make_a_fast_models_request_look_too_late_to_run(server):
    """The worker answers `timeout` without running a request whose step would end past its deadline,
    judged by how long steps take: those of the request's own architecture. After steps of a slow model
    (unet328), a request on the tiny model whose deadline is half a slow step away is served."""
    slow_s = min(_cost_s(server, batch=2) for _ in range(5))   # (ten slow steps: all the worker timed lately)
    results = asyncio.run(_burst(server.endpoint, 1, model="fast", timeout_ms=max(1, int(500 * slow_s))))
    assert _codes(results) == ["ok"], (results, slow_s)


def test_a_request_on_a_slow_model_runs_over_several_steps_and_a_fast_ones_request_runs_between(models, tmp_path):
    """A request that would hold the device long (8 frames of unet328 on the CPU: a second and more) runs
    over several steps, so that a request of another model sent meanwhile is answered within about one
    of its frames, not after all eight, from the model's first request on (before its steps were timed);
    and its mouths are those of its frames run one by one."""
    cfg = base_config(models, **{"shm.slots": 2})   # (room for both requests at the worker at once)
    with run_server(tmp_path, cfg) as srv, srv.client(timeout_s=60) as c:
        c.load("slow")
        c.load("fast")
        audio = np.random.default_rng(3).standard_normal((8, 32, 16, 16)).astype(np.float32)
        start = time.monotonic()
        c.composite("fast", audio[:1])
        fast_alone_s = time.monotonic() - start

        # the slow model's first request (none of its steps timed), the fast one sent while its first step runs
        fast_s, slow_first_s = _fast_beside(srv.endpoint, lambda cl: cl.composite("slow", audio), 3 * fast_alone_s,
                                            audio[:1])
        assert fast_s < slow_first_s / 3, (fast_s, slow_first_s, fast_alone_s)
        alone = [c.composite("slow", audio[i:i + 1], start_frame=i, format="png")[1][0] for i in range(8)]
        start = time.monotonic()
        header, whole = c.composite("slow", audio, format="png")   # (its steps timed: it runs a frame a step)
        slow_s = time.monotonic() - start
        assert whole == alone, "the frames of a request run over several steps are not its own"
        t = header["timing"]   # its stages, summed over its steps, are each counted once
        assert t["queue_ms"] + t["input_ms"] + t["inference_ms"] + t["composite_ms"] <= t["total_ms"], t

        # (two clients: one holds at most half the room; the fast one sent while the slow one's first frame runs)
        fast_s, slow_again_s = _fast_beside(srv.endpoint, lambda cl: cl.composite("slow", audio), slow_s / 8, audio[:1])
        assert fast_s < slow_again_s / 3, (fast_s, slow_again_s, slow_s)

        # Two slow requests of 4 frames take turns, one's frame prepared while the other's runs: a fast
        # one due sooner, sent meanwhile, puts the prepared slow step back and runs next (stats count it).
        before = c.stats()["workers"][0]["steps"]["put_back"]

        # (both at the worker, taking turns, when the fast one, due sooner, is sent)
        fast_s, slow_again_s = _fast_beside(
            srv.endpoint, lambda cl: asyncio.gather(*(cl.composite("slow", audio[:4], start_frame=k) for k in range(2))),
            slow_s / 4, audio[:1], timeout_ms=int(slow_s * 1000))
        assert c.stats()["workers"][0]["steps"]["put_back"] > before
    assert fast_s < slow_again_s / 4, (fast_s, slow_again_s)


def test_while_a_live_session_is_open_clients_requests_leave_it_half_the_workers_room(server):
    """This server's worker holds 8 frames in flight (shm.slots 1). Two clients' requests of 4 frames
    each on the slow model: with no live session open both go to the worker at once (each client's
    share is half), and the second is prepared there while the first runs; with one open, the second
    waits in the frontend until the first is done (the other half is the session's speech's), and the
    worker never holds it early."""
    async def two_clients() -> list:
        return [r for results in await asyncio.gather(*(asyncio.to_thread(asyncio.run, _burst(server.endpoint, 1))
                                                         for _ in range(2))) for r in results]

    def prepared_while_another_ran() -> int:
        with server.client(timeout_s=60) as c:
            before = c.stats()["workers"][0]["steps"]["prepared_during_a_step"]
            assert _codes(asyncio.run(two_clients())) == ["ok", "ok"]
            return c.stats()["workers"][0]["steps"]["prepared_during_a_step"] - before

    assert prepared_while_another_ran() >= 1
    with Session(server.endpoint, "fast") as s:
        frames_until(s, 0)
        assert prepared_while_another_ran() == 0
    assert prepared_while_another_ran() >= 1, "the sessions' half kept after they closed"


def test_deadline_gives_timeout_and_frees_the_slots(server):
    # Half a request's cost: the one running and the two waiting behind it all pass their deadline.
    results = asyncio.run(_burst(server.endpoint, 3, timeout_ms=max(1, int(500 * _cost_s(server)))))
    assert _codes(results).count("timeout") >= 2, _codes(results)
    assert "timeout_ms" in next(r for r, _ in results if not isinstance(r, dict)).message
    # Slots and queue places came back: a normal burst is served as before.
    assert _codes(asyncio.run(_burst(server.endpoint, 2))) == ["ok", "ok"]


def _kill_during_burst(server, role: str, n: int = 3) -> list:
    cost = _cost_s(server)
    pid = server.pids(role)[0]

    async def main():
        task = asyncio.create_task(_burst(server.endpoint, n))
        await asyncio.sleep(cost / 2)  # half-way through the first batch, the others queued behind it
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return await task, killed_at

    return asyncio.run(main())


@pytest.mark.parametrize("role", ["gpu", "cpu"])
def test_kill_worker_under_load_gives_unavailable_then_recovers(server, role):
    old = server.pids(role)[0]
    (results, killed_at) = _kill_during_burst(server, role)
    codes = _codes(results)
    assert "unavailable" in codes, codes
    assert set(codes) <= {"ok", "unavailable", "overloaded"}, codes
    # Never silence: every request was answered within 2 s of the kill (or finished before it).
    for result, _ in results:
        if getattr(result, "code", None) == "unavailable":
            assert "died" in result.message
    health, proc = server.restarted(role, old)
    assert proc["restarts"] >= 1
    assert _codes(asyncio.run(_burst(server.endpoint, 2))) == ["ok", "ok"]


def test_unavailable_arrives_when_the_worker_is_killed_not_at_the_deadline(server):
    cost = _cost_s(server, batch=8)
    pid = server.pids("gpu")[0]

    async def main():
        async with AsyncClient(server.endpoint, timeout_s=60) as client:
            task = asyncio.create_task(client.composite("slow", np.zeros((8, 32, 16, 16), np.float32)))
            await asyncio.sleep(cost / 2)   # half-way through it
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            try:
                await task
            except ServerError as err:
                return err.code, time.monotonic() - killed
            return "ok", time.monotonic() - killed

    code, after = asyncio.run(main())
    assert code == "unavailable" and after < UNNOTICED_S, (code, after)
    server.restarted("gpu", pid)


def test_kill_frontend_clients_reconnect_and_succeed(server):
    old = server.pids("frontend")[0]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the same client keeps working once the frontend is back: ZeroMQ reconnects
        try:
            with server.client(timeout_s=3) as c:
                header, images = c.composite("fast", AUDIO)
            break
        except ClientTimeout:
            assert time.monotonic() < deadline, "frontend did not come back"
    assert header["ok"] and len(images) == 4
    _, proc = server.restarted("frontend", old)
    assert proc["pid"] != old
    # The inference workers dropped what the dead frontend held: slow requests are served again.
    assert _codes(asyncio.run(_burst(server.endpoint, 2))) == ["ok", "ok"]


def test_clients_that_vanish_mid_request_leave_no_slot_behind(server):
    """A DEALER that sends work and closes at once: the work ends, its reply is dropped by ZeroMQ, and
    every slot comes back (a raw reply's image slot too); with one slot per ring a leak would starve
    the next request."""
    cost = _cost_s(server)
    for fmt in ("raw", "jpeg", "raw"):
        before = _client_gone(server)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.endpoint)
        for k in range(3):
            header = {"op": "composite", "id": k, "model": "slow", "batch": 4, "format": fmt}
            sock.send_multipart([b"", json.dumps(header).encode(), AUDIO.tobytes()])
        time.sleep(cost / 2)   # half-way through the first
        sock.close(linger=0)
        ctx.term()
        # One request running and two queued (queue_depth 2): all three end when their connection
        # closes, with no later request to prompt the frontend.
        deadline = time.monotonic() + UNNOTICED_S
        while _client_gone(server) - before < 3:
            assert time.monotonic() < deadline, (fmt, _client_gone(server) - before)
            time.sleep(0.05)
    with server.client(timeout_s=60) as c:
        header, images = c.composite("slow", AUDIO, format="raw")
    assert header["ok"] and len(images) == 4
    assert _codes(asyncio.run(_burst(server.endpoint, 2, format="raw"))) == ["ok", "ok"]


def _client_gone(server) -> float:
    """Requests ended because their client went away, from the Prometheus endpoint (not a request)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("lipsync_requests_total{") and 'outcome="client_gone"' in line)


def test_sigterm_finishes_in_flight_work_and_leaves_nothing(models, tmp_path):
    cfg = base_config(models, **{"supervisor.shutdown_timeout_s": UNNOTICED_S})
    with run_server(tmp_path, cfg) as srv:
        cost = _cost_s(srv)

        async def main():
            async with AsyncClient(srv.endpoint, timeout_s=60) as client:
                task = asyncio.create_task(client.composite("slow", AUDIO))
                await asyncio.sleep(cost / 2)   # half-way through it
                srv.proc.send_signal(signal.SIGTERM)
                return await task
        header, images = asyncio.run(main())
        assert header["ok"] and len(images) == 4  # accepted work was finished, not dropped
        assert srv.proc.wait(60) == 0
    # run_server's exit checks: no child process and no /dev/shm entry of the run remain.


def test_loading_a_model_does_not_stall_other_models(models, tmp_path):
    """A load runs off the request path: the loaded model keeps being served meanwhile."""
    with run_server(tmp_path, base_config(models)) as srv:
        with srv.client() as c:
            c.load("fast")

        async def main():
            async with AsyncClient(srv.endpoint, timeout_s=60) as client:
                load = asyncio.create_task(client.request("load", model="slow"))
                served_during_load = 0
                while not load.done():
                    header, _ = await client.composite("fast", np.zeros((1, 32, 16, 16), np.float32))
                    served_during_load += not load.done()
                await load
                return served_during_load

        assert asyncio.run(main()) >= 2


@pytest.fixture(scope="module")
def cold_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cold")
    make_avatar(root, "fast", n_frames=4)
    for name in ("cold1", "cold2"):
        make_avatar(root, name, n_frames=2, kind="unet328")
    return root


def test_requests_for_a_loading_model_do_not_stall_a_warm_one(cold_models, tmp_path):
    """One input slot: before, requests for a model still loading took it for the whole load."""
    with run_server(tmp_path, base_config(cold_models, **{"shm.slots": 1})) as srv:
        with srv.client() as c:
            c.load("fast")

        async def main():
            async with AsyncClient(srv.endpoint, timeout_s=60) as client:
                done = []

                async def one(model):
                    await client.composite(model, np.zeros((1, 32, 16, 16), np.float32))
                    done.append(model)

                cold = [asyncio.create_task(one("cold1")) for _ in range(2)]
                await asyncio.sleep(0.05)
                await one("fast")
                await asyncio.gather(*cold)
                return done

        assert asyncio.run(main())[0] == "fast"


def test_a_worker_that_dies_during_load_answers_unavailable_at_once(cold_models, tmp_path):
    with run_server(tmp_path, base_config(cold_models)) as srv:
        with srv.client(timeout_s=60) as c:   # how long loading cold2's twin takes here
            c.load("fast")   # (the worker's first load pays for more than the model)
            start = time.monotonic()
            c.load("cold1")
            load_s = time.monotonic() - start
        pid = srv.pids("gpu")[0]

        async def main():
            async with AsyncClient(srv.endpoint, timeout_s=60) as client:
                load = asyncio.create_task(client.request("load", model="cold2", timeout_ms=30_000))
                await asyncio.sleep(load_s / 3)   # a third of the way through the load
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                try:
                    await load
                    return "ok", 0.0
                except ServerError as err:
                    return err.code, time.monotonic() - killed

        code, after = asyncio.run(main())
        assert code == "unavailable" and after < UNNOTICED_S, (code, after)
        srv.restarted("gpu", pid)


def _probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_probes_say_alive_and_whether_a_request_would_be_served(server):
    assert _probe(server.metrics_port, "/healthz") == (200, {"status": "alive"})
    assert _probe(server.metrics_port, "/readyz") == (200, {"status": "ready"})
    pid = server.pids("gpu")[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + UNNOTICED_S
    while (probe := _probe(server.metrics_port, "/readyz"))[0] == 200:   # its only inference worker is gone
        assert time.monotonic() < deadline, "/readyz still said ready"
        time.sleep(0.05)
    assert probe[0] == 503 and "no inference worker is ready" in probe[1]["reason"], probe
    server.restarted("gpu", pid)
    assert _probe(server.metrics_port, "/readyz")[0] == 200
    assert _probe(server.metrics_port, "/healthz")[0] == 200


def test_probes_through_a_servers_life_starting_ready_degraded_draining(models, tmp_path):
    port = free_port()
    cfg = base_config(models, **{"metrics.port": port, "inference.workers_per_device": 2,
                                 "supervisor.shutdown_timeout_s": 30})
    seen = []

    def poll(until, limit_s=60.0):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                probe = _probe(port, "/readyz")
            except OSError:   # not listening yet: a Kubernetes probe fails the same way
                seen.append((None, {"status": "refused"}))
                time.sleep(0.02)
                continue
            seen.append(probe)
            if until(probe):
                return probe
            time.sleep(0.02)
        raise AssertionError(f"no such probe within {limit_s}s: {seen[-3:]}")

    watcher = threading.Thread(target=poll, args=(lambda p: p[0] == 200,), daemon=True)
    watcher.start()   # from before the server listens: every answer until the first 200
    with run_server(tmp_path, cfg) as srv:
        watcher.join(60)
        assert seen and seen[-1] == (200, {"status": "ready"})
        before = seen[:-1]
        assert before and all(p[1]["status"] in ("refused", "starting") for p in before), set(map(str, before))
        assert _probe(port, "/readyz") == (200, {"status": "ready"})
        with srv.client() as c:
            c.load("slow")
        cost = _cost_s(srv)
        pid = srv.pids("gpu")[0]
        os.kill(pid, signal.SIGKILL)   # one of two inference workers: it still serves
        degraded = poll(lambda p: p[1]["status"] != "ready", UNNOTICED_S)
        assert degraded[0] == 200 and degraded[1]["status"] == "degraded" and "cpu" in degraded[1]["reason"], degraded
        poll(lambda p: p[1]["status"] == "ready", 60)
        # SIGTERM with work in flight: not ready (draining) while it finishes, alive all along.
        burst = threading.Thread(target=lambda: asyncio.run(_burst(srv.endpoint, 8)), daemon=True)
        burst.start()
        time.sleep(cost / 2)   # half-way through the first of eight
        srv.proc.send_signal(signal.SIGTERM)
        draining = poll(lambda p: p[0] == 503, UNNOTICED_S)
        assert draining[1]["status"] == "draining", draining
        assert _probe(port, "/healthz")[0] == 200
        burst.join(60)
        srv.proc.wait(60)


def test_a_dead_frontends_live_sessions_leave_no_pin_behind(tmp_path, models):
    """A live session pins its model on its worker: never evicted while the session is open. A frontend
    killed with a session open takes the session with it: the worker drops the pin, and with room for
    one model the next model's load evicts the session's (before, it stayed pinned for good: the
    worker held two models past its cap of one, and held them until it restarted)."""
    from lipsync_client import Session
    cfg = base_config(models, **{"inference.max_models_per_worker": 1})
    with run_server(tmp_path, cfg) as srv, srv.client() as c:
        def loaded() -> list:
            return c.stats()["workers"][0]["loaded"]

        s = Session(srv.endpoint, "fast", timeout_s=5)
        deadline = time.monotonic() + 30
        while loaded() != ["fast"]:   # the session loads (and pins) its model at open
            assert time.monotonic() < deadline, "the session's model was never loaded"
            time.sleep(0.2)
        old = srv.pids("frontend")[0]
        os.kill(old, signal.SIGKILL)
        srv.restarted("frontend", old)
        s.__exit__(None, None, None)   # (its close goes to the new frontend: an unknown session there)
        deadline = time.monotonic() + 30
        while True:   # (the worker reads the supervisor's reset beside the new frontend's work)
            header, _ = c.composite("slow", AUDIO)
            assert header["ok"]
            if loaded() == ["slow"]:
                break
            assert time.monotonic() < deadline, f"the dead frontend's session still pins its model: {loaded()}"
            c.unload("slow")
            time.sleep(0.2)
