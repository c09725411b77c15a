"""python -m bench gpu: inference on one device, from onnxruntime alone up to live sessions, in one run.

The sections, in the order of their value (a run cut short keeps the first ones):

1. on a fresh server, each batch size's first `infer` after ready against its steady time;
2. the anchor: onnxruntime alone on the real-size unet_328 (random weights), its inputs and outputs
   already on the device, at each prepared shape (the batch sizes a worker runs: gpu_actor/shapes.prepared_sizes);
3. served `infer` per batch (visual input sent, 2 in flight) and its ratio to the anchor at that batch,
   with the inference process's CPU per 1,000 frames/s;
4. live JPEG levels, 27 % speaking: audio windows, then 16 kHz PCM in 20-ms chunks in real time;
5. distinct models: `session_open` -> the first speech frame and device MiB per model; one model's
   load while sessions speak (their speech missed during it);
6. the rest: a model's own session against its architecture's prepared session (weights bound per call),
   calls alternating between shapes, served `infer` once per further variant (`--variants`: fp16,
   fp32+graphs, fp16+graphs, i.e. inference.precision and inference.cuda_graphs), each on a server of
   its own, all against the fp32 anchor in one table; how many models stay resident on the device.
Every section but the further variants runs the first variant, on one server.

`--budget-s` bounds the whole run: before each section its cost is estimated from the settings and what
the run has measured so far (a first call per batch size, a server's start, a load), and a section that
would not fit is skipped and named. The figures are written (`save`) after every section. SIGINT or
SIGTERM stops the run where it is: the section in progress is marked interrupted and left in its thread,
the servers are stopped, the figures so far are kept.

Where onnxruntime has no CUDA provider or cupy sees no GPU it runs the same on the CPU provider with
small counts, so CI keeps it working. `--stand-in S` has CPU workers batch as the GPU path does and
stall S seconds on each (session, shape)'s first call, as cuDNN does, so a CPU host shows the GPU
path's first-call figures.

In-process sections: bench/gpu_device.py; sections that drive a server: bench/gpu_server.py.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bench.gpu_device import anchor, device_name, own_vs_shared, pick_device, print_anchor, \
    print_own_vs_shared
from bench.gpu_server import COLD_S, GROUPED_WAIT_S, WARM_S, LazyServer, alternating, alternating_calls, first_calls, \
    first_frames, live, load_while_speaking, residency, served, stop_children
from gpu_actor.device import CPU, STAND_IN_ENV, is_gpu
from gpu_actor.onnx_sessions import cuda_id
from gpu_actor.shapes import prepared_sizes

DISTINCT_WEIGHTS = 8              # residency: model files of distinct weights, the ids beyond hard-linked
VARIANTS = ("fp32", "fp16", "fp32+graphs", "fp16+graphs")
PCM_SECONDS = 4.0                 # the utterance a PCM session sends from its start in each burst


@dataclass(frozen=True)
class GpuBenchOptions:
    device: str                   # "cpu" or "cuda:N"
    model: str                    # model_builder kind: unet328 | tiny
    max_batch: int
    levels: tuple[int, ...]       # live levels, audio windows
    seconds: float                # per measurement (anchor shape, served batch, own vs shared batch)
    speaking: int                 # sessions speaking while a model loads
    max_models: int
    avatars: int                  # distinct models timed from session_open to the first speech frame
    residency_s: float
    stand_in: Optional[float]
    budget_ms: int = 280
    steady_calls: int = 10
    variants: tuple[str, ...] = ("fp32",)   # served infer's, each on a server of its own; the first: every section's
    pcm_levels: tuple[int, ...] = ()        # live levels, 16 kHz PCM
    avatar_levels: tuple[int, ...] = ()     # live levels, 16 kHz PCM, each session on an avatar of its own
    live_s: float = 8.0                     # per live level
    speaking_share: float = 0.27            # of each live session's time
    shed: bool = True                       # sessions.shed_speech
    budget_s: Optional[float] = None        # the whole run; None: no limit
    sections: tuple[str, ...] = ()          # only these (SECTIONS; served_<variant>); (): every one
    profile: Optional[Path] = None          # py-spy recordings of the frontend and inference per live level
    frontends: int = 1                      # frontend.processes


def options(device: str = "auto", model: str = "unet328", max_batch: Optional[int] = None,
            levels: Optional[tuple[int, ...]] = None, seconds: float = 8.0, speaking: Optional[int] = None,
            max_models: Optional[int] = None, avatars: Optional[int] = None, residency_s: Optional[float] = None,
            stand_in: Optional[float] = None, budget_ms: int = 280, variants: Optional[tuple[str, ...]] = None,
            pcm_levels: Optional[tuple[int, ...]] = None, live_s: Optional[float] = None,
            budget_s: Optional[float] = None, avatar_levels: Optional[tuple[int, ...]] = None,
            speaking_share: float = 0.27, shed: bool = True, sections: tuple[str, ...] = (),
            profile: Optional[Path] = None, frontends: int = 1) -> GpuBenchOptions:
    """The bench's settings, each one not given at its default for the device: large on a GPU, a few
    seconds' worth on the CPU provider. ValueError for a variant the device does not run."""
    device = pick_device(device)
    gpu = is_gpu(device)

    def pick(value, on_gpu, on_cpu):
        return value if value is not None else (on_gpu if gpu else on_cpu)

    variants = pick(variants, VARIANTS, ("fp32", "fp16") if stand_in is not None else ("fp32",))
    check_variants(variants, gpu or stand_in is not None)
    if not 0 < speaking_share <= 1:
        raise ValueError(f"--speaking-share {speaking_share:g}: expected a share of the time, above 0 and at most 1")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"--budget-s {budget_s:g}: expected the whole run's seconds, > 0")
    unknown = [name for name in sections if name not in SECTIONS and not name.startswith("served_")]
    if unknown:
        raise ValueError(f"--sections {','.join(unknown)}: expected a comma list of {', '.join(SECTIONS)} "
                         "(served_<variant> for a further variant's)")
    return GpuBenchOptions(device, model, pick(max_batch, 32, 4), pick(levels, (16, 48, 96, 150, 200), (1, 2)),
                           seconds, pick(speaking, 20, 2), pick(max_models, 1000, 8), pick(avatars, 4, 2),
                           pick(residency_s, 240.0, 60.0), stand_in, budget_ms, steady_calls=10 if gpu else 3,
                           variants=tuple(dict.fromkeys(variants)), pcm_levels=pick(pcm_levels, (48, 150), (1,)),
                           avatar_levels=pick(avatar_levels, (48, 150), (2,)),
                           live_s=live_s if live_s is not None else seconds, budget_s=budget_s,
                           speaking_share=speaking_share, shed=shed, sections=tuple(sections), profile=profile,
                           frontends=frontends)


def check_variants(variants: tuple[str, ...], gpu_path: bool) -> None:
    """Names among VARIANTS; fp16 and CUDA graphs only where workers run the GPU path (a GPU, --stand-in)."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants {','.join(variants)!r}: expected a comma list of {', '.join(VARIANTS)}")
    gpu_path_only = [v for v in variants if v != "fp32"]
    if gpu_path_only and not gpu_path:
        raise ValueError(f"--variants {','.join(gpu_path_only)}: the CPU provider's workers run fp32 in sessions of "
                         "their own (no fp16, no CUDA graphs); use --stand-in S to run the GPU path on the CPU")


def variant_settings(variant: str) -> dict:
    precision, _, graphs = variant.partition("+")
    return {"inference.precision": precision, "inference.cuda_graphs": graphs == "graphs"}


def _described(variant: str) -> str:
    s = variant_settings(variant)
    graphs = "true" if s["inference.cuda_graphs"] else "false"
    return f"inference.precision {s['inference.precision']}, inference.cuda_graphs {graphs}"


# -- shapes ------------------------------------------------------------------------------------------

def served_batches(sizes: tuple[int, ...], max_batch: int) -> tuple[int, ...]:
    """The prepared sizes and a few between them."""
    return tuple(sorted({*sizes, *(b for b in (3, 24) if b <= max_batch)}))


# -- models on disk ----------------------------------------------------------------------------------

def avatar(root: Path, name: str, demo_dir: Path, model: Callable[[Path], None], encoder: bool = False) -> str:
    """A model directory: the demo's 1280x720 frames (hard links) and crop rects, `model(path)` writing
    its model.onnx, and with `encoder` an audio encoder (sessions that send 16 kHz PCM)."""
    d = root / name
    (d / "frames").mkdir(parents=True)
    src = demo_dir / "demo"
    for f in (src / "frames").iterdir():
        os.link(f, d / "frames" / f.name)
    shutil.copy(src / "crop_rects.json", d / "crop_rects.json")
    model(d / "model.onnx")
    if encoder:
        from gpu_actor.model_builder import write_audio_encoder
        write_audio_encoder(d / "audio_encoder.onnx")
    return name


def _written(kind: str, seed: int) -> Callable[[Path], None]:
    from gpu_actor.model_builder import write_model
    return lambda path: write_model(path, kind=kind, audio="ave", seed=seed)


# -- what sections cost ------------------------------------------------------------------------------

# NOTE: docs/benchmarks.md, an H100: a first call at a new batch size took 3.1-5.7 s (cuDNN EXHAUSTIVE);
# the estimates take the worst until this run has measured its own
GPU_FIRST_CALL_S = 5.7
SECTIONS = ("first_call", "anchor", "served", "live", "live_pcm", "live_avatars", "first_frame", "load_while_speaking",
            "own_vs_shared", "alternating", "variants", "residency")   # in the order they run
STOP_S = 5.0          # a server's stop (SIGTERM, drain, its processes gone): kept in hand while one runs
LEVEL_S = 3.0         # a live level's sessions opened and closed, besides its seconds
FP16_PROBES = 2       # inference.precision fp16's first load runs an fp32 probe and an fp16 one (or more)


@dataclass
class Costs:
    """What the estimates rest on: priors from the settings, each replaced by what the run measures."""
    local_first_call_s: float  # a (session, batch size)'s first call in the bench's own process (and an fp16 probe's)
    server_s: float            # a server's start to READY
    prepare_s: float           # a server's first load: the model's architecture prepared at every size
    frame_ms: float            # served infer, per frame
    load_s: float              # a further model's load, its architecture prepared
    write_s: float             # a model file written (random weights)


def priors(o: GpuBenchOptions, sizes: tuple[int, ...]) -> Costs:
    gpu, unet = is_gpu(o.device), o.model == "unet328"
    # NOTE: on the stand-in, three sessions stall at each size: the model's, the crops graph's and the audio
    # encoder's; on a GPU the crops graph has no convolution and the encoder's are small
    first = GPU_FIRST_CALL_S if gpu else 3 * (o.stand_in or 0.0)
    return Costs(local_first_call_s=GPU_FIRST_CALL_S if gpu else 0.0,
                 server_s=15.0 if gpu else 10.0, prepare_s=len(sizes) * first + (2.0 if unet else 0.5),
                 frame_ms=(3.0 if gpu else 250.0) if unet else (2.0 if gpu else 15.0),
                 load_s=(0.5 if gpu else 1.5) if unet else 0.3, write_s=0.8 if unet else 0.05)


class Budget:
    """The whole run's seconds (None: no limit), counted from `started` on `clock`."""

    def __init__(self, seconds: Optional[float], started: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.started, self.clock = seconds, started, clock

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()


# -- signals -----------------------------------------------------------------------------------------

class Signals:
    """SIGINT and SIGTERM only note the signal: the main thread, waiting for a section's thread with a
    timeout, sees it and stops the run there (`SectionRunner.section`)."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:   # (a second one, while the run stops, changes nothing)
            self.received = signum


class Interrupted(Exception):
    """A signal stopped the run (Signals)."""


# -- servers and sections ----------------------------------------------------------------------------

def _pays(server: LazyServer, costs: Costs) -> float:
    """What a section on `server` pays before its own work: the server's start and its first load (every
    section loads a model of the one architecture, which the first load prepares)."""
    return 0.0 if server.running or server.error else costs.server_s + costs.prepare_s


class SectionRunner:
    """One run's sections: the budget check, the heading, the figures (or the error, or why it was
    skipped, or the signal that stopped it), the time against the estimate, and `save` after each."""

    def __init__(self, results: dict, budget: Budget, signals: Signals, save: Callable[[dict], None],
                 only: tuple[str, ...] = ()):
        self.results, self.budget, self.signals, self._save = results, budget, signals, save
        self.only = only   # --sections: the others are skipped, named
        self.servers: list[LazyServer] = []
        self.stopped_in = "setup"   # the section a signal stopped (else the run's setup)

    def save(self) -> None:
        self.results["run"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        self._save(self.results)

    def left(self) -> float:
        """Seconds of the budget a section may take: the running servers' stop kept in hand."""
        return self.budget.left() - STOP_S * sum(s.running for s in self.servers)

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= 0 or estimate_s <= self.left()

    def section(self, name: str, heading: str, estimate_s: float, body: Callable[[], object]) -> None:
        """Interrupted where a signal came before or during it."""
        if self.signals.received is not None:
            raise Interrupted(self.signals.name())
        print(f"\n{heading}", flush=True)
        run = self.results["run"]
        if self.only and name not in self.only:
            reason = "not in --sections"
        elif not self.fits(estimate_s):
            reason = (f"about {estimate_s:.0f} s, {max(self.left(), 0):.0f} s of --budget-s "
                      f"{self.budget.seconds:g} left")
        else:
            reason = None
        if reason is not None:
            self.results[name] = {"skipped": reason}
            run["skipped"][name] = reason
            print(f"  skipped: {reason}", flush=True)
            self.save()
            return
        clock = self.budget.clock
        t = clock()
        try:
            self.results[name] = self._in_thread(name, body)
        except Interrupted:
            self.stopped_in = name
            self.results[name] = {"interrupted": f"{self.signals.name()} after {clock() - t:.1f} s"}
            raise
        except Exception as err:
            self.results[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"  section failed: {type(err).__name__}: {err}", flush=True)
            traceback.print_exception(err)
        finally:
            took = clock() - t
            run["sections"][name] = {"s": round(took, 1), "estimate_s": round(estimate_s, 1)}
            print(f"  ({took:.1f} s; estimated {estimate_s:.0f} s)", flush=True)
            self.save()

    def _in_thread(self, name: str, body: Callable[[], object]) -> object:
        """`body()` in a thread of its own, waited for until it ends or a signal comes. NOTE: a signal
        leaves it where it is: its client calls may be waiting for a server that the same signal stops
        (a session's close, up to its timeout), and cutting them short is what the run's end is for."""
        out: dict = {}

        def target() -> None:
            try:
                out["figures"] = body()
            except BaseException as err:   # (re-raised in the main thread)
                out["error"] = err
        thread = threading.Thread(target=target, name=f"bench-gpu-{name}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if self.signals.received is not None:
                raise Interrupted(self.signals.name())
        if "error" in out:
            raise out["error"]
        return out["figures"]


def store_bytes(models: Path, o: GpuBenchOptions) -> int:
    """compositing.cache_bytes for the background store to hold every frame the live levels speak on (each
    a 1280x720 frame and its crop), so that no level decodes its avatars' frames again because the store
    evicted them: with 12 avatars of 24 frames, 512 MiB held 165 of their 288 frames, and the levels measured
    the host's decoding instead of the device's steps. At most half the free shared memory (said if so)."""
    from shm.store import entry_bytes
    frames = sum(1 for _ in (models / "avatar" / "frames").iterdir())
    avatars = 1 + o.avatars + max(o.avatar_levels, default=0)
    wanted = int(avatars * frames * entry_bytes(1280, 720) * 1.1)   # (JPEG sessions: no I420 copies)
    room = shutil.disk_usage("/dev/shm").free // 2
    if wanted > room:
        print(f"  the background store gets {room >> 20} MiB, half the free /dev/shm: {avatars} avatars of {frames} "
              f"frames want {wanted >> 20} MiB (levels past {room * avatars // wanted} avatars decode frames again)",
              flush=True)
    return max(512 << 20, min(wanted, room))


def _config(models: Path, o: GpuBenchOptions, metrics_port: int, variant: str) -> dict:
    from bench.sessions import _settings
    from tests.helpers import base_config
    return base_config(models, **{
        **_settings("jpeg", o.budget_ms, shed=o.shed, frontends=o.frontends),
        "compositing.cache_bytes": store_bytes(models, o),
        "limits.max_batch": o.max_batch, "limits.request_timeout_s": 600,
        "inference.devices": [cuda_id(o.device)] if is_gpu(o.device) else CPU,
        "inference.intra_op_threads": 0, "inference.max_models_per_worker": o.max_models + o.avatars + 8,
        "metrics.port": metrics_port, "inference.mixed_steps": "auto", **variant_settings(variant)})


def _served_name(variant: str, first: str) -> str:
    return "served" if variant == first else f"served_{variant}"


def _served_heading(variant: str, seconds: float, own_server: bool) -> str:
    return (f"served infer per batch, {variant} ({_described(variant)}"
            + ("; a server of its own" if own_server else "")
            + f"; visual input sent, 2 in flight, {seconds:g} s each) vs the fp32 anchor at that batch; the inference "
            "process's CPU (% of a core) per 1,000 frames/s:")


def variants_table(results: dict, variants: tuple[str, ...], batches: tuple[int, ...]) -> dict:
    """Each variant's served infer against the fp32 anchor, one row a variant: at each batch the ratio of
    its frames/s to the anchor's and the inference process's CPU per 1,000 frames/s."""
    first, out = variants[0], {}
    print(f"  {'variant':12}" + "".join(f"{'batch ' + str(b):>16}" for b in batches))
    for v in variants:
        r = results.get(_served_name(v, first), {})
        missing = next((f"{k}: {r[k]}" for k in ("error", "skipped", "interrupted") if k in r), None)
        if missing or not r:
            out[v] = {"error": missing or "not run"}
            print(f"  {v:12}  {out[v]['error']}", flush=True)
            continue
        out[v] = {b: {"fps": r[b]["fps"], "ratio": r[b]["ratio"],
                      "worker_cpu_per_1000_fps": r[b]["worker_cpu_per_1000_fps"]} for b in batches}
        cells = [(f"{row['ratio']:.2f}x" if row["ratio"] else "n/a") + f" {row['worker_cpu_per_1000_fps']:5.0f}%"
                 for row in out[v].values()]
        print(f"  {v:12}" + "".join(f"{c:>16}" for c in cells), flush=True)
    return out


# -- the run -----------------------------------------------------------------------------------------

def run(demo_dir: str, o: GpuBenchOptions, save: Callable[[dict], None] = lambda results: None,
        started: Optional[float] = None) -> dict:
    """Every section that fits `o.budget_s` (counted from `started`, the process's start), `save(results)`
    after each. results["run"]["signal"]: the signal that stopped the run, if one did."""
    demo = Path(demo_dir)
    budget = Budget(o.budget_s, time.monotonic() if started is None else started)
    root = Path(tempfile.mkdtemp(prefix="lsync-gpu-"))
    env = {STAND_IN_ENV: str(o.stand_in)} if o.stand_in is not None else None
    # the shapes the worker runs (with the stand-in, the GPU path's, on the CPU provider): the anchor's too
    # the worker's own table: batched on a card and on the stand-in, one frame a call on the CPU provider
    sizes = prepared_sizes(o.max_batch, batched=bool(env) or is_gpu(o.device))
    results: dict = {"device": o.device, "device_name": device_name(o.device), "model": o.model,
                     "prepared_sizes": sizes, "stand_in_s": o.stand_in, "variants_run": o.variants,
                     "run": {"budget_s": o.budget_s, "elapsed_s": 0.0, "sections": {}, "skipped": {},
                             "server_errors": [], "interrupted": None, "signal": None}}
    print(f"device {results['device_name']}; model {o.model} (random weights); limits.max_batch {o.max_batch}, "
          f"prepared shapes {', '.join(map(str, sizes))}"
          + (f"; stand-in device: CPU workers batch as on a GPU and stall {o.stand_in:g} s on each shape's first "
             f"call ({STAND_IN_ENV})" if env else "")
          + f"; variants {', '.join(o.variants)} (served infer runs each; the other sections {o.variants[0]})"
          + (f"; --budget-s {o.budget_s:g}, {budget.elapsed():.0f} s spent before the first section"
             if o.budget_s is not None else ""), flush=True)
    signals = Signals()
    r = SectionRunner(results, budget, signals, save, o.sections)
    signals.install()
    try:
        _sections(r, root, demo, o, env, sizes)
    except Interrupted:
        results["run"].update(interrupted=f"{signals.name()} during {r.stopped_in}", signal=signals.received)
        print(f"\nstopped by {results['run']['interrupted']}: the servers are stopped, the figures so far kept",
              flush=True)
    finally:
        for s in reversed(r.servers):
            failed = s.stop()
            if failed:
                results["run"]["server_errors"].append(failed)
                print(f"\n  a server's stop failed: {failed}", flush=True)
        stopped = stop_children()
        if stopped:
            results["run"]["server_errors"].append(f"stopped by SIGTERM at the end: {', '.join(stopped)}")
        shutil.rmtree(root, ignore_errors=True)
        _summary(results, budget)
        r.save()
        signals.restore()
    return results


def _summary(results: dict, budget: Budget) -> None:
    run = results["run"]
    run["elapsed_s"] = round(budget.elapsed(), 1)
    spent = f"{run['elapsed_s']:.0f} s" + (f" of --budget-s {budget.seconds:g}" if budget.seconds is not None else "")
    skipped = "; ".join(f"{k} ({v})" for k, v in run["skipped"].items())
    print(f"\nrun: {spent}" + (f"; skipped: {skipped}" if skipped else "; no section skipped")
          + (f"; {run['interrupted']}" if run["interrupted"] else ""), flush=True)


def _sections(r: SectionRunner, root: Path, demo: Path, o: GpuBenchOptions, env: Optional[dict],
              sizes: tuple[int, ...]) -> None:
    """Every section in the order of its value (the module docstring)."""
    from tests.helpers import free_ports
    batches = served_batches(sizes, o.max_batch)
    first, results, costs = o.variants[0], r.results, priors(o, sizes)
    models = root / "models"
    models.mkdir()
    avatar(models, "avatar", demo, _written(o.model, 0), encoder=True)
    port = free_ports(o.frontends)
    main = LazyServer(root, _config(models, o, port, first), env)
    r.servers.append(main)
    n, a = len(sizes), None

    def served_s() -> float:
        return len(batches) * (o.seconds + 2 * max(batches) * costs.frame_ms / 1000) + 1

    def first_called() -> dict:
        figures = first_calls(main.get(), "avatar", batches, o.steady_calls)
        costs.server_s = main.start_s
        costs.prepare_s = figures["load"]["client_ms"] / 1000
        costs.frame_ms = max(v["steady_ms"] / b for b, v in figures["batches"].items())
        return figures

    r.section("first_call", "first call per shape after ready (a fresh server, the model loaded, then one infer at "
              f"each batch; steady: the median of {o.steady_calls}):",
              _pays(main, costs) + sum(batches) * (1 + o.steady_calls) * costs.frame_ms / 1000, first_called)

    def anchored() -> dict:
        figures = anchor(models / "avatar" / "model.onnx", o.device, sizes, o.seconds)
        print_anchor(figures)
        costs.local_first_call_s = max(max(v["first_ms"] - v["ms"] for v in figures.values()) / 1000, 0.0)
        return figures

    r.section("anchor", f"onnxruntime alone, inputs and outputs on the device ({o.device}), per prepared shape "
              f"({o.seconds:g} s each, the median call):", 1 + n * (costs.local_first_call_s + o.seconds), anchored)
    if "error" not in results["anchor"] and "skipped" not in results["anchor"]:
        a = results["anchor"]

    r.section("served", _served_heading(first, o.seconds, own_server=False), _pays(main, costs) + served_s(),
              lambda: served(main.get(), "avatar", batches, sizes, a, o.seconds))
    _live_sections(r, main, o, port, costs, models, demo)
    _model_sections(r, root, models, demo, main, o, port, costs, sizes, batches)
    _variant_sections(r, root, models, o, env, costs, sizes, batches, a, served_s)

    pool: list[Path] = []

    def resident_model(k: int) -> str:
        if len(pool) < DISTINCT_WEIGHTS:   # (outside models/: the catalog never sees them)
            path = root / f"weights-{k}.onnx"
            _written(o.model, 200 + k)(path)
            pool.append(path)
        return avatar(models, f"r{k:04d}", demo, lambda path: os.link(pool[k % len(pool)], path))

    # NOTE: residency loads until --residency-s or the budget ends, whichever comes first; it needs room for
    # three loads at least
    seconds = min(o.residency_s, r.left() - _pays(main, costs) - costs.load_s - 2)
    clipped = f" (clipped to {max(seconds, 0):.0f} s by --budget-s)" if seconds < o.residency_s else ""
    loads_s = min(max(seconds, 3 * costs.load_s), o.max_models * 1.5 * costs.load_s)
    r.section("residency", f"models resident on the device: distinct models loaded one after another until one is "
              f"evicted, a load fails, --max-models {o.max_models} or --residency-s {o.residency_s:g}{clipped} "
              f"(weights of {min(DISTINCT_WEIGHTS, o.max_models)} distinct seeds, the other files hard links of "
              "them: the worker holds each model id's own copy):",
              _pays(main, costs) + costs.load_s + 2 + loads_s,
              lambda: residency(main.get(), o.device, resident_model, o.max_models, seconds))


def _live_sections(r: SectionRunner, main: LazyServer, o: GpuBenchOptions, port: int, costs: Costs, models: Path,
                   demo: Path) -> None:
    """Live levels on the first variant's server: audio windows, then 16 kHz PCM."""
    from config.audio import speech
    share = f"{o.speaking_share:.0%}"

    def levels_s(levels: tuple[int, ...]) -> float:
        return _pays(main, costs) + sum(o.live_s + LEVEL_S + n * 0.02 for n in levels)

    def recorded(section: str) -> Optional[Path]:
        return o.profile / section if o.profile is not None else None

    if o.levels:
        r.section("live", f"live sessions on the {o.model} model (1280x720 JPEG q75, {share} speaking, audio windows, "
                  f"{o.live_s:g} s per level): missed, on time, latency p99, each process's CPU:",
                  levels_s(o.levels), lambda: live(main.get(), o.levels, o.live_s, port, duty=o.speaking_share,
                                                   profile=recorded("live")))
    if o.pcm_levels:
        r.section("live_pcm", f"live sessions speaking 16 kHz PCM on the {o.model} model (20-ms chunks in real time, "
                  f"the avatar's audio encoder in the inference process; 1280x720 JPEG q75, {share} speaking, "
                  f"{o.live_s:g} s per level):", levels_s(o.pcm_levels),
                  lambda: live(main.get(), o.pcm_levels, o.live_s, port, speech(PCM_SECONDS), duty=o.speaking_share,
                               profile=recorded("live_pcm")))
    if o.avatar_levels:
        most = max(o.avatar_levels)
        r.section("live_avatars", f"live sessions speaking 16 kHz PCM, each on an avatar of its own ({o.model}, one "
                  f"architecture, other weights; 20-ms chunks in real time, {share} speaking, {o.live_s:g} s per level):",
                  levels_s(o.avatar_levels) + COLD_S + GROUPED_WAIT_S + LEVEL_S + most * (costs.write_s + costs.load_s),
                  lambda: live(main.get(), o.avatar_levels, o.live_s, port, speech(PCM_SECONDS), duty=o.speaking_share,
                               models=tuple(avatar(models, f"v{k:03d}", demo, _written(o.model, 500 + k), encoder=True)
                                            for k in range(most)), profile=recorded("live_avatars")))


def _model_sections(r: SectionRunner, root: Path, models: Path, demo: Path, main: LazyServer, o: GpuBenchOptions,
                    port: int, costs: Costs, sizes: tuple[int, ...], batches: tuple[int, ...]) -> None:
    """Loads (first frame, while speaking), then own vs shared and alternating shapes."""
    results = r.results

    def framed() -> list:
        distinct = [avatar(models, f"a{k:03d}", demo, _written(o.model, 100 + k)) for k in range(o.avatars)]
        rows = first_frames(main.get(), o.device, distinct)
        times = [row["load_ms"] for row in rows if row["load_ms"]]
        if times:
            costs.load_s = max(times) / 1000
        return rows

    r.section("first_frame", f"model load -> first frame: {o.avatars} distinct models, session_open then 1 s of "
              "speech at once; MiB per model as the worker's stats tell (nbytes) and as measured ("
              + ("the GPU's memory in use" if is_gpu(o.device) else "the worker's resident memory") + "):",
              _pays(main, costs) + o.avatars * (costs.write_s + costs.load_s + 2.5), framed)
    load_s = max(costs.load_s * 1.5, 1.0)
    r.section("load_while_speaking", f"a load while {o.speaking} sessions speak:",
              _pays(main, costs) + costs.write_s + WARM_S + 3 * load_s + o.budget_ms / 1000 + 2.3 + LEVEL_S
              + o.speaking * 0.02,
              lambda: load_while_speaking(main.get(), avatar(models, "w000", demo, _written(o.model, 99)), o.speaking,
                                          port, o.budget_ms, load_s))

    def compared() -> dict:
        further = root / "further.onnx"   # (outside models/: the catalog never sees it)
        _written(o.model, 1)(further)
        figures = own_vs_shared(models / "avatar" / "model.onnx", further, o.device, o.max_batch, o.seconds)
        print_own_vs_shared(figures, reference=not is_gpu(o.device) and o.model == "unet328")
        return figures

    # on a GPU: the own session's first calls at two sizes (twice: a further model), the shared one's at every size
    own_sizes = 2 if is_gpu(o.device) else 1
    r.section("own_vs_shared", f"a model's own session vs its architecture's prepared session (weights bound per call), "
              f"the {o.model} model on {o.device}"
              + (" (the shared one as on the stand-in device)" if not is_gpu(o.device) else
                 " (both with inputs on the device: no host copies)")
              + f": ready time and memory against the weight bytes, a further model's, then ms per frame in "
              f"interleaved rounds ({o.seconds:g} s per batch):",
              costs.write_s + (len(sizes) + 2 * own_sizes) * costs.local_first_call_s + own_sizes * (o.seconds + 1) + 3,
              compared)
    steady = results.get("first_call", {}).get("batches")
    shapes = alternating(batches)
    r.section("alternating", f"calls alternating between shapes {', '.join(map(str, shapes))} ({o.steady_calls} "
              "rounds), median vs the same shape's steady calls (first call per shape's):",
              _pays(main, costs) + o.steady_calls * sum(shapes) * costs.frame_ms / 1000 + 1,
              lambda: alternating_calls(main.get(), "avatar", shapes, o.steady_calls, steady))


def _variant_sections(r: SectionRunner, root: Path, models: Path, o: GpuBenchOptions, env: Optional[dict],
                      costs: Costs, sizes: tuple[int, ...], batches: tuple[int, ...], a: Optional[dict],
                      served_s: Callable[[], float]) -> None:
    """Served infer of each further variant, each on a server of its own; then every variant against the anchor."""
    from tests.helpers import free_ports
    first = o.variants[0]
    for v in o.variants[1:]:
        server = LazyServer(root, _config(models, o, free_ports(o.frontends), v), env)
        r.servers.append(server)
        probes = FP16_PROBES * costs.local_first_call_s if v.startswith("fp16") else 0.0
        r.section(_served_name(v, first), _served_heading(v, o.seconds, own_server=True),
                  _pays(server, costs) + probes + served_s(),
                  lambda s=server: served(s.get(), "avatar", batches, sizes, a, o.seconds))
        failed = server.stop()
        r.servers.remove(server)
        if failed:
            r.results["run"]["server_errors"].append(failed)
            print(f"  the {v} server's stop failed: {failed}", flush=True)
    r.section("variants", "variants against the fp32 anchor: served infer's frames/s over the anchor's at "
              "each batch, and the inference process's CPU (% of a core) per 1,000 frames/s:", 0.0,
              lambda: variants_table(r.results, o.variants, batches))
