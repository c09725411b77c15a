"""The edge split over loopback: an edge supervisor (frontend + compositing) using a GPU supervisor
(inference + bridge) with CURVE; a lost GPU host; unknown keys; tenants."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from lipsync_client import AsyncClient, Client, ClientTimeout, ServerError, curve_keys
from gpu_actor.model_builder import write_audio_encoder
from tests.conftest import TEST_PREFIX
from tests.helpers import (base_config, bridge_keys, decode_image, expected_frames, free_port, gpu_host, make_avatar,
                           one_beside_many, run_server, speech_beside_a_flood)

pytestmark = pytest.mark.slow
AUDIO = np.random.default_rng(7).standard_normal((4, 32, 16, 16)).astype(np.float32)
DEAD_AFTER_S = 3.0   # the edges' bridge.dead_after_s: a host that answers no heartbeat this long is unreachable
HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return bridge_keys(tmp_path_factory.mktemp("keys"), "stranger", "server", "alice", "bob")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_audio_encoder(make_avatar(root, "a", n_frames=5) / "audio_encoder.onnx")
    make_avatar(root, "b", n_frames=3, seed=2)
    make_avatar(root, "slow", n_frames=3, kind="unet328")
    return root


def gpu_config(models: Path, keys: Path, port: int, workers: int = 1) -> dict:
    return base_config(models, **{"shm.prefix": TEST_PREFIX + "g", "inference.workers_per_device": workers, "bridge": {
        "bind": f"tcp://127.0.0.1:{port}", "secret_key": str(keys / "gpu.key_secret"),
        "authorized_keys": str(keys / "authorized")}})


def edge_config(models: Path, keys: Path, port: int, client: str = "edge", **extra) -> dict:
    return base_config(models, **{"shm.prefix": TEST_PREFIX + "e", "bridge": {
        "hosts": [{"endpoint": f"tcp://127.0.0.1:{port}", "server_key": str(keys / "gpu.key")}],
        "client_secret_key": str(keys / f"{client}.key_secret"), "heartbeat_s": HEARTBEAT_S, "dead_after_s": DEAD_AFTER_S}}, **extra)


def _remote_ready(client: Client, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = client.health()
        gpu = [p for p in health["processes"] if p["role"] == "gpu"]
        if health["status"] == "ready" and all(p["state"] == "ready" for p in gpu):
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.2)


def test_composite_through_the_bridge_has_single_host_pixels(tmp_path, models, keys):
    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port, workers=2)):
        with run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
            health = _remote_ready(c)
            assert [p["device"] for p in health["processes"] if p["role"] == "gpu"] == [f"remote:tcp://127.0.0.1:{port}"]
            for fmt, visual in (("raw", None), ("png", np.random.default_rng(1).random((4, 6, 320, 320), dtype=np.float32))):
                header, images = c.composite("a", AUDIO, visual=visual, start_frame=2, format=fmt)
                _, expected = expected_frames(models, "a", AUDIO, 2, 4, visual=visual)
                for image, want in zip(images, expected):
                    np.testing.assert_array_equal(decode_image(image, fmt, header), want)
            reply, mouths = c.infer("b", np.zeros((2, 6, 320, 320), np.float32), AUDIO[:2])
            assert mouths.shape == (2, 3, 320, 320)
            # 16 kHz PCM crosses as PCM: the GPU host derives the windows, the pixels are the single host's.
            pcm = (np.sin(np.arange(5600) / 9.0) * 8000).astype("<i2")
            header, images = c.request("composite", [pcm], model="a", audio_format="pcm16", format="png")
            with run_server(tmp_path, base_config(models)) as single, single.client() as s:
                _, want = s.request("composite", [pcm], model="a", audio_format="pcm16", format="png")
            assert header["batch"] == len(images) == len(want) == 8
            for got, expected in zip(images, want):
                np.testing.assert_array_equal(decode_image(got, "png", {}), decode_image(expected, "png", {}))
            assert c.load("a")["loaded_on"] == [0]
            # The GPU host answers `stats` for all of its workers at once.
            stats = c.stats()
            assert stats["workers"][0]["device"].startswith("2 worker(s)"), stats["workers"]
            assert stats["models"]["a"]["frames"] == 16 and stats["models"]["b"]["frames"] == 2, stats["models"]
            # ... and `unload` for every worker that has the model.
            for model in ("a", "b"):
                assert c.unload(model)["loaded_on"] == []
            assert c.stats()["workers"][0]["loaded"] == []


def test_lost_gpu_host_gives_unavailable_then_recovers_without_edge_restart(tmp_path, models, keys):
    port = free_port()
    with run_server(tmp_path, edge_config(models, keys, port), role="edge", states=("degraded",)) as edge, \
            edge.client() as c:
        with gpu_host(tmp_path, gpu_config(models, keys, port)) as (proc, _):
            _remote_ready(c)
            cost = _host_cost_s(c)

            async def kill_during_request():
                async with AsyncClient(edge.endpoint, timeout_s=30) as ac:
                    task = asyncio.create_task(ac.composite("slow", np.zeros((8, 32, 16, 16), np.float32)))
                    await asyncio.sleep(cost / 2)   # half-way through it
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole GPU host goes away
                    killed = time.monotonic()
                    try:
                        await task
                        return "ok", 0.0
                    except ServerError as err:
                        return err.code, time.monotonic() - killed

            code, after = asyncio.run(kill_during_request())
            proc.wait(10)
        # Answered once its connection closed: not at the request's deadline, nor once heartbeats go unanswered.
        assert code == "unavailable" and after < DEAD_AFTER_S / 2, (code, after)
        with pytest.raises(ServerError) as err:
            c.composite("a", AUDIO)
        assert err.value.code == "unavailable" and "unreachable" in err.value.message
        assert c.health()["status"] == "degraded"
        # The host comes back on the same address (its predecessor's shm is swept at start).
        with gpu_host(tmp_path, gpu_config(models, keys, port)):
            _remote_ready(c)
            header, images = c.composite("a", AUDIO, format="jpeg")
            assert header["ok"] and len(images) == 4


def test_a_hung_gpu_host_is_unreachable_once_it_answers_no_heartbeat_for_dead_after_s(tmp_path, models, keys):
    """The GPU host's bridge stops (SIGSTOP: its connection stays open, nothing answers): a request sent then
    is answered `unavailable` once no heartbeat was answered for bridge.dead_after_s (not before: a busy
    host's pause is not a lost host; not at the request's deadline either), and once the bridge goes on
    the edge serves through it again."""
    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port)) as (host, _), \
            run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
        _remote_ready(c)
        c.composite("a", AUDIO)
        bridge = next(p for p in psutil.Process(host.pid).children() if _name(p) == "lsync-bridge0")
        os.kill(bridge.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(ServerError) as err:
                c.composite("a", AUDIO)
            after = time.monotonic() - stopped
        finally:
            os.kill(bridge.pid, signal.SIGCONT)
        assert err.value.code == "unavailable" and DEAD_AFTER_S - HEARTBEAT_S <= after < 5 * DEAD_AFTER_S, (err.value, after)
        deadline = time.monotonic() + 30
        while True:
            try:
                _remote_ready(c)
                header, images = c.composite("a", AUDIO, start_frame=1, format="raw")
                break
            except ServerError as e:   # (unavailable until the edge hears from it again)
                assert e.code == "unavailable" and time.monotonic() < deadline, e
                time.sleep(0.2)
        _, expected = expected_frames(models, "a", AUDIO, 1, len(AUDIO))
        for image, want in zip(images, expected):
            np.testing.assert_array_equal(decode_image(image, "raw", header), want)


def test_a_request_that_ends_before_the_edges_forwarder_reads_it_is_dropped_and_the_forwarder_serves_on(
        tmp_path, models, keys):
    """The edge's frontend ends a request (its deadline) while its task still waits, unread, for the
    forwarder to the GPU host: the forwarder, reading it then, finds its inputs freed and drops it,
    and goes on serving (before, it died of it, and the requests it held with it)."""
    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port)), \
            run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
        _remote_ready(c)
        c.composite("a", AUDIO)   # (loaded: the next request's inputs are written and its task sent at once)
        forwarder = edge.pids("gpu")[0]
        os.kill(forwarder, signal.SIGSTOP)   # its task waits in its socket, unread
        try:
            with pytest.raises(ServerError) as err:
                c.composite("a", AUDIO, timeout_ms=300)
            assert err.value.code == "timeout", err.value
        finally:
            os.kill(forwarder, signal.SIGCONT)
        header, images = c.composite("a", AUDIO, format="jpeg")
        assert header["ok"] and len(images) == 4
        assert edge.pids("gpu") == [forwarder], "the forwarder died of a request its frontend had ended"


def test_a_gpu_host_answers_probes(tmp_path, models, keys):
    import json
    import urllib.request
    port, probes = free_port(), free_port()
    with gpu_host(tmp_path, {**gpu_config(models, keys, port), "metrics": {"port": probes}}):
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{probes}/readyz", timeout=5) as resp:
                    assert json.loads(resp.read()) == {"status": "ready"}
                    break
            except OSError:   # 503 until one of its workers is ready (HTTPError is an OSError)
                assert time.monotonic() < deadline, "the GPU host never said ready"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{probes}/healthz", timeout=5) as resp:
            assert resp.status == 200


def test_gpu_host_refuses_an_unknown_edge_key(tmp_path, models, keys):
    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port)) as (_, gpu_log):
        with run_server(tmp_path, edge_config(models, keys, port, client="stranger"), role="edge",
                        states=("degraded",)) as edge, edge.client() as c:
            deadline = time.monotonic() + 30
            while (gpu := next(p for p in c.health()["processes"] if p["role"] == "gpu"))["state"] != "unreachable":
                assert time.monotonic() < deadline, gpu   # no heartbeat is ever answered: unreachable
                time.sleep(0.2)
            with pytest.raises(ServerError) as err:
                c.composite("a", AUDIO)
            assert err.value.code == "unavailable"
        stranger = (keys / "stranger.key").read_text().split('public-key = "')[1].split('"')[0]
        assert f"refused a client with unknown CURVE key {stranger}" in gpu_log.read_text()


def test_tenants_reach_only_their_models(tmp_path, models, keys):
    curve = {"secret_key": str(keys / "server.key_secret"), "tenants": {
        "alice": {"keys": [str(keys / "alice.key")], "models": ["a"]},
        "bob": {"keys": [str(keys / "bob.key")], "models": ["*"]}}}
    alice = curve_keys(str(keys / "alice.key_secret"), str(keys / "server.key"))
    bob = curve_keys(str(keys / "bob.key_secret"), str(keys / "server.key"))
    stranger = curve_keys(str(keys / "stranger.key_secret"), str(keys / "server.key"))
    with run_server(tmp_path, base_config(models, **{"frontend.curve": curve}), curve=alice) as srv:
        with srv.client() as c:
            assert [m["id"] for m in c.models()] == ["a"]
            assert c.composite("a", AUDIO)[0]["ok"]
            with pytest.raises(ServerError) as err:
                c.composite("b", AUDIO)
            assert err.value.code == "forbidden" and "tenant alice" in err.value.message
            with pytest.raises(ServerError) as err:
                c.load("slow")
            assert err.value.code == "forbidden"
        with srv.client(curve=bob) as c:
            assert {m["id"] for m in c.models()} == {"a", "b", "slow"}
            assert c.composite("b", AUDIO)[0]["ok"]
        with srv.client(curve=stranger, timeout_s=2) as c, pytest.raises(ClientTimeout):
            c.health()  # refused at the CURVE handshake: no request gets through
        with srv.client(curve=None, timeout_s=2) as c, pytest.raises(ClientTimeout):
            c.health()
        assert "refused a client with unknown CURVE key" in srv.log.read_text()


def test_a_tenant_holds_at_most_its_own_live_sessions_over_the_hosts_processes(tmp_path, models, keys):
    """frontend.curve.tenants.alice.max_sessions 2, on a host of two client-facing processes: of eight
    session_opens of alice's (each a connection of its own, spread over both), two get in and the rest get
    `busy` naming the limit; bob's still get in; one of alice's closing makes room for one more."""
    from lipsync_client import Session
    curve = {"secret_key": str(keys / "server.key_secret"), "tenants": {
        "alice": {"keys": [str(keys / "alice.key")], "max_sessions": 2},
        "bob": {"keys": [str(keys / "bob.key")]}}}
    alice = curve_keys(str(keys / "alice.key_secret"), str(keys / "server.key"))
    bob = curve_keys(str(keys / "bob.key_secret"), str(keys / "server.key"))
    cfg = base_config(models, **{"frontend.curve": curve, "frontend.processes": 2})
    with run_server(tmp_path, cfg, curve=alice) as srv:
        opened, busy = [], []
        try:
            for _ in range(8):
                try:
                    opened.append(Session(srv.endpoint, "a", curve=alice, timeout_s=30))
                except ServerError as err:
                    busy.append(err)
            assert len(opened) == 2 and len(busy) == 6
            assert all(e.code == "busy" and "tenants.alice.max_sessions" in e.message for e in busy), busy[0]
            opened += [Session(srv.endpoint, "b", curve=bob, timeout_s=30) for _ in range(3)]
            opened.pop(0).close()
            opened.append(Session(srv.endpoint, "a", curve=alice, timeout_s=30))
        finally:
            for session in opened:
                session.close()


@pytest.mark.parametrize("skew_s", [1e6, -1e6], ids=["gpu host up longer", "gpu host up shorter"])
def test_deadlines_hold_across_hosts_whose_clocks_differ(tmp_path, models, keys, skew_s):
    """Two hosts never share a monotonic clock: the GPU host reads its own 11.6 days ahead (or behind).
    Deadlines cross as budgets, so requests are served, and a short deadline still times out."""
    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port), clock_skew_s=skew_s):
        with run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
            _remote_ready(c)
            header, images = c.composite("a", AUDIO, format="jpeg")
            assert header["ok"] and len(images) == 4
            budget_ms = int(1000 * _host_cost_s(c))

            async def burst():   # one runs, the rest wait on the GPU host past a budget of one's cost
                async with AsyncClient(edge.endpoint, timeout_s=30) as ac:
                    tasks = [ac.composite("slow", np.zeros((8, 32, 16, 16), np.float32), timeout_ms=budget_ms)
                             for _ in range(3)]
                    return await asyncio.gather(*tasks, return_exceptions=True)

            results = asyncio.run(burst())
            assert any(isinstance(r, ServerError) and r.code == "timeout" for r in results), results


def test_a_gpu_host_survives_hostile_edge_messages(tmp_path, models, keys):
    """An authorized edge that sends garbage: each bad message is dropped (or answered bad_request),
    and the GPU host's bridge keeps serving without a restart."""
    import msgspec
    import zmq

    from shm.messages import InferDone, Pins, Ping, Pong, RemoteInfer, pack

    port = free_port()
    with gpu_host(tmp_path, gpu_config(models, keys, port)) as (_, gpu_log):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve = curve_keys(str(keys / "edge.key_secret"), str(keys / "gpu.key"))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = curve["secret"], curve["public"], curve["server"]
        sock.connect(f"tcp://127.0.0.1:{port}")
        audio = np.zeros((1, 32, 16, 16), np.float32).tobytes()

        def infer(**kw) -> bytes:
            fields = dict(req=1, model="a", batch=1, audio_shape=(32, 16, 16), visual=False, frames=[0],
                          composite=True, budget_ms=5000.0)
            return pack(RemoteInfer(**{**fields, **kw}))

        try:
            deadline = time.monotonic() + 30
            while True:   # the host answers once one of its workers is ready (as an edge waits)
                sock.send_multipart([pack(Ping(sent=0.0))])
                if sock.poll(1000):
                    pong = msgspec.msgpack.decode(sock.recv_multipart()[0], type=Pong)
                    if pong.workers_ready:
                        break
                assert time.monotonic() < deadline, "the GPU host never had a ready worker"
            for frames in ([b"\xff\x00garbage"], [msgspec.msgpack.encode(["Ping"])], [pack(Pong(sent=0, loaded=[]))],
                           [pack(InferDone(req=3, worker=0, ok=True))], [],
                           [pack(Pins(models={"../etc": 1}))], [pack(Pins(models={"a": 1 << 40}))]):
                sock.send_multipart(frames if frames else [b""])
            inputs = np.zeros((3, 1, 80, 16), np.float32).tobytes()   # encoder inputs, for the rows below
            refused = {2: infer(req=2, batch=99, frames=[0] * 99), 4: infer(req=4, audio_shape=(1 << 20,)),
                       5: infer(req=5), 6: infer(req=6, frames=[10_000]), 8: infer(req=8, frames=[0, 0]),
                       9: infer(req=9, rows=[[0] * 15 + [3]]), 10: infer(req=10, rows=[[-2] + [0] * 15]),
                       11: infer(req=11, rows=[[0] * 15]), 12: infer(req=12, pcm=True),
                       13: infer(req=13, model="../a")}
            payload = {5: audio[:8], 9: inputs, 10: inputs, 11: inputs, 12: b"\x00" * 3200}
            for req, msg in refused.items():
                sock.send_multipart([msg, payload.get(req, audio)])
            answers = {}
            while len(answers) < len(refused) and sock.poll(20_000):
                reply = msgspec.msgpack.decode(sock.recv_multipart()[0], type=InferDone)
                answers[reply.req] = reply
            assert set(answers) == set(refused), answers
            assert all(not a.ok and a.code in ("bad_request",) for a in answers.values()), answers
            assert "limits.max_batch" in answers[2].message and "frame 10000" in answers[6].message, answers
            says = {4: "limits.max_audio_elements", 5: "tensor frames of [8] bytes", 8: "2 frame indices for a batch of 1",
                    9: "window rows for 1 frames do not fit 3 encoder inputs",
                    10: "window rows for 1 frames do not fit", 11: "window rows for 1 frames do not fit", 12: "3200 bytes of PCM do not give 1 frames",
                    13: "model id '../a' is not valid"}
            # (refused at the bridge, before any of it reaches a worker: the worker's own check words it otherwise)
            assert all(said in answers[req].message for req, said in says.items()), answers
            sock.send_multipart([infer(req=7), audio])   # the bridge still serves
            assert sock.poll(20_000)
            assert msgspec.msgpack.decode(sock.recv_multipart()[0], type=InferDone).ok
        finally:
            sock.close()
            ctx.term()
        log = gpu_log.read_text()
        assert "died" not in log and "dropped a malformed message from an edge" in log, log[-3000:]
        assert "dropped an edge's pins" in log, log[-3000:]


def _host_cost_s(c: Client, runs: int = 3) -> float:
    """Seconds a GPU host spends on one batch of 8 of the slow model (its own inference and input
    timings, the median of a few warm runs): the measure of the time limits of a test that waits on it."""
    c.load("slow")
    costs = []
    for _ in range(runs):
        header, _ = c.composite("slow", np.zeros((8, 32, 16, 16), np.float32))
        costs.append((header["timing"]["inference_ms"] + header["timing"]["input_ms"]) / 1000)
    return sorted(costs)[runs // 2]


def test_a_gpu_host_drains_on_sigterm(tmp_path, models, keys):
    """SIGTERM to a GPU host: each request it has is finished, or answered `unavailable` (shutting down)
    at supervisor.shutdown_timeout_s, and the edge passes that on: never silence, never `unreachable`.
    The window is twice one request's cost on the host, measured here first, and six requests are on
    it when the signal comes half-way through the first: the first finishes and the last is cut, on
    any machine. A host that stopped is used again once one answers on its address."""
    port, n = free_port(), 6
    host_cfg = gpu_config(models, keys, port)
    edge_cfg = edge_config(models, keys, port)
    # NOTE: every request here is answered by the host; the edge's heartbeat must not give up first.
    edge_cfg["bridge"]["dead_after_s"] = 30
    for cfg in (host_cfg, edge_cfg):
        cfg["shm"]["slots"] = n
    with run_server(tmp_path, edge_cfg, role="edge", states=("degraded",)) as edge, edge.client() as c:
        with gpu_host(tmp_path, host_cfg):
            _remote_ready(c)
            cost = _host_cost_s(c)
        host_cfg["supervisor"]["shutdown_timeout_s"] = 2 * cost
        with gpu_host(tmp_path, host_cfg) as (proc, log):
            _remote_ready(c)
            c.load("slow")

            async def sigterm_during_requests():
                async with AsyncClient(edge.endpoint, timeout_s=120) as ac:
                    tasks = [asyncio.create_task(ac.composite("slow", np.zeros((8, 32, 16, 16), np.float32)))
                             for _ in range(n)]
                    await asyncio.sleep(cost / 2)
                    proc.send_signal(signal.SIGTERM)
                    return await asyncio.gather(*tasks, return_exceptions=True)

            results = asyncio.run(sigterm_during_requests())
            assert proc.wait(60 + 4 * cost) == 0, log.read_text()[-3000:]
        outcomes = [f"{type(r).__name__}: {r}" if isinstance(r, Exception) else f"ok, {len(r[1])} images"
                    for r in results]
        for result in results:
            if isinstance(result, Exception):
                assert isinstance(result, ServerError), outcomes
                assert result.code == "unavailable" and "shutting down" in result.message, outcomes
            else:
                header, images = result
                assert header["ok"] and len(images) == 8, outcomes
        assert any(not isinstance(r, Exception) for r in results), f"nothing in flight was finished: {outcomes}"
        assert any(isinstance(r, Exception) for r in results), f"the window ({2 * cost:.2f} s) cut nothing: {outcomes}"
        assert "went silent" not in edge.log.read_text(), "a host left without its Goodbye"
        assert [p["state"] for p in c.health()["processes"] if p["role"] == "gpu"] == ["stopped"]


def test_a_session_on_an_edge_pins_its_model_on_the_gpu_host(tmp_path, models, keys):
    """A GPU host that holds one model at a time: while an edge's live session is open on `a`, loading
    `b` there does not evict `a` (the session's speech would wait for a reload); once it closes, it may."""
    from lipsync_client import Session
    port = free_port()
    host_cfg = gpu_config(models, keys, port)
    host_cfg["inference"]["max_models_per_worker"] = 1
    with gpu_host(tmp_path, host_cfg), \
            run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
        _remote_ready(c)

        def loaded_on_host() -> set:
            return set(c.stats()["workers"][0]["loaded"])

        with Session(edge.endpoint, "a") as s:
            deadline = time.monotonic() + 30
            while "a" not in loaded_on_host():   # the session loads its model at open
                assert time.monotonic() < deadline, "the session's model was never loaded on the GPU host"
                time.sleep(0.2)
            header, _ = c.composite("b", AUDIO)
            assert header["ok"]
            assert "a" in loaded_on_host(), "the GPU host evicted a live session's model"
            s.send_audio(np.zeros((3, 32, 16, 16), np.float32))
        deadline = time.monotonic() + 30
        while True:   # the pin is gone with the session: the next load of b may evict a
            c.composite("b", AUDIO)
            c.unload("b")
            c.composite("b", AUDIO)
            if "a" not in loaded_on_host():
                break
            assert time.monotonic() < deadline, "the closed session's pin was never released on the GPU host"
            time.sleep(0.2)


def test_an_edges_live_speech_is_live_on_the_gpu_host_too(tmp_path, models, keys):
    """An edge's clients keep the GPU host's queue full (its limits.queue_depth 2, a request of 8 frames in
    flight) and get `overloaded` from there for the rest; a live session on the edge speaking meanwhile
    has every speech frame taken there, none refused: its requests cross with their due time, and the
    GPU host, like a single host, counts only clients' requests against its queue."""
    port = free_port()
    host_cfg = gpu_config(models, keys, port)
    host_cfg["limits"].update(queue_depth=2)
    host_cfg["shm"]["slots"] = 1
    with gpu_host(tmp_path, host_cfg), \
            run_server(tmp_path, edge_config(models, keys, port, **{"sessions.max_cpu_load": 0, "shm.slots": 8,
                                                                    "limits.queue_depth": 16}),
                       role="edge") as edge, edge.client() as c:   # (the edge: room for 8 requests in flight)
        _remote_ready(c)
        c.load("b")

        # (two clients: each holds at most a share of the edge's room; the GPU host's refusals, its queue of 2:
        # a newcomer refused, or another client's newest request pushed out for it)
        stats, before, after = speech_beside_a_flood(
            edge.endpoint, "b", 2, 6, lambda err: err.code == "overloaded" and (
                "has 2 requests queued" in err.message or " of its 2 requests" in err.message), 30)
        assert after > before, "the GPU host's queue was not full while the session spoke"
    assert "failed (overloaded)" not in stats["missed_in"], stats
    assert stats["frames_speech"] + stats["missed"] == 50, stats


def test_two_edges_clients_share_the_gpu_hosts_worker(tmp_path, models, keys):
    """One edge's client has eight requests at the GPU host's worker at once, each a step of its own
    (limits.max_batch frames; the stand-in device makes every call 400 ms long); another edge's client,
    whose number on its own edge is the same, sends one once the first of them is answered: it runs
    after the step running then and the one prepared behind it, not after all eight. The GPU host tells
    the two clients apart by the edge they came from."""
    from gpu_actor.device import STAND_IN_COST_ENV
    port = free_port()
    room = {"limits.max_batch": 2, "limits.queue_depth": 16, "shm.slots": 16}   # (a client's half: all eight)
    host_cfg = gpu_config(models, keys, port)
    host_cfg["limits"].update(max_batch=2, queue_depth=16)
    host_cfg["shm"]["slots"] = 16
    audio = np.random.default_rng(3).standard_normal((2, 32, 16, 16)).astype(np.float32)
    with gpu_host(tmp_path, host_cfg, env={STAND_IN_COST_ENV: "400,0"}), \
            run_server(tmp_path, edge_config(models, keys, port, **room), role="edge") as many_edge, \
            run_server(tmp_path, edge_config(models, keys, port, **room), role="edge") as one_edge:
        for edge in (many_edge, one_edge):
            with edge.client(timeout_s=120) as c:
                _remote_ready(c)
                c.composite("a", audio)   # (loaded; each edge's client is its first: number 1 there)

        order = one_beside_many(many_edge.endpoint, one_edge.endpoint, "a", audio)
    # answered before it: the first, the one running when it came, the one prepared behind that (and one
    # more where a host took a whole step to pass it on); as one client, it came after all eight
    assert order.index("one") <= 4, order


def _name(process: psutil.Process) -> str:
    """A process's name, or "" for one that ended since it was listed."""
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def _evicts(c: Client, model: str, other: str = "b") -> bool:
    """Whether loading `other` on a GPU host of one model a worker evicts `model` (it is not pinned)."""
    c.composite(other, AUDIO)
    c.unload(other)
    c.composite(other, AUDIO)
    return model not in c.stats()["workers"][0]["loaded"]


def test_an_edge_frontend_killed_with_a_session_open_leaves_no_pin_on_the_gpu_host(tmp_path, models, keys):
    """The edge's frontend dies with a live session open on `a`: the session is gone, and so is its pin on
    the GPU host (the edge's forwarder drops that process's pins and says so, Pins), so `a` may be
    evicted again there (before, it stayed pinned until the edge's forwarder restarted)."""
    from lipsync_client import Session
    port = free_port()
    host_cfg = gpu_config(models, keys, port)
    host_cfg["inference"]["max_models_per_worker"] = 1
    with gpu_host(tmp_path, host_cfg), run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge:
        with edge.client() as c:
            _remote_ready(c)
            s = Session(edge.endpoint, "a", timeout_s=5)
            deadline = time.monotonic() + 30
            while "a" not in c.stats()["workers"][0]["loaded"]:
                assert time.monotonic() < deadline, "the session's model was never loaded on the GPU host"
                time.sleep(0.2)
            assert not _evicts(c, "a"), "a live session's model was evicted"
            old = edge.pids("frontend")[0]
        os.kill(old, signal.SIGKILL)
        edge.restarted("frontend", old)
        s.__exit__(None, None, None)   # (the new frontend does not know it)
        with edge.client() as c:
            deadline = time.monotonic() + 30
            while not _evicts(c, "a"):
                assert time.monotonic() < deadline, "the dead frontend's session still pins its model on the GPU host"
                time.sleep(0.2)


def test_a_gpu_hosts_bridge_restarted_under_a_session_pins_its_model_again(tmp_path, models, keys):
    """The GPU host's bridge dies with an edge's live session open on `a`: its worker drops the dead
    bridge's pins, and the edge, finding the host ready again, says which pins its sessions hold (Pins):
    `a` stays pinned, and loading `b` does not evict it (before, it did: the session's next speech would
    wait for a reload)."""
    from lipsync_client import Session
    port = free_port()
    host_cfg = gpu_config(models, keys, port)
    host_cfg["inference"]["max_models_per_worker"] = 1
    with gpu_host(tmp_path, host_cfg) as (host, _), \
            run_server(tmp_path, edge_config(models, keys, port), role="edge") as edge, edge.client() as c:
        _remote_ready(c)
        with Session(edge.endpoint, "a", timeout_s=30) as s:
            deadline = time.monotonic() + 30
            while "a" not in c.stats()["workers"][0]["loaded"]:
                assert time.monotonic() < deadline, "the session's model was never loaded on the GPU host"
                time.sleep(0.2)
            bridge = next(p for p in psutil.Process(host.pid).children() if p.name() == "lsync-bridge0")
            os.kill(bridge.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not [p for p in psutil.Process(host.pid).children()
                       if p.pid != bridge.pid and _name(p) == "lsync-bridge0"]:
                assert time.monotonic() < deadline, "the GPU host's bridge was not restarted"
                time.sleep(0.2)
            while True:   # (answered unavailable until the edge finds the new bridge)
                try:
                    _remote_ready(c)
                    if c.composite("a", AUDIO)[0]["ok"]:
                        break
                except ServerError:
                    pass
                assert time.monotonic() < deadline, "the edge never served through the new bridge"
                time.sleep(0.2)
            assert not _evicts(c, "a"), "the session's model lost its pin with the bridge"
            s.send_audio(np.zeros((3, 32, 16, 16), np.float32))
