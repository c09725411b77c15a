"""The request engine alone (no processes, no sockets): every end of every kind of request sends exactly
one reply and frees exactly what the request held."""

from __future__ import annotations

import pytest

from frontend.core.scheduler import (CLIENT_GONE, KEEP_SLACK, CountedRoom, Dispatch, Fail, Kind, FreeImages, ReleaseOutput,
                                     Done, Request, Scheduler, SendWorker)
from shm.codes import ErrorCode, ModelEventKind, ProcState
from shm.messages import CompositeDone, InferDone, LoadDone, LoadModel, ModelEvent, StatsReport


def engine(workers: int = 1, compositors: int = 2, slots: int = 2, queue_depth: int = 4) -> Scheduler:
    e = Scheduler([f"cpu{i}" for i in range(workers)], compositors, CountedRoom(slots), queue_depth)
    for i in range(workers):
        assert e.process_event("gpu", i, ProcState.READY, pid=100 + i) == []
        e.model_event(ModelEvent(worker=i, model="m", event=ModelEventKind.LOADED))
    for i in range(compositors):
        e.process_event("cpu", i, ProcState.READY, pid=200 + i)
    return e


def of(actions, kind) -> list:
    return [a for a in actions if isinstance(a, kind)]


def ends(actions) -> list:
    return of(actions, Done) + of(actions, Fail)


def held(e: Scheduler) -> dict:
    """What the engine still holds for anyone: must be nothing once every request has ended."""
    return {"requests": len(e.table), "slots": sum(map(len, e.room.held.values())),
            "active": sum(len(w.active) for w in e.workers) + sum(len(c.active) for c in e.compositors),
            "queued": sum(len(w.queue) for w in e.workers), "connections": e.table.connections(),
            "clients": len(e._clients)}


NOTHING = {"requests": 0, "slots": 0, "active": 0, "queued": 0, "connections": 0, "clients": 0}


def submit(e: Scheduler, kind=Kind.COMPOSITE, model="m", batch=4, deadline=100.0, conn="c1"):
    r = Request(kind, model, batch, deadline=deadline, conn=conn, client=conn)
    return r, e.submit(r, now=0.0)


def test_composite_done_replies_once_and_frees_input_output_and_compositors():
    e = engine()
    r, actions = submit(e)
    (d,) = of(actions, Dispatch)
    assert [(c.compositor, c.start, c.end) for c in d.plan] == [(0, 0, 2), (1, 2, 4)] or len(d.plan) == 2
    actions = e.infer_done(InferDone(req=r.req, worker=0, ok=True, queue_ms=1.0, inference_ms=2.0))
    assert e.room.held[0] == set() and not ends(actions), "the input freed once inferred"
    for chunk in d.plan:
        actions = e.composite_done(CompositeDone(req=r.req, compositor=chunk.compositor, start=chunk.start,
                                                 end=chunk.end, ok=True, width=8, height=6), [b"x"] * 2)
    assert ends(actions) == [Done(r)] and of(actions, ReleaseOutput) == [ReleaseOutput(0, r.req)]
    assert actions.index(Done(r)) < actions.index(ReleaseOutput(0, r.req)), "reply before the slot is freed"
    assert r.size == (8, 6) and sum(len(v) for v in r.images.values()) == 4
    assert held(e) == NOTHING


def test_infer_reply_is_built_before_its_output_slot_is_released():
    e = engine()
    r, _ = submit(e, Kind.INFER)
    actions = e.infer_done(InferDone(req=r.req, worker=0, ok=True, output=None))
    assert [type(a) for a in actions][:2] == [Done, ReleaseOutput]
    assert held(e) == NOTHING


@pytest.mark.parametrize("end", ["deadline", "client_gone", "worker_dies", "compositor_dies", "worker_error",
                                 "compositor_error", "shutdown", "shell_fails"])
def test_every_end_of_a_running_composite_frees_exactly_what_it_held(end):
    e = engine()
    r, actions = submit(e)
    (d,) = of(actions, Dispatch)
    if end not in ("worker_dies", "worker_error", "deadline", "client_gone", "shutdown", "shell_fails"):
        e.infer_done(InferDone(req=r.req, worker=0, ok=True))   # now compositing
    raw = CompositeDone(req=r.req, compositor=d.plan[0].compositor, start=d.plan[0].start, end=d.plan[0].end,
                        ok=True, images=None)
    actions = {
        "deadline": lambda: e.tick(100.0),
        "client_gone": lambda: e.client_gone("c1"),
        "worker_dies": lambda: e.process_event("gpu", 0, ProcState.RESTARTING, pid=None, restarts=1),
        "compositor_dies": lambda: e.process_event("cpu", 1, ProcState.RESTARTING, pid=None, restarts=1),
        "worker_error": lambda: e.infer_done(InferDone(req=r.req, worker=0, ok=False, code=ErrorCode.INTERNAL,
                                                       message="model m failed")),
        "compositor_error": lambda: e.composite_done(
            CompositeDone(req=r.req, compositor=raw.compositor, start=raw.start, end=raw.end, ok=False,
                          code=ErrorCode.BAD_REQUEST, message="bad rects"), []),
        "shutdown": lambda: e.shutdown("stopping"),
        "shell_fails": lambda: e.fail(r.req, ErrorCode.INTERNAL, "writing inputs failed"),
    }[end]()
    (fail,) = ends(actions)
    assert isinstance(fail, Fail) and fail.request is r
    expected = {"deadline": ErrorCode.TIMEOUT, "client_gone": CLIENT_GONE, "worker_dies": ErrorCode.UNAVAILABLE,
                "compositor_dies": ErrorCode.UNAVAILABLE, "worker_error": ErrorCode.INTERNAL,
                "compositor_error": ErrorCode.BAD_REQUEST, "shutdown": ErrorCode.UNAVAILABLE,
                "shell_fails": ErrorCode.INTERNAL}[end]
    assert fail.code == expected
    if end == "worker_dies":
        assert 0 not in e.room.held   # its slots died with it
    elif end in ("deadline", "client_gone", "shutdown", "shell_fails"):
        assert r.req not in e.room.held[0] and ReleaseOutput(0, r.req) in actions
    else:
        assert ReleaseOutput(0, r.req) in actions
    assert held(e) == NOTHING
    # Late messages for the ended request free what they carry and answer nobody.
    late = e.infer_done(InferDone(req=r.req, worker=0, ok=True))
    assert late == [ReleaseOutput(0, r.req)]
    raw_late = e.composite_done(CompositeDone(req=r.req, compositor=0, start=0, end=2, ok=True,
                                              images=object()), [])
    assert raw_late == [FreeImages(0, r.req)]


def test_queue_full_is_overloaded_and_queued_requests_take_freed_slots_in_order():
    e = engine(slots=1, queue_depth=2)
    first, a1 = submit(e)
    queued = [submit(e)[0] for _ in range(2)]
    over, a4 = submit(e)
    assert of(a1, Dispatch) and ends(a4)[0].code is ErrorCode.OVERLOADED
    assert "limits.queue_depth" in ends(a4)[0].message
    actions = e.infer_done(InferDone(req=first.req, worker=0, ok=False, code=ErrorCode.INTERNAL, message="x"))
    assert [a.request for a in of(actions, Dispatch)] == [queued[0]]
    e.shutdown("stop")
    assert held(e) == NOTHING


@pytest.mark.parametrize("kind", [Kind.LOAD, Kind.UNLOAD, Kind.STATS])
def test_control_ops_are_their_workers_work(kind):
    e = engine(workers=2)
    r, actions = submit(e, kind, model="m" if kind is not Kind.STATS else None)
    targets = {a.worker for a in of(actions, SendWorker)}
    assert targets == ({0} if kind is Kind.LOAD else {0, 1})
    # A worker that dies meanwhile: a load waiting on it fails at once; unload and stats stop waiting.
    actions = e.process_event("gpu", 0, ProcState.RESTARTING, restarts=1)
    if kind is Kind.LOAD:
        assert ends(actions)[0].code is ErrorCode.UNAVAILABLE
    else:
        assert not ends(actions)
        answer = (StatsReport(req=r.req, worker=1, device="cpu", models={}, loaded=[], queue=0)
                  if kind is Kind.STATS else LoadDone(req=r.req, worker=1, model="m", ok=True))
        assert ends(e.control_done(answer)) == [Done(r)]
    assert held(e) == NOTHING


def test_stats_answers_with_what_came_after_its_gathering_deadline():
    e = engine(workers=2)
    r, _ = submit(e, Kind.STATS, model=None)
    e.control_done(StatsReport(req=r.req, worker=1, device="cpu", models={}, loaded=[], queue=0))
    assert e.tick(e.stats_timeout_s - 0.01) == []
    assert ends(e.tick(e.stats_timeout_s)) == [Done(r)] and r.waiting_on == {0}
    assert held(e) == NOTHING


def test_answers_a_request_was_not_waiting_for_are_not_taken_for_its_own():
    """A worker's answer for a request another worker runs, or a second answer, changes nothing: the
    stray InferDone only frees that worker's output slot, a StatsReport from a worker not asked (or twice)
    is not counted, and the request ends with its own workers' answers."""
    e = engine(workers=2)
    r, actions = submit(e, Kind.INFER)
    assert r.worker == 0
    assert e.infer_done(InferDone(req=r.req, worker=1, ok=True, output=None)) == [ReleaseOutput(1, r.req)]
    assert e.table.get(r.req) is r and not r.results
    assert ends(e.infer_done(InferDone(req=r.req, worker=0, ok=True, output=None))) == [Done(r)]
    stats, _ = submit(e, Kind.STATS, model=None)
    report = lambda w: StatsReport(req=stats.req, worker=w, device="cpu", models={}, loaded=[], queue=0)  # noqa: E731
    assert e.control_done(report(0)) == [] and e.control_done(report(0)) == []
    assert ends(e.control_done(report(1))) == [Done(stats)]
    assert sorted(a.worker for a in stats.results) == [0, 1]
    assert held(e) == NOTHING


def test_a_request_goes_to_the_worker_that_has_or_is_loading_its_model_else_the_least_busy():
    """frontend.routing affinity: the least busy worker (requests on it) when none has the model, ties
    to the first; the worker loading a model gets its next requests, though another is less busy (so a
    model is loaded once, not once per worker)."""
    e = engine(workers=2)   # both have `m`
    first, _ = submit(e, model="m")
    cold, actions = submit(e, model="cold")
    assert (first.worker, cold.worker) == (0, 1)
    assert [(a.worker, a.message.model) for a in of(actions, SendWorker)] == [(1, "cold")]
    e.infer_done(InferDone(req=first.req, worker=0, ok=True))   # worker 0 idle now, worker 1 loading `cold`
    again, actions = submit(e, model="cold")
    assert again.worker == 1 and not of(actions, SendWorker), "a second load of the model on another worker"
    other, _ = submit(e, model="m")
    assert other.worker == 0
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_room_goes_to_live_speech_due_soonest_then_to_each_client_by_its_frames_and_deadlines():
    """The order a worker's queue gets room in: live speech by due time, not arrival; then the clients, a
    client's requests by deadline, not arrival, each ranked by the frames its client has on the worker
    (in flight there, and queued before it): when room for two comes at once, the second goes to another
    client's request, not to the first one's client again."""
    from frontend.core.request import Inputs

    def speech(due: float) -> Request:
        r = Request(Kind.COMPOSITE, "m", 1, deadline=500.0, inputs=Inputs("m", 1, [0], b"", "windows", (4,), due=due))
        e.submit(r, now=0.0)
        return r

    e = engine(slots=1, queue_depth=16)
    running, _ = submit(e, conn="x", batch=1, deadline=10.0)
    late_speech, soon_speech = speech(300.0), speech(200.0)
    late, soon = (submit(e, conn="x", batch=1, deadline=d)[0] for d in (90.0, 60.0))
    order, last = [], running
    for _ in range(4):
        (d,) = of(e.infer_done(InferDone(req=last.req, worker=0, ok=True)), Dispatch)
        order.append(d.request)
        last = d.request
    assert order == [soon_speech, late_speech, soon, late]
    e.shutdown("stop")
    assert held(e) == NOTHING

    e = engine(slots=4, queue_depth=16)
    submit(e, conn="y")
    submit(e, conn="w")   # (in flight: room for two more)
    _, actions = submit(e, conn="x", model="cold", deadline=50.0)
    (load,) = of(actions, SendWorker)
    y_b = submit(e, conn="y", model="cold", deadline=55.0)[0]
    submit(e, conn="x", model="cold", deadline=60.0)
    x_a = next(r for r in e.workers[0].queue if r.deadline == 50.0)
    actions = e.control_done(LoadDone(req=load.message.req, worker=0, model="cold", ok=True))
    assert [a.request for a in of(actions, Dispatch)] == [x_a, y_b], [a.request.client for a in of(actions, Dispatch)]
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_a_cold_model_is_loaded_without_holding_a_slot_and_warm_requests_pass_it():
    e = engine(slots=1)
    cold, actions = submit(e, model="cold")
    (load,) = of(actions, SendWorker)
    assert isinstance(load.message, LoadModel) and load.message.model == "cold" and not of(actions, Dispatch)
    warm, actions = submit(e, model="m")
    assert [a.request for a in of(actions, Dispatch)] == [warm], "a warm request waits behind a cold load"
    e.infer_done(InferDone(req=warm.req, worker=0, ok=False, code=ErrorCode.INTERNAL, message="x"))
    actions = e.control_done(LoadDone(req=load.message.req, worker=0, model="cold", ok=True))
    assert [a.request for a in of(actions, Dispatch)] == [cold] and not ends(actions)
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_a_failed_cold_load_fails_the_requests_waiting_for_it():
    e = engine()
    waiting = [submit(e, model="broken")[0] for _ in range(2)]
    load = next(r for r in e.table if r.kind is Kind.WARM)
    actions = e.control_done(LoadDone(req=load.req, worker=0, model="broken", ok=False,
                                      code=ErrorCode.BAD_REQUEST, message="model broken: not ONNX"))
    assert sorted(f.request.req for f in ends(actions)) == sorted(r.req for r in waiting)
    assert all(f.code is ErrorCode.BAD_REQUEST and "not ONNX" in f.message for f in ends(actions))
    assert held(e) == NOTHING


def test_no_ready_worker_or_compositor_is_unavailable():
    e = Scheduler(["cpu"], 1, CountedRoom(1), 4)
    _, actions = submit(e)
    assert ends(actions)[0].code is ErrorCode.UNAVAILABLE and "worker 0 (cpu) is starting" in ends(actions)[0].message
    e.process_event("gpu", 0, ProcState.READY, pid=1)
    e.model_event(ModelEvent(worker=0, model="m", event=ModelEventKind.LOADED))
    _, actions = submit(e)
    assert ends(actions)[0].code is ErrorCode.UNAVAILABLE and "compositing" in ends(actions)[0].message
    assert held(e) == NOTHING


def test_messages_naming_unknown_workers_or_requests_are_ignored():
    e = engine()
    assert e.infer_done(InferDone(req=999, worker=7, ok=True)) == []
    assert e.control_done(LoadDone(req=999, worker=0, model="m", ok=True)) == []
    assert e.model_event(ModelEvent(worker=-1, model="m", event=ModelEventKind.LOADED)) == []
    assert e.process_event("gpu", 5, ProcState.READY) == []
    assert held(e) == NOTHING


def test_idle_renders_go_to_the_least_busy_compositor_and_end_like_any_request():
    e = engine(compositors=2)
    busy, _ = submit(e)   # a composite now holds both compositors
    r, actions = submit(e, Kind.RENDER, batch=3)
    (render,) = [a for a in actions if type(a).__name__ == "Render"]
    assert render.request is r
    done = e.composite_done(CompositeDone(req=r.req, compositor=render.compositor, start=0, end=3, ok=True,
                                          width=8, height=6), [b"x"] * 3)
    assert ends(done) == [Done(r)] and not of(done, ReleaseOutput)
    r2, actions = submit(e, Kind.RENDER, batch=1)
    c = [a for a in actions if type(a).__name__ == "Render"][0].compositor
    failed = ends(e.process_event("cpu", c, ProcState.RESTARTING, restarts=1))
    assert r2 in [f.request for f in failed] and all(f.code is ErrorCode.UNAVAILABLE for f in failed)
    e.shutdown("stop")
    assert held(e) == NOTHING


@pytest.mark.parametrize("state", [ProcState.UNREACHABLE, ProcState.STOPPED])
def test_a_gpu_host_that_goes_keeps_the_requests_whose_mouths_came_back(state):
    """An edge's GPU host lost, or shut down after its Goodbye: what was still on it is answered
    `unavailable` saying which; a request whose mouths came back first is composited as usual (the
    edge's RemoteWorker, and the output slot it wrote them into, live on)."""
    e = engine()
    back, actions = submit(e)
    (d,) = of(actions, Dispatch)
    e.infer_done(InferDone(req=back.req, worker=0, ok=True))   # compositing now
    still, _ = submit(e)
    actions = e.process_event("gpu", 0, state, pid=100)
    (fail,) = ends(actions)
    assert fail.request is still and fail.code == ErrorCode.UNAVAILABLE
    assert ("shutting down" if state is ProcState.STOPPED else "unreachable") in fail.message
    assert ReleaseOutput(0, back.req) not in actions
    for chunk in d.plan:
        actions = e.composite_done(CompositeDone(req=back.req, compositor=chunk.compositor, start=chunk.start,
                                                 end=chunk.end, ok=True, width=8, height=6), [b"x"] * 2)
    assert ends(actions) == [Done(back)] and ReleaseOutput(0, back.req) in actions
    assert held(e) == NOTHING


def test_readiness_in_every_state():
    from frontend.core.scheduler import CompositorState, WorkerState
    from frontend.probes import SERVING, readiness

    def worker(i, state, restarts=0, device="remote:tcp://gpu:5570"):
        return WorkerState(i, device, state=state, restarts=restarts)

    R, S, U, V = ProcState.READY, ProcState.STARTING, ProcState.UNREACHABLE, ProcState.VACANT
    ready_cpu = [CompositorState(state=R)]
    assert readiness([worker(0, S)], ready_cpu, synced=False, draining=False)[0] == "starting"
    assert readiness([worker(0, S), worker(1, V)], ready_cpu, True, False)[0] == "starting"
    assert readiness([worker(0, V)], ready_cpu, True, False) == ("starting", "no GPU host found yet")
    assert readiness([worker(0, R), worker(1, V)], ready_cpu, True, False) == ("ready", None), "vacant is not down"
    status, reason = readiness([worker(0, R), worker(1, U)], ready_cpu, True, False)
    assert status == "degraded" and "unreachable" in reason and status in SERVING
    status, reason = readiness([worker(0, S, restarts=1)], ready_cpu, True, False)
    assert status == "not ready" and status not in SERVING, "a restart is not a start"
    assert readiness([worker(0, R)], [CompositorState(state=ProcState.RESTARTING)], True, False)[0] == "not ready"
    assert readiness([worker(0, R)], ready_cpu, True, draining=True)[0] == "draining"


def test_round_robin_alternates_composite_requests_over_two_workers():
    e = engine(workers=2)
    e.routing = "round_robin"
    workers = []
    for _ in range(6):
        r = Request(Kind.COMPOSITE, "m", 1, deadline=1e9)
        e.submit(r, 0.0)
        workers.append(r.worker)
        e.fail(r.req, ErrorCode.TIMEOUT, "done with it")
    assert workers == [0, 1, 0, 1, 0, 1]


def test_backlogs_bound_each_connection_and_all_of_them_together():
    from types import SimpleNamespace

    from frontend.core.backlog import Backlogs
    mib = 1 << 20
    b = Backlogs(limit=4 * mib, total_limit=6 * mib)
    first = b.admit("c1", 3 * mib)
    assert first is not None and b.admit("c2", 3 * mib) is not None
    assert b.admit("c3", 1 * mib) is None, "an idle connection's reply past the bound over all is dropped"
    first[0] = SimpleNamespace(done=True)    # c1's reply has left the socket
    assert b.admit("c3", 2 * mib) is not None and b.total() == 5 * mib
    assert b.admit("c2", 2 * mib) is None, "past one connection's bound"
    b.closed("c2")
    assert b.total() == 2 * mib and b.admit("c4", 4 * mib) is not None
    assert Backlogs(limit=4 * mib, total_limit=1).admit("c", 8 * mib) is not None, "one reply always goes when none wait"


def test_h264_speech_goes_where_each_sessions_encoder_is_and_a_missing_one_gets_it_back():
    """An H.264 speech batch (`keep`): each session's frames go to the compositor of its encoder, which
    keeps their face boxes; frames of a compositor that is not ready go to another, boxes sent back."""
    e = engine(compositors=3)
    r = Request(Kind.COMPOSITE, "m", 5, deadline=100.0, conn="c1",
                keep=[("s1", 10, 2), ("s1", 11, 2), ("s2", 7, 0), ("s3", 4, 1), ("s3", 5, 1)])
    e.process_event("cpu", 1, ProcState.STARTING)   # s3's compositor restarts
    (d,) = of(e.submit(r, now=0.0), Dispatch)
    assert [(c.compositor, c.start, c.end, c.keep) for c in d.plan] == [
        (2, 0, 2, [("s1", 10), ("s1", 11)]), (0, 2, 3, [("s2", 7)]), (d.plan[2].compositor, 3, 5, None)]
    assert d.plan[2].compositor in (0, 2)
    e.infer_done(InferDone(req=r.req, worker=0, ok=True))
    for chunk in d.plan:
        actions = e.composite_done(CompositeDone(req=r.req, compositor=chunk.compositor, start=chunk.start,
                                                 end=chunk.end, ok=True, width=8, height=6),
                                   [b"" if chunk.keep else b"box"] * (chunk.end - chunk.start))
    assert ends(actions) == [Done(r)] and held(e) == NOTHING


def test_h264_speech_goes_to_the_least_busy_compositor_when_its_sessions_is_far_busier():
    """The boxes stay with the encoder only while that costs the batch little: a compositor more than
    KEEP_SLACK requests busier than the least busy (encodes queued there) gets no speech; it goes to
    the least busy, boxes sent back."""
    e = engine(compositors=2)
    renders = [e.submit(Request(Kind.RENDER, "m", 1, deadline=100.0, compositor=0), now=0.0)
               for _ in range(KEEP_SLACK + 1)]
    assert all(a.compositor == 0 for actions in renders for a in actions if type(a).__name__ == "Render")
    r = Request(Kind.COMPOSITE, "m", 2, deadline=100.0, conn="c1", keep=[("s0", 3, 0), ("s1", 9, 1)])
    (d,) = of(e.submit(r, now=0.0), Dispatch)
    assert [(c.compositor, c.start, c.end, c.keep) for c in d.plan] == [(1, 0, 1, None), (1, 1, 2, [("s1", 9)])]


def test_requests_hold_the_input_room_their_inputs_take_and_the_most_urgent_waits_first(shm_name):
    """With the shell's rings (room = the slots a request's inputs take), one-frame requests fill the room
    of a large one, and a request that does not fit holds back the less urgent ones behind it."""
    import numpy as np

    from config.geometry import MOUTH_BYTES, VISUAL_BYTES
    from frontend.core.request import Inputs
    from frontend.core.slots import RingRoom
    from shm.ring import RingSpec, SlotRing

    ring = SlotRing.create(RingSpec.in_pages(shm_name, 1, 4 * VISUAL_BYTES + 4096, VISUAL_BYTES))
    ring.become_writer()
    try:
        e = Scheduler(["cpu0"], 1, RingRoom([ring], [RingSpec("out", 16, MOUTH_BYTES)]), 16)
        e.process_event("gpu", 0, ProcState.READY, pid=100)
        e.model_event(ModelEvent(worker=0, model="m", event=ModelEventKind.LOADED))
        e.process_event("cpu", 0, ProcState.READY, pid=200)

        def request(batch: int, visual: bool, deadline: float) -> Request:
            audio = np.zeros((batch, 4), np.float32).tobytes()
            inputs = Inputs("m", 1, list(range(batch)), audio, "windows", (4,),
                            visual=b"\0" * (batch * VISUAL_BYTES) if visual else None)
            return Request(Kind.INFER, "m", batch, deadline=deadline, conn="c1", inputs=inputs)

        small = [request(2, False, 10.0 + i) for i in range(5)]   # no visual input: one slot each
        dispatched = [a.request for r in small for a in of(e.submit(r, now=0.0), Dispatch)]
        assert dispatched == small and ring.slots_in_use() == 5, "five requests in the room of one of 4 frames"
        big = request(4, True, 20.0)      # needs every slot: waits
        later = request(1, False, 30.0)   # would fit, but is less urgent than the big one
        assert not of(e.submit(big, now=0.0), Dispatch) and not of(e.submit(later, now=0.0), Dispatch)
        for r in small[:4]:
            assert not of(e.infer_done(InferDone(req=r.req, worker=0, ok=True)), Dispatch)
        actions = e.infer_done(InferDone(req=small[4].req, worker=0, ok=True))
        assert [a.request for a in of(actions, Dispatch)] == [big] and ring.held(big.req) == 0
        assert [a.request for a in of(e.infer_done(InferDone(req=big.req, worker=0, ok=True)), Dispatch)] == [later]

        # Frames in flight are bounded too (the output ring's): small inputs do not let a burst past it.
        room = RingRoom([ring], [RingSpec("out", 3, MOUTH_BYTES)])   # an output ring of 3 frames
        room.reset(0)
        first, second = request(2, False, 1.0), request(2, False, 2.0)
        first.req, second.req = 101, 102
        assert room.take(0, first) and not room.take(0, second)
        room.free(0, first.req)
        assert room.take(0, second) and ring.slots_in_use() == 1
    finally:
        ring.close(unlink=True)


def test_an_unpin_says_whose_pin_it_releases():
    """A live session closing releases its own process's pin (the worker keeps one list of pins per
    model from every client-facing process): the unpin carries the engine's first id, owner bits and all."""
    from shm.requests import first_id, owner_of
    e = Scheduler(["cpu0"], 1, CountedRoom(2), 4, first_id=first_id(3, 1000))
    e.process_event("gpu", 0, ProcState.READY)
    (send,) = e.unpin(0, "m")
    assert isinstance(send.message, LoadModel) and send.message.pin == -1 and owner_of(send.message.req) == 3


def test_a_request_waiting_for_a_cold_load_is_answered_once_at_shutdown():
    """Shutdown ends the engine's own load of a cold model, which fails the requests waiting for it; the
    shutdown must not then answer those requests a second time: every client gets exactly one reply."""
    e = engine()
    waiting = [submit(e, model="cold")[0] for _ in range(2)]
    assert any(r.kind is Kind.WARM for r in e.table)
    actions = e.shutdown("stopping")
    assert sorted(f.request.req for f in ends(actions)) == sorted(r.req for r in waiting)
    assert all(f.code is ErrorCode.UNAVAILABLE for f in ends(actions))
    assert held(e) == NOTHING


def test_raw_frames_are_freed_when_a_composite_fails_and_left_to_the_shell_when_it_succeeds():
    """Raw frames held in a compositor's image ring: a request that fails after some chunks came back
    frees them at once (else the image ring fills up); one that succeeds leaves them to the shell, which
    frees them once the reply's bytes have left (freeing them first would send overwritten frames)."""
    e = engine(slots=2)
    ok, actions = submit(e)
    (d,) = of(actions, Dispatch)
    e.infer_done(InferDone(req=ok.req, worker=0, ok=True))
    for chunk in d.plan:
        actions = e.composite_done(CompositeDone(req=ok.req, compositor=chunk.compositor, start=chunk.start,
                                                 end=chunk.end, ok=True, width=8, height=6, images=object()),
                                   [b"x"] * (chunk.end - chunk.start))
    assert ends(actions) == [Done(ok)] and not of(actions, FreeImages)
    assert ok.image_slots == {c.compositor for c in d.plan}, "the shell frees them once sent"

    bad, actions = submit(e)
    (d,) = of(actions, Dispatch)
    e.infer_done(InferDone(req=bad.req, worker=0, ok=True))
    first, second = d.plan
    assert not ends(e.composite_done(CompositeDone(req=bad.req, compositor=first.compositor, start=first.start,
                                                   end=first.end, ok=True, width=8, height=6, images=object()),
                                     [b"x"] * (first.end - first.start)))
    actions = e.composite_done(CompositeDone(req=bad.req, compositor=second.compositor, start=second.start,
                                             end=second.end, ok=False, code=ErrorCode.INTERNAL, message="x"), [])
    assert [f.request for f in ends(actions)] == [bad] and of(actions, FreeImages) == [FreeImages(first.compositor, bad.req)]
    assert held(e) == NOTHING


@pytest.mark.parametrize("lost", ["evicted", "restarted"])
def test_a_model_a_worker_lost_is_loaded_again_before_its_requests_are_dispatched(lost):
    """A worker that evicted a model, or restarted (a new process holds no model), must load it again
    before a request for it is dispatched there, never be sent work for a model it does not hold."""
    e = engine()
    if lost == "evicted":
        e.model_event(ModelEvent(worker=0, model="m", event=ModelEventKind.EVICTED))
    else:
        e.process_event("gpu", 0, ProcState.RESTARTING, restarts=1)
        e.process_event("gpu", 0, ProcState.READY, pid=101, restarts=1)
    r, actions = submit(e)
    (load,) = of(actions, SendWorker)
    assert not of(actions, Dispatch) and isinstance(load.message, LoadModel) and load.message.model == "m"
    actions = e.control_done(LoadDone(req=load.message.req, worker=0, model="m", ok=True))
    assert [a.request for a in of(actions, Dispatch)] == [r]
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_live_speech_due_soonest_is_dispatched_before_batch_work_queued_earlier():
    """A live session's speech (Inputs.due: when its first frame must go out) takes the next free room
    before batch work queued ahead of it, even when the batch work's deadline is earlier than the
    speech request's: else the session's frames go out late."""
    from frontend.core.request import Inputs
    e = engine(slots=1)
    running, _ = submit(e, Kind.INFER)
    batch, _ = submit(e, deadline=50.0)
    speech = Request(Kind.COMPOSITE, "m", 4, deadline=100.0, conn="c2",
                     inputs=Inputs("m", 1, [0] * 4, b"", "windows", (4,), due=5.0))
    assert not of(e.submit(speech, now=0.0), Dispatch)
    actions = e.infer_done(InferDone(req=running.req, worker=0, ok=True))
    assert [a.request for a in of(actions, Dispatch)] == [speech]
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_a_clients_flood_fills_only_its_own_queue_and_live_speech_is_always_taken():
    """limits.queue_depth bounds the requests of clients: a queue full of them refuses the next client
    request `overloaded`, and a live session's speech is still taken (and dispatched first), since
    refused it is a frame missed for sure; the speech queued counts against no client's place."""
    from frontend.core.request import Inputs

    def speech(due: float) -> Request:
        return Request(Kind.COMPOSITE, "m", 2, deadline=due + 1, inputs=Inputs("m", 1, [0] * 2, b"", "windows",
                                                                                  (4,), due=due))
    e = engine(slots=1, queue_depth=2)
    running, _ = submit(e)
    for _ in range(2):
        submit(e, conn="flood")
    refused, actions = submit(e, conn="flood")
    assert ends(actions)[0].code is ErrorCode.OVERLOADED
    live = [speech(5.0 + i) for i in range(3)]
    for r in live:
        assert not ends(e.submit(r, now=0.0)), "live speech refused by a queue full of client requests"
    _, actions = submit(e, conn="flood")
    assert ends(actions)[0].code is ErrorCode.OVERLOADED and "has 2 requests queued" in ends(actions)[0].message
    done = e.infer_done(InferDone(req=running.req, worker=0, ok=True))
    assert [a.request for a in of(done, Dispatch)] == [live[0]]
    # with only speech queued, a client's request still finds its place
    e2 = engine(slots=1, queue_depth=2)
    submit(e2)
    for r in [speech(5.0 + i) for i in range(3)]:
        e2.submit(r, now=0.0)
    assert not ends(submit(e2)[1]), "speech queued took a client's place"
    for engine_ in (e, e2):
        engine_.shutdown("stop")
        assert held(engine_) == NOTHING


def test_a_full_queue_refuses_the_client_holding_most_of_it_not_the_newcomer():
    """A client keeping the queue full must not keep another's requests out: the newcomer of another
    client takes the place of the flooding client's newest request (answered `overloaded`, saying why);
    the flooding client's own next request is refused; once both hold as much, either's next is theirs
    to lose."""
    e = engine(slots=1, queue_depth=4)
    submit(e, conn="flood")   # running
    flood = [submit(e, conn="flood")[0] for _ in range(4)]
    other, actions = submit(e, conn="other")
    (out,) = ends(actions)
    assert out.request is flood[-1] and out.code is ErrorCode.OVERLOADED
    assert "pushed out" in out.message and "4 of its 4" in out.message and "limits.queue_depth" in out.message
    _, actions = submit(e, conn="flood")
    assert ends(actions)[0].code is ErrorCode.OVERLOADED and "3 of them yours" in ends(actions)[0].message
    second, actions = submit(e, conn="other")
    assert [a.request for a in ends(actions)] == [flood[-2]]
    _, actions = submit(e, conn="other")   # 2 and 2: the newcomer's own client holds as much as any
    assert ends(actions)[0].code is ErrorCode.OVERLOADED and "2 of them yours" in ends(actions)[0].message
    assert [r for r in e.workers[0].queue] == [flood[0], flood[1], other, second]
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_a_tenant_is_numbered_the_same_by_every_client_facing_process_a_connection_by_its_own():
    """The number a worker shares its steps by (InferTask.client): a tenant's is its own in each engine
    (so a tenant connected through several processes is one client at the worker), a connection's is
    its engine's count."""
    from shm.requests import tenant_client
    engines = [engine(), engine()]
    for e in engines:
        submit(e, conn="c0")
        (tenant, _), (conn, _) = submit(e, conn=tenant_client("acme")), submit(e, conn="c1")
        assert tenant.client_no == tenant_client("acme") and conn.client_no == 2, (tenant.client_no, conn.client_no)
        e.shutdown("stop")
        assert held(e) == NOTHING


def test_a_client_holds_half_the_room_and_one_with_many_requests_out_waits_behind_anothers_one():
    """A client's requests hold at most half of a worker's room (unless it holds none), so another
    client's request finds room at once; and room goes first to the client with the fewest frames on
    the worker (in flight there, and queued before): a client that sent ten requests at once has the
    next free room after another client's request, not before; live speech still goes first."""
    from frontend.core.request import Inputs
    e = engine(slots=4, queue_depth=16)
    flood = [submit(e, conn="flood", deadline=50.0 + i)[0] for i in range(10)]
    assert sum(r.dispatched for r in flood) == 2, "a client took more than half of the room"
    other, actions = submit(e, conn="other", deadline=99.0)   # due after every one of the flood's
    assert [a.request for a in of(actions, Dispatch)] == [other], "another client's request found no room"
    third, _ = submit(e, conn="third", deadline=99.0)
    again, actions = submit(e, conn="other", deadline=99.5)   # the room is full now
    assert third.dispatched and not of(actions, Dispatch)
    done = e.infer_done(InferDone(req=third.req, worker=0, ok=True))
    assert [a.request for a in of(done, Dispatch)] == [again], "the flood's next request passed the other's"
    speech = Request(Kind.COMPOSITE, "m", 2, deadline=200.0, inputs=Inputs("m", 1, [0] * 2, b"", "windows", (4,),
                                                                            due=150.0))
    e.submit(speech, now=0.0)
    done = e.infer_done(InferDone(req=flood[0].req, worker=0, ok=True))
    assert [a.request for a in of(done, Dispatch)] == [speech]
    # the other client holds its share (two requests), the flood one: the flood's next
    done = e.infer_done(InferDone(req=speech.req, worker=0, ok=True))
    assert [a.request for a in of(done, Dispatch)] == [flood[2]]
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_while_live_sessions_are_open_clients_requests_leave_half_of_the_room_to_their_speech():
    """A client's requests on a slow model hold their room for seconds: with every bit of it theirs, a
    live session's speech waited behind them past its due time. While live sessions are open, clients'
    requests take at most half of a worker's room; with none open, all of it."""
    from frontend.core.request import Inputs
    sessions = [1]
    e = Scheduler(["cpu0"], 2, CountedRoom(4), 16, live_sessions=lambda: sessions[0])
    e.process_event("gpu", 0, ProcState.READY, pid=100)
    e.model_event(ModelEvent(worker=0, model="m", event=ModelEventKind.LOADED))
    for i in range(2):
        e.process_event("cpu", i, ProcState.READY, pid=200 + i)
    dispatched = [bool(of(submit(e, conn=f"c{i}")[1], Dispatch)) for i in range(3)]
    assert dispatched == [True, True, False], "clients took the live sessions' half"
    speech = Request(Kind.COMPOSITE, "m", 2, deadline=10.0, inputs=Inputs("m", 1, [0] * 2, b"", "windows", (4,),
                                                                           due=5.0))
    assert of(e.submit(speech, now=0.0), Dispatch), "speech found no room"
    sessions[0] = 0   # the sessions closed: clients may have it all
    done = e.infer_done(InferDone(req=speech.req, worker=0, ok=True))
    assert len(of(done, Dispatch)) == 1
    e.shutdown("stop")
    assert held(e) == NOTHING


def test_the_next_deadline_is_the_earliest_of_the_live_requests():
    """The shell arms its one timer at `next_deadline`: it must be the earliest deadline of a request
    still live (a later one would let a request's timeout pass unanswered), and an ended request's
    deadline no longer counts."""
    e = engine(slots=4)
    late, _ = submit(e, deadline=50.0)
    soon, _ = submit(e, deadline=5.0)
    later, _ = submit(e, deadline=80.0)
    assert e.next_deadline() == 5.0
    e.fail(soon.req, ErrorCode.INTERNAL, "x")
    assert e.next_deadline() == 50.0
    assert [f.request for f in ends(e.tick(50.0))] == [late] and e.next_deadline() == 80.0
    e.shutdown("stop")
    assert e.next_deadline() is None and held(e) == NOTHING


def test_a_shell_that_cannot_dispatch_or_build_a_reply_still_answers_once_and_frees_the_frames():
    """Carrying out an action can fail (writing the inputs, building the reply): the client still gets
    exactly one `internal` error naming it, and the request's slots and raw frames are freed."""
    from frontend.core.shell import Shell

    class Work:
        def __init__(self):
            self.failed_with = []

        def done(self, r):
            raise RuntimeError("encoding the reply failed")

        def failed(self, r, code, message):
            self.failed_with.append((code, message))

    class Sock:
        def __init__(self):
            self.sent = []

        def send(self, data):
            self.sent.append(data)

    class RecordingShell(Shell):
        broken_dispatch, freed = True, None

        def dispatch(self, action):
            if self.broken_dispatch:
                raise ValueError("input ring full")

        def free_images(self, req, compositors):
            self.freed = (self.freed or []) + [(req, sorted(compositors))]

    e = engine()
    shell = RecordingShell(e, [Sock()], [], shutdown_timeout_s=5.0)
    r = Request(Kind.COMPOSITE, "m", 4, deadline=100.0, conn="c1", work=Work())
    shell.apply(e.submit(r, now=0.0))
    assert r.work.failed_with == [(ErrorCode.INTERNAL, "ValueError: input ring full")]
    assert held(e) == NOTHING and len(shell.to_gpu[0].sent) == 1   # its output slot released

    shell.broken_dispatch = False
    r = Request(Kind.COMPOSITE, "m", 4, deadline=100.0, conn="c1", work=Work())
    actions = e.submit(r, now=0.0)
    (d,) = of(actions, Dispatch)
    shell.apply(actions)
    shell.apply(e.infer_done(InferDone(req=r.req, worker=0, ok=True)))
    for chunk in d.plan:
        shell.apply(e.composite_done(CompositeDone(req=r.req, compositor=chunk.compositor, start=chunk.start,
                                                   end=chunk.end, ok=True, images=object()), [b"x"] * 2))
    (failed,) = r.work.failed_with
    assert failed[0] is ErrorCode.INTERNAL and "building the reply failed" in failed[1]
    assert shell.freed == [(r.req, sorted(c.compositor for c in d.plan))] and held(e) == NOTHING


def test_a_connections_backlog_counts_its_unsent_replies_until_they_leave():
    """A reply counts toward its connection's bound until libzmq has let go of it: one still queued keeps
    the next one out; once it has left, the connection gets replies again (never shut out for good)."""
    from types import SimpleNamespace

    from frontend.core.backlog import Backlogs
    mib = 1 << 20
    b = Backlogs(limit=4 * mib)
    first = b.admit("c", 3 * mib)
    first[0] = SimpleNamespace(done=False)   # the send's tracker: still queued for the client
    assert b.admit("c", 2 * mib) is None and b.queued("c") == 3 * mib
    first[0].done = True
    second = b.admit("c", 2 * mib)
    assert second is not None and b.queued("c") == 2 * mib
    second[0] = SimpleNamespace(done=True)
    assert b.admit("c", 4 * mib) is not None and b.total() == 4 * mib


def test_an_input_room_never_strands_a_worker(shm_name):
    """The input room never holds a worker's requests back for good: a batch larger than the frames in
    flight it allows goes when the worker is idle; inputs larger than the whole ring are let through
    (writing them fails, naming shm.slots) instead of waiting forever; a restarted worker's room is all free."""
    import numpy as np

    from config.geometry import MOUTH_BYTES, VISUAL_BYTES
    from frontend.core.request import Inputs
    from frontend.core.slots import RingRoom
    from shm.ring import RingSpec, SlotRing

    ring = SlotRing.create(RingSpec.in_pages(shm_name, 1, 4 * VISUAL_BYTES + 4096, VISUAL_BYTES))
    ring.become_writer()

    def request(req: int, batch: int, visual: bool = False) -> Request:
        inputs = Inputs("m", 1, list(range(batch)), np.zeros((batch, 4), np.float32).tobytes(), "windows", (4,),
                        visual=b"\0" * (batch * VISUAL_BYTES) if visual else None)
        r = Request(Kind.INFER, "m", batch, inputs=inputs)
        r.req = req
        return r

    try:
        room = RingRoom([ring], [RingSpec("out", 3, MOUTH_BYTES)])   # 3 frames in flight
        assert room.take(0, request(1, 5)), "an idle worker takes a batch past the in-flight bound"
        room.free(0, 1)
        huge = request(2, 6, visual=True)
        assert ring.slots_for(huge.inputs.nbytes(huge.batch)) > ring.spec.n_slots
        assert room.take(0, huge) and ring.held(huge.req) is None, "let through, to fail with a message"
        room.free(0, huge.req)
        assert room.take(0, request(3, 2))
        room.reset(0)   # the worker died: a new one reads none of it
        assert room.take(0, request(4, 2)) and room.take(0, request(5, 1)), "its room is all free again"
        room.reset(0)
        # a reserve (live sessions open) leaves half of the frames in flight: 8 -> 4
        room = RingRoom([ring], [RingSpec("out", 8, MOUTH_BYTES)])
        assert room.take(0, request(6, 2), reserve=True) and not room.take(0, request(7, 3), reserve=True)
        assert room.take(0, request(8, 2), reserve=True) and room.take(0, request(9, 4)), "speech takes the rest"
        room.reset(0)
        # a client's share: half of what clients may hold (8 frames; 4 with the reserve), or one request
        mine = [request(10, 3)]
        assert room.take(0, mine[0])
        assert not room.share_full(0, request(11, 1), mine) and room.share_full(0, request(12, 2), mine)
        assert room.share_full(0, request(13, 1), mine, reserve=True)
        assert not room.share_full(0, request(14, 8), []), "a client holding nothing may take any request"
    finally:
        ring.close(unlink=True)


@pytest.mark.parametrize("code", [ErrorCode.BAD_REQUEST, ErrorCode.TIMEOUT, ErrorCode.OVERLOADED])
def test_a_workers_error_reaches_the_client_with_its_own_code(code):
    """A worker that fails a request says why (its inputs did not fit: bad_request; its deadline passed
    in the queue: timeout): the client gets that code and message, not a generic internal error."""
    e = engine()
    r, _ = submit(e)
    actions = e.infer_done(InferDone(req=r.req, worker=0, ok=False, code=code, message="why"))
    assert ends(actions) == [Fail(r, code, "why")]
    assert held(e) == NOTHING


def test_a_load_with_no_ready_worker_is_unavailable():
    """Every inference worker down (restarting): a `load` gets unavailable (retry later), not overloaded."""
    e = Scheduler(["cpu0"], 1, CountedRoom(2), 4)
    r = Request(Kind.LOAD, "m", 0, deadline=100.0, conn="c1")
    (fail,) = ends(e.submit(r, now=0.0))
    assert isinstance(fail, Fail) and fail.code is ErrorCode.UNAVAILABLE
    assert held(e) == NOTHING


def test_a_failed_load_leaves_the_model_unloaded_so_the_next_request_loads_it_again():
    """A worker that could not load a model (its file bad, no memory) does not hold it: the engine does
    not count it loaded there, so the next request for it asks for a load again rather than an inference
    of a model the worker lacks."""
    e = engine()
    load = Request(Kind.LOAD, "cold", 0, deadline=100.0, conn="c1")
    (send,) = of(e.submit(load, now=0.0), SendWorker)
    actions = e.control_done(LoadDone(req=load.req, worker=0, model="cold", ok=False, code=ErrorCode.OVERLOADED,
                                      message="no memory"))
    assert [a.code for a in ends(actions)] == [ErrorCode.OVERLOADED]
    assert "cold" not in e.workers[0].models
    r, actions = submit(e, model="cold")
    assert not of(actions, Dispatch) and [type(a.message) for a in of(actions, SendWorker)] == [LoadModel]


def test_a_composites_inference_done_lets_the_next_queued_request_onto_the_worker():
    """One input slot: the second request waits in the worker's queue; once the first's inference is done
    (its compositing still running), the second is dispatched at once, not after that compositing."""
    e = engine(slots=1)
    first, _ = submit(e)
    second, actions = submit(e, conn="c2")
    assert not of(actions, Dispatch), "no room for a second"
    actions = e.infer_done(InferDone(req=first.req, worker=0, ok=True))
    assert [d.request for d in of(actions, Dispatch)] == [second]


@pytest.mark.parametrize("kind", [Kind.UNLOAD, Kind.STATS])
def test_unload_and_stats_ask_only_the_ready_workers_and_end_when_they_answered(kind):
    """Two workers, one restarting: `unload` and `stats` go to the ready one only and end as soon as it
    answers, not at their deadline waiting on a worker that will never answer."""
    e = engine(workers=2)
    e.process_event("gpu", 1, ProcState.RESTARTING)
    r = Request(kind, "m" if kind is Kind.UNLOAD else None, 0, deadline=100.0, conn="c1")
    sends = of(e.submit(r, now=0.0), SendWorker)
    assert [s.worker for s in sends] == [0]
    answer = (LoadDone(req=r.req, worker=0, model="m", ok=True) if kind is Kind.UNLOAD
              else StatsReport(req=r.req, worker=0, device="cpu", models={}, loaded=[], queue=0))
    assert ends(e.control_done(answer)) == [Done(r)]
    assert held(e) == NOTHING


def test_a_render_pinned_to_a_compositor_that_is_down_fails_rather_than_moving():
    """An H.264 session's encoder lives in one compositing process: a render pinned there while it
    restarts fails (the session re-renders once it is back) instead of going to another process that
    has no such encoder."""
    e = engine(compositors=2)
    e.process_event("cpu", 1, ProcState.RESTARTING)
    r = Request(Kind.RENDER, "m", 1, deadline=100.0, conn=None)
    r.compositor = 1
    (fail,) = ends(e.submit(r, now=0.0))
    assert isinstance(fail, Fail) and fail.code is ErrorCode.UNAVAILABLE
    assert not of(e.submit(Request(Kind.RENDER, "m", 1, deadline=100.0, conn=None), now=0.0), Fail)
