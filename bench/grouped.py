"""python -m bench.grouped: n frames of n different avatars in one device call (gpu_actor/grouped.py)
against n frames of one avatar, and against n calls of one frame each.

For each batch size n, onnxruntime alone, inputs, weights and outputs bound where they live (IO binding;
OrtValues on the device), each session warmed first (a GPU's first call at a shape builds cuDNN's plans:
seconds), then rounds of one call of each way in turn for `--seconds` per way, each way's median:

    one model      the architecture's graph at batch n, one model's weights bound once: the anchor
    grouped conv   the grouped graph at n, n models' weights stacked, 1x1 convolutions grouped
    grouped matmul the same, 1x1 convolutions as batched MatMuls (cuBLAS strided-batched GEMM)
    n x 1 frame    the architecture's graph at batch 1, called n times, each with its own model's weights:
                   what mixing avatars costs without grouping

The models: the real-size unet_328 (or `tiny`) with random weights, model i's scaled per element by
0.9-1.1 (its own weights, the same cost). Each grouped row is checked against the same frame run alone.
`--budget-s` bounds the run: a size whose estimated cost (from the sizes already measured) does not fit
is skipped and named. `--json` is written after every size.

    python -m bench.grouped --device cuda:0 --sizes 1,4,8,16,32 --seconds 3 --budget-s 400 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bench.__main__ import _counts, _device, _write_json
from gpu_actor.device import is_gpu
from gpu_actor.onnx_sessions import cuda_id

VARIANTS = ("one", "conv", "matmul", "split")
LABELS = {"one": "one model", "conv": "grouped conv", "matmul": "grouped matmul", "split": "n x 1 frame"}
MIN_CALLS = 3
GPU_FIRST_CALL_S = 5.7      # docs/benchmarks.md, an H100: a first call at a new batch size (cuDNN EXHAUSTIVE)
CPU_FRAME_MS = {"unet328": 250.0, "tiny": 15.0}   # priors (bench/gpu.py's), until a size is measured


def _models(kind: str, audio: str, count: int):
    """The architecture and `count` models' weights, stacked: {name: [count, *shape]}."""
    from gpu_actor.model_builder import build_model
    from gpu_actor.model_split import split_proto
    split = split_proto(build_model(kind=kind, audio=audio, seed=1), Path(f"{kind}.onnx"))
    rng = np.random.default_rng(0)
    stacked = {}
    for name, weight in zip(split.architecture.weights, split.weights):
        scale = rng.uniform(0.9, 1.1, (count, *weight.shape)).astype(weight.dtype)
        scale[0] = 1
        stacked[name] = np.ascontiguousarray(weight[None] * scale)
    return split.architecture, stacked


class _Device:
    """Sessions and OrtValues on "cpu" or "cuda:N", as a worker makes its sessions."""

    def __init__(self, device: str):
        self.name = device
        self.where, self.index = ("cuda", cuda_id(device)) if is_gpu(device) else ("cpu", 0)
        if is_gpu(device):
            from gpu_actor.cuda_libs import preload
            preload()

    def session(self, graph: bytes):
        from gpu_actor.onnx_sessions import new_session, session_options
        if not is_gpu(self.name):
            return new_session(graph, session_options(0, False), ["CPUExecutionProvider"], "cpu")
        from gpu_actor.cuda import CudaDevice
        options = session_options(1, False)
        return new_session(graph, options, CudaDevice.providers_for(self.index), self.name)

    def value(self, array: np.ndarray):
        import onnxruntime as ort
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.where, self.index)

    def empty(self, shape, dtype=np.float32):
        import onnxruntime as ort
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.where, self.index)


class _Call:
    """One run of `session`, everything bound where it lives: the model's work and nothing else."""

    def __init__(self, session, feeds: dict, output: str, out):
        self.session, self.binding = session, session.io_binding()
        for name, value in feeds.items():
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output(output, out)
        self.held = (feeds, out)   # NOTE: a binding holds addresses, not the values

    def __call__(self) -> None:
        # NOTE: the CUDA provider synchronizes its stream at the end of a run: the wall time is the GPU's
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def fetch(self) -> np.ndarray:
        return self.binding.copy_outputs_to_cpu()[0]


def _rounds(calls: dict[str, Callable[[], None]], seconds: float) -> dict:
    """Each call's first run (a shape's plans built) and one more to warm, then rounds of one run of each,
    in turn (the order reversed every round, so that a busy host weighs on all alike), for `seconds` per
    call in all: each one's median."""
    out = {}
    for name, call in calls.items():
        t = time.perf_counter()
        call()
        out[name] = {"first_ms": (time.perf_counter() - t) * 1000}
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    stop = time.perf_counter() + seconds * len(calls)
    while len(times[order[0][0]]) < MIN_CALLS or (time.perf_counter() < stop and len(times[order[0][0]]) < 5000):
        for name, call in order:
            t = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t) * 1000)
        order.reverse()
    for name, values in times.items():
        out[name].update(ms=statistics.median(values), calls=len(values))
    return out


def measure(dev: _Device, architecture, stacked: dict, n: int, seconds: float, plain, io) -> dict:
    """The four ways of running n frames at batch size n; each grouped row against the frame alone."""
    from gpu_actor.grouped import grouped_graph
    visual_name, audio_name, output = io
    started = time.perf_counter()
    rng = np.random.default_rng(n)
    visual = rng.random((n, *plain["visual_shape"]), dtype=np.float32)
    audio = rng.standard_normal((n, *plain["audio_shape"])).astype(np.float32)
    per_model = [{w: dev.value(stacked[w][i]) for w in architecture.weights} for i in range(n)]
    out: dict = {"n": n}
    output_shape = (n, *plain["output_shape"])
    calls: dict[str, Callable[[], None]] = {
        "one": _Call(plain["session"], {visual_name: dev.value(visual), audio_name: dev.value(audio), **per_model[0]},
                     output, dev.empty(output_shape))}
    # NOTE: a session of its own at batch 1: onnxruntime's CUDA provider rebuilds cuDNN's plans whenever a
    # session's input shape changes (an H200: 1.6-3.6 s a call when one session alternated 16 and 1)
    singles = [_Call(plain["single"], {visual_name: dev.value(visual[i:i + 1]),
                                        audio_name: dev.value(audio[i:i + 1]), **per_model[i]},
                     output, dev.empty((1, *plain["output_shape"]))) for i in range(n)]
    calls["split"] = lambda: [c() for c in singles]
    for mode in ("conv", "matmul"):
        t = time.perf_counter()
        session = dev.session(grouped_graph(architecture, n, mode))
        out.setdefault("session_ms", {})[mode] = (time.perf_counter() - t) * 1000
        calls[mode] = _Call(session, {visual_name: dev.value(visual), audio_name: dev.value(audio),
                                      **{w: dev.value(stacked[w][:n]) for w in architecture.weights}},
                            output, dev.empty(output_shape))
    out.update(_rounds({v: calls[v] for v in VARIANTS}, seconds))
    for variant in VARIANTS:
        out[variant]["fps"] = n / out[variant]["ms"] * 1000
    alone = np.concatenate([c.fetch() for c in singles])
    for mode in ("conv", "matmul"):
        out[_diff_key(mode)] = float(np.abs(calls[mode].fetch() - alone).max())
        out[mode]["ratio"] = out[mode]["ms"] / out["one"]["ms"]
    out["split"]["ratio"] = out["split"]["ms"] / out["one"]["ms"]
    out["wall_s"] = time.perf_counter() - started
    return out


def _diff_key(mode: str) -> str:
    return f"{mode}_max_abs_diff"


def estimate_s(n: int, done: list[dict], device: str, model: str, seconds: float) -> float:
    """A size's cost: four variants, each warmed (2 calls and a first call's plans) then timed, from the
    largest size measured (per frame, scaled to n) or the priors."""
    if done:
        last = done[-1]
        scale = n / last["n"]
        # NOTE: on a GPU a first call is building cuDNN's plans, seconds whatever the batch (3.1-5.7 s from
        # batch 1 to 64 on an H100): scaling it by n, as the CPU's compute scales, skipped n = 16 on an
        # H200 at an estimated 96 s
        first_scale = 1.5 if is_gpu(device) else max(1.0, scale)
        total = sum(last["session_ms"].values()) / 1000 * first_scale
        for v in VARIANTS:
            call_s = last[v]["ms"] / 1000 * scale
            first_s = last[v]["first_ms"] / 1000 * first_scale
            total += first_s + call_s + max(seconds, MIN_CALLS * call_s)
        return total + 0.1 * n   # weights uploaded per model
    if is_gpu(device):
        return 4 * (GPU_FIRST_CALL_S + seconds) + 0.1 * n
    call_s = CPU_FRAME_MS[model] / 1000 * n
    return 4 * (2 * call_s + max(seconds, MIN_CALLS * call_s))


def run(device: str, model: str, audio: str, sizes: tuple[int, ...], seconds: float, budget_s: Optional[float],
        started: float, save: Callable[[dict], None]) -> dict:
    from bench.gpu_device import device_name
    from config.assets import classify_io
    dev = _Device(device)
    print(f"device: {device_name(device)}; model {model}/{audio}; sizes {list(sizes)}; {seconds:g} s each", flush=True)
    architecture, stacked = _models(model, audio, max(sizes))
    session = dev.session(architecture.graph)
    names = set(architecture.weights)
    io = classify_io([(i.name, list(i.shape)) for i in session.get_inputs() if i.name not in names],
                     [(o.name, list(o.shape)) for o in session.get_outputs()], f"{model}.onnx")
    plain = {"session": session, "single": dev.session(architecture.graph), "visual_shape": (6, 320, 320),
             "audio_shape": tuple(io.audio_shape), "output_shape": (3, 320, 320)}
    results: dict = {"device": device_name(device), "model": model, "audio": audio, "seconds": seconds,
                     "sizes": {}, "skipped": {}}
    done: list[dict] = []
    print_header()
    for n in sorted(set(sizes)):
        left = None if budget_s is None else budget_s - (time.monotonic() - started)
        need = estimate_s(n, done, device, model, seconds)
        if left is not None and need > left:
            results["skipped"][n] = f"estimated {need:.0f} s, {max(left, 0):.0f} s of --budget-s left"
            print(f"  n={n}: skipped, {results['skipped'][n]}", flush=True)
            continue
        figures = measure(dev, architecture, stacked, n, seconds, plain, (io.visual, io.audio, io.output))
        done.append(figures)
        results["sizes"][n] = figures
        print_size(figures)
        save(results)
    return results


def print_header() -> None:
    columns = " ".join(f"{LABELS[v] + ' ms':>18} {'fps':>7}" for v in VARIANTS)
    print(f"  {'n':>3} {columns} {'conv/one':>9} {'mm/one':>7} {'split/one':>9} {'max|diff|':>9}")


def print_size(f: dict) -> None:
    diff = max(f[_diff_key("conv")], f[_diff_key("matmul")])
    columns = " ".join(f"{f[v]['ms']:18.2f} {f[v]['fps']:7.1f}" for v in VARIANTS)
    print(f"  {f['n']:3d} {columns} {f['conv']['ratio']:9.2f} {f['matmul']['ratio']:7.2f} "
          f"{f['split']['ratio']:9.2f} {diff:9.1e}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="python -m bench.grouped", description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=_device, default="auto",
                        help="auto (cuda:0 where onnxruntime has CUDA and cupy sees a GPU, else cpu), cpu or cuda:N")
    parser.add_argument("--model", choices=["unet328", "tiny"], default="unet328")
    parser.add_argument("--audio", choices=["ave", "hubert", "wenet"], default="ave")
    parser.add_argument("--sizes", type=_counts, default=(1, 4, 8, 16, 32), help="batch sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of timed calls per variant and size")
    parser.add_argument("--budget-s", type=float, help="the whole run's seconds: a size that would not fit is skipped")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON (after every size)")
    args = parser.parse_args(argv)
    if not args.sizes or min(args.sizes) < 1:
        parser.error(f"--sizes {args.sizes}: expected positive batch sizes")
    from bench.gpu_device import pick_device
    device = pick_device(args.device)

    def save(results: dict) -> None:
        if args.json:
            _write_json(args.json, {"grouped": results})
    results = run(device, args.model, args.audio, args.sizes, args.seconds, args.budget_s, started, save)
    print(f"  ms per call, frames/s; the ratios: ms against one model's at the same n; max|diff|: grouped rows "
          f"against the same frames run alone; {time.monotonic() - started:.0f} s in all")
    save(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
