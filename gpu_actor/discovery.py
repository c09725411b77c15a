"""GPU hosts found by DNS: `bridge.hosts` entries with `dns:` (e.g. a Kubernetes headless Service,
whose name resolves to the address of every ready GPU pod).

Such an entry gets `max_hosts` RemoteWorker slots. Slot 0 resolves the name every
`bridge.resolve_s` and writes which slot has which address to a small file in the run's directory;
every slot reads it and connects to its own. A host that stays keeps its slot (its work is never
moved or lost because another host came or went); a new host takes the slot its hash names or the
next free one; a host that goes leaves its slot vacant.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def assign_slots(addresses: list[str], n_slots: int, previous: Optional[dict[int, str]] = None) -> dict[int, str]:
    """slot -> address for every address that gets one (at most n_slots of them). Hosts that stay
    keep their slot; a new one takes the slot its hash names, or the next free one."""
    present = set(addresses)
    taken = {slot: a for slot, a in (previous or {}).items() if a in present and 0 <= slot < n_slots}
    for address in sorted(present - set(taken.values())):
        if len(taken) == n_slots:
            break
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
    """This slot's endpoint (None: vacant), kept by a thread. Slot 0 resolves the name every `every_s`
    and writes the assignment to `table` (a file in the run's directory; written whole, then renamed);
    every slot reads it. One writer, so a host that stays keeps its slot whoever else comes or goes.
    NOTE: a thread, because a resolver can block for seconds (timeouts, retries) and the worker's
    loop must keep its heartbeats."""

    def __init__(self, name: str, port: int, slot: int, n_slots: int, every_s: float, table: str,
                 resolver: Callable[[str, int], list[str]] = resolve):
        self.name, self.port, self.slot, self.n_slots = name, port, slot, n_slots
        self.every_s, self.table, self._resolver = every_s, table, resolver
        self.endpoint: Optional[str] = None
        self.resolved = threading.Event()     # set once this slot has read an assignment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dns-{slot}", daemon=True)

    def start(self) -> "SlotWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> Optional[dict[int, str]]:
        try:
            with open(self.table) as f:
                return {int(k): v for k, v in json.load(f).items()}
        except (OSError, ValueError):
            return None

    def _write(self, assignment: dict[int, str]) -> None:
        tmp = f"{self.table}.tmp"
        with open(tmp, "w") as f:
            json.dump(assignment, f)
        os.replace(tmp, self.table)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.slot == 0:
                previous = self._read()
                assignment = assign_slots(self._resolver(self.name, self.port), self.n_slots, previous)
                if assignment != previous:
                    self._write(assignment)
            else:
                assignment = self._read()
            if assignment is not None:
                address = assignment.get(self.slot)
                self.endpoint = None if address is None else endpoint(address, self.port)
                self.resolved.set()
            self._stop.wait(self.every_s if self.slot == 0 else self.every_s / 2)
