"""The inference worker process: take a batch handle, run the model, write the mouths into a shm slot
of this worker's output ring, and hand the slot on (to the compositing pool, or to the frontend for
`infer`).

Loop: one poll point over the task socket (tasks and control) and the load-completion socket.
Tasks whose model is loading, or whose avatar's frames are being decoded (gpu_actor/backgrounds.py), wait
aside; every other task keeps running meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import zmq

from config import Config
from config import audio as A
from config.assets import AssetCache, AssetError, model_paths
from config.geometry import MOUTH_SHAPE, VISUAL_SHAPE
from gpu_actor.backgrounds import Backgrounds
from gpu_actor.device import make_device
from gpu_actor.encoder import AudioEncoders
from gpu_actor.handoff import acquire_slot, hand_off, mouth_slots, route
from gpu_actor.registry import Registry
from gpu_actor.runner import Part
from gpu_actor.visual import VisualFrames
from shm.child import CannotServe, child_main
from shm.codes import ErrorCode
from shm.endpoints import RunSpec, make_socket
from shm.messages import (InferDone, InferTask, LoadDone, LoadModel, ModelEvent, ReleaseTask,
                          ResetRequests, StatsQuery, StatsReport, StepDone, UnloadModel, pack, unpack)
from shm.ring import RingError, SlotRing, StaleHandle
from shm.store import BackgroundStore, StoreError

log = logging.getLogger(__name__)
IDLE_TICK_MS = 1000
STEPS_TIMED = 9   # the recent steps whose median is a step's expected time (one stall does not move it)


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
        self.to_frontend = make_socket(ctx, zmq.PUSH, connect=ep.frontend)
        self.to_cpu = [make_socket(ctx, zmq.PUSH, connect=addr) for addr in ep.cpu]
        wake_addr = f"inproc://gpu{index}-wake"
        self._wake_rx = make_socket(ctx, zmq.PULL, bind=wake_addr)
        self._wake_tx = make_socket(ctx, zmq.PUSH, connect=wake_addr)
        self.inputs = SlotRing.attach(run.input_rings[index])
        self.outputs = SlotRing.attach(run.output_rings[index])
        self.outputs.become_writer()
        self.store = BackgroundStore.attach(run.store)
        inf = config.inference
        # NOTE: a finished load wakes the loop from the load thread, or from this one when the load
        # failed before its callback was attached: the lock keeps the socket to one thread at a time.
        self._wake_lock = threading.Lock()
        self.backgrounds = Backgrounds(run.store, self.store, self._wake)
        for ring in (self.inputs, self.outputs):   # copies to and from the slots at the bus's speed
            device.pin(ring.data())
        self.registry = Registry(device, inf, config.limits.max_batch, self._onnx_path, self._model_event, self._wake,
                                 companions=self._load_encoder)
        self.queue: deque[InferTask] = deque()
        self.pending_loads: dict[str, list[int]] = {}   # model -> LoadModel request ids
        self.assets = AssetCache(config)
        self.encoders = AudioEncoders(device, config.limits.max_batch, inf.intra_op_threads, inf.spin_threads)
        max_batch = config.limits.max_batch
        self._visual = np.empty((max_batch, *VISUAL_SHAPE), np.float32)  # audio-only inputs are built here
        self._step_s: deque[float] = deque(maxlen=STEPS_TIMED)   # the last steps' seconds, start to end
        self._stopping = False
        self._handlers = {InferTask: self._infer_task, ReleaseTask: lambda m: self.outputs.release_request(m.req),
                          LoadModel: self._load_op, UnloadModel: self._unload_op, StatsQuery: self._stats,
                          ResetRequests: lambda m: self.outputs.become_writer()}
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
            self._wake_tx.send(b"")

    def _model_event(self, model: str, event: str, load_ms: float, nbytes: int, frames_per_s: float) -> None:
        self.to_frontend.send(pack(ModelEvent(worker=self.index, model=model, event=event, load_ms=load_ms,
                                              nbytes=nbytes, frames_per_s=frames_per_s)))

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.registry.close()
        self.registry.device.unpin_all()   # NOTE: before the rings unmap what it pinned
        for ring in (self.inputs, self.outputs):
            ring.close()
        self.backgrounds.close()
        self.store.close()

    # -- loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        next_tick = time.monotonic() + IDLE_TICK_MS / 1000
        while not self._stopping:
            timeout = 0 if self._runnable() is not None else IDLE_TICK_MS
            self._drain(self.poller.poll(timeout))
            tasks = self._step_tasks()
            if tasks:
                self._step(tasks)
            if time.monotonic() >= next_tick:
                self.registry.unload_idle(time.monotonic())
                self._expire_waiting()
                next_tick = time.monotonic() + IDLE_TICK_MS / 1000

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
        self.registry.queued(msg.model)
        self.queue.append(msg)
        if msg.model not in self.registry.loaded and not self.registry.start_load(msg.model):
            self._fail_model(msg.model, "unknown_model", f"unknown model {msg.model!r}: no such entry in "
                             "`models` and no such directory in `models_dir`")

    def _unload_op(self, msg: UnloadModel) -> None:
        ok = self.registry.unload(msg.model)
        self.to_frontend.send(pack(LoadDone(
            req=msg.req, worker=self.index, model=msg.model, ok=ok, code=None if ok else ErrorCode.OVERLOADED,
            message="" if ok else f"model {msg.model} has work queued or running; retry when it is idle")))

    def _stats(self, msg: StatsQuery) -> None:
        self.to_frontend.send(pack(StatsReport(
            req=msg.req, worker=self.index, device=self.device,
            models={m: s.as_dict() for m, s in self.registry.stats.items()},
            loaded=sorted(self.registry.loaded), queue=len(self.queue),
            architectures=self.registry.loader.describe())))

    def _load_op(self, msg: LoadModel) -> None:
        if msg.pin < 0:   # a live session closed: the model may be evicted again (no answer)
            self.registry.unpin(msg.model)
            return
        if msg.pin > 0:
            self.registry.pin(msg.model)
        if msg.model in self.registry.loaded:
            self.to_frontend.send(pack(LoadDone(req=msg.req, worker=self.index, model=msg.model, ok=True,
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
                self.to_frontend.send(pack(LoadDone(req=req, worker=self.index, model=result.model, ok=True,
                                                    load_ms=result.load_ms)))

    def _fail_model(self, model: str, code: str, message: str) -> None:
        """Answer every task and load request waiting on `model`, which cannot be loaded."""
        for task in [t for t in self.queue if t.model == model]:
            self.queue.remove(task)
            self._done(task, code, message)
        for req in self.pending_loads.pop(model, []):
            self.to_frontend.send(pack(LoadDone(req=req, worker=self.index, model=model, ok=False, code=code,
                                                message=message)))

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for task in [t for t in self.queue if t.deadline and t.deadline < now]:
            self.queue.remove(task)
            self._done(task, "timeout", "the deadline passed while the model was loading or its backgrounds were "
                       "read")

    def _done(self, task: InferTask, code: str = "", message: str = "", **fields) -> None:
        self.registry.finished(task.model)
        if code:
            self.registry.stat(task.model).errors += 1
        self.to_frontend.send(pack(InferDone(req=task.req, worker=self.index, ok=not code, code=code or None,
                                             message=message, **fields)))

    # -- one step ------------------------------------------------------------------------------------

    def _step_tasks(self) -> list[InferTask]:
        """The next step's tasks, out of the queue: the most urgent runnable task, then the other runnable
        tasks of its architecture, most urgent first, while their frames fit the largest call the device
        runs (one task at least: a larger one runs as several calls)."""
        runnable = sorted((t for t in self.queue if self._ready(t)), key=_urgency)
        if not runnable:
            return []
        first = self.registry.loaded[runnable[0].model].runner
        chosen, rows = [runnable[0]], runnable[0].batch
        for task in runnable[1:]:
            runner = self.registry.loaded[task.model].runner
            if runner.group is first.group and rows + task.batch <= first.step_rows:
                chosen.append(task)
                rows += task.batch
        for task in chosen:
            self.queue.remove(task)
        return chosen

    def _step(self, tasks: list[InferTask]) -> None:
        """Run `tasks` together: each its output slot and inputs, then one runner call per model for all
        of that model's rows (gpu_actor/runner.Runner.run_parts), each task answered and handed on as soon
        as its model's call is done. A task whose slot, inputs or run fails fails alone. A step that ran
        calls is timed (`_expected_step_s`)."""
        t0 = time.monotonic()
        jobs: list[_Job] = []
        for i, task in enumerate(tasks):
            try:
                job = self._begin(task, wait=not jobs)
            except _NoSlotFree:   # this task and the rest wait for the next step
                self.queue.extendleft(reversed(tasks[i:]))
                break
            if job is not None:
                jobs.append(job)
        jobs = self._audio_inputs(jobs)
        by_model: dict[str, list[_Job]] = {}
        for job in jobs:
            by_model.setdefault(job.task.model, []).append(job)
        if not by_model:
            return
        runners = {model: self.registry.loaded[model].runner for model in by_model}
        first = runners[jobs[0].task.model]
        if len(by_model) > 1 and first.group.prefers_grouped([sum(j.task.batch for j in g) for g in by_model.values()]):
            kind = "grouped"   # several avatars, one call of the architecture's N-model form
            self._run(jobs, "models " + ", ".join(by_model), lambda: first.group.run_grouped(
                [(runners[model], [Part(j.visual, j.audio, j.out) for j in group]) for model, group in by_model.items()]))
        else:
            kind = "one_model" if len(by_model) == 1 else "sub_calls"
            for model, group in by_model.items():
                self._run(group, f"model {model}",
                          lambda r=runners[model], g=group: r.run_parts([Part(j.visual, j.audio, j.out) for j in g]))
        calls = first.end_step(kind)
        self._step_s.append(time.monotonic() - t0)
        if calls:   # (the GPU path's: a CPU call holds one frame)
            self.to_frontend.send(pack(StepDone(worker=self.index, kind=kind, calls=calls)))

    def _expected_step_s(self) -> float:
        """How long a step takes now: the median of the last STEPS_TIMED (0 until three have run)."""
        if len(self._step_s) < 3:
            return 0.0
        return sorted(self._step_s)[len(self._step_s) // 2]

    def _begin(self, task: InferTask, wait: bool) -> Optional[_Job]:
        """A task's output slot (waited for when `wait`, else only if one is free: _NoSlotFree) and visual
        input; None when the task is answered already (its inputs are bad, or it would end past its
        deadline: a step takes `_expected_step_s`).
        Past its deadline its frames are of no use (a live session's go out idle), and running them would
        make the tasks behind it late too: under a burst past what the device runs, every frame would be
        late rather than the burst's excess missed."""
        started = time.monotonic()
        queue_ms = (started - task.enqueued) * 1000 if task.enqueued else 0.0
        if task.deadline and started > task.deadline:
            self._done(task, "timeout", f"waited {queue_ms:.0f} ms in the inference queue, past the deadline")
            return None
        step_s = self._expected_step_s()
        if task.deadline and started + step_s > task.deadline:
            self._done(task, "timeout", f"waited {queue_ms:.0f} ms in the inference queue; with steps of "
                       f"{step_s * 1000:.0f} ms now, it would end past its deadline")
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
        except (AssetError, StoreError) as err:
            self.outputs.release(slot)
            self._done(task, "bad_request", str(err))
            return None
        except StaleHandle as err:
            self.outputs.release(slot)
            self._done(task, "timeout", f"request was cancelled while queued ({err})")
            return None
        built = time.perf_counter() - t0 if task.visual is None else 0.0
        return _Job(task, slot, out, visual, None, queue_ms, built)

    def _audio_inputs(self, jobs: list[_Job]) -> list[_Job]:
        """Each job's audio windows: as sent, or derived from 16 kHz PCM (a live session's encoder inputs:
        every job's together, one encoder call per encoder). The jobs whose audio is fine; the others are
        answered."""
        sent: dict[int, np.ndarray] = {}
        for job in jobs:
            try:
                sent[id(job)] = self.inputs.read(job.task.audio)
            except StaleHandle as err:
                self._fail(job, "timeout", f"request was cancelled while queued ({err})")
        live = [job for job in jobs if id(job) in sent and job.task.rows is not None]
        t0 = time.perf_counter()
        features = self.encoders.features_many(
            [(j.task.model, j.task.utterance, j.task.first_input, sent[id(j)]) for j in live])
        encode_s = time.perf_counter() - t0
        computed = dict(zip(map(id, live), features))
        ok = []
        for job in (j for j in jobs if id(j) in sent):
            t1 = time.perf_counter()
            try:
                job.audio = self._audio_input(job.task, sent[id(job)], computed.get(id(job)))
            except AssetError as err:
                self._fail(job, "bad_request", str(err))
                continue
            if job.task.audio.dtype == "int16" or job.task.rows is not None:   # windows built from PCM here
                job.built_s += time.perf_counter() - t1 + (encode_s if id(job) in computed else 0.0)
            ok.append(job)
        return ok

    def _fail(self, job: _Job, code: str, message: str) -> None:
        self.outputs.release(job.slot)
        self._done(job.task, code, message)

    def _run(self, jobs: list[_Job], what: str, call: Callable[[], None]) -> None:
        """Jobs of a step run by `call` (one model's, or several models' grouped); each answered and
        handed on."""
        t0 = time.perf_counter()
        try:
            call()
        except StaleHandle as err:   # a client's visual input freed mid-run: the step's results are not theirs
            for job in jobs:
                self._fail(job, "timeout", f"request was cancelled while running ({err})")
            return
        except Exception as err:  # onnxruntime's own errors, or a bug: these requests fail, not the worker
            log.exception("running %s failed", what)
            for job in jobs:
                self._fail(job, "internal", f"{what} failed to run: {type(err).__name__}: "
                           f"{str(err).splitlines()[0][:300] if str(err) else ''}")
            return
        per_call = sum(j.visual.spent_s for j in jobs if isinstance(j.visual, VisualFrames))   # built between calls
        inference_ms = (time.perf_counter() - t0 - per_call) * 1000
        for job in jobs:
            task = job.task
            try:
                for ref in (task.audio, task.visual):
                    if ref is not None:
                        self.inputs.verify(ref)   # the frontend freed it mid-run: the result is not ours
            except StaleHandle as err:
                self._fail(job, "timeout", f"request was cancelled while running ({err})")
                continue
            built = job.built_s + (job.visual.spent_s if isinstance(job.visual, VisualFrames) else 0.0)
            self.registry.touch(task.model, task.batch)
            self.registry.stat(task.model).infer_ms.append(inference_ms)
            ref = self.outputs.ref(job.slot, 0, "float32", (task.batch, *MOUTH_SHAPE))
            self._done(task, output=ref if not task.plan else None, queue_ms=job.queue_ms,
                       inference_ms=inference_ms, input_ms=built * 1000)
            hand_off(self.to_cpu, task, self.index, ref)

    def _audio_input(self, task: InferTask, audio: np.ndarray, features: Union[None, np.ndarray, AssetError]) -> np.ndarray:
        """The model's audio windows: `audio` as sent, or derived from 16 kHz PCM (mel -> encoder ->
        windows); `features`: a live session's encoder outputs (`_audio_inputs`)."""
        if task.rows is not None:   # a pcm16 session's encoder inputs, and each frame's rows of their outputs
            rows = np.asarray(task.rows, np.int64)
            if rows.shape != (task.batch, 16) or rows.max() >= len(audio) or rows.min() < -1:
                raise AssetError(f"model {task.model}: window rows {rows.shape} do not fit {len(audio)} encoder inputs")
            if isinstance(features, AssetError):
                raise features
            return A.windows_from_rows(features, rows)
        if audio.dtype != np.int16:
            return audio
        windows = self.encoders.windows(task.model, audio)
        if len(windows) != task.batch:
            raise AssetError(f"model {task.model}: the PCM gives {len(windows)} frames, the request has {task.batch}")
        return windows

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


@dataclass
class _Job:
    """A task of a step: its output slot (`out`: the slot's rows), inputs, and the time it waited and spent
    building inputs."""

    task: InferTask
    slot: int
    out: np.ndarray
    visual: Union[np.ndarray, VisualFrames]
    audio: Optional[np.ndarray]
    queue_ms: float
    built_s: float


def _urgency(task: InferTask) -> float:
    """When a task's first frame is needed: a live session's due time, else its deadline (none: last)."""
    return task.due or task.deadline or float("inf")


def run_gpu_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("gpu", index, run, lambda ctx: InferenceWorker(ctx, config, run, index))
