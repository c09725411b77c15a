"""A worker's step on its device thread: the jobs its main thread prepared (gpu_actor/worker.py: each
task's output slot and inputs), run as one or more device calls (the audio encoder's, then the model's),
and what came of each job. Nothing here touches a socket: the main thread answers the jobs and hands them
on once the step is back, and meanwhile prepares the next step, so the device never waits for the host's
work between two steps (as SGLang's overlap scheduler prepares batch k+1 while batch k runs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from config import audio as A
from config.assets import AssetError
from gpu_actor.encoder import AudioEncoders
from gpu_actor.runner import Part, Runner
from gpu_actor.visual import VisualFrames
from shm.messages import InferTask
from shm.ring import StaleHandle

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A task of a step: its output slot (`out`: the slot's rows), its inputs (`sent`: its audio as the
    frontend sent it; `audio`: the model's windows, made on the device thread), its model's runner, the
    time it spent building inputs and the time it waited (until its step started, less that building).

    A task larger than a step holds runs over several steps, a part of its rows each (`part`): each part
    is a Job of its own viewing those rows of the task's Job (`whole`), which keeps the slot, the windows
    made once, the rows done and the inference time so far."""

    task: InferTask
    slot: int
    out: np.ndarray
    visual: Union[np.ndarray, VisualFrames, Callable[[int, int], np.ndarray]]
    sent: np.ndarray
    runner: Runner
    built_s: float
    queue_ms: float = 0.0
    audio: Optional[np.ndarray] = None
    whole: Optional["Job"] = None        # a part's task Job
    rows: tuple[int, int] = (0, 0)       # a part's rows of its task
    done: int = 0                        # (a whole) rows run so far
    inference_ms: float = 0.0            # (a whole) its parts' inference so far

    @property
    def count(self) -> int:
        """The rows this job runs."""
        return self.rows[1] - self.rows[0] if self.whole is not None else self.task.batch

    def part(self, start: int, end: int) -> "Job":
        """Rows [start, end) of this task's Job, to run in a step of their own."""
        visual = self.visual
        if isinstance(visual, np.ndarray):
            view = visual[start:end]
        else:   # the avatar's crops, built per call: rows of the part are rows start.. of the task
            view = lambda a, b: visual(start + a, start + b)   # noqa: E731
        return Job(self.task, self.slot, self.out[start:end], view, self.sent, self.runner, 0.0, whole=self,
                   rows=(start, end))


@dataclass
class WorkerStep:
    """The jobs of one step, and what the device thread made of them: the jobs that failed (code, message),
    the jobs each call ran (with its ms), the step's kind and device calls, and its seconds."""

    jobs: list[Job]
    failed: list[tuple[Job, str, str]] = field(default_factory=list)
    ran: list[tuple[list[Job], float]] = field(default_factory=list)
    answered: int = 0    # (the main thread's) how many of `ran` it answered
    kind: str = ""       # one_model, sub_calls or grouped; "" when no job got as far as a call
    calls: list[tuple[int, int]] = field(default_factory=list)   # each device call's (prepared size, frames)
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return sum(job.count for job in self.jobs)


def run_step(step: WorkerStep, encoders: AudioEncoders, landed: Callable[[], None]) -> WorkerStep:
    """(The device thread) the step's audio windows, then one runner call per model for all of that model's
    rows (gpu_actor/runner.Runner.run_parts), or one call of the architecture's N-model form for all of
    them when it is the faster (Prepared.prefers_grouped). A job whose inputs or call fail fails alone.
    `landed()` after each model's calls but the last: its jobs can be answered while the rest run."""
    t0 = time.monotonic()
    jobs = _audio_inputs(step, encoders)
    by_model: dict[str, list[Job]] = {}
    for job in jobs:
        by_model.setdefault(job.task.model, []).append(job)
    if not by_model:
        return step
    first = jobs[0].runner
    if len(by_model) > 1 and first.group.prefers_grouped([sum(j.task.batch for j in g) for g in by_model.values()]):
        step.kind = "grouped"   # several avatars, one call of the architecture's N-model form
        _run(step, jobs, "models " + ", ".join(by_model), lambda: first.group.run_grouped(
            [(group[0].runner, _parts(group)) for group in by_model.values()]))
    else:
        step.kind = "one_model" if len(by_model) == 1 else "sub_calls"
        for i, (model, group) in enumerate(by_model.items()):
            _run(step, group, f"model {model}", lambda g=group: g[0].runner.run_parts(_parts(g)))
            if i < len(by_model) - 1 and step.ran:
                landed()
    step.calls = first.end_step(step.kind)
    step.seconds = time.monotonic() - t0
    return step


def _parts(jobs: list[Job]) -> list[Part]:
    return [Part(job.visual, job.audio, job.out) for job in jobs]


def _audio_inputs(step: WorkerStep, encoders: AudioEncoders) -> list[Job]:
    """Each job's audio windows: as sent, or derived from 16 kHz PCM (a live session's encoder inputs:
    every job's together, one encoder call per encoder). The jobs whose audio is fine; the others failed."""
    # (a part of a task whose windows an earlier part made takes its rows of them)
    todo = [job for job in step.jobs if job.whole is None or job.whole.audio is None]
    live = [job for job in todo if job.task.rows is not None]
    t0 = time.perf_counter()
    features = encoders.features_many([(j.task.model, j.task.utterance, j.task.first_input, j.sent) for j in live])
    encode_s = time.perf_counter() - t0
    computed = dict(zip(map(id, live), features))
    ok = []
    for job in step.jobs:
        whole = job.whole or job
        if whole.audio is None:
            t1 = time.perf_counter()
            try:
                whole.audio = _audio_input(job.task, job.sent, computed.get(id(job)), encoders)
            except AssetError as err:
                step.failed.append((job, "bad_request", str(err)))
                continue
            if job.task.audio.dtype == "int16" or job.task.rows is not None:   # windows built from PCM here
                job.built_s += time.perf_counter() - t1 + (encode_s if id(job) in computed else 0.0)
        if job.whole is not None:
            job.audio = whole.audio[job.rows[0]:job.rows[1]]
        ok.append(job)
    return ok


def _audio_input(task: InferTask, audio: np.ndarray, features: Union[None, np.ndarray, AssetError],
                 encoders: AudioEncoders) -> np.ndarray:
    """The model's audio windows: `audio` as sent, or derived from 16 kHz PCM (mel -> encoder -> windows);
    `features`: a live session's encoder outputs (`_audio_inputs`)."""
    if task.rows is not None:   # a pcm16 session's encoder inputs, and each frame's rows of their outputs
        rows = np.asarray(task.rows, np.int64)
        if rows.shape != (task.batch, 16) or rows.max() >= len(audio) or rows.min() < -1:
            raise AssetError(f"model {task.model}: window rows {rows.shape} do not fit {len(audio)} encoder inputs")
        if isinstance(features, AssetError):
            raise features
        return A.windows_from_rows(features, rows)
    if audio.dtype != np.int16:
        return audio
    windows = encoders.windows(task.model, audio)
    if len(windows) != task.batch:
        raise AssetError(f"model {task.model}: the PCM gives {len(windows)} frames, the request has {task.batch}")
    return windows


def _run(step: WorkerStep, jobs: list[Job], what: str, call: Callable[[], None]) -> None:
    """Jobs of a step run by `call` (one model's, or several models' grouped): `step.ran`, with the call's
    ms (the visual inputs built between its device calls not counted), or `step.failed`."""
    t0, built_s = time.perf_counter(), _visual_spent_s(jobs)
    try:
        call()
    except StaleHandle as err:   # a client's visual input freed mid-run: the step's results are not theirs
        step.failed.extend((job, "timeout", f"request was cancelled while running ({err})") for job in jobs)
        return
    except Exception as err:  # onnxruntime's own errors, or a bug: these requests fail, not the worker
        log.exception("running %s failed", what)
        message = f"{what} failed to run: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        step.failed.extend((job, "internal", message) for job in jobs)
        return
    built_s = _visual_spent_s(jobs) - built_s   # the visual inputs built between its device calls
    step.ran.append((jobs, (time.perf_counter() - t0 - built_s) * 1000))


def _visual_spent_s(jobs: list[Job]) -> float:
    """The time the jobs' visual inputs built on demand took so far (a part's: its task's, counted once)."""
    frames = {id(v): v for v in ((job.whole or job).visual for job in jobs) if isinstance(v, VisualFrames)}
    return sum(v.spent_s for v in frames.values())
