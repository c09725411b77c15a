"""python -m bench gpu: inference on one device, from onnxruntime alone up to live sessions, in one run.

- the anchor: onnxruntime alone on the real-size unet_328 (random weights), its inputs and outputs
  already on the device, at each prepared shape (the batch sizes a worker runs: `prepared_sizes`);
- a model's own session against its architecture's shared session (weights bound per call): ready
  time, memory against the weight bytes, ms per frame at batch 1 and the largest prepared size;
- on a fresh server, each batch size's first `infer` after ready against its steady time, and calls
  alternating between shapes;
- served `infer` per batch (visual input sent, 2 in flight) and its ratio to the anchor at that batch,
  with the inference process's CPU per 1,000 frames/s: once per variant (`--variants`: fp32, fp16,
  fp32+graphs, fp16+graphs, i.e. inference.precision and inference.cuda_graphs), each on a server of
  its own, then all of them against the fp32 anchor in one table;
- live JPEG levels on that model, 27 % speaking (bench/sessions.py's levels);
- distinct models: `session_open` -> the first speech frame and device MiB per model; one model's load
  while sessions speak (their speech missed during it); how many models stay resident on the device.
Every section but served `infer` runs the first variant.

Where onnxruntime has no CUDA provider or cupy sees no GPU it runs the same on the CPU provider with
small counts, so CI keeps it working. `--stand-in S` has CPU workers batch as the GPU path does and
stall S seconds on each (session, shape)'s first call, as cuDNN does, so a CPU host shows the GPU
path's first-call figures.

In-process sections: bench/gpu_device.py; sections that drive a server: bench/gpu_server.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bench.gpu_device import anchor, cuda_index, device_name, own_vs_shared, pick_device, print_anchor, \
    print_own_vs_shared
from bench.gpu_server import first_calls, first_frames, live, load_while_speaking, residency, served

STAND_IN_ENV = "LIPSYNC_STAND_IN_STALL_S"
DISTINCT_WEIGHTS = 8              # residency: model files of distinct weights, the ids beyond hard-linked
VARIANTS = ("fp32", "fp16", "fp32+graphs", "fp16+graphs")


@dataclass(frozen=True)
class GpuBenchOptions:
    device: str                   # "cpu" or "cuda:N"
    model: str                    # model_builder kind: unet328 | tiny
    max_batch: int
    levels: tuple[int, ...]
    seconds: float                # per measurement and per live level
    speaking: int                 # sessions speaking while a model loads
    max_models: int
    avatars: int                  # distinct models timed from session_open to the first speech frame
    residency_s: float
    stand_in: Optional[float]
    budget_ms: int = 280
    steady_calls: int = 10
    variants: tuple[str, ...] = ("fp32",)   # served infer's, each on a server of its own; the first: every section's


def options(device: str = "auto", model: str = "unet328", max_batch: Optional[int] = None,
            levels: Optional[tuple[int, ...]] = None, seconds: float = 8.0, speaking: Optional[int] = None,
            max_models: Optional[int] = None, avatars: Optional[int] = None, residency_s: Optional[float] = None,
            stand_in: Optional[float] = None, budget_ms: int = 280,
            variants: Optional[tuple[str, ...]] = None) -> GpuBenchOptions:
    """The bench's settings, each one not given at its default for the device: large on a GPU, a few
    seconds' worth on the CPU provider. ValueError for a variant the device does not run."""
    device = pick_device(device)
    gpu = device != "cpu"

    def pick(value, on_gpu, on_cpu):
        return value if value is not None else (on_gpu if gpu else on_cpu)

    variants = pick(variants, VARIANTS, ("fp32", "fp16") if stand_in is not None else ("fp32",))
    check_variants(variants, gpu or stand_in is not None)
    return GpuBenchOptions(device, model, pick(max_batch, 32, 4), pick(levels, (16, 48, 96, 150, 200), (1, 2)),
                           seconds, pick(speaking, 20, 2), pick(max_models, 1000, 8), pick(avatars, 4, 2),
                           pick(residency_s, 240.0, 60.0), stand_in, budget_ms, steady_calls=10 if gpu else 3,
                           variants=tuple(dict.fromkeys(variants)))


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

def prepared_sizes(max_batch: int, device: str) -> tuple[int, ...]:
    """The batch sizes a worker runs onnxruntime at, a batch padded up to the next: on a GPU the powers of
    two below `limits.max_batch` and max_batch itself; on the CPU provider one frame per call."""
    from gpu_actor.shapes import prepared_sizes as worker_sizes
    return tuple(worker_sizes(max_batch, batched=device != "cpu"))


def served_batches(sizes: tuple[int, ...], max_batch: int) -> tuple[int, ...]:
    """The prepared sizes and a few between them."""
    return tuple(sorted({*sizes, *(b for b in (3, 24) if b <= max_batch)}))


# -- models on disk ----------------------------------------------------------------------------------

def avatar(root: Path, name: str, demo_dir: Path, model: Callable[[Path], None]) -> str:
    """A model directory: the demo's 1280x720 frames (hard links) and crop rects, and `model(path)`
    writing its model.onnx."""
    d = root / name
    (d / "frames").mkdir(parents=True)
    src = demo_dir / "demo"
    for f in (src / "frames").iterdir():
        os.link(f, d / "frames" / f.name)
    shutil.copy(src / "crop_rects.json", d / "crop_rects.json")
    model(d / "model.onnx")
    return name


def _written(kind: str, seed: int) -> Callable[[Path], None]:
    from gpu_actor.model_builder import write_model
    return lambda path: write_model(path, kind=kind, audio="ave", seed=seed)


# -- sections ----------------------------------------------------------------------------------------

def _section(results: dict, name: str, heading: str, body: Callable[[], object]) -> None:
    """One section: its heading, then its figures, or its error (the other sections still run)."""
    print(f"\n{heading}", flush=True)
    try:
        results[name] = body()
    except Exception as err:
        results[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"  section failed: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()


def _server_sections(results: dict, root: Path, cfg: dict, env: Optional[dict],
                     sections: list[tuple[str, str, Callable]]) -> None:
    """Sections that share one server; a server that does not start (or stop cleanly) is reported
    under each section it left without figures."""
    from tests.helpers import run_server
    try:
        with run_server(root, cfg, env=env) as srv:
            for name, heading, body in sections:
                _section(results, name, heading, lambda: body(srv))
    except Exception as err:
        print(f"\n  server failed: {type(err).__name__}: {err}", flush=True)
        for name, heading, _ in sections:
            if name not in results:
                print(f"\n{heading}\n  section failed: the server: {type(err).__name__}: {err}", flush=True)
                results[name] = {"error": f"server: {type(err).__name__}: {err}"}


def _config(models: Path, o: GpuBenchOptions, metrics_port: int, variant: str) -> dict:
    from bench.sessions import _settings
    from tests.helpers import base_config
    return base_config(models, **{
        **_settings("jpeg", o.budget_ms), "limits.max_batch": o.max_batch, "limits.request_timeout_s": 600,
        "inference.devices": "cpu" if o.device == "cpu" else [cuda_index(o.device)],
        "inference.intra_op_threads": 0, "inference.max_models_per_worker": o.max_models + o.avatars + 8,
        "metrics.port": metrics_port, **variant_settings(variant)})


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
        if "error" in r:
            out[v] = {"error": r["error"]}
            print(f"  {v:12}  failed: {r['error']}", flush=True)
            continue
        out[v] = {b: {"fps": r[b]["fps"], "ratio": r[b]["ratio"],
                      "worker_cpu_per_1000_fps": r[b]["worker_cpu_per_1000_fps"]} for b in batches}
        cells = [(f"{row['ratio']:.2f}x" if row["ratio"] else "n/a") + f" {row['worker_cpu_per_1000_fps']:5.0f}%"
                 for row in out[v].values()]
        print(f"  {v:12}" + "".join(f"{c:>16}" for c in cells), flush=True)
    return out


# -- the run -----------------------------------------------------------------------------------------

def run(demo_dir: str, o: GpuBenchOptions) -> dict:
    demo = Path(demo_dir)
    root = Path(tempfile.mkdtemp(prefix="lsync-gpu-"))
    env = {STAND_IN_ENV: str(o.stand_in)} if o.stand_in is not None else None
    # the shapes the worker runs (with the stand-in, the GPU path's, on the CPU provider): the anchor's too
    sizes = prepared_sizes(o.max_batch, "cuda:0" if env else o.device)
    batches = served_batches(sizes, o.max_batch)
    first = o.variants[0]
    results: dict = {"device": o.device, "device_name": device_name(o.device), "model": o.model,
                     "prepared_sizes": sizes, "stand_in_s": o.stand_in, "variants_run": o.variants}
    print(f"device {results['device_name']}; model {o.model} (random weights); limits.max_batch {o.max_batch}, "
          f"prepared shapes {', '.join(map(str, sizes))}"
          + (f"; stand-in device: CPU workers batch as on a GPU and stall {o.stand_in:g} s on each shape's first "
             f"call ({STAND_IN_ENV})" if env else "")
          + f"; variants {', '.join(o.variants)} (served infer runs each; the other sections {first})", flush=True)
    try:
        models = root / "models"
        models.mkdir()
        avatar(models, "avatar", demo, _written(o.model, 0))
        _in_process(results, root, models / "avatar" / "model.onnx", o, sizes)
        a = results["anchor"] if "error" not in results["anchor"] else None
        _served_sections(results, root, models, o, env, a, sizes, batches)
        _model_sections(results, root, models, demo, o, env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _in_process(results: dict, root: Path, model: Path, o: GpuBenchOptions, sizes: tuple[int, ...]) -> None:
    """The anchor, and the model's own session against the shared one, in the bench's process."""
    def anchored() -> dict:
        figures = anchor(model, o.device, sizes, o.seconds)
        print_anchor(figures)
        return figures

    def compared() -> dict:
        further = root / "further.onnx"   # (outside models/: the catalog never sees it)
        _written(o.model, 1)(further)
        figures = own_vs_shared(model, further, o.device, o.max_batch, o.seconds)
        print_own_vs_shared(figures, reference=o.device == "cpu" and o.model == "unet328")
        return figures

    _section(results, "anchor", f"onnxruntime alone, inputs and outputs on the device ({o.device}), per prepared "
             f"shape ({o.seconds:g} s each, the median call):", anchored)
    _section(results, "own_vs_shared", f"a model's own session vs its architecture's shared session (weights bound "
             f"per call), the {o.model} model on {o.device}"
             + (" (the shared one as on the stand-in device)" if o.device == "cpu" else
                " (both with inputs on the device: no host copies)")
             + f": ready time and memory against the weight bytes, a further model's, then ms per frame in "
             f"interleaved rounds ({o.seconds:g} s per batch):", compared)


def _served_sections(results: dict, root: Path, models: Path, o: GpuBenchOptions, env: Optional[dict],
                     a: Optional[dict], sizes: tuple[int, ...], batches: tuple[int, ...]) -> None:
    """The first variant's server: first calls and served infer; each further variant's: served infer;
    then every variant against the anchor."""
    from tests.helpers import free_port
    first = o.variants[0]
    _server_sections(results, root, _config(models, o, free_port(), first), env, [
        ("first_call", f"first call per shape after ready (a fresh server, the model loaded, then one infer at "
         f"each batch; steady: the median of {o.steady_calls}):",
         lambda srv: first_calls(srv, "avatar", batches, o.steady_calls)),
        ("served", _served_heading(first, o.seconds, own_server=False),
         lambda srv: served(srv, "avatar", batches, sizes, a, o.seconds)),
    ])
    for v in o.variants[1:]:
        _server_sections(results, root, _config(models, o, free_port(), v), env, [
            (_served_name(v, first), _served_heading(v, o.seconds, own_server=True),
             lambda srv: served(srv, "avatar", batches, sizes, a, o.seconds))])
    _section(results, "variants", "variants against the fp32 anchor: served infer's frames/s over the anchor's at "
             "each batch, and the inference process's CPU (% of a core) per 1,000 frames/s:",
             lambda: variants_table(results, o.variants, batches))


def _model_sections(results: dict, root: Path, models: Path, demo: Path, o: GpuBenchOptions,
                    env: Optional[dict]) -> None:
    """Live sessions and distinct models, on one server of the first variant."""
    from tests.helpers import free_port
    port = free_port()
    cfg = _config(models, o, port, o.variants[0])
    distinct = [avatar(models, f"a{k:03d}", demo, _written(o.model, 100 + k)) for k in range(o.avatars)]
    extra = avatar(models, "w000", demo, _written(o.model, 99))
    pool: list[Path] = []

    def resident_model(k: int) -> str:
        if len(pool) < DISTINCT_WEIGHTS:   # (outside models/: the catalog never sees them)
            path = root / f"weights-{k}.onnx"
            _written(o.model, 200 + k)(path)
            pool.append(path)
        return avatar(models, f"r{k:04d}", demo, lambda path: os.link(pool[k % len(pool)], path))

    def expected_load_s() -> float:
        rows = results.get("first_frame")
        times = [r["load_ms"] for r in rows if r["load_ms"]] if isinstance(rows, list) else []
        return max(times) / 1000 * 1.5 if times else 2.0

    _server_sections(results, root, cfg, env, [
        ("live", f"live sessions on the {o.model} model (1280x720 JPEG q75, 27% speaking, {o.seconds:g} s per "
         "level): missed, on time, latency p99, each process's CPU:",
         lambda srv: live(srv, o.levels, o.seconds, port)),
        ("first_frame", f"model load -> first frame: {o.avatars} distinct models, session_open then 1 s of speech "
         "at once; MiB per model as the worker's stats tell (nbytes) and as measured ("
         + ("the GPU's memory in use" if o.device != "cpu" else "the worker's resident memory") + "):",
         lambda srv: first_frames(srv, o.device, distinct)),
        ("load_while_speaking", f"a load while {o.speaking} sessions speak:",
         lambda srv: load_while_speaking(srv, extra, o.speaking, port, o.budget_ms, expected_load_s())),
        ("residency", f"models resident on the device: distinct models loaded one after another until one is "
         f"evicted, a load fails, --max-models {o.max_models} or --residency-s {o.residency_s:g} (weights of "
         f"{min(DISTINCT_WEIGHTS, o.max_models)} distinct seeds, the other files hard links of them: the worker "
         "holds each model id's own copy):",
         lambda srv: residency(srv, o.device, resident_model, o.max_models, o.residency_s)),
    ])
