"""python -m lipsync_client [--endpoint E] health|models|load M|unload M|stats [M]|composite M|bench|stream M|watch [M]"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Optional

from lipsync_client import commands
from lipsync_client.requests import Client
from lipsync_client.wire import DEFAULT_ENDPOINT, ClientTimeout, ServerError


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lipsync_client", description="a client for the lip-sync server")
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("health")
    sub.add_parser("models")
    for name in ("load", "unload"):
        sub.add_parser(name).add_argument("model")
    sub.add_parser("stats").add_argument("model", nargs="?")
    comp = sub.add_parser("composite", help="composite frames with random audio and save them to a folder")
    comp.add_argument("model")
    comp.add_argument("--batch", type=int, default=8)
    comp.add_argument("--start-frame", type=int, default=0)
    comp.add_argument("--format", choices=["jpeg", "png", "raw"], default=None)
    comp.add_argument("--out", default="frames")
    comp.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="load test: latency percentiles and frames/s")
    bench.add_argument("--models", nargs="+", default=["demo"])
    bench.add_argument("--concurrency", type=int, default=4)
    bench.add_argument("--count", type=int, default=100, help="requests (ignored with --duration)")
    bench.add_argument("--duration", type=float, default=0.0, help="seconds to run")
    bench.add_argument("--batch", type=int, default=8)
    bench.add_argument("--visual", action="store_true", help="send the visual input too (else audio only)")
    bench.add_argument("--format", choices=["jpeg", "png", "raw"], default=None)
    bench.add_argument("--json", action="store_true")
    stream = sub.add_parser("stream", help="live sessions: audio in real time, frames out; on-time %%, missed, "
                                           "latency percentiles")
    stream.add_argument("model")
    stream.add_argument("--seconds", type=float, default=10.0)
    stream.add_argument("--duty", type=float, default=0.27, help="fraction of the time each session speaks")
    stream.add_argument("--sessions", type=int, default=1)
    stream.add_argument("--out", default=None, help="save every frame received to this folder")
    stream.add_argument("--pcm", nargs="?", const="demo", default=None, metavar="FILE.wav",
                        help="speak this 16 kHz mono WAV (alone: a generated speech-like utterance, the demo's) "
                             "instead of random feature windows")
    stream.add_argument("--format", choices=["jpeg", "png", "raw", "h264"], default="jpeg",
                        help="h264: one Annex-B access unit per frame; --out then writes one .h264 file per session")
    stream.add_argument("--webrtc", action="store_true",
                        help="(h264) watch it in a browser: prints each session's viewer URL; frames go there")
    watch = sub.add_parser("watch", help="a live H.264 session in your browser: prints (and opens) its viewer URL, "
                                         "speaks the demo utterance every few seconds")
    watch.add_argument("model", nargs="?", default="demo")
    watch.add_argument("--wait", type=float, default=0.0, help="wait this many seconds for the server to be ready")
    watch.add_argument("--no-browser", action="store_true", help="print the URL only")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "watch":
            try:
                asyncio.run(commands.run_watch(args.endpoint, args.model, args.wait, not args.no_browser))
            except KeyboardInterrupt:
                pass
            return 0
        if args.cmd == "stream":
            if args.webrtc and args.format != "h264":
                parser.error("--webrtc needs --format h264")
            results = asyncio.run(commands.run_stream(args.endpoint, args.model, args.seconds, args.duty, args.sessions,
                                                       args.out, pcm=args.pcm, format=args.format,
                                                       webrtc=args.webrtc))
            commands.print_stream(results)
            return 0
        if args.cmd == "composite":
            return commands.composite(args)
        if args.cmd == "bench":
            result = asyncio.run(commands.bench(args))
            if args.json:
                print(json.dumps(result))
            else:
                lat = result["latency_ms"]
                print(f"{result['requests']} requests of batch {args.batch} in {result['seconds']:.1f}s: "
                      f"{result['frames_per_s']:.1f} frames/s; latency p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, "
                      f"p99 {lat['p99']:.1f} ms; errors {result['errors'] or 'none'}")
                print("mean timing (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in result["timing_ms_mean"].items()))
            return 0
        with Client(args.endpoint) as client:
            method = getattr(client, args.cmd)
            result = method(args.model) if args.cmd in ("load", "unload") else (
                method(args.model) if args.cmd == "stats" else method())
        print(json.dumps(result, indent=2))
        return 0
    except (ServerError, ClientTimeout) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
