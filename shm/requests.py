"""Request ids across processes: the high bits of an id name the client-facing process that made it
(its owner: frontend i, or a GPU host's bridge i), so that every process answering a request sends
the answer to its owner, and a restarted owner's predecessor's requests are told from every other
owner's (ResetRequests carries the new owner's first id, owner bits included).

    bits  63 .. 56 | 55 .. 48         | 47 .. 0
          unused   | owner (0 .. 255) | counted from the owner's first id

An owner's ids start at the host's monotonic clock in microseconds when it starts (2^48 us is 8.9
years of uptime) and count up one a request.
"""

from __future__ import annotations

import hashlib
from typing import Hashable

OWNER_SHIFT = 48
MAX_OWNERS = 256
# A client's number (InferTask.client) with this bit set is a tenant's, the same wherever the tenant
# connects (every client-facing process, every edge host): its other bits hash its name. Other clients
# (connections) are numbered by their process from 1, and are that process's only.
TENANT_BIT = 1 << 62


def owner_of(req: int) -> int:
    return req >> OWNER_SHIFT


def first_id(owner: int, now_us: int) -> int:
    """The first request id of owner `owner` starting at `now_us` (a monotonic clock in microseconds)."""
    if not 0 <= owner < MAX_OWNERS:
        raise ValueError(f"owner {owner} is not in 0..{MAX_OWNERS - 1}")
    return (owner << OWNER_SHIFT) | (now_us & ((1 << OWNER_SHIFT) - 1))


def tenant_client(name: str) -> int:
    """The client number of the tenant `name` (56 bits of its name's hash: two tenants' numbers meet
    once in 2^28 pairs of names)."""
    return TENANT_BIT | int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "big")


def is_tenant(client: Hashable) -> bool:
    """Whether a client (a number, or a connection's key) is a tenant's number (tenant_client)."""
    return isinstance(client, int) and bool(client & TENANT_BIT)


def client_key(req: int, client: int) -> Hashable:
    """Whose share of a worker a task of request `req` and client number `client` takes: a tenant's
    wherever it came from, else the process that numbered the client (the request's owner)'s client."""
    return client if is_tenant(client) else (owner_of(req), client)


def same_owner_below(req: int, floor: int) -> bool:
    """`req` is of the owner `floor` names, and made before it (a restarted owner's predecessor's)."""
    return owner_of(req) == owner_of(floor) and req < floor


def release_owned(held: dict, key, req: int) -> None:
    """`held`: key -> request ids (a model's pins). The newest of `key`'s ids of `req`'s owner goes
    (another owner's stay, for that owner's restart to drop); a key left with none goes too."""
    reqs = held.get(key)
    mine = [i for i, r in enumerate(reqs or ()) if owner_of(r) == owner_of(req)]
    if mine:
        del reqs[mine[-1]]
        if not reqs:
            del held[key]


def drop_owned_below(held: dict, floor: int) -> int:
    """`held`: key -> request ids. The ids of `floor`'s owner below it (a restarted owner's
    predecessor's) go, and the keys left with none; how many ids went."""
    dropped = 0
    for key in list(held):
        kept = [req for req in held[key] if not same_owner_below(req, floor)]
        dropped += len(held[key]) - len(kept)
        if kept:
            held[key] = kept
        else:
            del held[key]
    return dropped


class Floors:
    """Per owner, the first id of its process now: the ids of that owner below it are a dead
    predecessor's (ResetRequests), never to be answered."""

    def __init__(self) -> None:
        self._by_owner: dict[int, int] = {}

    def raise_to(self, floor: int) -> None:
        owner = owner_of(floor)
        self._by_owner[owner] = max(self._by_owner.get(owner, 0), floor)

    def gone(self, req: int) -> bool:
        return req < self._by_owner.get(owner_of(req), 0)
