"""python -m bench gpu: inference on one device, from onnxruntime alone up to live sessions, in one run.

- the anchor: onnxruntime alone on the real-size unet_328 (random weights), its inputs and outputs
  already on the device, at each prepared shape (the batch sizes a worker runs: `prepared_sizes`);
- on a fresh server, each batch size's first `infer` after ready against its steady time, and calls
  alternating between shapes;
- served `infer` per batch (visual input sent, 2 in flight) and its ratio to the anchor at that batch,
  with the inference process's CPU per 1,000 frames/s;
- live JPEG levels on that model, 27 % speaking (bench/sessions.py's levels);
- distinct models: `session_open` -> the first speech frame and device MiB per model; one model's load
  while sessions speak (their speech missed during it); how many models stay resident on the device.

Where onnxruntime has no CUDA provider or cupy sees no GPU it runs the same on the CPU provider with
small counts, so CI keeps it working. `--stand-in S` has CPU workers batch as the GPU path does and
stall S seconds on each (session, shape)'s first call, as cuDNN does, so a CPU host shows the GPU
path's first-call figures.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import psutil

from lipsync_client import AsyncClient, ServerError, Session

STAND_IN_ENV = "LIPSYNC_STAND_IN_STALL_S"
AUDIO_SHAPE = (32, 16, 16)        # the "ave" features every model here takes
WARM_S = 3.5                      # a speaking session of bench/sessions.py starts speaking within 3 s
DISTINCT_WEIGHTS = 8              # residency: model files of distinct weights, the ids beyond hard-linked


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


def options(device: str = "auto", model: str = "unet328", max_batch: Optional[int] = None,
            levels: Optional[tuple[int, ...]] = None, seconds: float = 8.0, speaking: Optional[int] = None,
            max_models: Optional[int] = None, avatars: Optional[int] = None, residency_s: Optional[float] = None,
            stand_in: Optional[float] = None, budget_ms: int = 280) -> GpuBenchOptions:
    """The bench's settings, each one not given at its default for the device: large on a GPU, a few
    seconds' worth on the CPU provider."""
    device = pick_device(device)
    gpu = device != "cpu"

    def pick(value, on_gpu, on_cpu):
        return value if value is not None else (on_gpu if gpu else on_cpu)

    return GpuBenchOptions(device, model, pick(max_batch, 32, 4), pick(levels, (16, 48, 96, 150, 200), (1, 2)),
                           seconds, pick(speaking, 20, 2), pick(max_models, 1000, 8), pick(avatars, 4, 2),
                           pick(residency_s, 240.0, 60.0), stand_in, budget_ms, steady_calls=10 if gpu else 3)


# -- the device --------------------------------------------------------------------------------------

def pick_device(wanted: str) -> str:
    """`auto`: cuda:0 where onnxruntime has its CUDA provider and cupy sees a GPU, else cpu."""
    if wanted != "auto":
        return wanted
    try:
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "cpu"
        import cupy
        return "cuda:0" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:   # no cupy, or a CUDA runtime without a driver
        return "cpu"


def _cuda_index(device: str) -> int:
    return int(device.split(":")[1])


def _smi(query: str, index: int) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def device_name(device: str) -> str:
    if device != "cpu":
        index = _cuda_index(device)
        smi = _smi("name,memory.total", index)
        if smi:
            name, mib = (v.strip() for v in smi.rsplit(",", 1))
            return f"{device}: {name}, {mib} MiB"
        try:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(index)
            return f"{device}: {props['name'].decode()}, {props['totalGlobalMem'] >> 20} MiB"
        except Exception as err:
            return f"{device} (its name unknown: {type(err).__name__}: {err})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"cpu: {name}, {os.cpu_count()} cores"


def memory_mib(device: str, worker_pid: int) -> Optional[float]:
    """What a load is measured by from outside the server: the GPU's memory in use (every process), or
    the CPU worker's resident memory."""
    if device == "cpu":
        try:
            return psutil.Process(worker_pid).memory_info().rss / 2 ** 20
        except psutil.Error:
            return None
    used = _smi("memory.used", _cuda_index(device))
    if used:
        return float(used)
    try:
        import cupy
        with cupy.cuda.Device(_cuda_index(device)):
            free, total = cupy.cuda.runtime.memGetInfo()
        return (total - free) / 2 ** 20
    except Exception:
        return None


# -- shapes ------------------------------------------------------------------------------------------

def prepared_sizes(max_batch: int, device: str) -> tuple[int, ...]:
    """The batch sizes a worker runs onnxruntime at, a batch padded up to the next: on a GPU the powers of
    two below `limits.max_batch` and max_batch itself; on the CPU provider one frame per call. The
    worker's own table where it has one."""
    try:
        from gpu_actor.shapes import prepared_sizes as worker_sizes
    except ImportError:
        worker_sizes = None
    if worker_sizes is not None:
        params = inspect.signature(worker_sizes).parameters
        if "device" in params:
            return tuple(worker_sizes(max_batch, device=device))
        if "batched" in params:   # (the table's first form: batched calls or one frame per call)
            return tuple(worker_sizes(max_batch, batched=device != "cpu"))
    if device == "cpu":
        return (1,)
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def calls_for(batch: int, sizes: tuple[int, ...]) -> list[int]:
    """The prepared shapes a batch runs as: chunks of the largest, the last padded up to the next."""
    out, rest = [], batch
    while rest > 0:
        n = min(rest, max(sizes))
        out.append(min(s for s in sizes if s >= n))
        rest -= n
    return out


def served_batches(sizes: tuple[int, ...], max_batch: int) -> tuple[int, ...]:
    """The prepared sizes and a few between them."""
    return tuple(sorted({*sizes, *(b for b in (3, 24) if b <= max_batch)}))


def alternating(batches: tuple[int, ...]) -> tuple[int, ...]:
    """Two or three shapes far apart: the smallest, one near their geometric middle, the largest."""
    lo, hi = batches[0], batches[-1]
    mid = min(batches, key=lambda b: abs(np.log(b) - (np.log(lo) + np.log(hi)) / 2))
    return tuple(dict.fromkeys((lo, mid, hi)))


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


# -- the anchor --------------------------------------------------------------------------------------

def anchor(model: Path, device: str, sizes: tuple[int, ...], seconds: float) -> dict:
    """onnxruntime alone, the session made as a worker makes it, its inputs and output bound where they
    live (OrtValues on the device): a call is the model's work and nothing else."""
    import onnxruntime as ort

    from config.assets import classify_io
    from gpu_actor.runner import make_session
    session = make_session(model, device, threads=0)
    io = classify_io([(i.name, list(i.shape)) for i in session.get_inputs()],
                     [(o.name, list(o.shape)) for o in session.get_outputs()], str(model))
    where, index = ("cpu", 0) if device == "cpu" else ("cuda", _cuda_index(device))
    rng = np.random.default_rng(0)
    out = {}
    for b in sizes:
        visual = ort.OrtValue.ortvalue_from_numpy(rng.random((b, 6, 320, 320), dtype=np.float32), where, index)
        audio = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((b, *io.audio_shape)).astype(np.float32),
                                                 where, index)
        mouths = ort.OrtValue.ortvalue_from_shape_and_type([b, 3, 320, 320], np.float32, where, index)
        binding = session.io_binding()
        binding.bind_ortvalue_input(io.visual, visual)
        binding.bind_ortvalue_input(io.audio, audio)
        binding.bind_ortvalue_output(io.output, mouths)
        times = []
        stop = time.perf_counter() + seconds
        while len(times) < 4 or (time.perf_counter() < stop and len(times) < 2000):
            t = time.perf_counter()
            # NOTE: the CUDA provider synchronizes its stream at the end of a run: the wall time is the GPU's
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            times.append((time.perf_counter() - t) * 1000)
        ms = statistics.median(times[1:])
        out[b] = {"first_ms": times[0], "ms": ms, "fps": b / ms * 1000, "calls": len(times)}
    return out


def _print_anchor(a: dict) -> None:
    print(f"  {'shape':>5} {'ms/call':>9} {'frames/s':>9} {'first call ms':>14}")
    for b, v in a.items():
        print(f"  {b:5d} {v['ms']:9.2f} {v['fps']:9.1f} {v['first_ms']:14.1f}   ({v['calls']} calls)", flush=True)


def anchor_fps(batch: int, sizes: tuple[int, ...], a: dict) -> float:
    """Frames/s of the anchor for `batch` frames run as the worker runs them (calls_for)."""
    return batch / sum(a[s]["ms"] for s in calls_for(batch, sizes)) * 1000


# -- one server's infer ------------------------------------------------------------------------------

def _inputs(batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random((batch, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((batch, *AUDIO_SHAPE)).astype(np.float32))


def _timed(client, model: str, visual: np.ndarray, audio: np.ndarray) -> tuple[float, float]:
    """(client ms, the worker's inference ms) of one `infer`."""
    t = time.perf_counter()
    header, _ = client.infer(model, visual, audio)
    return (time.perf_counter() - t) * 1000, header.get("timing", {}).get("inference_ms", float("nan"))


def first_calls(srv, model: str, batches: tuple[int, ...], steady_calls: int) -> dict:
    """On a server just ready: the model's load, then one `infer` at each batch size (its first), then
    each size's steady time (median of `steady_calls`), then calls alternating between shapes."""
    inputs = {b: _inputs(b) for b in batches}
    with srv.client(timeout_s=600) as c:
        t = time.perf_counter()
        reply = c.load(model)
        load = {"client_ms": (time.perf_counter() - t) * 1000, "load_ms": reply.get("load_ms")}
        first = {b: _timed(c, model, *inputs[b]) for b in batches}
        steady = {b: [_timed(c, model, *inputs[b]) for _ in range(steady_calls)] for b in batches}
        shapes = alternating(batches)
        mixed: dict = {b: [] for b in shapes}
        for _ in range(steady_calls):
            for b in shapes:
                mixed[b].append(_timed(c, model, *inputs[b]))
    med = {b: (statistics.median(v[0] for v in calls), statistics.median(v[1] for v in calls))
           for b, calls in steady.items()}
    out = {"load": load, "batches": {}, "alternating": {}}
    print(f"  load: {load['client_ms']:.0f} ms (the worker's load_ms {_ms(load['load_ms'])})")
    print(f"  {'batch':>5} {'first ms':>9} {'(inference)':>11} {'steady ms':>10} {'(inference)':>11} {'first/steady':>12}")
    for b in batches:
        ratio = first[b][0] / med[b][0]
        out["batches"][b] = {"first_ms": first[b][0], "first_inference_ms": first[b][1], "steady_ms": med[b][0],
                             "steady_inference_ms": med[b][1], "ratio": ratio}
        print(f"  {b:5d} {first[b][0]:9.1f} {first[b][1]:11.1f} {med[b][0]:10.1f} {med[b][1]:11.1f} {ratio:12.2f}",
              flush=True)
    print(f"\ncalls alternating between shapes {', '.join(map(str, shapes))} ({steady_calls} rounds), "
          "median vs the same shape's steady calls:")
    for b, calls in mixed.items():
        ms = statistics.median(v[0] for v in calls)
        out["alternating"][b] = {"ms": ms, "max_ms": max(v[0] for v in calls), "ratio": ms / med[b][0]}
        print(f"  batch {b:3d}: {ms:8.1f} ms (max {out['alternating'][b]['max_ms']:.1f}) vs steady {med[b][0]:.1f} "
              f"= {ms / med[b][0]:.2f}x", flush=True)
    return out


async def _served(endpoint: str, model: str, batch: int, seconds: float, worker_pid: int,
                  concurrency: int = 2) -> dict:
    visual, audio = _inputs(batch)
    times: list[float] = []
    async with AsyncClient(endpoint, timeout_s=600) as client:
        await client.infer(model, visual, audio)   # warm
        stop = time.perf_counter() + seconds
        done = 0

        async def loop() -> None:
            nonlocal done
            while True:
                t = time.perf_counter()
                await client.infer(model, visual, audio)
                times.append((time.perf_counter() - t) * 1000)
                done += batch
                if time.perf_counter() >= stop:
                    return

        proc = psutil.Process(worker_pid)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = 100 * (sum(proc.cpu_times()[:2]) - cpu0) / wall
    fps = done / wall
    return {"fps": fps, "ms_p50": statistics.median(times), "worker_cpu_percent": cpu,
            "worker_cpu_per_1000_fps": cpu / fps * 1000}


def served(srv, model: str, batches: tuple[int, ...], sizes: tuple[int, ...], a: Optional[dict],
           seconds: float) -> dict:
    pid = srv.pids("gpu")[0]
    out = {}
    print(f"  {'batch':>5} {'infer fps':>10} {'ms p50':>8} {'anchor fps':>11} {'ratio':>6} "
          f"{'inference CPU':>14} {'per 1,000 fps':>14}")
    for b in batches:
        r = asyncio.run(_served(srv.endpoint, model, b, seconds, pid))
        ref = anchor_fps(b, sizes, a) if a else None
        r.update(anchor_fps=ref, ratio=r["fps"] / ref if ref else None)
        out[b] = r
        print(f"  {b:5d} {r['fps']:10.1f} {r['ms_p50']:8.1f} " + (f"{ref:11.1f} {r['ratio']:6.2f} " if ref else
                                                                  f"{'n/a':>11} {'n/a':>6} ")
              + f"{r['worker_cpu_percent']:13.0f}% {r['worker_cpu_per_1000_fps']:13.0f}%", flush=True)
    return out


# -- live sessions and models ------------------------------------------------------------------------

def live(srv, levels: tuple[int, ...], seconds: float, metrics_port: int) -> list[dict]:
    from bench.sessions import _print, _run_level
    with srv.client(timeout_s=600) as c:   # its load (and a GPU's warm-up of every shape) is not a level's
        c.load("avatar")
    out = []
    for n in levels:
        r = _run_level(srv, n, seconds, 0.27, fmt="jpeg", metrics_port=metrics_port)
        _print(r)
        inferred = r["speech"] / seconds
        gpu = r["processes"].get("gpu0", {}).get("cpu", 0.0)
        r["worker_cpu_per_1000_fps"] = gpu / inferred * 1000 if inferred else None
        print(f"        inference process {gpu:.0f}% of a core for {inferred:.0f} speech frames/s"
              + (f" = {r['worker_cpu_per_1000_fps']:.0f}% per 1,000 frames/s" if inferred else ""), flush=True)
        out.append(r)
    return out


def _model_stats(srv, model: Optional[str] = None) -> dict:
    with srv.client(timeout_s=30) as c:
        return c.stats(model)


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def _ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def first_frames(srv, device: str, models: list[str]) -> list[dict]:
    """Per model not loaded yet: `session_open`, then one second of speech at once; the time to the
    first speech frame; device MiB as the worker tells it (`stats`' nbytes) and as measured outside."""
    pid = srv.pids("gpu")[0]
    windows = np.random.default_rng(2).standard_normal((25, *AUDIO_SHAPE)).astype(np.float32)
    out = []
    print(f"  {'model':>6} {'open ms':>8} {'first frame ms':>15} {'load_ms':>8} {'MiB (worker)':>13} "
          f"{'MiB (measured)':>15}")
    for m in models:
        before = memory_mib(device, pid)
        t0 = time.monotonic()
        with Session(srv.endpoint, m, format="jpeg", quality=75, timeout_s=300) as s:
            opened = time.monotonic() - t0
            s.send_audio(windows, last=True)
            first, deadline = None, t0 + 300
            # until the first speech frame, or the utterance's last frame (a frame not ready when due goes
            # out idle: a device too slow for this model in real time may miss every one)
            while first is None:
                frame = s.next_frame(timeout_s=max(deadline - time.monotonic(), 0.001))
                if frame is None:
                    raise TimeoutError(f"{m}: the utterance had not ended 300 s after session_open")
                if frame[0].get("event") != "frame":
                    continue
                if frame[0].get("kind") == "speech":
                    first = time.monotonic() - t0
                elif frame[0].get("last"):
                    break
            missed = s.close().get("missed")
        after = memory_mib(device, pid)
        stats = _model_stats(srv, m).get("models", {}).get(m, {})
        nbytes = stats.get("nbytes")
        row = {"model": m, "open_ms": opened * 1000, "first_frame_ms": first * 1000 if first is not None else None,
               "missed": missed, "load_ms": stats.get("load_ms"),
               "worker_mib": nbytes / 2 ** 20 if nbytes is not None else None,
               "measured_mib": after - before if before is not None and after is not None else None}
        out.append(row)
        shown = _ms(row["first_frame_ms"]) if first is not None else f"none ({missed} missed)"
        print(f"  {m:>6} {row['open_ms']:8.0f} {shown:>15} {_ms(row['load_ms']):>8} "
              f"{_mib(row['worker_mib']):>13} {_mib(row['measured_mib']):>15}", flush=True)
    return out


def _counters(metrics_port: int) -> dict[str, float]:
    from bench.procstat import _parse_metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        metrics = _parse_metrics(r.read().decode())
    return {kind: metrics.get(f'lipsync_session_frames_total{{kind="{kind}"}}', 0.0) for kind in ("speech", "missed")}


def _window(a: dict, b: dict) -> dict:
    missed, speech = b["missed"] - a["missed"], b["speech"] - a["speech"]
    return {"missed": int(missed), "speech": int(speech), "missed_share": missed / max(missed + speech, 1)}


def load_while_speaking(srv, model: str, n: int, metrics_port: int, budget_ms: int, expect_s: float) -> dict:
    """`n` sessions speak all the time; after a window of the same length as the load is expected to
    take, one model not loaded yet is loaded: the speech frames missed during that window and during
    the load (to its end plus the latency budget), from the server's session counters."""
    from bench.sessions import _level
    window = max(expect_s, 1.0)
    settle = budget_ms / 1000 + 0.3

    async def scenario() -> dict:
        seconds = WARM_S + 3 * window + settle + 2.0
        ends = time.monotonic() + seconds
        level = asyncio.create_task(_level(srv.endpoint, n, seconds, 1.0))
        await asyncio.sleep(WARM_S)
        c0 = await asyncio.to_thread(_counters, metrics_port)
        await asyncio.sleep(window)
        c1 = await asyncio.to_thread(_counters, metrics_port)
        t, error, reply = time.monotonic(), None, {}
        try:
            with srv.client(timeout_s=600) as c:
                reply = await asyncio.to_thread(c.load, model)
        except (ServerError, OSError) as err:
            error = f"{type(err).__name__}: {err}"
        load_s = time.monotonic() - t
        await asyncio.sleep(settle)
        cut = time.monotonic() > ends
        c2 = await asyncio.to_thread(_counters, metrics_port)
        await level
        return {"sessions": n, "load_ms": load_s * 1000, "worker_load_ms": reply.get("load_ms"), "error": error,
                "before": _window(c0, c1), "during": _window(c1, c2), "cut": cut}

    r = asyncio.run(scenario())
    d, b = r["during"], r["before"]
    print(f"  {n} sessions speaking all the time; loading {model} took {r['load_ms']:.0f} ms (the worker's load_ms "
          f"{_ms(r['worker_load_ms'])})" + (f", FAILED: {r['error']}" if r["error"] else ""))
    print(f"  speech missed during the load: {d['missed']} of {d['missed'] + d['speech']} "
          f"({100 * d['missed_share']:.1f}%; the goal: 0); in the {window:.1f} s before it: {b['missed']} of "
          f"{b['missed'] + b['speech']} ({100 * b['missed_share']:.1f}%)"
          + ("  NOTE: the sessions ended before the load did: its window is cut" if r["cut"] else ""), flush=True)
    return r


def residency(srv, device: str, make: Callable[[int], str], max_models: int, budget_s: float) -> dict:
    """Load distinct models one after another until a load evicts a model, fails, --max-models is
    reached or `budget_s` is spent; how many stayed resident."""
    pid = srv.pids("gpu")[0]
    before = memory_mib(device, pid)
    resident = set(_resident(_model_stats(srv)))
    ours: list[str] = []
    load_ms: list[float] = []
    reason, deadline = f"--max-models {max_models} reached", time.monotonic() + budget_s
    with srv.client(timeout_s=600) as c:
        for k in range(max_models):
            if time.monotonic() > deadline:
                reason = f"the {budget_s:g}-s budget ran out (--residency-s)"
                break
            model = make(k)
            try:
                reply = c.load(model)
            except ServerError as err:
                reason = f"load {k + 1} ({model}) failed: {err.code}: {err}"
                break
            load_ms.append(reply.get("load_ms") or 0.0)
            ours.append(model)
            now = set(_resident(c.stats()))
            gone = resident - now
            resident = now
            if gone:
                reason = f"load {k + 1} ({model}) evicted {sorted(gone)[0]}" + (
                    f" and {len(gone) - 1} more" if len(gone) > 1 else "")
                break
    after = memory_mib(device, pid)
    kept = [m for m in ours if m in resident]
    out = {"loaded": len(ours), "resident": len(kept), "resident_all": len(resident), "stopped": reason,
           "load_ms_p50": statistics.median(load_ms) if load_ms else None,
           "measured_mib": after - before if before is not None and after is not None else None}
    per = out["measured_mib"] / len(kept) if kept and out["measured_mib"] is not None else None
    print(f"  {len(ours)} distinct models loaded, {len(kept)} of them resident at the end ({len(resident)} models "
          f"on the worker in all); stopped: {reason}")
    print(f"  load_ms p50 {_ms(out['load_ms_p50'])}; memory measured {_mib(out['measured_mib'])} MiB "
          f"({_mib(per)} MiB per model)", flush=True)
    return out


def _resident(stats: dict) -> list[str]:
    return [m for w in stats.get("workers", []) for m in w.get("loaded", [])]


# -- the run -----------------------------------------------------------------------------------------

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


def _config(models: Path, o: GpuBenchOptions, metrics_port: int) -> dict:
    from bench.sessions import _settings
    from tests.helpers import base_config
    return base_config(models, **{
        **_settings("jpeg", o.budget_ms), "limits.max_batch": o.max_batch, "limits.request_timeout_s": 600,
        "inference.devices": "cpu" if o.device == "cpu" else [_cuda_index(o.device)],
        "inference.intra_op_threads": 0, "inference.max_models_per_worker": o.max_models + o.avatars + 8,
        "metrics.port": metrics_port})


def run(demo_dir: str, o: GpuBenchOptions) -> dict:
    from tests.helpers import free_port
    demo = Path(demo_dir)
    root = Path(tempfile.mkdtemp(prefix="lsync-gpu-"))
    env = {STAND_IN_ENV: str(o.stand_in)} if o.stand_in is not None else None
    # the shapes the worker runs (with the stand-in, the GPU path's, on the CPU provider): the anchor's too
    sizes = prepared_sizes(o.max_batch, "cuda:0" if env else o.device)
    batches = served_batches(sizes, o.max_batch)
    results: dict = {"device": o.device, "device_name": device_name(o.device), "model": o.model,
                     "prepared_sizes": sizes, "stand_in_s": o.stand_in}
    print(f"device {results['device_name']}; model {o.model} (random weights); limits.max_batch {o.max_batch}, "
          f"prepared shapes {', '.join(map(str, sizes))}"
          + (f"; stand-in device: CPU workers batch as on a GPU and stall {o.stand_in:g} s on each shape's first "
             f"call ({STAND_IN_ENV})" if env else ""), flush=True)
    try:
        models = root / "models"
        models.mkdir()
        avatar(models, "avatar", demo, _written(o.model, 0))

        def anchored() -> dict:
            figures = anchor(models / "avatar" / "model.onnx", o.device, sizes, o.seconds)
            _print_anchor(figures)
            return figures

        _section(results, "anchor", f"onnxruntime alone, inputs and outputs on the device ({o.device}), per prepared "
                 f"shape ({o.seconds:g} s each, the median call):", anchored)
        a = results["anchor"] if "error" not in results["anchor"] else None
        cfg = _config(models, o, free_port())
        _server_sections(results, root, cfg, env, [
            ("first_call", f"first call per shape after ready (a fresh server, the model loaded, then one infer at "
             f"each batch; steady: the median of {o.steady_calls}):",
             lambda srv: first_calls(srv, "avatar", batches, o.steady_calls)),
            ("served", f"served infer per batch (visual input sent, 2 in flight, {o.seconds:g} s each) vs the anchor "
             "at that batch; the inference process's CPU (% of a core) per 1,000 frames/s:",
             lambda srv: served(srv, "avatar", batches, sizes, a, o.seconds)),
        ])
        port = free_port()
        cfg = _config(models, o, port)
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
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results
