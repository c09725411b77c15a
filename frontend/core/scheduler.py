"""The request engine: every request's life from admission to its one reply, with no sockets.

`Scheduler` takes events (a request arrives, a worker answers, a process dies, a client goes, time
passes) and returns actions (dispatch this request to that worker, send this control message, free
that slot, reply). The client frontend (frontend/server.py) and the GPU host's bridge
(frontend/bridge.py) are thin ZeroMQ shells that feed it events and carry out its actions, so
routing, slot accounting, queues, chunk plans, gathering, deadlines and death handling exist once.

A request's states:

    QUEUED --room in the worker's input ring, its model loaded on the worker--> RUNNING (Dispatch)
    RUNNING --InferDone--> COMPOSITING (composite) | done (infer)
    COMPOSITING --every chunk's CompositeDone--> done
    GATHERING (load, unload, stats: waits for each asked worker's answer) --> done

Every end (done, error, deadline, client gone, a process death, shutdown) goes through `_finish`,
which emits exactly one Done or Fail first (so the shell can still read the output slot to build an
`infer` reply), then frees everything the request held.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Optional, Protocol, Union

from frontend.core.request import CLIENT_GONE, Kind, Request, State
from shm.codes import ErrorCode, ModelEventKind, ProcState
from shm.messages import (Chunk, CompositeDone, InferDone, LoadDone, LoadModel, ModelEvent, StatsQuery, StatsReport,
                          UnloadModel)
from shm.requests import is_tenant


STATS_TIMEOUT_S = 2.0   # how long a `stats` op waits for the workers' answers before it answers with what came
KEEP_SLACK = 3         # H.264 speech goes to a busier compositor than the least busy by at most this many requests
# What an edge's RemoteWorker says of its GPU host: the worker process, and its output ring, live on.
HOST_STATES = (ProcState.UNREACHABLE, ProcState.STARTING, ProcState.VACANT, ProcState.STOPPED)


# -- actions -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dispatch:
    """Write the request's inputs into the input room it holds at `worker`, send the InferTask."""
    request: Request
    worker: int
    plan: list[Chunk]


@dataclass(frozen=True)
class Render:
    """Send the request's background frames to `compositor` to be encoded (RenderIdle)."""
    request: Request
    compositor: int


@dataclass(frozen=True)
class SendWorker:
    worker: int
    message: Union[LoadModel, UnloadModel, StatsQuery]


@dataclass(frozen=True)
class ReleaseOutput:
    """Tell the worker to free the request's output slot (ReleaseTask)."""
    worker: int
    req: int


@dataclass(frozen=True)
class FreeImages:
    compositor: int
    req: int


@dataclass(frozen=True)
class Done:
    """The request succeeded: build its reply from it and send it. Raw frames: free `image_slots`
    once the bytes have left."""
    request: Request


@dataclass(frozen=True)
class Fail:
    request: Request
    code: Union[ErrorCode, str]          # CLIENT_GONE: send nothing
    message: str


Action = Union[Dispatch, Render, SendWorker, ReleaseOutput, FreeImages, Done, Fail]


# While live sessions are open, clients' requests leave this part of each worker's room (1 / LIVE_RESERVE:
# half) to their speech: a client's requests on a slow model held all of it for seconds, and every speech
# frame waited behind them past its due time.
LIVE_RESERVE = 2


def clients_room(room: int, reserve: bool) -> int:
    """What clients' requests may hold of a worker's `room`: all of it, less the live sessions' reserve."""
    return room - (room // LIVE_RESERVE if reserve else 0)


class Room(Protocol):
    """Where a worker's dispatched requests hold their inputs: taken when the engine dispatches, freed
    the moment it no longer needs them, so the same pump can give the room to the next request. The
    shells' is their input rings (core/slots.RingRoom); `CountedRoom` is the engine's own."""

    def take(self, worker: int, r: Request, reserve: bool = False) -> bool:
        """Hold the room `r`'s inputs take in `worker`'s inputs now; False when it is not free. `reserve`:
        leave 1 / LIVE_RESERVE of the worker's room free, unless it holds nothing."""

    def share_full(self, worker: int, r: Request, mine: list[Request], reserve: bool = False) -> bool:
        """Whether `r` would take its client past its share of `worker`'s room: `mine`, the requests of
        its client holding room there, and `r` together may hold at most half of what clients may hold
        there (all of it, less the reserve), unless `mine` is empty."""

    def free(self, worker: int, req: int) -> None:
        """The request's inputs are no longer needed (the worker answered, or the request ended)."""

    def reset(self, worker: int) -> None:
        """The worker died: all of its room is free (a new worker reads none of it)."""


class CountedRoom:
    """`slots` requests per worker, whatever their size (the engine without shared memory)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.held: dict[int, set[int]] = {}

    def take(self, worker: int, r: Request, reserve: bool = False) -> bool:
        held = self.held.setdefault(worker, set())
        if len(held) >= clients_room(self.slots, reserve and bool(held)):
            return False
        held.add(r.req)
        return True

    def share_full(self, worker: int, r: Request, mine: list[Request], reserve: bool = False) -> bool:
        return bool(mine) and len(mine) + 1 > clients_room(self.slots, reserve) // 2

    def free(self, worker: int, req: int) -> None:
        self.held.get(worker, set()).discard(req)

    def reset(self, worker: int) -> None:
        self.held.pop(worker, None)


# -- state ---------------------------------------------------------------------------------------

@dataclass
class WorkerState:
    index: int
    device: str
    state: ProcState = ProcState.STARTING
    pid: Optional[int] = None
    restarts: int = 0
    queue: deque = field(default_factory=deque)    # Requests waiting for room or for their model
    active: set[int] = field(default_factory=set)  # every request assigned here and not ended
    models: set[str] = field(default_factory=set)  # loaded, as far as its ModelEvents tell
    warming: dict[str, int] = field(default_factory=dict)   # model -> the WARM request loading it

    @property
    def ready(self) -> bool:
        return self.state is ProcState.READY


@dataclass
class CompositorState:
    state: ProcState = ProcState.STARTING
    pid: Optional[int] = None
    restarts: int = 0
    active: set[int] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.state is ProcState.READY


class RequestTable:
    """Live requests by id, by connection, and by deadline (a heap with lazy deletion)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Request] = {}
        self._by_conn: dict[Hashable, set[int]] = {}
        self._deadlines: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))

    def get(self, req: int) -> Optional[Request]:
        return self._by_id.get(req)

    def add(self, r: Request) -> None:
        self._by_id[r.req] = r
        if r.conn is not None:
            self._by_conn.setdefault(r.conn, set()).add(r.req)
        self._push_deadline(r)

    def _push_deadline(self, r: Request) -> None:
        when = min(r.deadline, r.gather_deadline)
        if when != float("inf"):
            heapq.heappush(self._deadlines, (when, r.req))

    def pop(self, req: int) -> Optional[Request]:
        r = self._by_id.pop(req, None)
        if r is not None and r.conn is not None:
            reqs = self._by_conn.get(r.conn)
            if reqs is not None:
                reqs.discard(req)
                if not reqs:
                    del self._by_conn[r.conn]
        return r

    def on_conn(self, conn: Hashable) -> list[Request]:
        return [self._by_id[q] for q in self._by_conn.get(conn, ())]

    def connections(self) -> int:
        return len(self._by_conn)

    def due(self, now: float) -> list[Request]:
        """Requests whose deadline (or gathering deadline) has passed."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, req = heapq.heappop(self._deadlines)
            r = self._by_id.get(req)
            if r is not None and r not in out:
                out.append(r)
        return out

    def next_deadline(self) -> Optional[float]:
        while self._deadlines and self._deadlines[0][1] not in self._by_id:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None


# -- the scheduler -------------------------------------------------------------------------------

class Scheduler:
    def __init__(self, devices: list[str], n_compositors: int, room: Room, queue_depth: int,
                 routing: str = "affinity", stats_timeout_s: float = STATS_TIMEOUT_S, first_id: int = 1,
                 live_sessions: Callable[[], int] = lambda: 0):
        """`room`: where dispatched requests hold their inputs (the shell's input rings); `first_id`: the
        first request id (core/shell.first_request_id); `live_sessions()`: the live sessions open (while
        there are any, their speech has a reserve of every worker's room: LIVE_RESERVE)."""
        self.live_sessions = live_sessions
        self.workers = [WorkerState(i, d) for i, d in enumerate(devices)]
        self.room = room
        self.compositors = [CompositorState() for _ in range(n_compositors)]
        self.table = RequestTable()
        self.queue_depth, self.routing, self.stats_timeout_s = queue_depth, routing, stats_timeout_s
        self._ids = itertools.count(first_id)
        self.first_id = first_id
        self._rr = itertools.count()       # round_robin routing
        self._turns = itertools.count()    # compositing plans (their own count: sharing one made every
                                           # composite request take two turns, so with two workers
                                           # round_robin sent every one to the same worker)
        self._clients: dict[Hashable, list[int]] = {}   # Request.client -> [its number, its requests]
        self._client_nos = itertools.count(1)

    # -- admission ------------------------------------------------------------------------------

    def submit(self, r: Request, now: float) -> list[Action]:
        """A new request: tensor ops are routed and queued, control ops sent to their workers."""
        r.req = next(self._ids)
        if r.kind is Kind.STATS:
            r.gather_deadline = now + self.stats_timeout_s
        if r.client is not None:
            held = self._clients.get(r.client)
            if held is None:
                held = self._clients[r.client] = [r.client if is_tenant(r.client) else next(self._client_nos), 0]
            r.client_no = held[0]
            held[1] += 1
        self.table.add(r)
        if r.kind in (Kind.INFER, Kind.COMPOSITE):
            return self._admit(r)
        if r.kind is Kind.RENDER:
            return self._render(r)
        if r.kind is Kind.LOAD:
            worker = self._pick(r.model)
            if worker is None:
                return self._finish(r, ErrorCode.UNAVAILABLE, self.no_worker_message())
            return self._gather(r, [worker], LoadModel(req=r.req, model=r.model, pin=r.pin))
        message = StatsQuery(req=r.req) if r.kind is Kind.STATS else UnloadModel(req=r.req, model=r.model)
        return self._gather(r, [w for w in self.workers if w.ready], message)

    def _admit(self, r: Request) -> list[Action]:
        worker = self._pick(r.model)
        if worker is None:
            return self._finish(r, ErrorCode.UNAVAILABLE, self.no_worker_message())
        # NOTE: a live session's speech is never refused here: admission bounds it (its sessions, each with
        # a latency budget or two of speech in requests, live/speech.py), and refused it is a frame missed
        # for sure. Only the requests of clients count against limits.queue_depth, so that a client's
        # flood of them cannot cost a live session its speech.
        actions: list[Action] = []
        if len(worker.queue) >= self.queue_depth and not _live(r) and \
                len(queued := [q for q in worker.queue if not _live(q)]) >= self.queue_depth:
            # NOTE: a full queue refuses the client holding most of it (as fq_codel drops from the longest
            # flow): the newcomer when that is its own client, else that client's newest request, so that
            # a client keeping the queue full cannot keep another's requests out
            held = Counter(q.client_no for q in queued)
            most = max(held.values())
            if held[r.client_no] >= most:
                return self._finish(r, ErrorCode.OVERLOADED, f"inference worker {worker.index} has {len(queued)} "
                                    f"requests queued (limits.queue_depth), {held[r.client_no]} of them yours; "
                                    "retry later")
            out = next(q for q in reversed(queued) if held[q.client_no] == most)
            actions += self._finish(out, ErrorCode.OVERLOADED, f"pushed out of inference worker {worker.index}'s "
                                    f"full queue for another client's request: {most} of its {len(queued)} "
                                    "requests (limits.queue_depth) were yours; retry later", pump=False)
        r.worker = worker.index
        worker.active.add(r.req)
        worker.queue.append(r)
        return actions + self._pump(worker)

    def _render(self, r: Request) -> list[Action]:
        ready = [i for i, c in enumerate(self.compositors) if c.ready]
        if r.compositor is not None:
            ready = [r.compositor] if r.compositor in ready else []
        if not ready:
            return self._finish(r, ErrorCode.UNAVAILABLE, "no compositing process is ready (restarting)")
        c = min(ready, key=lambda i: (len(self.compositors[i].active), i))
        r.chunks = {0: c}
        r.state = State.COMPOSITING
        self.compositors[c].active.add(r.req)
        return [Render(r, c)]

    def _gather(self, r: Request, targets: list[WorkerState], message) -> list[Action]:
        r.state = State.GATHERING
        r.waiting_on = {w.index for w in targets}
        for w in targets:
            w.active.add(r.req)
        if not targets:
            return self._finish(r)
        return [SendWorker(w.index, message) for w in targets]

    def _pick(self, model: Optional[str]) -> Optional[WorkerState]:
        ready = [w for w in self.workers if w.ready]
        if not ready:
            return None
        if self.routing == "round_robin":
            return ready[next(self._rr) % len(ready)]
        if self.routing == "affinity":
            warm = [w for w in ready if model in w.models or model in w.warming]
            ready = warm or ready
        return min(ready, key=lambda w: (len(w.active), w.index))

    def no_worker_message(self) -> str:
        states = ", ".join(f"worker {w.index} ({w.device}) is {w.state.value}" for w in self.workers)
        return f"no inference worker is ready: {states}; retry shortly"

    # -- dispatch -------------------------------------------------------------------------------

    def _pump(self, worker: WorkerState) -> list[Action]:
        """Dispatch queued requests whose model is loaded into free room; start loads for the others.
        NOTE: a request for a model still loading holds no slot, so it cannot stall the warm models'
        requests behind it (they pass it in the queue; one model's requests keep their order)."""
        actions: list[Action] = []
        if not worker.ready:
            return actions
        no_compositor = []
        ordered, flying = self._order(worker)
        reserving = self.live_sessions() > 0
        for r in ordered:
            if r.model not in worker.models:
                continue
            if r.kind is Kind.COMPOSITE and not any(c.ready for c in self.compositors):
                no_compositor.append(r)
                continue
            reserve = reserving and not _live(r)
            mine = flying.setdefault(r.client_no, []) if r.client is not None and not _live(r) else []
            if mine and self.room.share_full(worker.index, r, mine, reserve):
                continue   # its client holds its share of the room: the next client's may go
            if not self.room.take(worker.index, r, reserve=reserve):
                break   # NOTE: the most urgent waits for room first: smaller requests do not pass it
            plan = self._plan(r) if r.kind is Kind.COMPOSITE else []
            worker.queue.remove(r)
            r.in_slot = r.dispatched = True
            r.state = State.RUNNING
            mine.append(r)
            actions.append(Dispatch(r, worker.index, plan))
        for r in list(worker.queue):
            if r.model not in worker.models and r.model not in worker.warming:
                actions += self._warm(worker, r.model)
        for r in no_compositor:
            actions += self._finish(r, ErrorCode.UNAVAILABLE, "no compositing process is ready (restarting); "
                                    "retry shortly", pump=False)
        return actions

    def _order(self, worker: WorkerState) -> tuple[list[Request], dict[int, list[Request]]]:
        """The worker's queue in the order it gets room: live sessions' speech first, due soonest first;
        then clients' requests, the client with the fewest frames on the worker first (its requests in
        flight there and those queued before), each client's in deadline order; ties keep their order.
        So a client keeping many requests out waits behind another's one, not the reverse. And each
        client's requests holding room there (by Request.client_no)."""
        queued = sorted(worker.queue, key=_due)
        live = [r for r in queued if _live(r)]
        if len(live) == len(queued):   # (only speech waits: no client's share to count)
            return live, {}
        flying: dict[int, list[Request]] = {}
        for req in worker.active:
            r = self.table.get(req)
            if r is not None and r.in_slot and not _live(r):
                flying.setdefault(r.client_no, []).append(r)
        held = Counter({client: sum(r.batch for r in rs) for client, rs in flying.items()})
        ranked = []
        for r in queued:
            if not _live(r):
                ranked.append((held[r.client_no], len(ranked), r))
                held[r.client_no] += r.batch
        return live + [r for *_, r in sorted(ranked, key=lambda x: x[:2])], flying

    def _warm(self, worker: WorkerState, model: str) -> list[Action]:
        warm = Request(Kind.WARM, model)
        warm.req = next(self._ids)
        self.table.add(warm)
        worker.warming[model] = warm.req
        warm.worker = worker.index
        return self._gather(warm, [worker], LoadModel(req=warm.req, model=model))

    def _plan(self, r: Request) -> list[Chunk]:
        """Split the batch over the ready compositing processes, least busy first (ties rotate); H.264
        speech (`r.keep`) goes to its sessions' encoders' compositors, where the face boxes stay."""
        ready = [i for i, c in enumerate(self.compositors) if c.ready]
        if not ready:
            return []
        turn = next(self._turns)
        ready.sort(key=lambda i: (len(self.compositors[i].active), (i + turn) % len(self.compositors)))
        if r.keep is not None:
            plan = self._plan_kept(r.keep, ready, [len(c.active) for c in self.compositors])
        else:
            n = min(r.batch, len(ready))
            bounds = [r.batch * k // n for k in range(n + 1)]
            plan = [Chunk(ready[k], bounds[k], bounds[k + 1]) for k in range(n)]
        for chunk in plan:
            r.chunks[chunk.start] = chunk.compositor
            self.compositors[chunk.compositor].active.add(r.req)
        return plan

    @staticmethod
    def _plan_kept(keep: list[tuple[str, int, int]], ready: list[int], active: list[int]) -> list[Chunk]:
        """One chunk per run of frames bound for one compositor: there if it is ready and not more than
        KEEP_SLACK requests busier than the least busy (the boxes stay there), else to the least busy
        (the boxes come back, as for any other)."""
        plan, start, least = [], 0, ready[0]
        for compositor, run in itertools.groupby(keep, key=lambda frame: frame[2]):
            frames = [(session, index) for session, index, _ in run]
            end = start + len(frames)
            if compositor in ready and active[compositor] <= active[least] + KEEP_SLACK:
                plan.append(Chunk(compositor, start, end, frames))
            else:
                plan.append(Chunk(least, start, end))
            start = end
        return plan

    # -- results --------------------------------------------------------------------------------

    def infer_done(self, msg: InferDone) -> list[Action]:
        r = self.table.get(msg.req)
        if r is None or r.worker != msg.worker or r.state is not State.RUNNING:
            # The request ended first (deadline, a dead process): its output slot must still be freed.
            return [ReleaseOutput(msg.worker, msg.req)] if 0 <= msg.worker < len(self.workers) else []
        worker = self.workers[msg.worker]
        actions: list[Action] = []
        r.in_slot = False
        self.room.free(worker.index, r.req)
        r.timing.update(queue_ms=msg.queue_ms, input_ms=msg.input_ms, inference_ms=msg.inference_ms)
        if not msg.ok:
            actions += self._finish(r, msg.code or ErrorCode.INTERNAL, msg.message)
        elif r.kind is Kind.INFER:
            r.output = msg.output
            actions += self._finish(r)
        else:
            r.state = State.COMPOSITING
        return actions + self._pump(worker)

    def composite_done(self, msg: CompositeDone, frames: list) -> list[Action]:
        r = self.table.get(msg.req)
        if r is None or r.chunks.get(msg.start) != msg.compositor:
            # The request ended first: its raw frames are not wanted.
            return [FreeImages(msg.compositor, msg.req)] if msg.images is not None else []
        del r.chunks[msg.start]
        if msg.compositor not in r.chunks.values():
            self.compositors[msg.compositor].active.discard(r.req)
        if msg.images is not None:
            r.image_slots.add(msg.compositor)
        if not msg.ok:
            return self._finish(r, msg.code or ErrorCode.INTERNAL, msg.message)
        r.images[msg.start] = frames
        r.size = (msg.width, msg.height)
        r.lost.update(msg.lost)
        r.timing["composite_ms"] = max(r.timing.get("composite_ms", 0.0), msg.composite_ms)
        return [] if r.chunks else self._finish(r)

    def control_done(self, msg: Union[LoadDone, StatsReport]) -> list[Action]:
        r = self.table.get(msg.req)
        if r is None or r.state is not State.GATHERING or msg.worker not in r.waiting_on:
            return []
        r.waiting_on.discard(msg.worker)
        self.workers[msg.worker].active.discard(r.req)
        r.results.append(msg)
        if isinstance(msg, LoadDone) and msg.ok and r.kind in (Kind.LOAD, Kind.WARM):
            self.workers[msg.worker].models.add(msg.model)
        if r.waiting_on:
            return []
        if r.kind is Kind.STATS:
            return self._finish(r)
        failed = next((a for a in r.results if not a.ok), None)
        if failed is not None:
            return self._finish(r, failed.code or ErrorCode.INTERNAL, failed.message)
        return self._finish(r)

    def model_event(self, msg: ModelEvent) -> list[Action]:
        if not 0 <= msg.worker < len(self.workers):
            return []
        worker = self.workers[msg.worker]
        if msg.event is ModelEventKind.LOADED:
            worker.models.add(msg.model)
        elif msg.event is ModelEventKind.PREPARED:   # (its frames/s only: admission's, live/capacity.py)
            return []
        else:
            worker.models.discard(msg.model)
        return self._pump(worker)

    # -- processes ------------------------------------------------------------------------------

    def process_event(self, role: str, index: int, state: ProcState, pid: Optional[int] = None,
                      restarts: int = 0) -> list[Action]:
        procs = self.workers if role == "gpu" else self.compositors if role == "cpu" else []
        if not 0 <= index < len(procs):
            return []
        proc = procs[index]
        was_ready = proc.ready
        proc.state, proc.pid, proc.restarts = state, pid, restarts
        if state is ProcState.READY:
            return self._pump(proc) if isinstance(proc, WorkerState) else []
        if not was_ready:
            return []
        return self._lost(role, proc, index, state)

    def _lost(self, role: str, proc, index: int, state: ProcState) -> list[Action]:
        """Everything the process held gets `unavailable` now, never silence."""
        what = f"{'inference worker' if role == 'gpu' else 'compositing process'} {index}"
        device = proc.device if isinstance(proc, WorkerState) else "cpu"
        reason = {ProcState.UNREACHABLE: f"{what} ({device}) is unreachable; retry",
                  ProcState.STARTING: f"{what} ({device}) has no ready inference worker on its host; retry",
                  ProcState.STOPPED: f"{what} ({device}) is shutting down; retry on another",
                  }.get(state, f"{what} died and is restarting; retry")
        actions: list[Action] = []
        for req in list(proc.active):
            r = self.table.get(req)
            if r is None:
                continue
            if r.state is State.GATHERING and r.kind in (Kind.STATS, Kind.UNLOAD):
                # A dead worker holds no model and has no stats to give: do not wait for it.
                r.waiting_on.discard(index)
                if not r.waiting_on:
                    actions += self._finish(r)
                continue
            if role == "gpu" and state in HOST_STATES and r.worker == index and r.state is State.COMPOSITING:
                continue   # its mouths came back before its GPU host went: they are composited as usual
            if isinstance(proc, WorkerState) and r.worker == index:
                # NOTE: its slots died with the worker: the room is reset below, and a new worker
                # takes its output ring over.
                r.in_slot = r.dispatched = False
            actions += self._finish(r, ErrorCode.UNAVAILABLE, reason)
        proc.active.clear()
        if isinstance(proc, WorkerState):
            proc.models.clear()
            proc.warming.clear()
            self.room.reset(index)
        return actions

    # -- ends -----------------------------------------------------------------------------------

    def unpin(self, worker: int, model: str) -> list[Action]:
        """A live session closed: its model may be evicted from `worker` again."""
        w = self.workers[worker] if 0 <= worker < len(self.workers) else None
        # (req: this engine's first id: whose pin it releases, shm/requests.py)
        return [SendWorker(worker, LoadModel(req=self.first_id, model=model, pin=-1))] if w is not None and w.ready else []

    def fail(self, req: int, code: Union[ErrorCode, str], message: str) -> list[Action]:
        """The shell could not carry an action out (e.g. writing the inputs failed)."""
        r = self.table.get(req)
        return self._finish(r, code, message) if r is not None else []

    def client_gone(self, conn: Hashable) -> list[Action]:
        actions: list[Action] = []
        for r in self.table.on_conn(conn):
            actions += self._finish(r, CLIENT_GONE, "")
        return actions

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for r in self.table.due(now):
            if r.state is State.GATHERING and r.kind is Kind.STATS and now >= r.gather_deadline:
                actions += self._finish(r)   # answered with what came; the rest are listed as missing
            elif now >= r.deadline:
                where = "in the queue" if r.state is State.QUEUED else r.state.value
                actions += self._finish(r, ErrorCode.TIMEOUT, f"no result by the deadline (request was {where})")
            else:
                self.table._push_deadline(r)
        return actions

    def next_deadline(self) -> Optional[float]:
        return self.table.next_deadline()

    def shutdown(self, message: str) -> list[Action]:
        actions: list[Action] = []
        for r in self.table:
            actions += self._finish(r, ErrorCode.UNAVAILABLE, message)
        return actions

    def _finish(self, r: Request, code: Union[ErrorCode, str, None] = None, message: str = "",
                pump: bool = True) -> list[Action]:
        """The one end of every request: one Done or Fail first, then free everything it held."""
        if self.table.pop(r.req) is None:
            return []
        if r.client is not None and (held := self._clients.get(r.client)) is not None:
            held[1] -= 1
            if not held[1]:
                del self._clients[r.client]
        actions: list[Action] = []
        if r.kind is not Kind.WARM:
            actions.append(Done(r) if code is None else Fail(r, code, message))
        if code is not None or r.kind is not Kind.COMPOSITE:
            actions += [FreeImages(c, r.req) for c in sorted(r.image_slots)]   # else the shell frees them once sent
        for c in self.compositors:
            c.active.discard(r.req)
        touched = {r.worker} if r.worker is not None else set()
        touched |= {w.index for w in self.workers if r.req in w.active}
        for index in sorted(touched):
            worker = self.workers[index]
            worker.active.discard(r.req)
            if r in worker.queue:
                worker.queue.remove(r)
            if worker.warming.get(r.model) == r.req:
                del worker.warming[r.model]
                if code is not None:   # the load failed: so do the requests waiting for it
                    for waiting in [q for q in worker.queue if q.model == r.model]:
                        actions += self._finish(waiting, code, message, pump=False)
            if index == r.worker:
                if r.in_slot:
                    self.room.free(index, r.req)
                if r.dispatched:
                    actions.append(ReleaseOutput(index, r.req))
            if pump:
                actions += self._pump(worker)
        r.in_slot = r.dispatched = False
        return actions

    # -- views ----------------------------------------------------------------------------------

    def loaded(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for w in self.workers:
            for model in sorted(w.models):
                out.setdefault(model, []).append(w.index)
        return out

    def synced(self) -> bool:
        return all(p.pid is not None for p in [*self.workers, *self.compositors])


def _due(r: Request) -> float:
    return r.inputs.due if r.inputs is not None and r.inputs.due else r.deadline


def _live(r: Request) -> bool:
    """A live session's speech (it has a due time)."""
    return r.inputs is not None and r.inputs.due > 0


def merge_model_stats(reports: list[StatsReport]) -> dict[str, dict[str, float]]:
    """Per-model stats of several workers as one: counts add up; latencies, load time and last use
    take the highest worker's value."""
    merged: dict[str, dict[str, float]] = {}
    for report in reports:
        for model, stats in report.models.items():
            into = merged.setdefault(model, {})
            for key, value in stats.items():
                if key.startswith("inference_ms") or key in ("last_used", "load_ms"):
                    into[key] = max(into.get(key, 0.0), value)
                else:
                    into[key] = into.get(key, 0) + value
    return merged
