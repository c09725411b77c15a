"""Whose task a step takes next: live sessions' speech first, due soonest first; then clients' tasks in
start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM 1996), so that a client with many tasks queued
shares the device with another client's one task instead of running all of its own first.

Each client's service so far ends at a virtual tag: the frames the worker has taken of its tasks,
counted from the virtual time when it last had none waiting. Its queued tasks, deadline first, start
where its service ends, one after another; the virtual time is the highest start a step has taken.
Tasks run in start order (ties: deadline first): a newcomer's first task starts at the virtual time,
ahead of the queued tasks of a client that sent many, and two clients that keep tasks queued get the
device's frames in equal shares, whatever the size of their tasks. A client whose service ends at or
before the virtual time is forgotten: its next task would start there anyway. Clients that each send
one request and go all start at the virtual time, which then does not move, so their tags would stay;
past MAX_CLIENTS the ones ending soonest are forgotten (each comes back at most its last task's frames
early).

A client is a tenant, wherever its tasks come from, else a connection: its frontend's number for it
within the process that sent the task (the owner bits of its request id), so that numbers of two
frontends never meet (shm/requests.py client_key).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

from shm.messages import InferTask
from shm.requests import client_key


MAX_CLIENTS = 4096   # tags kept at most (then the half ending soonest go)


def _client(task: InferTask) -> Hashable:
    return client_key(task.req, task.client)


def _deadline(task: InferTask) -> float:
    return task.deadline or float("inf")


class Turns:
    def __init__(self) -> None:
        self.virtual = 0.0
        self._ends: dict[Hashable, float] = {}   # client -> where its service so far ends

    def order(self, tasks: Iterable[InferTask], rows: Callable[[InferTask], int]) -> list[InferTask]:
        """`tasks` in the order they run, `rows(task)` being the frames each has still to run."""
        tasks = list(tasks)
        live = sorted((t for t in tasks if t.due), key=lambda t: t.due)
        starts: dict[Hashable, float] = {}
        ranked = []
        for task in sorted((t for t in tasks if not t.due), key=_deadline):
            client = _client(task)
            start = starts.get(client)
            if start is None:
                start = max(self.virtual, self._ends.get(client, 0.0))
            starts[client] = start + rows(task)
            ranked.append((start, _deadline(task), len(ranked), task))
        return live + [task for *_, task in sorted(ranked, key=lambda x: x[:3])]

    def taken(self, task: InferTask, rows: int) -> None:
        """`rows` of the task went into a step: its client's service grows by them, and the virtual time
        moves up to where they started; a client whose service ends before it has no say any more."""
        if task.due:
            return
        client = _client(task)
        start = max(self.virtual, self._ends.get(client, 0.0))
        self._ends[client] = start + rows
        if start > self.virtual:
            self.virtual = start
            for other in [c for c, end in self._ends.items() if end <= start]:
                del self._ends[other]
        if len(self._ends) > MAX_CLIENTS:
            kept = sorted(self._ends.items(), key=lambda item: item[1])[-(MAX_CLIENTS // 2):]
            self._ends = dict(kept)
