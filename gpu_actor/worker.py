"""The inference worker process: take a batch handle, run the model, write the mouths into a shm slot
of this worker's output ring, and hand the slot on (to the compositing pool, or to the frontend for
`infer`).

Loop: one poll point over the task socket (tasks and control) and the wake socket (a load done, a step
back from the device thread). Tasks whose model is loading, or whose avatar's frames are being decoded
(gpu_actor/backgrounds.py), wait aside; every other task keeps running meanwhile.

Steps: the main thread picks a step's tasks and prepares them (output slots, inputs: `_prepare`); one
device thread runs it (gpu_actor/step.py); while it runs, the main thread prepares the next one, and
answers and hands on the last one's tasks once it is back. So the device runs step after step, the host's
work between them hidden behind its calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import numpy as np
import zmq

from config import Config
from config.assets import AssetCache, AssetError, model_paths
from config.geometry import MOUTH_SHAPE, VISUAL_SHAPE
from gpu_actor.backgrounds import Backgrounds
from gpu_actor.device import make_device
from gpu_actor.encoder import AudioEncoders
from gpu_actor.handoff import acquire_slot, hand_off, mouth_slots, route
from gpu_actor.registry import Registry
from gpu_actor.step import Job, WorkerStep, run_step
from gpu_actor.turns import Turns
from gpu_actor.visual import VisualFrames
from shm.child import CannotServe, child_main
from shm.codes import ErrorCode
from shm.endpoints import Owners, RunSpec, make_socket
from shm.messages import (InferDone, InferTask, LoadDone, LoadModel, ModelEvent, ReleaseTask,
                          ResetRequests, StatsQuery, StatsReport, StepDone, UnloadModel, pack, unpack)
from shm.requests import Floors, same_owner_below
from shm.ring import RingError, SlotRing, SlotRings, StaleHandle
from shm.store import BackgroundStore, StoreError

log = logging.getLogger(__name__)
IDLE_TICK_MS = 1000
STEPS_TIMED = 9   # the recent steps whose median is a step's expected time (one stall does not move it)
# How long one task may hold the device in a step: a larger one runs over several steps, so that a more
# urgent task (a live session's speech) waits at most about this long. A client's 8 frames of unet328 on
# the CPU provider held it 1.2 s in one step, and a live session beside them missed its speech.
STEP_QUANTUM_S = 0.040


class InferenceWorker:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int):
        self.config, self.run_spec, self.index = config, run, index
        self.device = run.devices[index]
        device = make_device(self.device)   # NOTE: first: a GPU's waits are set to block before its context exists
        device.check()
        if config.inference.precision not in device.precisions:
            raise CannotServe(f"inference.precision: {config.inference.precision} needs a GPU worker (inference.devices); "
                              f"{device.name} runs {', '.join(device.precisions)}: set inference.precision: fp32")
        ep = run.endpoints
        self.tasks = make_socket(ctx, zmq.PULL, bind=ep.gpu[index])
        self.to_frontend = Owners(ctx, ep.frontend)
        self.to_cpu = [make_socket(ctx, zmq.PUSH, connect=addr) for addr in ep.cpu]
        wake_addr = f"inproc://gpu{index}-wake"
        self._wake_rx = make_socket(ctx, zmq.PULL, bind=wake_addr)
        self._wake_tx = make_socket(ctx, zmq.PUSH, connect=wake_addr)
        self.inputs = SlotRings(run.inputs_to(index))   # one per client-facing process
        self.outputs = SlotRing.attach(run.output_rings[index])
        self.outputs.become_writer()
        self.store = BackgroundStore.attach(run.store)
        inf = config.inference
        # NOTE: a finished load wakes the loop from the load thread, or from this one when the load
        # failed before its callback was attached: the lock keeps the socket to one thread at a time.
        self._wake_lock = threading.Lock()
        self.backgrounds = Backgrounds(run.store, self.store, self._wake)
        for ring in (*self.inputs, self.outputs):   # copies to and from the slots at the bus's speed
            device.pin(ring.data())
        self.registry = Registry(device, inf, config.limits.max_batch, self._onnx_path, self._model_event, self._wake,
                                 companions=self._load_encoder)
        self.queue: deque[InferTask] = deque()
        self.turns = Turns()                      # whose task a step takes next
        self.pending_loads: dict[str, list[int]] = {}   # model -> LoadModel request ids
        self.assets = AssetCache(config)
        self.encoders = AudioEncoders(device, config.limits.max_batch, inf.intra_op_threads, inf.spin_threads)
        max_batch = config.limits.max_batch
        self._visual = np.empty((max_batch, *VISUAL_SHAPE), np.float32)  # audio-only inputs are built here
        # each architecture's last steps: their seconds, start to end, and rows (a slow model's steps say
        # nothing of how long another's take: weighed by them, a small model's every task looked doomed)
        self._timed: dict[object, deque[tuple[float, int]]] = {}
        self._partial: dict[int, Job] = {}   # tasks part run (request id -> its Job), queued for their next part
        # NOTE: one thread makes every device call of a step (the encoder's too: onnxruntime keeps a CUDA
        # graph per thread, and a capture meets no other call of this worker's); it touches no socket
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix=f"lsync-gpu{index}-device",
                                                 initializer=device.bind_thread)
        self._flight: Optional[tuple[WorkerStep, Future]] = None   # the step the device thread runs
        self._flight_started = 0.0
        self._next: Optional[WorkerStep] = None   # the step prepared to run after it
        self._blocked = False   # no output slot was free for the next step: wait for a message
        # requests whose jobs hold output slots the device thread may write (prepared or running, not yet
        # answered), and those of them the frontend ended meanwhile: their slots are freed as they fail
        self._on_device: set[int] = set()
        self._ended: set[int] = set()
        self._floors = Floors()   # a dead frontend's request ids (ResetRequests): never answered
        # stats: the steps run, those prepared while another ran, the seconds the device thread ran them
        # and those put back for a more urgent task of another architecture (`_start`)
        self._steps = {"steps": 0, "prepared_during_a_step": 0, "device_busy_s": 0.0, "put_back": 0}
        self._stopping = False
        self._handlers = {InferTask: self._infer_task, ReleaseTask: self._release,
                          LoadModel: self._load_op, UnloadModel: self._unload_op, StatsQuery: self._stats,
                          ResetRequests: self._reset}
        self.poller = zmq.Poller()
        self.poller.register(self.tasks, zmq.POLLIN)
        self.poller.register(self._wake_rx, zmq.POLLIN)
        for model in inf.preload:
            self.registry.start_load(model)

    # -- plumbing ---------------------------------------------------------------------------------

    def _onnx_path(self, model: str) -> Optional[Path]:
        paths = model_paths(self.config, model)
        return paths.onnx if paths else None

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:   # (closed: the worker is closing; a load ending now wakes no one)
                self._wake_tx.send(b"")

    def _model_event(self, model: str, event: str, load_ms: float, nbytes: int, frames_per_s: float) -> None:
        self.to_frontend.broadcast(pack(ModelEvent(worker=self.index, model=model, event=event, load_ms=load_ms,
                                              nbytes=nbytes, frames_per_s=frames_per_s)))

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self._device_thread.shutdown(wait=True)   # NOTE: a step in flight ends before its sessions close
        with self._wake_lock:   # a load may still end on the load thread (the registry does not wait for it)
            self._wake_tx.close(linger=0)
        self.registry.close()
        self.registry.device.unpin_all()   # NOTE: before the rings unmap what it pinned
        for ring in (*self.inputs, self.outputs):
            ring.close()
        self.backgrounds.close()
        self.store.close()

    # -- loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        next_tick = time.monotonic() + IDLE_TICK_MS / 1000
        while not self._stopping:
            self._drain(self.poller.poll(self._timeout()))
            self._blocked = False
            self._advance()
            if time.monotonic() >= next_tick:
                self.registry.unload_idle(time.monotonic())
                self._expire_waiting()
                next_tick = time.monotonic() + IDLE_TICK_MS / 1000

    def _timeout(self) -> int:
        """The loop's poll: none while there is work for this thread now (a step to prepare or start, one
        back to answer), else until a message or a wake (a load done, the device thread's step back)."""
        if self._flight is not None and (self._flight[1].done() or self._flight[0].answered < len(self._flight[0].ran)):
            return 0
        if self._next is None and not self._blocked and self._runnable() is not None:
            return 0
        # (a step prepared while the device thread is free never waits here: `_advance` started it)
        return IDLE_TICK_MS

    def _drain(self, events) -> None:
        ready = dict(events)
        if ready.get(self._wake_rx):
            while self._wake_rx.poll(0):
                self._wake_rx.recv()
        self._finish_loads()
        while self.tasks.poll(0):
            self._handle(unpack(self.tasks.recv()))

    def _runnable(self) -> Optional[InferTask]:
        return next((t for t in self.queue if self._ready(t)), None)

    def _ready(self, task: InferTask) -> bool:
        """A task runs once its model is loaded and, audio-only, its frames' crops are in the store (the
        missing ones are decoded meanwhile, off this thread: gpu_actor/backgrounds.py)."""
        if task.model not in self.registry.loaded:
            return False
        if task.visual is not None:
            return True
        try:
            assets = self.assets.get(task.model, task.version)
            assets.check_frames(task.frames)
        except AssetError:
            return True   # answered with the error as it runs
        return self.backgrounds.ready(assets, task.frames)

    def _handle(self, msg) -> None:
        route(self._handlers, msg, f"inference worker {self.index}")

    def _infer_task(self, msg: InferTask) -> None:
        if self._floors.gone(msg.req):   # a dead frontend's, read after the reset
            return
        self.registry.queued(msg.model)
        self.queue.append(msg)
        if msg.model not in self.registry.loaded and not self.registry.start_load(msg.model):
            self._fail_model(msg.model, "unknown_model", f"unknown model {msg.model!r}: no such entry in "
                             "`models` and no such directory in `models_dir`")

    def _unload_op(self, msg: UnloadModel) -> None:
        ok = self.registry.unload(msg.model)
        self.to_frontend.send(msg.req, pack(LoadDone(
            req=msg.req, worker=self.index, model=msg.model, ok=ok, code=None if ok else ErrorCode.OVERLOADED,
            message="" if ok else f"model {msg.model} has work queued or running; retry when it is idle")))

    def _release(self, msg: ReleaseTask) -> None:
        """The frontend is done with a request: its output slots freed, unless a step holds them (prepared
        or running): the device thread may still write them, so they are freed as that job fails."""
        if msg.req in self._on_device:
            self._ended.add(msg.req)
        else:
            self.outputs.release_request(msg.req)

    def _reset(self, msg: ResetRequests) -> None:
        """The frontend restarted: its predecessor's requests (ids below `msg.floor`) go unanswered, their
        slots freed. Those a step holds (prepared or running: the device thread may still write their
        slots) fail as their step starts or comes back, unanswered; their slots are freed then. Its live
        sessions' pins go too: the sessions went with it."""
        self._floors.raise_to(msg.floor)
        dropped = self.registry.drop_pins_below(msg.floor)
        if dropped:
            log.info("released %d live session pin(s) of the frontend that restarted", dropped)
        for task in [t for t in self.queue if same_owner_below(t.req, msg.floor)]:
            self.queue.remove(task)
            self.registry.finished(task.model)
            if self._partial.pop(task.req, None) is not None:   # part run, waiting for its next part: no
                self._on_device.discard(task.req)                  # step holds its slot (freed just below)
        for model, reqs in list(self.pending_loads.items()):
            self.pending_loads[model] = [req for req in reqs if not same_owner_below(req, msg.floor)]
        self.outputs.release_below(msg.floor, keep=self._on_device)

    def _stats(self, msg: StatsQuery) -> None:
        self.to_frontend.send(msg.req, pack(StatsReport(
            req=msg.req, worker=self.index, device=self.device,
            models={m: s.as_dict() for m, s in self.registry.stats.items()},
            loaded=sorted(self.registry.loaded), queue=len(self.queue),
            architectures=self.registry.loader.describe(), steps=dict(self._steps))))

    def _load_op(self, msg: LoadModel) -> None:
        if msg.pin < 0:   # a live session closed: the model may be evicted again (no answer)
            self.registry.unpin(msg.model, msg.req)
            return
        if msg.pin > 0:
            self.registry.pin(msg.model, msg.req)
        if msg.model in self.registry.loaded:
            self.to_frontend.send(msg.req, pack(LoadDone(req=msg.req, worker=self.index, model=msg.model, ok=True,
                                                load_ms=self.registry.stat(msg.model).load_ms)))
            return
        self.pending_loads.setdefault(msg.model, []).append(msg.req)
        if not self.registry.start_load(msg.model):
            self._fail_model(msg.model, "unknown_model", f"unknown model {msg.model!r}")

    def _finish_loads(self) -> None:
        for result in self.registry.poll_loads():
            if result.error is not None:
                log.warning("model %s failed to load: %s", result.model, result.error)
                self._fail_model(result.model, result.code, result.error)
                continue
            for req in self.pending_loads.pop(result.model, []):
                self.to_frontend.send(req, pack(LoadDone(req=req, worker=self.index, model=result.model, ok=True,
                                                    load_ms=result.load_ms)))

    def _fail_model(self, model: str, code: str, message: str) -> None:
        """Answer every task and load request waiting on `model`, which cannot be loaded."""
        for task in [t for t in self.queue if t.model == model]:
            self.queue.remove(task)
            self._done(task, code, message)
        for req in self.pending_loads.pop(model, []):
            self.to_frontend.send(req, pack(LoadDone(req=req, worker=self.index, model=model, ok=False, code=code,
                                                message=message)))

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for task in [t for t in self.queue if t.deadline and t.deadline < now]:
            self.queue.remove(task)
            whole = self._partial.get(task.req)
            if whole is not None:
                self._fail(whole, "timeout", "the deadline passed between two parts of the request")
                continue
            self._done(task, "timeout", "the deadline passed while the model was loading or its backgrounds were "
                       "read")

    def _done(self, task: InferTask, code: str = "", message: str = "", **fields) -> None:
        self.registry.finished(task.model)
        if self._floors.gone(task.req):   # the frontend that sent it is gone: no one to answer
            return
        if code:
            self.registry.stat(task.model).errors += 1
        self.to_frontend.send(task.req, pack(InferDone(req=task.req, worker=self.index, ok=not code, code=code or None,
                                             message=message, **fields)))

    # -- steps --------------------------------------------------------------------------------------

    def _advance(self) -> None:
        """The step back from the device thread taken; a prepared step started as soon as the device
        thread is free; the step that came back answered and handed on; the next one prepared (while one
        runs: without waiting for an output slot) and started if the device thread is free."""
        back = None
        if self._flight is not None and self._flight[1].done():
            back = self._landed()
        elif self._flight is not None:   # a sub-call step's models whose calls are done
            self._answer_ran(self._flight[0])
        self._start()
        if back is not None:   # NOTE: before a step waits for a slot: its hand-offs free them
            self._finish(back)
        if self._next is None:
            self._next = self._prepare(self._step_tasks(), waits=self._flight is None)
        self._start()

    def _start(self) -> None:
        """The prepared step to the device thread, if it is free: its tasks that would now end past their
        deadlines, or whose inputs the frontend freed (the request ended), answered; topped up with the
        tasks of its architecture that came since it was prepared."""
        if self._flight is not None or self._next is None:
            return
        step, self._next = self._next, None
        group = step.jobs[0].runner.group
        urgent = min((t for t in self.queue if self._ready(t)), key=_urgency, default=None) \
            if self._expected_step_s(group) > STEP_QUANTUM_S else None
        if urgent is not None and self.registry.loaded[urgent.model].runner.group is not group and \
                _urgency(urgent) < min(_urgency(job.task) for job in step.jobs):
            # NOTE: a long step (a large model's frame on the CPU) prepared while another ran, and a more
            # urgent task of another architecture came meanwhile: that one goes first, not after it
            self._unprepare(step)
            self._steps["put_back"] += 1
            step = self._prepare(self._step_tasks(), waits=False, topping_up=True)
            if step is None:
                return
            group = step.jobs[0].runner.group
        # NOTE: weighed again: the step that ran before it may have lasted longer than steps do (a new
        # shape's first call on a card stalls for seconds), and a client may have gone meanwhile
        now = time.monotonic()
        ends, kept = now + self._expected_step_s(group), []
        for job in step.jobs:
            why = self._late(job.task, now, ends) or self._gone(job.task)
            if why:
                self._fail(job, "timeout", why)
            else:
                kept.append(job)
        step.jobs = kept
        more = self._prepare(self._step_tasks(group, step.rows), waits=False, topping_up=True)
        if more is not None:
            step.jobs += more.jobs
        if not step.jobs:
            return
        self._flight_started = now = time.monotonic()
        for job in step.jobs:   # the wait ends here, not when the step was prepared; less the inputs'
            job.queue_ms = max(_waited_ms(job.task, now) - job.built_s * 1000, 0.0)   # building, its own stage
        self._flight = (step, self._device_thread.submit(run_step, step, self.encoders, self._wake))
        self._flight[1].add_done_callback(lambda _: self._wake())

    def _unprepare(self, step: WorkerStep) -> None:
        """A prepared step's tasks back to the queue as they were: a part's task to the rows it has done,
        a whole task's output slot freed (taken again when it runs); one the frontend ended, answered."""
        for job in step.jobs:
            if job.whole is not None:
                self._partial[job.task.req] = job.whole
            else:
                why = self._gone(job.task)
                if why:
                    self._fail(job, "timeout", why)
                    continue
                self._on_device.discard(job.task.req)
                self.outputs.release(job.slot)
            self.queue.append(job.task)

    def _landed(self) -> WorkerStep:
        step, future = self._flight
        self._flight = None
        try:
            return future.result()
        except Exception as err:   # a bug outside any call (run_step answers a call's own errors)
            log.exception("a step failed")
            answered = {id(job) for jobs, _ in step.ran[:step.answered] for job in jobs}
            step.failed = [(job, "internal", f"the step failed: {type(err).__name__}: {err}")
                           for job in step.jobs if id(job) not in answered]
            step.ran, step.kind, step.calls = step.ran[:step.answered], "", []
            return step

    def _step_tasks(self, group: object = None, rows: int = 0) -> list[tuple[InferTask, int]]:
        """The next step's tasks, out of the queue, each with the rows it runs there: the runnable task
        whose turn it is (gpu_actor/turns.py: live speech due soonest, then clients' tasks shared fairly),
        then the other runnable tasks of its architecture in their turns, while their
        frames fit the largest call the device runs (one task at least: a larger one runs as several calls,
        and one that would hold the device past STEP_QUANTUM_S runs that much now and the rest in later
        steps). With `group`: the tasks of that architecture that fit whole beside the `rows` a step holds."""
        runnable = self.turns.order((t for t in self.queue if self._ready(t)), self._left)
        if group is not None:
            runnable = [t for t in runnable if self.registry.loaded[t.model].runner.group is group]
        if not runnable:
            return []
        first = self.registry.loaded[runnable[0].model].runner
        chosen = []
        for task in runnable:
            runner = self.registry.loaded[task.model].runner
            left = self._left(task)
            if not chosen and not rows:
                chosen.append((task, min(left, self._span(runner))))
                rows += chosen[0][1]
                if chosen[0][1] < left:
                    break   # a step of one task's part: full
            elif runner.group is first.group and rows + left <= first.step_rows:
                chosen.append((task, left))
                rows += left
        for task, taken in chosen:
            self.queue.remove(task)
            self.turns.taken(task, taken)
        return chosen

    def _left(self, task: InferTask) -> int:
        """The rows of `task` still to run."""
        whole = self._partial.get(task.req)
        return task.batch - (whole.done if whole is not None else 0)

    def _span(self, runner) -> int:
        """The most rows of one task a step runs: at least one call's worth, else what runs within
        STEP_QUANTUM_S at the architecture's recent speed (unknown until three steps were timed: one
        call's worth, so that a slow architecture's first tasks do not hold the device whole, nor make
        its steps look as long as they were for a while after)."""
        row_s = _recent([seconds / max(rows, 1) for seconds, rows in self._timed.get(runner.group, ())])
        if row_s is None:
            return runner.step_rows
        return max(runner.step_rows, int(STEP_QUANTUM_S / max(row_s, 1e-9)))

    def _prepare(self, tasks: list[tuple[InferTask, int]], waits: bool,
                 topping_up: bool = False) -> Optional[WorkerStep]:
        """A step of `tasks` (each with the rows it runs): each its output slot and inputs (a task answered
        already is left out). The first task waits for a slot when `waits`; a task that finds none free
        goes back to the queue with those behind it (None when that was the first). Its deadline is weighed
        against when the step would end: after the one running now, unless `topping_up` (it starts now)."""
        if not tasks:
            return None
        now = time.monotonic()
        step_s = self._expected_step_s(self.registry.loaded[tasks[0][0].model].runner.group)   # (runnable: loaded)
        starts = now if topping_up or self._flight is None else \
            max(now, self._flight_started + self._expected_step_s(self._flight[0].jobs[0].runner.group))
        jobs: list[Job] = []
        for i, (task, rows) in enumerate(tasks):
            try:
                job = self._begin(task, wait=waits and not jobs, ends=starts + step_s, rows=rows)
            except _NoSlotFree:   # this task and the rest wait for a later step
                self.queue.extendleft(reversed([t for t, _ in tasks[i:]]))
                self._blocked = not jobs and not topping_up
                break
            if job is not None:
                jobs.append(job)
        if jobs and self._flight is not None and not topping_up:
            self._steps["prepared_during_a_step"] += 1
        return WorkerStep(jobs) if jobs else None

    def _finish(self, step: WorkerStep) -> None:
        """(The main thread) a step back from the device thread: each job answered and handed on, or
        failed; the step timed and counted."""
        for job, code, message in step.failed:
            self._fail(job, code, message)
        self._answer_ran(step)
        if step.kind:
            group = step.jobs[0].runner.group
            self._timed.setdefault(group, deque(maxlen=STEPS_TIMED)).append((step.seconds, step.rows))
            self._steps["steps"] += 1
            self._steps["device_busy_s"] += step.seconds
        if step.calls:   # (the GPU path's: a CPU call holds one frame)
            self.to_frontend.first(pack(StepDone(worker=self.index, kind=step.kind, calls=step.calls,
                                                  seconds=step.seconds)))

    def _expected_step_s(self, group: object) -> float:
        """How long a step of `group` (an architecture) takes now: the median of its last STEPS_TIMED (0
        until three have run)."""
        return _recent([seconds for seconds, _ in self._timed.get(group, ())]) or 0.0

    def _begin(self, task: InferTask, wait: bool, ends: float, rows: Optional[int] = None) -> Optional[Job]:
        """A task's output slot (waited for when `wait`, else only if one is free: _NoSlotFree) and inputs;
        None when the task is answered already (its inputs are bad or gone, or it would end past its
        deadline: its step would end at `ends`). `rows` fewer than it has left: its next part's Job (the
        task's own Job, with its slot and inputs, kept for the parts after it).
        Past its deadline its frames are of no use (a live session's go out idle), and running them would
        make the tasks behind it late too: under a burst past what the device runs, every frame would be
        late rather than the burst's excess missed."""
        started = time.monotonic()
        whole = self._partial.pop(task.req, None)
        late = self._late(task, started, ends)
        if whole is not None:   # its next part: slot and inputs are the task's already
            if late:
                self._fail(whole, "timeout", late)
                return None
            end = whole.done + (rows if rows is not None else task.batch - whole.done)
            return whole.part(whole.done, end)
        if late:
            self._done(task, "timeout", late)
            return None
        if wait:
            try:
                slot = acquire_slot(self.outputs, task.req, task.batch,
                                    max(task.deadline - started, 0.001) if task.deadline else 30, self.tasks, self._handle)
            except RingError as err:
                self._done(task, "timeout", str(err))
                return None
        else:
            slot = self.outputs.try_acquire(task.req, mouth_slots(self.outputs, task.batch))
            if slot is None:
                raise _NoSlotFree
        t0 = time.perf_counter()
        try:
            out = self.outputs.writable(slot, 0, "float32", (task.batch, *MOUTH_SHAPE))
            visual = self._visual_input(task)
            sent = self.inputs.read(task.audio)
        except (AssetError, StoreError) as err:
            self.outputs.release(slot)
            self._done(task, "bad_request", str(err))
            return None
        except StaleHandle as err:
            self.outputs.release(slot)
            self._done(task, "timeout", f"request was cancelled while queued ({err})")
            return None
        built = time.perf_counter() - t0 if task.visual is None else 0.0
        self._on_device.add(task.req)
        job = Job(task, slot, out, visual, sent, self.registry.loaded[task.model].runner, built)
        if rows is None or rows >= task.batch:
            return job
        first = job.part(0, rows)
        first.built_s, job.built_s = built, 0.0   # (counted once: the task's is what its parts add up to)
        return first

    def _late(self, task: InferTask, now: float, ends: float) -> str:
        """Why `task`, whose step would end at `ends`, is of no use any more (past its deadline, or it would
        end past it); "" when it is not."""
        if not task.deadline:
            return ""
        queue_ms = _waited_ms(task, now)
        if now > task.deadline:
            return f"waited {queue_ms:.0f} ms in the inference queue, past the deadline"
        if ends > task.deadline:
            return (f"waited {queue_ms:.0f} ms in the inference queue; with the steps before it and its own, "
                    f"it would end {(ends - now) * 1000:.0f} ms from now, past its deadline")
        return ""

    def _gone(self, task: InferTask, stage: str = "queued") -> str:
        """Why `task` ended while it was at `stage` (the frontend freed its inputs: its client went, or it
        was cancelled); "" when it did not."""
        if task.req in self._ended:
            return f"request was cancelled while {stage}"
        if self._floors.gone(task.req):
            return f"the frontend restarted while the request was {stage}"
        try:
            for ref in (task.audio, task.visual):
                if ref is not None:
                    self.inputs.verify(ref)
        except StaleHandle as err:
            return f"request was cancelled while {stage} ({err})"
        return ""

    def _fail(self, job: Job, code: str, message: str) -> None:
        self._partial.pop(job.task.req, None)
        self._on_device.discard(job.task.req)
        self._ended.discard(job.task.req)
        self.outputs.release(job.slot)
        self._done(job.task, code, message)

    def _answer_ran(self, step: WorkerStep) -> None:
        """The jobs of `step` whose calls are done and not yet answered: each answered and handed on,
        unless the frontend freed its inputs meanwhile."""
        while step.answered < len(step.ran):
            jobs, inference_ms = step.ran[step.answered]
            step.answered += 1
            self._answer(jobs, inference_ms)

    def _answer(self, jobs: list[Job], inference_ms: float) -> None:
        for job in jobs:
            task = job.task
            gone = self._gone(task, "running")   # the frontend freed an input mid-run: the result is not ours
            if gone:
                self._fail(job, "timeout", gone)
                continue
            if job.whole is not None:   # a part: the task's rows so far, its time counted on its Job
                whole = job.whole
                whole.done, whole.inference_ms = job.rows[1], whole.inference_ms + inference_ms
                whole.built_s += job.built_s
                whole.queue_ms = whole.queue_ms if job.rows[0] else job.queue_ms
                if whole.done < task.batch:
                    self._partial[task.req] = whole
                    self.queue.append(task)   # its next part, in a later step
                    continue
                job, inference_ms = whole, whole.inference_ms
            built = job.built_s + (job.visual.spent_s if isinstance(job.visual, VisualFrames) else 0.0)
            self.registry.touch(task.model, task.batch)
            self.registry.stat(task.model).infer_ms.append(inference_ms)
            self._on_device.discard(task.req)
            ref = self.outputs.ref(job.slot, 0, "float32", (task.batch, *MOUTH_SHAPE))
            self._done(task, output=ref if not task.plan else None, queue_ms=job.queue_ms,
                       inference_ms=inference_ms, input_ms=built * 1000)
            hand_off(self.to_cpu, task, self.index, ref)

    def _load_encoder(self, model: str) -> None:
        """(The load thread) a model with an audio encoder loads and warms it with the model, so a live
        session's first PCM meets no new session or shape on this worker's main thread."""
        paths = model_paths(self.config, model)
        self.encoders.load(model, paths.audio_encoder if paths is not None else None)

    def _visual_input(self, task: InferTask) -> Union[np.ndarray, VisualFrames]:
        """The client's visual input, or the avatar's crops (fetched now), built per call as the model runs."""
        if task.visual is not None:
            return self.inputs.read(task.visual)
        assets = self.assets.get(task.model, task.version)
        assets.check_frames(task.frames)
        crops = []
        for frame in task.frames:
            _, crop, _ = self.store.fetch(assets.store_id, frame, lambda f=frame: assets.decode(f), want_background=False)
            crops.append(crop)
        return VisualFrames(crops, self._visual)



class _NoSlotFree(Exception):
    """Every output slot is taken: the task waits for a later step."""


def _waited_ms(task: InferTask, now: float) -> float:
    """How long `task` has been at this worker, ms (0 where the frontend did not say when it came)."""
    return (now - task.enqueued) * 1000 if task.enqueued else 0.0


def _recent(timed) -> Optional[float]:
    """The median of the last timings (STEPS_TIMED of them: one stall does not move it); None until three."""
    return sorted(timed)[len(timed) // 2] if len(timed) >= 3 else None


def _urgency(task: InferTask) -> float:
    """When a task's first frame is needed: a live session's due time, else its deadline (none: last)."""
    return task.due or task.deadline or float("inf")


def run_gpu_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("gpu", index, run, lambda ctx: InferenceWorker(ctx, config, run, index))
