"""Live sessions: how many concurrent 25-fps sessions one machine serves with >= 99 % of frames on time
(sent <= 40 ms after due) and none dropped, speaking 27 % of the time in bursts of about 3 s, or all
silent; speech latency; and where a level's limit comes from: each process's CPU against one core
(the first to saturate named), each stage's queue over the run (bench/procstat.py), and with
--profile the frontend's CPU per frame sent by function (bench/pyspy.py).

A near-zero-cost model (so inference does not hide the rest), the demo's 1280x720 background, JPEG q75
(or with --format h264, H.264 at sessions.h264's defaults and two compositing processes, the work being
mostly encoding: bytes per second per session too).
Audio is sent in real time, one frame's window per frame period while a session speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np
import psutil

from bench import pyspy
from bench.procstat import CpuSampler, DepthSampler, server_pids
from lipsync_client import AsyncSession, ServerError
from lipsync_client.commands import read_wav
from gpu_actor.model_builder import write_audio_encoder, write_model
from config.audio import write_speech
from tests.helpers import base_config, free_ports, run_server

FPS = 25.0
MAX_IN_FLIGHT = 16   # a session's audio chunks sent and not yet answered
# --profile: the processes recorded, each its role and its figure's key
PROFILED = {"frontend0": ("frontend", "profile"), "gpu0": ("inference", "profile_inference")}


def _models(demo_dir: Path, root: Path) -> Path:
    d = root / "avatar"
    (d / "frames").mkdir(parents=True)
    src = demo_dir / "demo"
    for f in (src / "frames").iterdir():
        os.link(f, d / "frames" / f.name)
    shutil.copy(src / "crop_rects.json", d / "crop_rects.json")
    write_model(d / "model.onnx", kind="tiny", audio="ave")
    write_audio_encoder(d / "audio_encoder.onnx")
    return root


async def _admitted(endpoint: str, fmt: str, mode: str, admit_s: float,
                    model: str = "avatar") -> tuple[Optional[AsyncSession], int]:
    """An open session, and how many times the server answered busy first (asked again when it said, for
    up to `admit_s`); None if it never let the session in."""
    give_up, refusals = time.monotonic() + admit_s, 0
    while True:
        s = AsyncSession(endpoint, model, format=fmt, quality=75 if fmt == "jpeg" else None, timeout_s=60,
                         audio=mode)
        try:
            return await s.__aenter__(), refusals
        except ServerError as err:
            await s.__aexit__(None, None, None)
            if err.code != "busy" or not admit_s:
                raise
            refusals += 1
            if time.monotonic() + err.retry_after_s > give_up:
                return None, refusals
            await asyncio.sleep(err.retry_after_s)


async def _session(endpoint: str, seconds: float, duty: float, burst_s: float, seed: int,
                   pcm: Optional[np.ndarray] = None, fmt: str = "jpeg", tts: bool = False, admit_s: float = 0.0,
                   model: str = "avatar") -> dict:
    rng = np.random.default_rng(seed)
    mode = "pcm16" if pcm is not None else "window"
    received = [0, 0.0, 0.0]   # bytes, first and last arrival

    s, refusals = await _admitted(endpoint, fmt, mode, admit_s, model)
    if s is None:
        return {"refused": True, "busy": refusals}
    async with s:   # (open already: entering it again is the same session)
        async def drain():
            while True:
                _, image, _ = await s.frames.get()
                received[0] += len(image)
                received[1] = received[1] or time.monotonic()
                received[2] = time.monotonic()

        reader = asyncio.create_task(drain())
        window = rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
        # PCM goes in 20-ms chunks in real time, one utterance per burst; or, as a streaming TTS gives
        # it (`tts`), in 200-ms chunks at twice real time
        step = 1 / FPS if pcm is None else (0.1 if tts else 0.02)
        chunk_samples = 3200 if tts else 320
        t0 = time.monotonic() + rng.uniform(0, step)
        speaking_until, tick, sent = 0.0, 0, 0
        in_flight: deque = deque()
        next_burst = t0 + (rng.uniform(0, burst_s / duty) if duty else float("inf"))
        while (now := time.monotonic()) - t0 < seconds:
            if now >= next_burst:
                speaking_until = now + burst_s * rng.uniform(0.7, 1.3)
                next_burst = speaking_until + burst_s * (1 - duty) / duty * rng.uniform(0.7, 1.3)
                sent = 0
            if now < speaking_until:
                # (streamed as a voice agent's client does: a chunk's reply is not waited for before the
                # next chunk goes, only checked)
                if pcm is None:
                    in_flight.append(s.push_audio(window))
                elif sent < len(pcm):
                    chunk = pcm[sent:sent + chunk_samples]
                    sent += len(chunk)
                    ending = sent >= len(pcm) or now + step >= speaking_until
                    in_flight.append(s.push_audio(chunk, last=ending))
                    sent = len(pcm) if ending else sent
            while in_flight and (len(in_flight) > MAX_IN_FLIGHT or in_flight[0].done()):
                await in_flight.popleft()
            tick += 1
            await asyncio.sleep(max(t0 + tick * step - time.monotonic(), 0))
        for reply in in_flight:
            await reply
        stats = await s.close()
        reader.cancel()
        return {**stats, "bytes_per_s": received[0] / max(received[2] - received[1], 1e-9), "busy": refusals,
                "endpoint": endpoint}


async def _level(endpoint: str | tuple[str, ...], n: int, seconds: float, duty: float, pcm=None, fmt: str = "jpeg",
                 tts: bool = False, admit_s: float = 0.0, models: tuple[str, ...] = ("avatar",)) -> list[dict]:
    """n sessions, session i on models[i % len(models)] and, given several endpoints, on endpoint[i % their
    count]."""
    endpoints = (endpoint,) if isinstance(endpoint, str) else endpoint
    return await asyncio.gather(*(_session(endpoints[i % len(endpoints)], seconds, duty, 3.0, i, pcm, fmt, tts,
                                           admit_s, models[i % len(models)]) for i in range(n)))


def _pcm_costs(encoder_path: Path, speech: np.ndarray) -> dict:
    """What PCM input adds per frame: the incremental mel in the frontend's event loop (PcmStream, per
    20-ms chunk) and the encoder run in the inference process (per encoder input = per frame)."""
    import onnxruntime as ort

    from config.audio import PcmStream, encoder_inputs, melspectrogram
    samples = speech.astype(np.float32) / 32768
    stream, t0 = PcmStream(), time.process_time()
    for k in range(0, len(samples), 320):
        stream.push(samples[k:k + 320], last=k + 320 >= len(samples))
    mel_s = time.process_time() - t0
    chunks = -(-len(samples) // 320)
    inputs = encoder_inputs(melspectrogram(samples))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(encoder_path), options, providers=["CPUExecutionProvider"])
    session.run(None, {"mel": inputs[:8]})
    t0 = time.process_time()
    for _ in range(3):
        session.run(None, {"mel": inputs})
    encoder_s = (time.process_time() - t0) / 3
    return {"mel_us_per_chunk": mel_s / chunks * 1e6, "mel_percent_of_realtime": 100 * mel_s / (len(samples) / 16000),
            "encoder_ms_per_frame": encoder_s / len(inputs) * 1000}


def _run_level(srv, n: int, seconds: float, duty: float, pcm=None, fmt: str = "jpeg", tts: bool = False,
               metrics_port: Optional[int] = None, profile: Optional[Path] = None, native: bool = False,
               admit_s: float = 0.0, models: tuple[str, ...] = ("avatar",)) -> dict:
    procs = server_pids(srv)
    pids = {**procs, "supervisor": srv.proc.pid, "bench client": os.getpid()}
    cpu, depth = CpuSampler(pids), DepthSampler(srv.endpoint, metrics_port)
    kind = ("pcm-tts" if tts else "pcm") if pcm is not None else fmt
    recordings = _record(procs, n, duty, kind, profile, native)
    cpu.start()
    depth.start()
    try:
        stats = asyncio.run(_level(srv.endpoint, n, seconds, duty, pcm, fmt, tts, admit_s, models))
        refused = [st for st in stats if st.get("refused")]
        stats = [st for st in stats if not st.get("refused")]
    finally:
        cpu.stop()
        depth.stop()
        failed = {name: recording.stop() for name, recording in recordings.items()}
    used = cpu.result()
    frames = sum(s["frames_speech"] + s["frames_idle"] for s in stats)
    late = sum(s["late"] for s in stats)
    p99 = [s["latency_ms_p99"] for s in stats if s["latency_ms_p99"] is not None]
    wall = cpu.samples[-1][0] - cpu.samples[0][0]
    # (several client-facing processes: all of them together; their event loops' threads summed)
    fronts = [v for k, v in used.items() if k.startswith("frontend")]
    frontend = {"cpu": sum(v["cpu"] for v in fronts), "thread_cpu": sum(v["thread_cpu"] for v in fronts)}
    result = {"sessions": len(stats), "asked": n, "refused": len(refused),
              "busy_answers": sum(st["busy"] for st in stats + refused),
              "duty": duty, "pcm": pcm is not None, "tts": tts, "frames": frames,
              "speech": sum(s["frames_speech"] for s in stats),
              "on_time": 1 - late / max(frames, 1), "late": late, "missed": sum(s["missed"] for s in stats),
              "dropped": sum(s["dropped"] for s in stats), "max_late_ms": max(s["max_late_ms"] for s in stats),
              "latency_p99_ms": max(p99) if p99 else None, "format": fmt,
              "kbit_s_per_session": 8 * sum(s["bytes_per_s"] for s in stats) / len(stats) / 1000,
              "encoded": sum(s.get("frames_encoded", 0) for s in stats),
              "stages_ms": _stages(stats), "missed_in": _sum_counts(s.get("missed_in", {}) for s in stats),
              "frontend_us_per_frame": 1e4 * frontend["cpu"] * wall / max(frames, 1),
              "frontend_loop_us_per_frame": 1e4 * frontend["thread_cpu"] * wall / max(frames, 1),
              "cpu_percent": {k: round(v["cpu"]) for k, v in used.items() if k != "machine"},
              "processes": used, "saturated": _first_saturated(used), "queues": depth.result()}
    result["missed_share"] = result["missed"] / max(result["missed"] + result["speech"], 1)
    # shedding (sessions.shed_speech): the sessions that kept all their speech, and how those fared
    kept = [s for s in stats if not s.get("shed")]
    kept_missed, kept_speech = sum(s["missed"] for s in kept), sum(s["frames_speech"] for s in kept)
    result.update(shed=sum(s.get("shed", 0) for s in stats), sessions_shed=len(stats) - len(kept),
                  kept_missed=kept_missed, kept_missed_share=kept_missed / max(kept_missed + kept_speech, 1))
    # the frontend's CPU per frame sent; the inference process's per speech frame (all it runs)
    per_frame = {"frontend0": (result["frontend_loop_us_per_frame"], frames, "frame sent"),
                 "gpu0": (1e4 * used.get("gpu0", {}).get("thread_cpu", 0.0) * wall / max(result["speech"], 1),
                          result["speech"], "speech frame")}
    for name, recording in recordings.items():
        (us, count, per), (role, key) = per_frame[name], PROFILED[name]
        result[key] = pyspy.figures(recording.out, failed[name], count, us, role, per)
    return result


def _record(procs: dict[str, int], n: int, duty: float, kind: str, profile: Optional[Path],
            native: bool = False) -> dict:
    """py-spy recordings over the level (--profile) of the frontend and of the first inference process,
    by process name; none without --profile or py-spy. `kind`: the level's input (a format, pcm or
    pcm-tts), in the recording's name."""
    exe = pyspy.executable(profile)
    if exe is None:
        return {}
    level = f"{kind}-{n}-{'speaking' if duty else 'silent'}"
    return {name: pyspy.Recording(exe, procs[name], profile / f"{role}-{level}.txt", native=native)
            for name, (role, _) in PROFILED.items() if name in procs}


def _first_saturated(used: dict) -> dict:
    """The process that saturated first in the level (its busiest thread >= 90 % of one core over a
    second), else the busiest one, named as not saturated."""
    procs = {k: v for k, v in used.items() if k not in ("machine", "bench client")}
    hit = [(v["saturated_at"], k) for k, v in procs.items() if v["saturated_at"] is not None]
    if hit:
        at, name = min(hit)
        return {"process": name, "at_s": at, "saturated": True, "thread_cpu": procs[name]["thread_cpu"]}
    name = max(procs, key=lambda k: procs[k]["thread_cpu"])
    return {"process": name, "at_s": None, "saturated": False, "thread_cpu": procs[name]["thread_cpu"]}


def _stages(stats: list[dict]) -> dict:
    """Each stage over all sessions: the median of their p50s, the largest of their p99s and maxima (a
    session reports percentiles, not every frame: the p99 here is an upper bound of the pooled p99)."""
    out = {}
    for name in ("batching", "queue", "inference", "to_composite", "composite", "encode_wait", "encode", "hold"):
        parts = [s["stages_ms"][name] for s in stats if name in s.get("stages_ms", {})]
        if parts:
            out[name] = {"p50": float(np.median([p["p50"] for p in parts])), "p99": max(p["p99"] for p in parts),
                         "max": max(p["max"] for p in parts)}
    return out


def _sum_counts(dicts) -> dict:
    total: dict = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _settings(fmt: str, budget_ms: int, admission: bool = False, shed: bool = True, frontends: int = 1) -> dict:
    # NOTE: admission by load off (sessions.max_cpu_load 0) unless asked for: a server in service answers
    # `busy` before its cliff, and the bench measures where that cliff is
    # (with admission: its sessions speak 27 % of the time, and the server is told so)
    return {"sessions.max_sessions": 1000, "sessions.max_cpu_load": 0.75 if admission else 0,
            "sessions.speaking_share": 0.27,
            "sessions.latency_budget_ms": budget_ms, "sessions.shed_speech": shed,
            "limits.max_batch": 24,
            "compositing.max_frame_width": 1280, "compositing.max_frame_height": 720,
            "compositing.cache_bytes": 512 << 20, "compositing.workers": 2 if fmt == "h264" else "auto",
            "limits.queue_depth": 256, "shm.slots": 4, "frontend.processes": frontends}


def run_split(demo_dir: str, seconds: float = 10.0, sessions: int = 10, fmt: str = "jpeg",
              budget_ms: int = 280, edges: tuple[int, ...] = (1,), pcm: bool = False) -> dict:
    """One speaking level through edges (frontend + compositing) and a GPU host (inference + bridge)
    over loopback with CURVE, all on this machine, once per count in `edges`: the sessions spread over
    that many edges (session i on edge i % count), as a host whose one frontend process is its limit
    would run more of them in front of its own card. `pcm`: 16 kHz PCM in 20-ms chunks instead of audio
    windows. Each edge's frontend CPU per frame it sent; the GPU host's bridge and worker CPU per
    speech frame."""
    from tests.helpers import bridge_configs, bridge_keys, free_port, gpu_host
    root = Path(tempfile.mkdtemp(prefix="lsync-split-"))
    results = []
    try:
        models = _models(Path(demo_dir), root)
        keys, port = bridge_keys(root / "keys"), free_port()
        speech = read_wav(str(write_speech(root / "speech.wav", seconds=4.0))) if pcm else None
        for count in edges:
            configs = [bridge_configs(models, keys, port, f"lsbsplit{k}", **_settings(fmt, budget_ms))
                       for k in range(count)]
            with gpu_host(root, configs[0][0]) as (host, _), contextlib.ExitStack() as stack:
                servers = [stack.enter_context(run_server(root, edge_cfg, role="edge")) for _, edge_cfg in configs]
                for edge in servers:
                    _wait_host_ready(edge)
                    if fmt == "h264":   # the idle loop is encoded once per edge: not measured
                        asyncio.run(_level(edge.endpoint, 4, 4.0, 0.5, None, fmt))
                host_pids = {name.removeprefix("lsync-"): c.pid for c in psutil.Process(host.pid).children(recursive=True)
                             if (name := c.name()).startswith("lsync-")}   # (not multiprocessing's helpers)
                results.append(_run_split_level(servers, host_pids, sessions, seconds, speech, fmt))
            _print_split(results[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"levels": results}


def _wait_host_ready(edge, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while edge.health()["status"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError("the edge never saw its GPU host ready")
        time.sleep(0.2)


def _run_split_level(edges: list, host: dict[str, int], n: int, seconds: float, pcm=None, fmt: str = "jpeg") -> dict:
    """n sessions, 27% speaking, spread over `edges`; each process's CPU: the edges' as e<k>.<role><i>, the
    GPU host's as host.<role><i>."""
    pids = {f"e{k}.{name}": pid for k, srv in enumerate(edges) for name, pid in server_pids(srv).items()}
    pids.update({f"host.{name}": pid for name, pid in host.items()})
    pids["bench client"] = os.getpid()
    cpu = CpuSampler(pids)
    cpu.start()
    try:
        stats = asyncio.run(_level(tuple(e.endpoint for e in edges), n, seconds, 0.27, pcm, fmt))
    finally:
        cpu.stop()
    used = cpu.result()
    wall = cpu.samples[-1][0] - cpu.samples[0][0]
    count = len(edges)
    frames = [sum(s["frames_speech"] + s["frames_idle"] for s in stats if s["endpoint"] == e.endpoint) for e in edges]
    speech = sum(s["frames_speech"] for s in stats)
    missed = sum(s["missed"] for s in stats)
    late = sum(s["late"] for s in stats)
    p99 = [s["latency_ms_p99"] for s in stats if s["latency_ms_p99"] is not None]

    def per(name: str, what: int) -> Optional[float]:
        return 1e4 * used[name]["cpu"] * wall / max(what, 1) if name in used else None

    return {"edges": count, "sessions": n, "pcm": pcm is not None, "format": fmt, "frames": sum(frames),
            "frames_per_edge": frames,
            "speech": speech, "missed": missed, "missed_share": missed / max(missed + speech, 1),
            "late": late, "on_time": 1 - late / max(sum(frames), 1), "dropped": sum(s["dropped"] for s in stats),
            "latency_p99_ms": max(p99) if p99 else None, "stages_ms": _stages(stats),
            "frontend_us_per_frame": [per(f"e{k}.frontend0", frames[k]) for k in range(count)],
            "host_us_per_speech_frame": {name.removeprefix("host."): per(name, speech)
                                         for name in pids if name.startswith("host.")},
            "cpu_percent": {k: round(v["cpu"]) for k, v in used.items() if k != "machine"},
            "machine": used["machine"]}


def _print_split(r: dict) -> None:
    audio = "16 kHz PCM, 20-ms chunks in real time" if r["pcm"] else "audio windows"
    host = ", ".join(f"{name} {us:.0f}" for name, us in r["host_us_per_speech_frame"].items() if us is not None)
    print(f"  through {r['edges']} edge(s) + a GPU host, {r['sessions']} sessions speaking 27% ({audio}): "
          f"{r['frames']} frames ({r['speech']} speech), {100 * r['on_time']:.2f}% on time, late {r['late']}, "
          f"missed {r['missed']} ({100 * r['missed_share']:.1f}% of speech), dropped {r['dropped']}, speech latency "
          f"p99 {r['latency_p99_ms']} ms\n"
          f"        each edge's frontend, us of CPU per frame it sent: "
          + ", ".join(f"{us:.0f}" for us in r["frontend_us_per_frame"])
          + f"; the GPU host's processes, us of CPU per speech frame: {host}\n"
          f"        CPU, % of one core over the run: "
          + ", ".join(f"{name} {v}%" for name, v in r["cpu_percent"].items())
          + f"; machine {r['machine']['cpu']:.0f}% of {100 * r['machine']['cores']}%", flush=True)
    if r.get("stages_ms"):
        print("        speech frame stages, ms p50/p99/max: " + ", ".join(
            f"{name} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}" for name, v in r["stages_ms"].items()), flush=True)


def run(demo_dir: str, seconds: float = 10.0, speaking=(10, 20, 30, 40), silent=(100, 200, 300),
        pcm_speaking=(10, 20), fmt: str = "jpeg", budget_ms: int = 280, split: bool = True,
        profile: Optional[Path] = None, native: bool = False, shed: bool = True, split_edges: tuple[int, ...] = (1,),
        split_sessions: int = 10, split_pcm: bool = False, frontends: int = 1) -> dict:
    """Each level on one server; `profile`: a directory for a py-spy recording of the frontend per level
    (`native`: with C frames, pausing the process per sample)."""
    root = Path(tempfile.mkdtemp(prefix="lsync-sessions-"))
    try:
        models = _models(Path(demo_dir), root)
        port = free_ports(frontends)
        cfg = base_config(models, **_settings(fmt, budget_ms, shed=shed, frontends=frontends), **{"metrics.port": port})
        results = []
        with run_server(root, cfg) as srv:
            if fmt == "h264":   # the avatar's idle loop is encoded once, on its first sessions: not measured
                asyncio.run(_level(srv.endpoint, 4, 4.0, 0.5, None, fmt))
            for n in speaking:
                results.append(_run_level(srv, n, seconds, 0.27, fmt=fmt, metrics_port=port, profile=profile,
                                          native=native))
                _print(results[-1])
            for n in silent:
                results.append(_run_level(srv, n, seconds, 0.0, fmt=fmt, metrics_port=port, profile=profile,
                                          native=native))
                _print(results[-1])
            if fmt == "jpeg":
                _pcm_levels(srv, root, models, seconds, pcm_speaking, results, port, profile, native)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"levels": results, "split": run_split(demo_dir, seconds, split_sessions, fmt=fmt, budget_ms=budget_ms,
                                                  edges=split_edges, pcm=split_pcm) if split else None}


def run_admission(demo_dir: str, seconds: float = 10.0, asked=(60, 80), fmt: str = "h264", budget_ms: int = 280,
                  admit_s: float = 10.0, shed: bool = True, frontends: int = 1) -> dict:
    """Past capacity, with the server's admission on (sessions.max_cpu_load at its default): each level
    asks for more sessions than the machine holds, all at once, each asking again when the server says
    (busy's retry_after_ms) for up to `admit_s`. How many got in, how many were refused, and the quality
    of those that got in. A fresh server per level (its measured cost starts from nothing). `frontends`:
    its client-facing processes, which admit over the host's sessions together."""
    results = []
    for n in asked:
        root = Path(tempfile.mkdtemp(prefix="lsync-admission-"))
        try:
            models = _models(Path(demo_dir), root)
            port = free_ports(frontends)
            cfg = base_config(models, **_settings(fmt, budget_ms, admission=True, shed=shed, frontends=frontends),
                              **{"metrics.port": port})
            with run_server(root, cfg) as srv:
                if fmt == "h264":   # the avatar's idle loop is encoded once, on its first sessions: not measured
                    asyncio.run(_level(srv.endpoint, 4, 4.0, 0.5, None, fmt))
                results.append(_run_level(srv, n, seconds, 0.27, fmt=fmt, metrics_port=port, admit_s=admit_s))
                _print(results[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return {"admission": results}


def _pcm_levels(srv, root: Path, models: Path, seconds: float, levels, results: list,
                metrics_port: Optional[int] = None, profile: Optional[Path] = None, native: bool = False) -> None:
    if not levels:
        return
    speech = read_wav(str(write_speech(root / "speech.wav", seconds=4.0)))
    costs = _pcm_costs(models / "avatar" / "audio_encoder.onnx", speech)
    print(f"  PCM: mel in the frontend {costs['mel_us_per_chunk']:.0f} us per 20-ms chunk "
          f"({costs['mel_percent_of_realtime']:.2f}% of real time); encoder in the worker "
          f"{costs['encoder_ms_per_frame']:.2f} ms per frame", flush=True)
    for n in levels:
        for tts in (False, True):
            results.append(_run_level(srv, n, seconds, 0.27, speech, tts=tts, metrics_port=metrics_port,
                                      profile=profile, native=native))
            _print(results[-1])


def _print(r: dict) -> None:
    pcm = (" (16 kHz PCM, TTS-like: 200-ms chunks at 2x real time)" if r.get("tts") else
           " (16 kHz PCM, 20-ms chunks in real time)") if r.get("pcm") else ""
    kind = (f"speaking {r['duty']:.0%}" + pcm) if r["duty"] else "silent"
    if r.get("refused") or r.get("busy_answers"):
        print(f"  {r['asked']} sessions asked for: {r['sessions']} admitted, {r['refused']} refused busy "
              f"({r['busy_answers']} busy answers in all, each asked again as the server said)", flush=True)
    print(f"  {r['sessions']:4d} sessions {kind}: {r['frames']} frames ({r['speech']} speech), "
          f"{100 * r['on_time']:.2f}% on time, late {r['late']} (max {r['max_late_ms']:.0f} ms), "
          f"missed {r['missed']} ({100 * r['missed_share']:.1f}% of speech), dropped {r['dropped']}, "
          f"speech latency p99 {r['latency_p99_ms']} ms, {r['kbit_s_per_session']:.0f} kbit/s per session"
          + (f", {r['encoded']} frames encoded (the rest from the idle loop)" if r["format"] == "h264" else ""),
          flush=True)
    if r.get("shed"):
        print(f"        shed (the host full, newest first): {r['shed']} speech frames not rendered in "
              f"{r['sessions_shed']} sessions; the other {r['sessions'] - r['sessions_shed']} missed "
              f"{r['kept_missed']} ({100 * r['kept_missed_share']:.2f}% of their speech)", flush=True)
    _print_processes(r)
    if r.get("stages_ms"):
        print("        speech frame stages, ms p50/p99/max: " + ", ".join(
            f"{name} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}" for name, v in r["stages_ms"].items())
              + (f"; missed while in: {r['missed_in']}" if r.get("missed_in") else ""), flush=True)
    _print_queues(r.get("queues") or {})
    for key in ("profile", "profile_inference"):
        if r.get(key):
            pyspy.print_summary(r[key])


def _print_processes(r: dict) -> None:
    """CPU per process against one core, its busiest thread, and which one saturated first."""
    procs, machine = r["processes"], r["processes"]["machine"]
    parts = []
    for name, v in procs.items():
        if name == "machine":
            continue
        mark = " SATURATED" if v["saturated"] else (f" (>= 90% from {v['saturated_at']} s)" if v["saturated_at"] is not None
                                                   else "")
        parts.append(f"{name} {v['cpu']:.0f}% (max {v['cpu_max']:.0f}%, thread {v['thread']} {v['thread_cpu']:.0f}%, "
                     f"waited for a core {v['wait']:.0f}%){mark}")
    first = r["saturated"]
    verdict = (f"{first['process']} saturated first ({first['at_s']} s in, its busiest thread {first['thread_cpu']:.0f}% "
               "of a core)" if first["saturated"] else
               f"no process saturated (the busiest: {first['process']}, its busiest thread {first['thread_cpu']:.0f}%)")
    print("        CPU, % of one core over the run: " + "; ".join(parts) + "\n"
          f"        machine {machine['cpu']:.0f}% of {100 * machine['cores']}% ({machine['others']:.0f}% of it not this "
          f"bench's); {verdict}; "
          f"the frontend: {r['frontend_us_per_frame']:.0f} us of CPU per frame sent "
          f"({r['frontend_loop_us_per_frame']:.0f} us in its busiest thread)\n"
          f"        second by second, % of one core: {first['process']} "
          + " ".join(map(str, procs[first['process']]['series']))
          + f"; the machine (of {100 * machine['cores']}%) " + " ".join(map(str, machine["series"])), flush=True)
    if machine["others"] >= 10:   # (py-spy itself, with --profile, takes about 20% at 500 Hz)
        print(f"        NOTE: {machine['others']:.0f}% of a core went to other programs during this level: the "
              "figures above are those of a shared machine", flush=True)


def _print_queues(q: dict) -> None:
    """Each stage's queue over the run (mean/max), and missed speech second by second."""
    if not q:
        return
    print("        queues, mean/max over the run: " + "; ".join(
        f"{name} {v['mean']:g}/{v['max']:g}" for name, v in q["queues"].items()), flush=True)
    if q.get("per_second"):
        print("        per second: " + "; ".join(f"{kind} {' '.join(map(str, series))}"
                                                for kind, series in q["per_second"].items()), flush=True)
