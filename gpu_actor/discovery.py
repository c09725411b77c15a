"""GPU hosts found by DNS: `bridge.hosts` entries with `dns:` (e.g. a Kubernetes headless Service,
whose name resolves to the address of every ready GPU pod).

Such an entry gets `max_hosts` RemoteWorker slots. Each slot resolves the name every
`bridge.resolve_s` and takes the address the shared rule gives it; every slot sees the same
addresses and applies the same rule, so no two take the same host and no coordination is needed.
The rule keeps hosts where they are: an address goes to the slot its hash names, or the next free
one, in address order, so a host that appears or goes moves no other host unless their slots
collided (rare with `max_hosts` well above the number of hosts).
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from typing import Callable, Optional

_DEVICE = re.compile(r"^remote:dns://(?P<name>[^/:]+):(?P<port>\d+)/(?P<slot>\d+)\Z")


def dns_device(name: str, port: int, slot: int) -> str:
    return f"remote:dns://{name}:{port}/{slot}"


def parse_dns_device(device: str) -> Optional[tuple[str, int, int]]:
    """(name, port, slot) of a DNS slot's device string; None for a fixed endpoint."""
    m = _DEVICE.match(device)
    return (m["name"], int(m["port"]), int(m["slot"])) if m else None


def assign_slots(addresses: list[str], n_slots: int) -> dict[int, str]:
    """slot -> address for every address that gets one (at most n_slots of them)."""
    taken: dict[int, str] = {}
    for address in sorted(set(addresses))[:n_slots]:
        slot = int.from_bytes(hashlib.blake2b(address.encode(), digest_size=4).digest(), "big") % n_slots
        while slot in taken:
            slot = (slot + 1) % n_slots
        taken[slot] = address
    return taken


def endpoint(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def resolve(name: str, port: int) -> list[str]:
    """Every address `name` resolves to now (IPv4 and IPv6); [] when it resolves to none."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


class SlotWatcher:
    """A thread that resolves the name every `every_s` and keeps this slot's endpoint (None: vacant).
    NOTE: a thread, because a resolver can block for seconds (timeouts, retries) and the worker's
    loop must keep its heartbeats."""

    def __init__(self, name: str, port: int, slot: int, n_slots: int, every_s: float,
                 resolver: Callable[[str, int], list[str]] = resolve):
        self.name, self.port, self.slot, self.n_slots = name, port, slot, n_slots
        self.every_s, self._resolver = every_s, resolver
        self.endpoint: Optional[str] = None
        self.resolved = threading.Event()     # set after the first resolution
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dns-{slot}", daemon=True)

    def start(self) -> "SlotWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            address = assign_slots(self._resolver(self.name, self.port), self.n_slots).get(self.slot)
            self.endpoint = None if address is None else endpoint(address, self.port)
            self.resolved.set()
            self._stop.wait(self.every_s)
