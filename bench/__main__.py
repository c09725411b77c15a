"""python -m bench [all|compositing|serving|bridge|catalog|sessions|cpu|h264|startup|avatars|first_words|importer] [--seconds S] [--format jpeg|h264] ...

Builds a 1280x720 demo avatar with the unet_328-shaped model in a cache directory, then prints, in one
run, each ratio the project is judged by (docs/benchmarks.md records them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from config import parse_config


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", choices=["all", "compositing", "serving", "bridge", "catalog", "sessions", "cpu", "h264",
                                                         "startup", "avatars", "first_words", "importer"], default="all")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per serving measurement")
    parser.add_argument("--frames", type=int, default=96, help="frames per compositing measurement")
    parser.add_argument("--models", type=int, default=10_000, help="model directories for the catalog and startup benches")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "lipsync-bench"))
    parser.add_argument("--runs", type=int, default=5, help="launches of the startup bench (the median is printed)")
    parser.add_argument("--servers", type=int, default=10, help="fresh servers per case of the first_words bench")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--format", choices=["jpeg", "h264"], default="jpeg", help="frames of the sessions bench")
    parser.add_argument("--budget-ms", type=int, default=280, help="sessions.latency_budget_ms of the sessions bench")
    args = parser.parse_args()
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
        results["sessions"] = sessions.run(models_dir, args.seconds, fmt=args.format, budget_ms=args.budget_ms)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
