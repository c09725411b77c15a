"""bench gpu, what runs in the bench's own process: the device's name and memory, the anchor (onnxruntime
alone, inputs and outputs on the device) and a model's own session against its architecture's shared
session (weights bound per call)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import psutil

from gpu_actor.device import CPU, is_gpu, visible_gpus
from gpu_actor.onnx_sessions import cuda_id

OWN_VS_SHARED_MIN_ROUNDS = 3


# -- the device --------------------------------------------------------------------------------------

def pick_device(wanted: str) -> str:
    """`auto`: the first GPU a worker could run on (gpu_actor/device.visible_gpus, as the supervisor's
    `inference.devices: auto`), else the CPU."""
    if wanted != "auto":
        return wanted
    gpus = visible_gpus()
    return f"cuda:{gpus[0]}" if gpus else CPU


def _smi(query: str, index: int) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def device_name(device: str) -> str:
    if is_gpu(device):
        index = cuda_id(device)
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


def memory_mib(device: str, pid: int) -> Optional[float]:
    """What a load is measured by: the GPU's memory in use (every process), or the process's resident
    memory."""
    if not is_gpu(device):
        try:
            return psutil.Process(pid).memory_info().rss / 2 ** 20
        except psutil.Error:
            return None
    used = _smi("memory.used", cuda_id(device))
    if used:
        return float(used)
    try:
        import cupy
        with cupy.cuda.Device(cuda_id(device)):
            free, total = cupy.cuda.runtime.memGetInfo()
        return (total - free) / 2 ** 20
    except Exception:
        return None


# -- the anchor --------------------------------------------------------------------------------------

def _io(session, model: Path):
    from config.assets import classify_io
    return classify_io([(i.name, list(i.shape)) for i in session.get_inputs()],
                       [(o.name, list(o.shape)) for o in session.get_outputs()], str(model))


def _resident_call(session, io, device: str, batch: int, rng: np.random.Generator) -> Callable[[], None]:
    """One call of `session` at `batch`, its inputs and output bound where they live (OrtValues on the
    device): the model's work and nothing else."""
    import onnxruntime as ort
    where, index = ("cuda", cuda_id(device)) if is_gpu(device) else ("cpu", 0)
    visual = ort.OrtValue.ortvalue_from_numpy(rng.random((batch, 6, 320, 320), dtype=np.float32), where, index)
    audio = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, *io.audio_shape)).astype(np.float32),
                                             where, index)
    mouths = ort.OrtValue.ortvalue_from_shape_and_type([batch, 3, 320, 320], np.float32, where, index)
    binding = session.io_binding()
    binding.bind_ortvalue_input(io.visual, visual)
    binding.bind_ortvalue_input(io.audio, audio)
    binding.bind_ortvalue_output(io.output, mouths)

    def call() -> None:
        # NOTE: the CUDA provider synchronizes its stream at the end of a run: the wall time is the GPU's
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        _ = (visual, audio, mouths)   # a binding holds addresses, not the values: the closure keeps them
    return call


def _own_session(model: Path, dev):
    """`model` in a session of its own on `dev` (a gpu_actor device), made as a worker makes one."""
    from gpu_actor.own_session import own_session
    return own_session(model, dev, 0)


def anchor(model: Path, device: str, sizes: tuple[int, ...], seconds: float) -> dict:
    """onnxruntime alone, the session made as a worker makes it, at each of `sizes`."""
    from gpu_actor.cuda import CudaDevice
    from gpu_actor.device import CpuDevice
    session = _own_session(model, CudaDevice(device) if is_gpu(device) else CpuDevice())
    io = _io(session, model)
    rng = np.random.default_rng(0)
    out = {}
    for b in sizes:
        call = _resident_call(session, io, device, b, rng)
        times = []
        stop = time.perf_counter() + seconds
        while len(times) < 4 or (time.perf_counter() < stop and len(times) < 2000):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1000)
        ms = statistics.median(times[1:])
        out[b] = {"first_ms": times[0], "ms": ms, "fps": b / ms * 1000, "calls": len(times)}
    return out


def print_anchor(a: dict) -> None:
    print(f"  {'shape':>5} {'ms/call':>9} {'frames/s':>9} {'first call ms':>14}")
    for b, v in a.items():
        print(f"  {b:5d} {v['ms']:9.2f} {v['fps']:9.1f} {v['first_ms']:14.1f}   ({v['calls']} calls)", flush=True)


def anchor_fps(batch: int, sizes: tuple[int, ...], a: dict) -> float:
    """Frames/s of the anchor for `batch` frames run as the worker runs them (its calls' plan)."""
    from gpu_actor.shapes import BatchShapes
    return batch / sum(a[step.size]["ms"] for step in BatchShapes(sizes).plan(batch)) * 1000


# -- a model's own session against its architecture's prepared session -------------------------------

def own_vs_shared(model: Path, further: Path, device: str, max_batch: int, seconds: float) -> dict:
    """`model` in a session of its own and in its architecture's prepared session (weights bound per call)
    on one device: each one's time to be ready and the memory it took, then a further model's (`further`,
    other weights); then ms per frame at batch 1 and at the largest prepared size (on the CPU 1 only),
    in interleaved rounds of one call each, for `seconds` per batch.

    On the CPU the own session is a worker's (gpu_actor/own_session.OwnSessionRunner, its warm-up included) and
    the shared one the stand-in device's (gpu_actor/architectures.PreparedRunner on the CPU provider), each run as
    a worker runs it. On a GPU the own session is the anchor's, its inputs on the device, and the shared
    call is the prepared session run on its staging buffers with the model's weights bound: neither pays
    the host copies a worker adds (served infer has them)."""
    import onnx   # noqa: F401  NOTE: imported before memory is measured: the shared load needs them
    import gpu_actor.visual_onnx  # noqa: F401
    from gpu_actor.architectures import Architectures
    from gpu_actor.cuda import CudaDevice
    from gpu_actor.device import StandInDevice
    gpu = is_gpu(device)
    dev = CudaDevice(device) if gpu else StandInDevice(0.0)
    sizes = dev.sizes(max_batch if gpu else 1)
    batches = tuple(dict.fromkeys((1, max(sizes))))
    rng = np.random.default_rng(0)
    architectures = Architectures(dev, max(sizes), 0, False)
    own = _own_calls_gpu if gpu else _own_calls_cpu

    def ready(make: Callable[[], object]) -> tuple[object, dict]:
        before, t = dev.memory_used(), time.perf_counter()
        made = make()
        return made, {"ms": (time.perf_counter() - t) * 1000, "mib": (dev.memory_used() - before) / 2 ** 20}

    own_calls, own_ready = ready(lambda: own(model, dev, batches, rng))
    shared, shared_ready = ready(lambda: architectures.load(model))
    further_own, own_further = ready(lambda: own(further, dev, batches, rng))
    further_shared, shared_further = ready(lambda: architectures.load(further))
    del further_own, further_shared
    shared_calls = _shared_calls(shared, dev, batches, rng)
    out = {"weights_mib": shared.prepared.architecture.nbytes / 2 ** 20, "memory": "device" if gpu else "RSS",
           "own": {"ready": own_ready, "further": own_further},
           "shared": {"ready": shared_ready, "further": shared_further}, "batches": {}}
    for b in batches:
        out["batches"][b] = _rounds(own_calls[b], shared_calls[b], b, seconds)
    return out


def _own_calls_cpu(model: Path, dev, batches: tuple[int, ...], rng) -> dict:
    """A worker's session of the model's own on the CPU provider, loaded as a worker loads it."""
    from gpu_actor.device import CpuDevice
    from gpu_actor.own_session import OwnSessionRunner
    runner = OwnSessionRunner(model, CpuDevice(), threads=0)
    runner.warm_up()
    return _run_calls(runner, batches, rng)


def _run_calls(runner, batches: tuple[int, ...], rng) -> dict:
    """batch -> a call of `runner.run` (an OwnSessionRunner's or a PreparedRunner's) on random inputs made once."""
    calls = {}
    for b in batches:
        visual = rng.random((b, 6, 320, 320), dtype=np.float32)
        audio = rng.standard_normal((b, *runner.io.audio_shape)).astype(np.float32)
        mouths = np.empty((b, 3, 320, 320), np.float32)
        calls[b] = lambda v=visual, a=audio, m=mouths: runner.run(v, a, m)
    return calls


def _own_calls_gpu(model: Path, dev, batches: tuple[int, ...], rng) -> dict:
    """The anchor's session, ready when it has run once at each batch (cuDNN's plans for its shapes)."""
    session = _own_session(model, dev)
    io = _io(session, model)
    calls = {b: _resident_call(session, io, dev.name, b, rng) for b in batches}
    for call in calls.values():
        call()
    return calls


def _shared_calls(runner, dev, batches: tuple[int, ...], rng) -> dict:
    """The CPU: PreparedRunner.run as a worker calls it. A GPU: the prepared architecture's call at each
    batch, bound as the runner binds it (Prepared.binding), on random inputs uploaded once."""
    if not is_gpu(dev.name):
        return _run_calls(runner, batches, rng)
    p, own, calls = runner.prepared, {}, {}
    for b in batches:
        dev.upload(p.visual[:b], rng.random((b, 6, 320, 320), dtype=np.float32))
        dev.upload(p.audio[:b], rng.standard_normal((b, *p.io.audio_shape)).astype(np.float32))
        binding = p.binding(runner.weights, b, own)   # (the worker's own binding of the model at b)
        calls[b] = lambda n=b, bd=binding: p.call(n, bd)
    return calls


def _rounds(own: Callable[[], None], shared: Callable[[], None], batch: int, seconds: float) -> dict:
    """Rounds of one call each, which goes first alternating; ms per frame, each one's median."""
    own(), shared()   # NOTE: not a round's: after the other batch's calls a session meets this shape again
    times: dict[str, list[float]] = {"own": [], "shared": []}
    order = [("own", own), ("shared", shared)]
    stop = time.perf_counter() + seconds
    while len(times["own"]) < OWN_VS_SHARED_MIN_ROUNDS or (time.perf_counter() < stop and len(times["own"]) < 1000):
        for name, call in order:
            t = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t) * 1000 / batch)
        order.reverse()
    own_ms, shared_ms = statistics.median(times["own"]), statistics.median(times["shared"])
    return {"own_ms_per_frame": own_ms, "shared_ms_per_frame": shared_ms, "ratio": shared_ms / own_ms,
            "rounds": len(times["own"])}


def print_own_vs_shared(r: dict, reference: bool) -> None:
    """`reference`: this run is of the kind gpu_actor/device.py's choice for the CPU rests on."""
    mem = r["memory"]
    weights = r["weights_mib"]
    print("  the model's weights: " + (f"{weights:.1f} MiB" if weights >= 1 else f"{weights * 1024:.1f} KiB"))
    print(f"  {'':14} {'ready ms':>9} {'MiB (' + mem + ')':>13} {'a further model ms':>19} {'MiB (' + mem + ')':>13}")
    for name, label in (("own", "own session"), ("shared", "prepared session")):
        ready, further = r[name]["ready"], r[name]["further"]
        print(f"  {label:14} {ready['ms']:9.0f} {ready['mib']:13.1f} {further['ms']:19.0f} {further['mib']:13.1f}")
    print(f"  {'batch':>5} {'own ms/frame':>13} {'shared ms/frame':>16} {'shared/own':>11} {'rounds':>7}")
    for b, v in r["batches"].items():
        print(f"  {b:5d} {v['own_ms_per_frame']:13.2f} {v['shared_ms_per_frame']:16.2f} {v['ratio']:11.2f} "
              f"{v['rounds']:7d}")
    if reference:
        v = r["batches"][1]
        verdict = "keeps" if v["ratio"] >= 1 else "should not keep"
        print(f"  the CPU provider {verdict} a session per model (gpu_actor/device.py): this run, one frame a call, "
              f"{v['own_ms_per_frame']:.1f} ms in its own session against {v['shared_ms_per_frame']:.1f} ms with its "
              f"weights as inputs ({v['ratio']:.2f}x)")
    sys.stdout.flush()
