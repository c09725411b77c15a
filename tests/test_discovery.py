"""GPU hosts found by DNS (bridge.hosts with `dns:`): the slot rule without processes, and an edge
that adds a host when its address appears behind the name and retires it when it goes, over loopback
names (the edge and its GPU hosts in a network namespace of their own, whose /etc/hosts the test
edits the way a headless Service's records change)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lipsync_client import AsyncClient, ServerError
from gpu_actor.discovery import assign_slots
from tests.conftest import TEST_PREFIX
from tests.helpers import ROOT, base_config, free_port, gpu_host, make_avatar, run_server

NAME = "gpu-hosts.lipsync.test"


def test_slots_keep_their_hosts_when_others_come_and_go():
    hosts = [f"10.0.0.{i}" for i in range(1, 6)]
    before = assign_slots(hosts, 4 * 2)
    assert sorted(before.values()) == hosts and len(set(before)) == 5
    after = assign_slots(hosts[:2] + hosts[3:] + ["10.0.0.9"], 8, before)   # one goes, one comes
    moved = [a for s, a in before.items() if a != "10.0.0.3" and after.get(s) != a]
    assert not moved and "10.0.0.9" in after.values(), "hosts that stayed kept their slots"
    # Two hosts whose hashes name the same slot: the one that stays keeps the slot it got.
    pair = assign_slots(["127.0.0.2", "127.0.0.3"], 4)
    assert len(pair) == 2
    kept = assign_slots(["127.0.0.3"], 4, pair)
    assert kept == {s: a for s, a in pair.items() if a == "127.0.0.3"}
    assert len(assign_slots([f"10.1.0.{i}" for i in range(20)], 8)) == 8, "at most max_hosts"
    assert assign_slots([], 4) == {}


def _netns_or_skip() -> str:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`) for a network namespace with its own /etc/hosts")
    name = f"lsdns{secrets.token_hex(3)}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("`ip netns add` is not allowed here")
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    return name


@pytest.fixture
def netns():
    name = _netns_or_skip()
    etc = Path("/etc/netns") / name
    etc.mkdir(parents=True, exist_ok=True)
    try:
        yield name, etc / "hosts"
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def set_hosts(path: Path, addresses: list[str]) -> None:
    """Rewrite in place: the namespace's /etc/hosts is this very file, bind-mounted."""
    with open(path, "r+" if path.exists() else "w") as f:
        f.seek(0)
        f.truncate()
        f.write("127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addresses))


def wait_hosts(srv, want: set[str], timeout_s: float = 30.0) -> dict:
    """Until the ready GPU-host slots are exactly `want` (addresses), one slot each, the rest vacant."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = srv.health()
        slots = [p for p in health["processes"] if p["role"] == "gpu"]
        ready = [p["device"].rsplit("tcp://", 1)[1].split(":")[0] for p in slots
                 if p["state"] == "ready" and "tcp://" in p["device"]]
        vacant = sum(p["state"] == "vacant" for p in slots)
        if sorted(ready) == sorted(want) and vacant == len(slots) - len(want):
            return health
        assert time.monotonic() < deadline, (want, [(p["device"], p["state"]) for p in slots])
        time.sleep(0.2)


def served_by(srv, n: int) -> Counter:
    audio = np.zeros((1, 32, 16, 16), np.float32)
    with srv.client() as c:
        return Counter(c.composite("a", audio)[0]["worker"]["index"] for _ in range(n))


def test_an_edge_adds_and_retires_gpu_hosts_found_by_dns(netns, tmp_path):
    ns, hosts = netns
    set_hosts(hosts, ["127.0.0.2"])
    models = tmp_path / "models"
    make_avatar(models, "a", n_frames=3)
    make_avatar(models, "slow", n_frames=3, kind="unet328")   # ~0.15 s a frame: work stays in flight
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "supervisor", "keys", str(keys), "gpu", "edge"], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    (keys / "authorized").mkdir()
    (keys / "authorized" / "edge.key").write_bytes((keys / "edge.key").read_bytes())
    port = free_port()

    def gpu(address: str, tag: str) -> dict:   # both hosts share one server key, as a StatefulSet would
        return base_config(models, **{"shm.prefix": TEST_PREFIX + tag, "bridge": {
            "bind": f"tcp://{address}:{port}", "secret_key": str(keys / "gpu.key_secret"),
            "authorized_keys": str(keys / "authorized")}})

    edge = base_config(models, **{"shm.prefix": TEST_PREFIX + "e", "frontend.routing": "round_robin",
                                  "frontend.bind": [f"ipc://{tmp_path}/edge.sock"], "bridge": {
        "hosts": [{"dns": NAME, "port": port, "max_hosts": 4, "server_key": str(keys / "gpu.key")}],
        "client_secret_key": str(keys / "edge.key_secret"), "heartbeat_s": 0.2, "dead_after_s": 0.8,
        "resolve_s": 0.3}})
    inside = ("ip", "netns", "exec", ns)
    with gpu_host(tmp_path, gpu("127.0.0.2", "g1"), prefix=inside), \
            gpu_host(tmp_path, gpu("127.0.0.3", "g2"), prefix=inside), \
            run_server(tmp_path, edge, role="edge", prefix=inside) as srv:
        health = wait_hosts(srv, {"127.0.0.2"})
        assert len([p for p in health["processes"] if p["role"] == "gpu"]) == 4
        assert health["status"] == "ready", "empty slots are not a fault"
        assert len(served_by(srv, 4)) == 1

        set_hosts(hosts, ["127.0.0.2", "127.0.0.3"])   # a host appears behind the name
        wait_hosts(srv, {"127.0.0.2", "127.0.0.3"})
        assert len(served_by(srv, 6)) == 2, "both hosts serve"

        # And one goes, with work in flight on both: the retired host's requests end `unavailable`
        # at once (a retry goes to the other), the rest are served.
        with srv.client(timeout_s=60) as c:   # each host loads the slow model (round robin), then its cost here
            timings = [c.composite("slow", np.zeros((8, 32, 16, 16), np.float32))[0]["timing"] for _ in range(4)]
        cost = min(t["inference_ms"] + t["input_ms"] for t in timings[2:]) / 1000

        async def burst():
            async with AsyncClient(srv.endpoint, timeout_s=60) as client:
                async def one():
                    try:
                        return (await client.composite("slow", np.zeros((8, 32, 16, 16), np.float32)))[0]["worker"]["index"]
                    except ServerError as err:
                        return err.code
                tasks = [asyncio.create_task(one()) for _ in range(6)]
                await asyncio.sleep(cost / 2)   # half-way through the first on each host, two more behind it
                set_hosts(hosts, ["127.0.0.3"])
                return await asyncio.gather(*tasks)

        t0 = time.monotonic()
        outcomes = Counter(asyncio.run(burst()))
        assert outcomes["unavailable"] >= 1 and sum(v for k, v in outcomes.items() if k != "unavailable") >= 1, outcomes
        assert time.monotonic() - t0 < 60, "a request waited for its deadline"
        wait_hosts(srv, {"127.0.0.3"})
        assert len(served_by(srv, 4)) == 1
