"""Several client-facing processes (`frontend.processes`): they share the port, the kernel giving each new
connection to one of them, and they share the inference workers and compositors. Each serves its own
connections (the same pixels as any other would), its own metrics, and its death and restart take only
its own requests: a request of another process in flight at that moment is answered with its mouths."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

from lipsync_client import Client, ClientTimeout, ServerError, Session
from tests.conftest import TEST_PREFIX
from tests.helpers import (base_config, bridge_configs, bridge_keys, frames_until, free_port, free_ports, gpu_host,
                           make_avatar, run_server)

pytestmark = pytest.mark.slow
AUDIO = np.zeros((4, 32, 16, 16), np.float32)
SLOW = np.random.default_rng(3).standard_normal((8, 32, 16, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "slow", n_frames=8, kind="unet328")   # ~0.15 s a frame here: work stays in flight
    make_avatar(root, "fast", n_frames=4)
    return root


def _frontend(client: Client) -> tuple[int, int]:
    """(index, pid) of the process that serves this client's connection."""
    info = next(p for p in client.health()["processes"] if p["role"] == "frontend")
    return info["index"], info["pid"]


def _clients_on_each(endpoint: str, n: int = 2, most: int = 64) -> dict[int, Client]:
    """A connected client served by each of the n processes (new connections until each has one)."""
    found: dict[int, Client] = {}
    for _ in range(most):
        client = Client(endpoint, timeout_s=60)
        index, _ = _frontend(client)
        if index in found:
            client.close()
        else:
            found[index] = client
        if len(found) == n:
            return found
    raise AssertionError(f"{most} connections all went to processes {sorted(found)} of {n}")


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_connections_spread_over_the_processes_each_serving_the_same_pixels(tmp_path, models):
    port = free_ports(2)
    cfg = base_config(models, **{"frontend.processes": 2, "metrics.port": port})
    with run_server(tmp_path, cfg) as srv:
        served: dict[int, list] = {0: [], 1: []}
        pids: dict[int, set] = {0: set(), 1: set()}
        for _ in range(20):   # (all 20 on one process: 2 in a million)
            with Client(srv.endpoint, timeout_s=60) as c:   # a connection of its own
                index, pid = _frontend(c)
                header, images = c.composite("fast", AUDIO)
                assert header["ok"] and len(images) == 4
                served[index].append(images)
                pids[index].add(pid)
        assert served[0] and served[1], {i: len(v) for i, v in served.items()}
        assert all(len(p) == 1 for p in pids.values()) and pids[0] != pids[1], pids
        reference = served[0][0]
        assert all(images == reference for images in served[0] + served[1])
        # each process counts its own requests on its own port
        counts = [_metric(port + i, "lipsync_requests_total") for i in (0, 1)]
        assert counts[0] >= 2 * len(served[0]) and counts[1] >= 2 * len(served[1]), counts


def test_live_sessions_on_every_process_speak_through_the_shared_workers(tmp_path, models):
    """16 sessions (all on one process: 1 in 30,000), each speaking six windows: every one of their speech
    frames is the frame the batch API gives for the same window and frame."""
    port = free_ports(2)
    # (admission off: 16 opens at once pass the unmeasured ramp of a host of one core)
    cfg = base_config(models, **{"frontend.processes": 2, "metrics.port": port, "sessions.max_cpu_load": 0})
    windows = np.random.default_rng(5).standard_normal((6, 32, 16, 16)).astype(np.float32)
    with run_server(tmp_path, cfg) as srv:
        sessions = [Session(srv.endpoint, "fast", format="png", timeout_s=60) for _ in range(16)]
        try:
            deadline = time.monotonic() + 30
            while not all(_metric(port + i, "lipsync_sessions_open") for i in (0, 1)):   # (gauges set each second)
                assert time.monotonic() < deadline, "the sessions did not open on both processes"
                time.sleep(0.2)
            replies = [s.send_audio(windows) for s in sessions]
            spoken = []
            for s, reply in zip(sessions, replies):
                first = reply["first_frame"]
                got = {h["index"]: (h, img) for _, h, img in frames_until(s, first + 5) if h["kind"] == "speech"}
                assert sorted(got) == list(range(first, first + 6)), sorted(got)
                spoken.append((first, got))
        finally:
            for s in sessions:
                s.close()
        with srv.client() as c:
            for first, got in spoken:
                for i in (0, 5):
                    header, image = got[first + i]
                    _, (want,) = c.composite("fast", windows[i:i + 1], start_frame=header["frame"], format="png")
                    assert image == want


def test_a_killed_process_takes_only_its_own_requests_and_comes_back(tmp_path, models):
    cfg = base_config(models, **{"frontend.processes": 2, "limits.max_batch": 8})
    with run_server(tmp_path, cfg) as srv:
        clients = _clients_on_each(srv.endpoint)
        try:
            a, b = clients[0], clients[1]
            want = a.composite("slow", SLOW)[1]   # (its model loaded) the mouths a request of 0 gets alone
            start = time.monotonic()
            assert a.composite("slow", SLOW)[1] == want
            cost = time.monotonic() - start
            _, victim = _frontend(b)
            result: dict = {}

            def request() -> None:
                try:
                    result["images"] = a.composite("slow", SLOW)[1]
                except (ServerError, ClientTimeout) as err:
                    result["error"] = err

            thread = threading.Thread(target=request)
            thread.start()
            time.sleep(cost / 2)   # half-way through it: on the worker
            os.kill(victim, signal.SIGKILL)
            thread.join(120)
            # the worker dropped what the dead process held, and only that
            assert result.get("images") == want, result.get("error")
            deadline = time.monotonic() + 60
            while True:   # the supervisor starts another in its place
                back = [p for p in psutil.Process(srv.proc.pid).children()
                        if p.name() == "lsync-frontend1" and p.pid != victim]
                if back:
                    break
                assert time.monotonic() < deadline, "process 1 was not restarted"
                time.sleep(0.2)
        finally:
            for c in clients.values():
                c.close()
        # new connections reach both again, and both serve
        deadline = time.monotonic() + 60
        while True:
            try:
                clients = _clients_on_each(srv.endpoint)
                break
            except (ClientTimeout, ServerError):
                assert time.monotonic() < deadline, "the restarted process never served"
                time.sleep(0.2)
        for c in clients.values():
            assert c.composite("slow", SLOW)[1] == want
            c.close()


def _open_until_busy(endpoint: str, most: int) -> tuple[list[Session], int]:
    """Sessions opened, each on a connection of its own, until `most` tries: (those opened, those busy)."""
    opened, busy = [], 0
    for _ in range(most):
        try:
            opened.append(Session(endpoint, "fast", format="png", timeout_s=60))
        except ServerError as err:
            if err.code == "unavailable":   # (a process starting again)
                continue
            assert err.code == "busy" and "on this host (sessions.max_sessions)" in err.message, err
            busy += 1
    return opened, busy


def test_max_sessions_holds_for_the_host_over_every_process(tmp_path, models):
    """sessions.max_sessions counts the sessions of every client-facing process (shm/board.py), not each
    one's own (16 tries over two processes: each would let in 4); a process killed with its sessions
    leaves their room to the other at once, before it is started again."""
    port = free_ports(2)
    cfg = base_config(models, **{"frontend.processes": 2, "metrics.port": port, "sessions.max_sessions": 4,
                                 "supervisor.restart_backoff_s": 600})   # (the killed one stays down 30 s)
    with run_server(tmp_path, cfg) as srv:
        sessions, busy = _open_until_busy(srv.endpoint, 16)
        try:
            assert (len(sessions), busy) == (4, 12)
            held = [int(_metric(port + i, "lipsync_sessions_open")) for i in (0, 1)]
            assert sum(held) == 4, held
            victim = 0 if held[0] >= held[1] else 1
            pid = next(p.pid for p in psutil.Process(srv.proc.pid).children() if p.name() == f"lsync-frontend{victim}")
            os.kill(pid, signal.SIGKILL)
            psutil.Process(pid).wait(30)
            more: list = []
            name = f"lsync-frontend{victim}"
            while len(more) < held[victim]:   # (the supervisor sees the death a moment later)
                assert not any(p.name() == name for p in psutil.Process(srv.proc.pid).children()), \
                    f"the survivor let in {len(more)} of {held[victim]} sessions before the other came back"
                got, _ = _open_until_busy(srv.endpoint, 4)
                more += got
                sessions += got
                time.sleep(0.2)
            assert len(more) == held[victim], (held, len(more))
            assert _open_until_busy(srv.endpoint, 2)[1] == 2
        finally:
            for s in sessions:
                try:
                    s.close()
                except (ServerError, ClientTimeout):   # (one the killed process held)
                    pass


def test_an_edges_processes_each_get_their_own_answers_from_the_gpu_host(tmp_path, models):
    """On an edge the bridge's client (gpu_actor/remote.py) answers each process's requests to it."""
    gpu_cfg, edge_cfg = bridge_configs(models, bridge_keys(tmp_path / "keys"), free_port(), TEST_PREFIX)
    edge_cfg["frontend"]["processes"] = 2
    with gpu_host(tmp_path, gpu_cfg), run_server(tmp_path, edge_cfg, role="edge") as edge:
        clients = _clients_on_each(edge.endpoint)
        visual = np.random.default_rng(4).random((2, 6, 320, 320), dtype=np.float32)
        try:
            answers = [c.composite("fast", AUDIO) for c in clients.values()]
            mouths = [c.infer("fast", visual, AUDIO[:2])[1] for c in clients.values()]   # (the mouths come back)
        finally:
            for c in clients.values():
                c.close()
    assert all(header["ok"] and len(images) == 4 for header, images in answers)
    assert answers[0][1] == answers[1][1]
    np.testing.assert_array_equal(mouths[0], mouths[1])


def test_a_gpu_hosts_bridge_processes_serve_the_edge_connections_each_takes(tmp_path, models):
    """bridge.processes: 2. An edge that lists the host 12 times (12 connections; all on one bridge: 1 in
    2,000) and sends its requests round robin over them is served through both bridges alike; with one
    bridge killed, its connections move to the other and the restarted one, and every request is served
    again."""
    port = free_port()
    gpu_cfg, edge_cfg = bridge_configs(models, bridge_keys(tmp_path / "keys"), port, TEST_PREFIX)
    gpu_cfg["bridge"]["processes"] = 2
    edge_cfg["bridge"]["hosts"] = edge_cfg["bridge"]["hosts"] * 12
    edge_cfg["frontend"]["routing"] = "round_robin"
    visual = np.random.default_rng(6).random((2, 6, 320, 320), dtype=np.float32)
    with gpu_host(tmp_path, gpu_cfg) as (host, _), run_server(tmp_path, edge_cfg, role="edge") as edge, \
            edge.client() as c:
        bridges = {p.name(): p for p in psutil.Process(host.pid).children() if p.name().startswith("lsync-bridge")}
        assert sorted(bridges) == ["lsync-bridge0", "lsync-bridge1"]

        def held() -> dict[str, int]:
            return {name: sum(1 for conn in p.net_connections("tcp") if conn.status == "ESTABLISHED"
                              and conn.laddr.port == port) for name, p in bridges.items()}

        deadline = time.monotonic() + 60
        while sum(held().values()) < 12:   # (the edge's 12 connections come up one by one)
            assert time.monotonic() < deadline, held()
            time.sleep(0.2)
        assert all(held().values()), held()
        want = c.infer("fast", visual, AUDIO[:2])[1]
        for _ in range(24):   # round robin: each connection twice
            np.testing.assert_array_equal(c.infer("fast", visual, AUDIO[:2])[1], want)
        os.kill(bridges["lsync-bridge1"].pid, signal.SIGKILL)
        deadline, served = time.monotonic() + 60, 0
        while served < 24:   # the dead bridge's connections are unreachable a moment, then served again
            try:
                np.testing.assert_array_equal(c.infer("fast", visual, AUDIO[:2], timeout_ms=20000)[1], want)
                served += 1
            except ServerError as err:
                assert err.code == "unavailable", err
                served = 0
            assert time.monotonic() < deadline, f"requests still fail after the bridge's restart ({served} in a row)"


def test_the_processes_need_a_fixed_tcp_port(tmp_path, models):
    from config import ConfigError, parse_config
    for bind in ("ipc:///tmp/lsync-frontends", "tcp://127.0.0.1:0"):
        with pytest.raises(ConfigError, match="frontend.processes"):
            parse_config({"frontend": {"processes": 2, "bind": [bind]}})
    with pytest.raises(ConfigError, match="bridge.processes"):
        parse_config({"bridge": {"processes": 2, "bind": "ipc:///tmp/lsync-bridge"}})
    with pytest.raises(ConfigError, match="viewer.public_url"):
        parse_config({"frontend": {"processes": 2}, "viewer": {"port": 8080, "public_url": "https://a.example"}})
