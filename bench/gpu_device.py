"""bench gpu, what runs in the bench's own process: the device's name and memory, and the anchor
(onnxruntime alone, inputs and outputs on the device)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

import numpy as np
import psutil


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


def cuda_index(device: str) -> int:
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
        index = cuda_index(device)
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
    if device == "cpu":
        try:
            return psutil.Process(pid).memory_info().rss / 2 ** 20
        except psutil.Error:
            return None
    used = _smi("memory.used", cuda_index(device))
    if used:
        return float(used)
    try:
        import cupy
        with cupy.cuda.Device(cuda_index(device)):
            free, total = cupy.cuda.runtime.memGetInfo()
        return (total - free) / 2 ** 20
    except Exception:
        return None


def calls_for(batch: int, sizes: tuple[int, ...]) -> list[int]:
    """The prepared shapes a batch runs as: chunks of the largest, the last padded up to the next."""
    out, rest = [], batch
    while rest > 0:
        n = min(rest, max(sizes))
        out.append(min(s for s in sizes if s >= n))
        rest -= n
    return out


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
    where, index = ("cpu", 0) if device == "cpu" else ("cuda", cuda_index(device))
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


def print_anchor(a: dict) -> None:
    print(f"  {'shape':>5} {'ms/call':>9} {'frames/s':>9} {'first call ms':>14}")
    for b, v in a.items():
        print(f"  {b:5d} {v['ms']:9.2f} {v['fps']:9.1f} {v['first_ms']:14.1f}   ({v['calls']} calls)", flush=True)


def anchor_fps(batch: int, sizes: tuple[int, ...], a: dict) -> float:
    """Frames/s of the anchor for `batch` frames run as the worker runs them (calls_for)."""
    return batch / sum(a[s]["ms"] for s in calls_for(batch, sizes)) * 1000

