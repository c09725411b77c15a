"""A fresh session's first words: on freshly started servers, the first session of a model sends a 1-s
utterance the moment `session_open` returns, then `sessions_after` more sessions on the same server do
the same; per format (jpeg, raw, h264) and audio kind (window, pcm16): speech frames missed, and
`session_open`'s time-to-ready for the cold model (first session) and the warm one (the others),
median and p99.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.startup import ROOT, _config

FORMATS = ("jpeg", "raw", "h264")
AUDIO = ("window", "pcm16")


def _utterance(audio: str, rng: np.random.Generator) -> np.ndarray:
    """One second of speech: 25 frames of window features, or 16 kHz PCM."""
    if audio == "pcm16":
        from config.audio import speech
        return speech(1.0, seed=int(rng.integers(1 << 30)))
    return rng.standard_normal((25, 32, 16, 16)).astype(np.float32)


def _session(endpoint: str, model: str, fmt: str, audio: str, rng: np.random.Generator) -> tuple[float, dict]:
    """(seconds session_open took, the session's stats once its utterance has played)."""
    from lipsync_client import Session
    t = time.monotonic()
    with Session(endpoint, model, format=fmt, audio=audio, timeout_s=60.0) as s:
        opened = time.monotonic() - t
        s.send_audio(_utterance(audio, rng), last=True)
        # until the utterance's last frame has gone out (its `last`), at most 20 s
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            frame = s.next_frame(timeout_s=1.0)
            if frame is not None and frame[0].get("last"):
                break
        return opened, s.close()


def _server(models_dir: str, directory: Path, timeout_s: float = 60.0):
    import zmq
    from lipsync_client import Client, ClientTimeout
    path, endpoint = _config(models_dir, directory)
    zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, 5)
    log = open(path.with_suffix(".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--config", str(path)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    with Client(endpoint, timeout_s=1.0) as client:
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the server did not come up: {path.with_suffix('.log').read_text()[-2000:]}")
            try:
                if client.health()["status"] == "ready":
                    return proc, endpoint, log
            except ClientTimeout:
                continue
            time.sleep(0.01)


def _stop(proc, log) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def run(models_dir: str, servers: int = 10, sessions_after: int = 20, model: str = "demo",
        formats=FORMATS, audio_kinds=AUDIO) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="lsync-first-"))
    rng = np.random.default_rng(0)
    out = {}
    print(f"a fresh session's first words: {servers} fresh servers per case, the first session's 1-s utterance "
          f"right after session_open, then {sessions_after} sessions after it ({os.cpu_count()} cores)")
    try:
        for fmt in formats:
            for audio in audio_kinds:
                first_missed, after_missed, first_speech, cold, warm = [], [], [], [], []
                for _ in range(servers):
                    proc, endpoint, log = _server(models_dir, directory)
                    try:
                        opened, stats = _session(endpoint, model, fmt, audio, rng)
                        cold.append(opened)
                        first_missed.append(stats["missed"])
                        first_speech.append(stats["frames_speech"])
                        if stats["missed"]:
                            print(f"    a first session missed {stats['missed']} in {stats['missed_in']}; stages "
                                  f"p99 {({k: v['p99'] for k, v in stats['stages_ms'].items()})}")
                        for _ in range(sessions_after):
                            opened, stats = _session(endpoint, model, fmt, audio, rng)
                            warm.append(opened)
                            after_missed.append(stats["missed"])
                    finally:
                        _stop(proc, log)
                case = {"first_missed": first_missed, "first_speech": first_speech,
                        "after_missed_total": int(sum(after_missed)), "after_sessions": len(after_missed),
                        "open_cold_ms": {"median": statistics.median(cold) * 1000, "p99": _p99(cold) * 1000},
                        "open_warm_ms": ({"median": statistics.median(warm) * 1000, "p99": _p99(warm) * 1000}
                                         if warm else None)}
                out[f"{fmt}/{audio}"] = case
                warm_text = (f"warm {case['open_warm_ms']['median']:.0f}/{case['open_warm_ms']['p99']:.0f} ms"
                             if warm else "no warm sessions")
                print(f"  {fmt:>4} {audio:>6}: first sessions missed {first_missed} (speech frames "
                      f"{first_speech}); {case['after_missed_total']} missed in {len(after_missed)} sessions after; "
                      f"session_open median/p99: cold {case['open_cold_ms']['median']:.0f}/"
                      f"{case['open_cold_ms']['p99']:.0f} ms, {warm_text}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("models_dir")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--after", type=int, default=2)
    args = parser.parse_args()
    run(args.models_dir, args.servers, args.after)
