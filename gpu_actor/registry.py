"""The models one inference worker holds: lazy loads off the request path, caps, eviction, stats.

Loads run on one background thread, so a worker keeps serving its other models while one loads; the
loop learns of a finished load through `poll_loads`. On the CPU a load is a session of the model's own
and its warm-up run; on a GPU (and the stand-in device) it is reading the weights and uploading them,
and the first model of an architecture also prepares the architecture's session at every batch size
(gpu_actor/architectures.py) before it counts as loaded.
Caps: `inference.max_models_per_worker` and `inference.max_model_bytes` (a model's bytes: its weights
on a GPU, the resident-memory delta of its load on the CPU). Over a cap the idle model chosen by
`inference.eviction` (lru | lfu) goes; a model with work queued or running is never evicted. A load
the device has no memory for evicts an idle model and tries again; with none idle, that load fails.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from config.assets import AssetError
from config.schema import InferenceConfig
from gpu_actor.architectures import Architectures
from gpu_actor.onnx_sessions import out_of_memory
from gpu_actor.own_session import OwnSessions
from gpu_actor.runner import Loader, Runner
from shm.requests import drop_owned_below, release_owned

log = logging.getLogger(__name__)


@dataclass
class ModelStats:
    requests: int = 0
    frames: int = 0
    errors: int = 0
    loads: int = 0
    evictions: int = 0
    load_ms: float = 0.0
    frames_per_s: float = 0.0    # on a GPU: its architecture's frames/s when it loaded (Prepared.frames_per_s)
    nbytes: int = 0              # what the model holds: its weights on a GPU, its load's resident memory on the CPU
    last_used: float = 0.0       # wall clock, for people
    uses: int = 0
    infer_ms: deque = field(default_factory=lambda: deque(maxlen=1024))

    def as_dict(self) -> dict[str, float]:
        ms = np.asarray(self.infer_ms) if self.infer_ms else np.zeros(1)
        return {"requests": self.requests, "frames": self.frames, "errors": self.errors, "loads": self.loads,
                "evictions": self.evictions, "load_ms": round(self.load_ms, 2), "nbytes": self.nbytes,
                "frames_per_s": round(self.frames_per_s, 1), "last_used": self.last_used,
                "inference_ms_p50": float(np.percentile(ms, 50)), "inference_ms_p99": float(np.percentile(ms, 99))}


@dataclass
class Loaded:
    runner: Runner
    nbytes: int
    last_used: float             # monotonic


@dataclass
class LoadResult:
    model: str
    runner: Optional[Runner]
    nbytes: int
    load_ms: float
    error: Optional[str]
    code: str = ""


class Registry:
    """`options`: the `inference` config section (caps, eviction, threads, precision, CUDA graphs);
    `max_batch`: limits.max_batch, the largest size a GPU path prepares."""

    def __init__(self, device, options: InferenceConfig, max_batch: int, resolve: Callable[[str], Optional[Path]],
                 on_event: Callable[[str, str, float, int, float], None], wake: Callable[[], None],
                 companions: Callable[[str], None] = lambda model: None):
        self.device = device
        self.max_models, self.max_bytes = options.max_models_per_worker, options.max_model_bytes
        self.eviction, self.idle_unload_s = options.eviction, options.idle_unload_s
        self._threads, self._spin = options.intra_op_threads, options.spin_threads
        self._resolve = resolve          # model id -> onnx path, or None if unknown
        self._on_event = on_event        # (model, event, load_ms, nbytes, frames_per_s)
        self._wake = wake                # called from the load thread when a load finishes
        self._companions = companions    # (load thread) load and warm what the model runs with (its audio encoder)
        self.loaded: dict[str, Loaded] = {}
        self.loading: dict[str, cf.Future] = {}
        self.stats: dict[str, ModelStats] = {}
        self.busy: Counter[str] = Counter()   # tasks queued or running, per model
        # per model, the request ids that pinned it: live sessions that need it here (never evicted)
        self.pins: dict[str, list[int]] = {}
        self._unload_when_loaded: set[str] = set()   # unloaded while its load was running
        self._prepared_more = False   # set by the background thread: an N-model form became ready
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="model-load", initializer=self.device.bind_thread)
        # what serves faster once ready but no load needs (an architecture's N-model form): loads never queue
        # behind it; like the load thread it holds the device's lock around each call into the device
        self._background = cf.ThreadPoolExecutor(1, thread_name_prefix="model-prepare",
                                                 initializer=self.device.bind_thread)
        # how models become runners, chosen once from the device (gpu_actor/runner.py)
        self.loader: Loader = Architectures(device, max_batch, self._threads, self._spin, options.precision,
                                            options.cuda_graphs, options.mixed_steps) \
            if device.shared_weights else OwnSessions(device, self._threads, self._spin)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._background.shutdown(wait=False, cancel_futures=True)
        self.loaded.clear()

    def _held(self, model: str) -> bool:
        return bool(self.busy[model] or self.pins.get(model))

    def queued(self, model: str) -> None:
        """A task for `model` came: it is held (never evicted) until `finished`."""
        self.busy[model] += 1

    def finished(self, model: str) -> None:
        self.busy[model] -= 1

    def pin(self, model: str, req: int = 0) -> None:
        """A live session needs `model` here (pinned by request `req`): held until as many `unpin`s, or
        until the process that pinned it restarts (`drop_pins_below`)."""
        self.pins.setdefault(model, []).append(req)

    def unpin(self, model: str, req: int = 0) -> None:
        """A session of the process that made request `req` closed: one of that process's pins of `model`
        goes (another process's stay, for its restart to drop)."""
        release_owned(self.pins, model, req)

    def drop_pins_below(self, floor: int) -> int:
        """The pins of a frontend (or bridge) that restarted, by its predecessor's request ids: their
        sessions went with it and no one will unpin them. Models over the caps that they held are
        evicted now. How many pins went."""
        dropped = drop_owned_below(self.pins, floor)
        if dropped:
            self._make_room(extra=0)
        return dropped

    def stat(self, model: str) -> ModelStats:
        return self.stats.setdefault(model, ModelStats())

    # -- loading -----------------------------------------------------------------------------

    def start_load(self, model: str) -> bool:
        """Begin loading `model` unless it is loaded or loading; False if the id is unknown."""
        self._unload_when_loaded.discard(model)   # the newer wish wins
        if model in self.loaded or model in self.loading:
            return True
        path = self._resolve(model)
        if path is None:
            return False
        self._make_room(extra=1)
        self.loading[model] = self._submit(model, path)
        return True

    def _submit(self, model: str, path: Optional[Path]) -> cf.Future:
        if path is None:   # gone from the catalog meanwhile
            future: cf.Future = cf.Future()
            future.set_result(LoadResult(model, None, 0, 0.0, f"unknown model {model!r}", "unknown_model"))
        else:
            future = self._pool.submit(self._load, model, path)
        future.add_done_callback(lambda _: self._wake())
        return future

    def _load(self, model: str, path: Path) -> LoadResult:
        t0 = time.perf_counter()
        try:
            runner = self.loader.load(path, model)
            self._companions(model)
        except AssetError as err:
            return LoadResult(model, None, 0, 0.0, str(err), "unknown_model" if "missing" in str(err) else "bad_request")
        except Exception as err:  # a model must never take the worker down
            code = "out_of_memory" if out_of_memory(err) else "bad_request"
            return LoadResult(model, None, 0, 0.0, f"{path}: {type(err).__name__}: {str(err)[:300]}", code)
        return LoadResult(model, runner, runner.nbytes, (time.perf_counter() - t0) * 1000, None)

    def _prepare_more(self, runner: Callable[[], Optional[Runner]]) -> None:
        """(The background thread) what serves `runner`'s model faster once ready, where due (an
        architecture's N-model form: gpu_actor/architectures.Architectures.prepare_more); a failure is
        logged: mixed steps run as sub-calls."""
        try:
            if self.loader.prepare_more(runner):
                self._prepared_more = True   # (the worker says so from its own thread: poll_loads)
                self._wake()
        except Exception:   # onnxruntime's own errors, or a bug: the models still serve, one call each
            log.exception("preparing an architecture's N-model form failed; its mixed steps run a call per model")

    def frames_per_s(self) -> float:
        """The frames a second the device runs with the models loaded now: the lowest of their runners'
        (an architecture's, measured per size: gpu_actor/prepared.Prepared.frames_per_s); 0: not measured
        (the CPU provider, or no model)."""
        return min((f for f in (m.runner.frames_per_s for m in self.loaded.values()) if f > 0), default=0.0)

    def poll_loads(self) -> list[LoadResult]:
        """Finished loads, now in the loaded set (or failed); call from the worker loop. Every model event
        carries the device's frames/s after it (admission's, frontend/live/capacity.py)."""
        if self._prepared_more:
            self._prepared_more = False
            self._on_event("", "prepared", 0.0, 0, self.frames_per_s())
        done = []
        for model, future in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[model]
            result = future.result()
            stats = self.stat(model)
            if result.code == "out_of_memory":
                if self._evict_one(keep=model):
                    self.loading[model] = self._submit(model, self._resolve(model))   # again, with room made
                    continue
                result.code = "overloaded"
                result.error = (f"{result.error} (the device has no memory for model {model} and every loaded "
                                "model is in use: retry when fewer are, or lower inference.max_models_per_worker)")
            if result.runner is None:
                stats.errors += 1
                self._on_event(model, "failed", 0.0, 0, 0.0)
            else:
                stats.loads += 1
                stats.load_ms, stats.nbytes = result.load_ms, result.nbytes
                stats.frames_per_s = result.runner.frames_per_s
                self.loaded[model] = Loaded(result.runner, result.nbytes, time.monotonic())
                self._on_event(model, "loaded", result.load_ms, result.nbytes, self.frames_per_s())
                # (a thread of its own: no avatar's load waits for it)
                self._background.submit(self._prepare_more, weakref.ref(result.runner))
                if model in self._unload_when_loaded:
                    self._unload_when_loaded.discard(model)
                    self._drop(model, "unloaded")
                else:
                    self._make_room(extra=0, keep=model)
            done.append(result)
        return done

    # -- eviction ----------------------------------------------------------------------------

    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.loaded.values())

    def _over_cap(self, extra: int) -> bool:
        if len(self.loaded) + len(self.loading) + extra > self.max_models:
            return True
        return bool(self.max_bytes) and self.total_bytes() > self.max_bytes

    def _make_room(self, extra: int, keep: Optional[str] = None) -> None:
        while self._over_cap(extra):
            if not self._evict_one(keep):
                log.warning("model cap exceeded but every loaded model is busy; evicting later")
                return

    def _evict_one(self, keep: Optional[str] = None) -> bool:
        """Evict the idle model `inference.eviction` picks; False if every loaded model is held."""
        idle = [(m, s) for m, s in self.loaded.items() if not self._held(m) and m != keep]
        if not idle:
            return False
        if self.eviction == "lfu":
            victim = min(idle, key=lambda ms: (self.stat(ms[0]).uses, ms[1].last_used))[0]
        else:
            victim = min(idle, key=lambda ms: ms[1].last_used)[0]
        self.stat(victim).evictions += 1
        self._drop(victim, "evicted")
        return True

    def _drop(self, model: str, event: str) -> None:
        self.loaded.pop(model)   # (its device memory goes back with the next load: Architectures.load)
        self._on_event(model, event, 0.0, 0, self.frames_per_s())

    def unload(self, model: str) -> bool:
        """Unload now if idle; returns False if it is busy (the caller reports it)."""
        if self._held(model):
            return False
        if model in self.loading:  # the load thread cannot be stopped: drop the model when it is done
            self._unload_when_loaded.add(model)
            return True
        if model not in self.loaded:
            return True
        self._drop(model, "unloaded")
        return True

    def unload_idle(self, now: float) -> None:
        if not self.idle_unload_s:
            return
        for model, state in list(self.loaded.items()):
            if not self._held(model) and now - state.last_used > self.idle_unload_s:
                self._drop(model, "unloaded")

    def touch(self, model: str, frames: int) -> None:
        state = self.loaded[model]
        state.last_used = time.monotonic()
        stats = self.stat(model)
        stats.uses += 1
        stats.requests += 1
        stats.frames += frames
        stats.last_used = time.time()
