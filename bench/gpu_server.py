"""bench gpu, the sections that drive a server: each batch size's first call after ready, calls alternating
between shapes, served `infer` against the anchor, live sessions (audio windows or 16 kHz PCM), a model's
load to its first frame, a load while sessions speak, and how many models stay resident."""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import psutil

from bench.gpu_device import anchor_fps, memory_mib
from lipsync_client import AsyncClient, ServerError, Session

AUDIO_SHAPE = (32, 16, 16)        # the "ave" features every model here takes
WARM_S = 3.5                      # a speaking session of bench/sessions.py starts speaking within 3 s


def alternating(batches: tuple[int, ...]) -> tuple[int, ...]:
    """Two or three shapes far apart: the smallest, one near their geometric middle, the largest."""
    lo, hi = batches[0], batches[-1]
    mid = min(batches, key=lambda b: abs(np.log(b) - (np.log(lo) + np.log(hi)) / 2))
    return tuple(dict.fromkeys((lo, mid, hi)))


# -- the servers --------------------------------------------------------------------------------------

class LazyServer:
    """A server of one variant: started by the first section that needs it, stopped by `stop`."""

    def __init__(self, root: Path, cfg: dict, env: Optional[dict]):
        self.root, self.cfg, self.env = root, cfg, env
        self.srv, self._cm, self.error = None, None, None
        self.start_s: Optional[float] = None   # from its start to READY, once started

    @property
    def running(self) -> bool:
        return self.srv is not None

    def get(self):
        from tests.helpers import run_server
        if self.error is not None:
            raise RuntimeError(f"the server did not start: {self.error}")
        if self.srv is None:
            t, cm = time.monotonic(), run_server(self.root, self.cfg, env=self.env)
            try:
                self.srv = cm.__enter__()
            except Exception as err:
                self.error = f"{type(err).__name__}: {err}"
                raise
            self._cm, self.start_s = cm, time.monotonic() - t
        return self.srv

    def stop(self) -> Optional[str]:
        """Stop it (its processes gone, its shared memory unlinked): None, or what went wrong."""
        if self._cm is None:
            return None
        cm, self._cm, self.srv = self._cm, None, None
        try:
            cm.__exit__(None, None, None)
        except Exception as err:   # a non-zero exit, a process or /dev/shm entry left behind
            return f"{type(err).__name__}: {err}"
        return None


def stop_children(timeout_s: float = 60.0) -> list[str]:
    """SIGTERM every process this one started that still runs (a server whose start a signal cut short, in
    a section's thread), and wait for it: what had to be stopped so."""
    children = psutil.Process().children()
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        child.kill()
    return [f"pid {c.pid}" for c in children]


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
    each size's steady time (median of `steady_calls`)."""
    inputs = {b: _inputs(b) for b in batches}
    with srv.client(timeout_s=600) as c:
        t = time.perf_counter()
        reply = c.load(model)
        load = {"client_ms": (time.perf_counter() - t) * 1000, "load_ms": reply.get("load_ms")}
        first = {b: _timed(c, model, *inputs[b]) for b in batches}
        steady = {b: [_timed(c, model, *inputs[b]) for _ in range(steady_calls)] for b in batches}
    med = {b: (statistics.median(v[0] for v in calls), statistics.median(v[1] for v in calls))
           for b, calls in steady.items()}
    out = {"load": load, "batches": {}}
    print(f"  load: {load['client_ms']:.0f} ms (the worker's load_ms {_ms(load['load_ms'])})")
    print(f"  {'batch':>5} {'first ms':>9} {'(inference)':>11} {'steady ms':>10} {'(inference)':>11} {'first/steady':>12}")
    for b in batches:
        ratio = first[b][0] / med[b][0]
        out["batches"][b] = {"first_ms": first[b][0], "first_inference_ms": first[b][1], "steady_ms": med[b][0],
                             "steady_inference_ms": med[b][1], "ratio": ratio}
        print(f"  {b:5d} {first[b][0]:9.1f} {first[b][1]:11.1f} {med[b][0]:10.1f} {med[b][1]:11.1f} {ratio:12.2f}",
              flush=True)
    return out


def alternating_calls(srv, model: str, shapes: tuple[int, ...], rounds: int, steady: Optional[dict]) -> dict:
    """`rounds` rounds of one `infer` at each of `shapes`: each shape's median against its steady time
    (`steady`: first_calls' batches; where it lacks a shape, `rounds` calls at that shape first)."""
    inputs = {b: _inputs(b) for b in shapes}
    steady_ms, mixed = {}, {b: [] for b in shapes}
    with srv.client(timeout_s=600) as c:
        for b in shapes:
            row = (steady or {}).get(b)
            steady_ms[b] = row["steady_ms"] if row else statistics.median(
                _timed(c, model, *inputs[b])[0] for _ in range(rounds + 1))
        for _ in range(rounds):
            for b in shapes:
                mixed[b].append(_timed(c, model, *inputs[b]))
    out = {}
    for b, calls in mixed.items():
        ms = statistics.median(v[0] for v in calls)
        out[b] = {"ms": ms, "max_ms": max(v[0] for v in calls), "steady_ms": steady_ms[b], "ratio": ms / steady_ms[b]}
        print(f"  batch {b:3d}: {ms:8.1f} ms (max {out[b]['max_ms']:.1f}) vs steady {steady_ms[b]:.1f} "
              f"= {ms / steady_ms[b]:.2f}x", flush=True)
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

COLD_S = 6.0   # live(): the first speech of every avatar, before the levels
GROUPED_WAIT_S = 60.0   # live(): at most this long for the N-model form, with several avatars


def live(srv, levels: tuple[int, ...], seconds: float, metrics_port: int,
         pcm: Optional[np.ndarray] = None, models: tuple[str, ...] = ("avatar",), duty: float = 0.27,
         profile: Optional[Path] = None) -> list[dict]:
    """bench/sessions.py's speaking levels, session i on models[i % len(models)]: audio windows, one per
    frame period, or with `pcm` (16 kHz int16) that utterance from its start in 20-ms chunks in real time,
    once per burst; each session speaking `duty` of the time. Several avatars: first a session on each
    speaks all the time for COLD_S, printed (their backgrounds' first decode, cold), so the levels measure
    avatars in use. `profile`: a directory for py-spy recordings of the frontend and the first
    inference process per level (bench/pyspy.py)."""
    from bench.sessions import _print, _run_level
    with srv.client(timeout_s=600) as c:   # their loads (and a GPU's warm-up of every shape) are not a level's
        for model in models:
            c.load(model)
    if len(models) > 1:
        _await_grouped(srv)
    out = []
    if len(models) > 1:
        print(f"    first speech of each of the {len(models)} avatars at once (cold: their backgrounds decoded "
              "on first use):", flush=True)
        before = _calls(srv)
        r = _run_level(srv, len(models), COLD_S, 1.0, pcm, fmt="jpeg", metrics_port=metrics_port, models=models)
        _print(r)
        r["device_calls"] = calls = _calls_between(before, _calls(srv))
        r["cold"] = True
        out.append(r)
        print(f"        device calls: {calls['calls']}, {calls['frames_per_call']:.2f} frames a call", flush=True)
    for n in levels:
        before = _calls(srv)
        r = _run_level(srv, n, seconds, duty, pcm, fmt="jpeg", metrics_port=metrics_port, models=models,
                       profile=profile)
        _print(r)
        r["device_calls"] = calls = _calls_between(before, _calls(srv))
        print(f"        device calls: {calls['calls']}, {calls['frames_per_call']:.2f} frames a call, "
              f"{calls['padded_share']:.0%} of their rows padding; steps {calls['steps']}; the device thread "
              f"busy {calls['device_busy_s']:.1f} s of the level's {seconds:g}, {calls['overlapped']:.0f} of "
              f"{calls['worker_steps']:.0f} steps prepared while another ran", flush=True)
        inferred = r["speech"] / seconds
        gpu = r["processes"].get("gpu0", {}).get("cpu", 0.0)
        r["worker_cpu_per_1000_fps"] = gpu / inferred * 1000 if inferred else None
        print(f"        inference process {gpu:.0f}% of a core for {inferred:.0f} speech frames/s"
              + (f" = {r['worker_cpu_per_1000_fps']:.0f}% per 1,000 frames/s" if inferred else ""), flush=True)
        out.append(r)
    return out


def _await_grouped(srv, most_s: float = GROUPED_WAIT_S) -> Optional[float]:
    """Wait (at most `most_s`) until every architecture with several models loaded has its N-model form
    (gpu_actor/mixed.py: prepared on a thread of its own once a second avatar loads, seconds of first calls
    on a GPU), so that the levels measure steps as they run once it is ready; printed. The seconds waited,
    or None where it was not ready in time."""
    started = time.monotonic()
    while True:
        archs = [a for w in _model_stats(srv).get("workers", []) for a in (w.get("architectures") or {}).values()
                 if a.get("models", 0) > 1]
        waited = time.monotonic() - started
        if all(a.get("grouped_ms") for a in archs):
            ways = sorted({str(a.get("grouped_pointwise")) for a in archs})
            print(f"    the N-model form ready after {waited:.1f} s (its 1x1 convolutions as {', '.join(ways)}; ms a "
                  f"call by size: {'; '.join(str(a['grouped_ms']) for a in archs)})" if archs else
                  "    no architecture with several models loaded: no N-model form to wait for", flush=True)
            return waited
        if waited >= most_s:
            print(f"    the N-model form not ready after {waited:.0f} s: the levels run with what is ready", flush=True)
            return None
        time.sleep(0.5)


def _calls(srv) -> dict:
    """The worker's model calls so far, summed over its architectures (stats: frames per call), and its
    device thread's seconds in steps."""
    calls: Counter = Counter()
    rows: Counter = Counter()
    steps: Counter = Counter()
    busy: Counter = Counter()
    for worker in _model_stats(srv).get("workers", []):
        for arch in (worker.get("architectures") or {}).values():
            calls.update({int(k): v for k, v in arch.get("calls_by_size", {}).items()})
            rows.update({int(k): v for k, v in arch.get("frames_per_call_histogram", {}).items()})
            steps.update(arch.get("steps", {}))
        busy.update(worker.get("steps", {}))
    return {"sizes": calls, "rows": rows, "steps": steps, "busy": busy}


def _calls_between(before: dict, after: dict) -> dict:
    """The calls a level made: their count, mean frames, padded share of their rows, steps by kind; the
    seconds the device thread ran steps, and the steps prepared while another ran."""
    sizes, rows, steps = (after[k] - before[k] for k in ("sizes", "rows", "steps"))
    n, slots, frames = sum(sizes.values()), sum(k * v for k, v in sizes.items()), sum(k * v for k, v in rows.items())
    busy = {k: after["busy"].get(k, 0) - before["busy"].get(k, 0) for k in after["busy"]}
    return {"calls": n, "frames_per_call": frames / n if n else 0.0, "padded_share": 1 - frames / slots if slots else 0.0,
            "histogram": {str(k): v for k, v in sorted(rows.items())}, "steps": dict(steps),
            "device_busy_s": busy.get("device_busy_s", 0.0), "overlapped": busy.get("prepared_during_a_step", 0),
            "worker_steps": busy.get("steps", 0)}


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
