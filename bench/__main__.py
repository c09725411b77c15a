"""python -m bench [all|compositing|serving|bridge|catalog|sessions|transport|cpu|h264|startup|avatars|first_words|importer|gpu|steps|beside] [--seconds S] [--format jpeg|h264] ...

Builds a 1280x720 demo avatar with the unet_328-shaped model in a cache directory, then prints, in one
run, each ratio the project is judged by (docs/benchmarks.md records them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from config import parse_config


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _device(text: str) -> str:
    from gpu_actor.device import parse_device
    try:
        return text if text == "auto" else parse_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} or auto") from None


def _write_json(path: str, results: dict) -> None:
    """`results` into `path` whole or not at all: a temporary file beside it, renamed over it."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, target)


def main() -> int:
    started = time.monotonic()   # (the gpu bench's --budget-s counts from here: the demo's build is in it)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", choices=["all", "compositing", "serving", "bridge", "catalog", "sessions", "transport", "cpu", "h264",
                                                         "startup", "avatars", "first_words", "importer", "gpu", "steps",
                                                         "beside"],
                        default="all")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per serving measurement")
    parser.add_argument("--frames", type=int, default=96, help="frames per compositing measurement")
    parser.add_argument("--models", type=int, default=10_000, help="model directories for the catalog and startup benches")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "lipsync-bench"))
    parser.add_argument("--runs", type=int, default=5, help="launches of the startup bench (the median is printed)")
    parser.add_argument("--servers", type=int, default=10, help="fresh servers per case of the first_words bench")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--format", choices=["jpeg", "h264"], default="jpeg", help="frames of the sessions bench")
    parser.add_argument("--budget-ms", type=int, default=280, help="sessions.latency_budget_ms of the sessions and gpu benches")
    parser.add_argument("--levels", type=_counts, default=None,
                        help="sessions bench: speaking levels (sessions, comma-separated; '' for none; default "
                             "10,20,30,40); gpu bench: its live levels (default 16,48,96,150,200 on a GPU, 1,2 on the "
                             "CPU); beside bench: the client's requests in flight (default 0,1,4)")
    parser.add_argument("--silent", type=_counts, default=(100, 200, 300),
                        help="sessions bench: silent levels (sessions, comma-separated; '' for none)")
    parser.add_argument("--pcm-levels", type=_counts, default=None,
                        help="sessions bench (jpeg): 16 kHz PCM speaking levels ('' for none; default 10,20); gpu "
                             "bench: its live PCM levels (default 48,150 on a GPU, 1 on the CPU)")
    parser.add_argument("--admission", action="store_true",
                        help="sessions bench: past capacity, with the server's admission on: each of --levels is a "
                             "number of sessions asked for at once (each asks again on busy, as told, for 10 s), on a "
                             "fresh server; how many got in and how they fared")
    parser.add_argument("--no-split", action="store_true", help="sessions bench: skip the edge + GPU host level")
    parser.add_argument("--frontends", type=int, default=1,
                        help="sessions and gpu benches: the server's client-facing processes (frontend.processes; "
                             "default 1)")
    parser.add_argument("--split-edges", type=_counts, default=(1,),
                        help="sessions bench: the edge + GPU host level once per count of edges, all on this host, "
                             "its sessions spread over them (default 1)")
    parser.add_argument("--split-sessions", type=int, default=10, help="sessions bench: that level's sessions (default 10)")
    parser.add_argument("--split-pcm", action="store_true",
                        help="sessions bench: that level's sessions speak 16 kHz PCM in 20-ms chunks (default: audio "
                             "windows)")
    parser.add_argument("--no-shed", action="store_true",
                        help="sessions and gpu benches: sessions.shed_speech off (every session misses alike past "
                             "capacity)")
    parser.add_argument("--profile", metavar="DIR", type=Path,
                        help="sessions, gpu and steps benches: py-spy recordings of the frontend and the first inference "
                             "process per live level into DIR, summed up per function per frame sent (the inference "
                             "process: per speech frame; needs py-spy installed beside the bench's python)")
    parser.add_argument("--profile-native", action="store_true",
                        help="--profile with C frames too (py-spy then pauses the frontend for each sample)")
    gpu = parser.add_argument_group("gpu bench (each default: large on a GPU, small on the CPU provider)")
    gpu.add_argument("--device", type=_device, default="auto",
                     help="auto (cuda:0 where onnxruntime has CUDA and cupy sees a GPU, else cpu), cpu or cuda:N")
    gpu.add_argument("--model", choices=["unet328", "tiny"], default="unet328",
                     help="the real-size unet_328 (random weights) or a near-zero-cost model")
    gpu.add_argument("--max-batch", type=int, help="limits.max_batch (default 32 on a GPU, 4 on the CPU)")
    gpu.add_argument("--speaking", type=int, help="sessions speaking while a model loads (default 20 / 2)")
    gpu.add_argument("--avatars", type=int, help="distinct models timed from session_open to the first speech frame "
                                                 "(default 4 / 2)")
    gpu.add_argument("--max-models", type=int, help="distinct models loaded at most to find how many stay resident "
                                                    "(default 1000 / 8)")
    gpu.add_argument("--residency-s", type=float, help="seconds at most for those loads (default 240 / 60)")
    gpu.add_argument("--stand-in", type=float, metavar="S",
                     help="CPU workers batch as on a GPU and stall S seconds on each shape's first call "
                          "(LIPSYNC_STAND_IN_STALL_S), so a CPU host shows the GPU path's first-call figures")
    gpu.add_argument("--variants", type=_names, metavar="LIST",
                     help="served infer once per variant, each on a server of its own, against the fp32 anchor: a "
                          "comma list of fp32, fp16, fp32+graphs, fp16+graphs (inference.precision, "
                          "inference.cuda_graphs); the other sections run the first (default all four on a GPU, "
                          "fp32 on the CPU, fp32,fp16 with --stand-in)")
    gpu.add_argument("--avatar-levels", type=_counts, default=None,
                     help="gpu bench: live PCM levels with each session on an avatar of its own (one architecture, "
                          "other weights; default 48,150 on a GPU, 2 on the CPU; '' for none)")
    gpu.add_argument("--sections", type=_names, default=(), metavar="LIST",
                     help="only these sections, the others skipped and named: a comma list of first_call, anchor, "
                          "served, live, live_pcm, live_avatars, first_frame, load_while_speaking, own_vs_shared, "
                          "alternating, served_<variant>, variants, residency (default: every one)")
    gpu.add_argument("--live-s", type=float, metavar="S", help="seconds per live level (default --seconds)")
    gpu.add_argument("--speaking-share", type=float, default=0.27, metavar="F",
                     help="share of the time each session of a live level speaks, 0 to 1 (default 0.27; 1: all "
                          "speaking all the time)")
    gpu.add_argument("--budget-s", type=float, metavar="S",
                     help="the whole run's seconds, the demo's build included: before each section its cost is "
                          "estimated (from the settings and what the run measured so far) and a section that would "
                          "not fit is skipped and named (default: no limit). The JSON is written after every "
                          "section; SIGINT or SIGTERM stops the run, its servers and keeps what it measured")
    steps = parser.add_argument_group("steps bench (--levels: sessions at once, default 6,12)")
    steps.add_argument("--mixed-modes", type=_names, default=("sub_calls", "auto"), metavar="LIST",
                       help="inference.mixed_steps of each server, one after the other (default sub_calls,auto)")
    steps.add_argument("--cost-ms", default="10,1", metavar="F,P",
                       help="each stand-in model call's cost: fixed ms, ms per frame (default 10,1)")
    steps.add_argument("--speech-s", type=float, default=2.0, help="each session's utterance (default 2)")
    steps.add_argument("--rounds", type=int, default=2, help="utterances at once per level and mode (default 2)")
    args = parser.parse_args()
    gpu_settings = None
    if args.what == "gpu":   # NOTE: before the demo's build: a variant the device does not run is refused at once
        from bench import gpu
        try:
            gpu_settings = gpu.options(args.device, args.model, args.max_batch, args.levels, args.seconds,
                                       args.speaking, args.max_models, args.avatars, args.residency_s, args.stand_in,
                                       args.budget_ms, variants=args.variants, pcm_levels=args.pcm_levels,
                                       live_s=args.live_s, budget_s=args.budget_s,
                                       avatar_levels=args.avatar_levels, speaking_share=args.speaking_share,
                                       shed=not args.no_shed, sections=args.sections, profile=args.profile,
                                       frontends=args.frontends)
        except ValueError as err:
            parser.error(str(err))
    levels = args.levels if args.levels is not None else (10, 20, 30, 40)
    from shm.child import tune_malloc
    from supervisor.demo import build_demo
    tune_malloc()  # as every server process does, so the bare loops compare fairly
    cfg = parse_config({"demo": {"cache_dir": args.cache_dir, "frames": 24}}, base_dir="/")
    models_dir = str(build_demo(cfg))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results = {}
    if args.what in ("all", "compositing"):
        from bench import compositing
        results["compositing"] = compositing.run(models_dir, "demo", args.frames)
    if args.what in ("all", "serving"):
        from bench import serving
        results["serving"] = serving.run(models_dir, args.seconds)
    if args.what in ("all", "bridge"):
        from bench import bridge
        results["bridge"] = bridge.run()
    if args.what in ("all", "catalog"):
        from bench import catalog
        results["catalog"] = catalog.run(args.models)
    if args.what in ("all", "sessions"):
        from bench import sessions
        print(f"live sessions (near-zero-cost model, 1280x720 {'JPEG q75' if args.format == 'jpeg' else 'H.264'}, "
              "25 fps):")
        if args.admission:
            print(f"  admission on (sessions.max_cpu_load 0.75): sessions asked for at once, {levels}")
            results["sessions"] = sessions.run_admission(models_dir, args.seconds, levels, fmt=args.format,
                                                         budget_ms=args.budget_ms, shed=not args.no_shed,
                                                         frontends=args.frontends)
        else:
            pcm_levels = args.pcm_levels if args.pcm_levels is not None else (10, 20)
            results["sessions"] = sessions.run(models_dir, args.seconds, levels, args.silent, pcm_levels,
                                               fmt=args.format, budget_ms=args.budget_ms, split=not args.no_split,
                                               profile=args.profile, native=args.profile_native,
                                               shed=not args.no_shed, split_edges=args.split_edges,
                                               split_sessions=args.split_sessions, split_pcm=args.split_pcm,
                                               frontends=args.frontends)
    if args.what in ("all", "transport"):
        from bench import transport
        mix = [(n, round(n * transport.SPEAKING_SHARE)) for n in levels] + [(n, 0) for n in args.silent]
        results["transport"] = transport.run(args.seconds, mix)
    if args.what in ("all", "h264"):
        from bench import h264
        results["h264"] = h264.run(models_dir, "demo")
    if args.what in ("all", "startup"):
        from bench import startup
        results["startup"] = startup.run(models_dir, args.runs, args.models)
    if args.what in ("all", "avatars"):
        from bench import avatars
        results["avatars"] = avatars.run(models_dir, args.seconds)
    if args.what in ("all", "cpu"):
        from bench import cpu
        results["cpu"] = cpu.run(models_dir, args.seconds)
    # NOTE: not in `all`: each starts many servers (first_words) or writes a 5-minute avatar (importer)
    if args.what == "first_words":
        from bench import first_words
        results["first_words"] = first_words.run(models_dir, args.servers)
    if args.what == "importer":
        from bench import importer
        results["importer"] = importer.run(7500, Path(args.cache_dir) / "importer")
    if args.what == "steps":
        from bench import steps
        results["steps"] = steps.run(args.levels or (6, 12), args.mixed_modes, args.cost_ms, args.speech_s, args.rounds,
                                     profile=args.profile)
    if args.what == "beside":
        from bench import beside
        results["beside"] = beside.run(args.levels if args.levels is not None else (0, 1, 4))
    if args.what == "gpu":   # NOTE: not in `all`: on a GPU host it is that host's bench, minutes long
        from bench import gpu

        def save(figures: dict) -> None:   # after each section: what a run cut short still returns
            if args.json:
                _write_json(args.json, {**results, "gpu": figures})
        results["gpu"] = gpu.run(models_dir, gpu_settings, save, started)
    if args.json:
        _write_json(args.json, results)
    stopped_by = results.get("gpu", {}).get("run", {}).get("signal")
    if stopped_by:
        # NOTE: its servers are stopped and its figures written; the section the signal cut short is left in
        # its thread (bench/gpu.py, _Run._in_thread), maybe waiting for a server that is gone: not waited for
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + stopped_by)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
