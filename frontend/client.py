"""A small Python client for the lip-sync server, sync (`Client`) and asyncio (`AsyncClient`), and a CLI.

    from frontend.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        reply, images = c.composite("demo", audio=np.zeros((4, 32, 16, 16), np.float32), batch=4)

Both use a DEALER socket (empty delimiter first, as the protocol says) and match replies by `id`, so
`AsyncClient` can keep many requests in flight. Errors raise `ServerError` with the protocol's code.

CLI: python -m frontend.client [--endpoint E] health|models|load M|unload M|stats [M]|composite M|bench|stream M|watch [M]
Live sessions: frontend/stream.py (Session, AsyncSession).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import zmq
import zmq.asyncio

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
Reply = tuple[dict, list]


class ServerError(Exception):
    """The server answered `ok: false`; `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str, reply: Optional[dict] = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.reply = code, message, reply


class ClientTimeout(TimeoutError):
    """No reply within the client's own timeout (the server may be down or restarting)."""


def _tensor_payload(visual: Optional[np.ndarray], audio: np.ndarray) -> list:
    frames = [] if visual is None else [np.ascontiguousarray(visual, dtype="<f4")]
    return frames + [np.ascontiguousarray(audio, dtype="<f4")]


def _header(op: str, rid: int, **fields) -> bytes:
    return json.dumps({"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}).encode()


def _parse(frames: list) -> Reply:
    header = json.loads(bytes(frames[0]))
    if not header.get("ok"):
        err = header.get("error", {})
        raise ServerError(err.get("code", "internal"), err.get("message", ""), header)
    return header, frames[1:]


def curve_keys(secret_key_file: str, server_key_file: str) -> dict:
    """CURVE keys for a client: its own pair (the .key_secret file) and the server's public key."""
    import zmq.auth
    public, secret = zmq.auth.load_certificate(secret_key_file)
    server, _ = zmq.auth.load_certificate(server_key_file)
    return {"public": public, "secret": secret, "server": server}


def _new_socket(ctx, endpoint: str, curve: Optional[dict]):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.curve_secretkey, sock.curve_publickey = curve["secret"], curve["public"]
        sock.curve_serverkey = curve["server"]
    sock.connect(endpoint)
    return sock


class Client:
    """Synchronous client: one request at a time."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 60.0, curve: Optional[dict] = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.Context.instance()
        self._curve = curve
        self._sock = _new_socket(self._ctx, endpoint, curve)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, op: str, payload: Sequence = (), timeout_s: Optional[float] = None, **fields) -> Reply:
        rid = next(self._ids)
        self._sock.send_multipart([b"", _header(op, rid, **fields), *payload], copy=False)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000)):
                # A late reply must not be taken for the next request's: start over on a new socket.
                self._sock.close(linger=0)
                self._sock = _new_socket(self._ctx, self.endpoint, self._curve)
                raise ClientTimeout(f"no reply to {op} within {timeout_s or self.timeout_s:g}s from {self.endpoint}")
            frames = self._sock.recv_multipart()
            header = json.loads(frames[1])
            if header.get("id") in (rid, None):
                return _parse(frames[1:])

    def health(self) -> dict:
        return self.request("health")[0]

    def models(self, wait_s: float = 30.0) -> list[dict]:
        """Every model; waits up to `wait_s` for models whose files the server is still reading."""
        deadline = time.monotonic() + wait_s
        while True:
            models = self.request("models")[0]["models"]
            if not any(m.get("pending") for m in models) or time.monotonic() > deadline:
                return models
            time.sleep(0.1)

    def load(self, model: str, **kw) -> dict:
        return self.request("load", model=model, **kw)[0]

    def unload(self, model: str) -> dict:
        return self.request("unload", model=model)[0]

    def stats(self, model: Optional[str] = None) -> dict:
        return self.request("stats", model=model)[0]

    def infer(self, model: str, visual: np.ndarray, audio: np.ndarray, **kw) -> tuple[dict, np.ndarray]:
        header, frames = self.request("infer", _tensor_payload(visual, audio), model=model, batch=len(visual), **kw)
        return header, np.stack([np.frombuffer(f, "<f4").reshape(3, 320, 320) for f in frames])

    def composite(self, model: str, audio: np.ndarray, visual: Optional[np.ndarray] = None,
                  batch: Optional[int] = None, **kw) -> Reply:
        batch = batch or (len(visual) if visual is not None else len(audio))
        return self.request("composite", _tensor_payload(visual, audio), model=model, batch=batch, **kw)


class AsyncClient:
    """asyncio client: any number of requests in flight on one DEALER socket, matched by id."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 60.0, curve: Optional[dict] = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = _new_socket(self._ctx, endpoint, curve)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            header = json.loads(frames[1])
            future = self._waiting.pop(header.get("id"), None)
            if future is not None and not future.done():
                future.set_result(frames[1:])

    async def request(self, op: str, payload: Sequence = (), timeout_s: Optional[float] = None, **fields) -> Reply:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        await self._sock.send_multipart([b"", _header(op, rid, **fields), *payload], copy=False)
        try:
            frames = await asyncio.wait_for(future, timeout_s or self.timeout_s)
        except asyncio.TimeoutError:
            self._waiting.pop(rid, None)
            raise ClientTimeout(f"no reply to {op} within {timeout_s or self.timeout_s:g}s") from None
        return _parse(frames)

    async def composite(self, model: str, audio: np.ndarray, visual: Optional[np.ndarray] = None,
                        batch: Optional[int] = None, **kw) -> Reply:
        batch = batch or (len(visual) if visual is not None else len(audio))
        return await self.request("composite", _tensor_payload(visual, audio), model=model, batch=batch, **kw)

    async def infer(self, model: str, visual: np.ndarray, audio: np.ndarray, **kw) -> Reply:
        return await self.request("infer", _tensor_payload(visual, audio), model=model, batch=len(visual), **kw)


# -- CLI ------------------------------------------------------------------------------------------

def _audio_shape(client: Client, model: str) -> tuple[int, ...]:
    info = next((m for m in client.models() if m["id"] == model), None)
    if info is None or info.get("audio_shape") is None:
        raise SystemExit(f"model {model!r} is not served here (or its files are broken): see `models`")
    return tuple(info["audio_shape"])


def _cmd_composite(args) -> int:
    with Client(args.endpoint) as client:
        shape = _audio_shape(client, args.model)
        rng = np.random.default_rng(args.seed)
        audio = rng.standard_normal((args.batch, *shape)).astype(np.float32)
        header, images = client.composite(args.model, audio, batch=args.batch, start_frame=args.start_frame,
                                          format=args.format)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ext = {"jpeg": "jpg", "png": "png", "raw": "bgr"}[header["format"]]
    for i, image in enumerate(images):
        (out / f"frame_{args.start_frame + i:05d}.{ext}").write_bytes(image)
    print(json.dumps({k: header[k] for k in ("batch", "format", "width", "height", "frames", "timing")}))
    print(f"wrote {len(images)} frames to {out}")
    return 0


async def _bench(args) -> dict:
    probe = Client(args.endpoint)
    shapes = {m: _audio_shape(probe, m) for m in args.models}
    probe.close()
    rng = np.random.default_rng(0)
    audio = {m: rng.standard_normal((args.batch, *s)).astype(np.float32) for m, s in shapes.items()}
    visual = rng.random((args.batch, 6, 320, 320), dtype=np.float32) if args.visual else None
    latencies, timings, errors = [], [], {}
    done = 0
    stop_at = time.monotonic() + args.duration if args.duration else None
    counter = itertools.count()

    async def one(client: AsyncClient) -> None:
        nonlocal done
        while True:
            n = next(counter)
            if (stop_at and time.monotonic() > stop_at) or (not stop_at and n >= args.count):
                return
            model = args.models[n % len(args.models)]
            t0 = time.perf_counter()
            try:
                header, _ = await client.composite(model, audio[model], visual, batch=args.batch,
                                                   start_frame=n * args.batch, format=args.format)
                latencies.append((time.perf_counter() - t0) * 1000)
                timings.append(header["timing"])
            except (ServerError, ClientTimeout) as err:
                key = getattr(err, "code", "client_timeout")
                errors[key] = errors.get(key, 0) + 1
            done += 1
            if not args.json:
                total = args.count if not stop_at else None
                sys.stderr.write(f"\r{done} requests" + (f"/{total}" if total else "") + f", {len(errors)} error kinds")

    async with AsyncClient(args.endpoint) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    if not args.json:
        sys.stderr.write("\n")
    lat = np.asarray(latencies) if latencies else np.zeros(1)
    breakdown = {k: float(np.mean([t[k] for t in timings])) if timings else 0.0
                 for k in ("queue_ms", "input_ms", "inference_ms", "composite_ms", "total_ms")}
    return {"requests": len(latencies), "errors": errors, "batch": args.batch, "seconds": elapsed,
            "frames_per_s": len(latencies) * args.batch / elapsed,
            "latency_ms": {p: float(np.percentile(lat, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "timing_ms_mean": breakdown}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend.client", description=__doc__.split("\n")[0])
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
            from frontend.stream import run_watch
            try:
                asyncio.run(run_watch(args.endpoint, args.model, args.wait, not args.no_browser))
            except KeyboardInterrupt:
                pass
            return 0
        if args.cmd == "stream":
            if args.webrtc and args.format != "h264":
                parser.error("--webrtc needs --format h264")
            from frontend.stream import print_stream, run_stream
            print_stream(asyncio.run(run_stream(args.endpoint, args.model, args.seconds, args.duty, args.sessions,
                                                args.out, pcm=args.pcm, format=args.format,
                                                webrtc=args.webrtc)))
            return 0
        if args.cmd == "composite":
            return _cmd_composite(args)
        if args.cmd == "bench":
            result = asyncio.run(_bench(args))
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
