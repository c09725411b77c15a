"""Where a process's CPU goes per frame: a py-spy recording of a server process during a bench level
(the frontend per frame sent, the inference process per speech frame; with `native`, C frames too),
split by function (self: samples with the function on top; total: samples with it anywhere on the
stack) and scaled to microseconds per frame by the busiest thread's measured CPU.

py-spy counts a thread that is ready to run but waiting for a core as busy where it waits: on a host
with more busy threads than cores (this bench's 2-core runs), a call that wakes another process (a
ZeroMQ send) takes the blame for the wait that follows it. Read the shares beside the process's
"waited for a core".

py-spy is a measuring tool, not a dependency: `pip install py-spy` into the environment that runs the
bench; without it, `--profile` says so and the bench runs without it. It samples without stopping the
process (`--nonblocking`), so the profile does not slow the frames it measures.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

# Native leaves where a thread waits without running (py-spy pauses the process to take native stacks,
# and then counts a thread parked in its event loop's poll as a sample)
IDLE = {"epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect6", "clock_nanosleep",
        "nanosleep"}
_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def find() -> Optional[str]:
    """The py-spy executable beside this interpreter's, else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def executable(profile: Optional[Path]) -> Optional[str]:
    """py-spy for `--profile DIR`, DIR made; None without --profile, or where py-spy is not installed
    (said so: the bench runs without a profile)."""
    if profile is None:
        return None
    exe = find()
    if exe is None:
        print("  --profile: py-spy is not installed here (pip install py-spy); no profile", flush=True)
        return None
    profile.mkdir(parents=True, exist_ok=True)
    return exe


class Recording:
    """`py-spy record` of `pid` into `out` (collapsed stacks, one root per thread) until stop()."""

    def __init__(self, exe: str, pid: int, out: Path, rate: Optional[int] = None, native: bool = False):
        self.out = out
        # a frontend at a few % of a core gives few samples: sample often, unless each sample pauses it
        rate = rate or (100 if native else 500)
        # NOTE: native frames (C extensions, the event loop's own C code) need py-spy to pause the process
        # for each sample: the profile then costs the frames it measures some time; Python frames do not
        how = ["--native"] if native else ["--nonblocking"]
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--output", str(out),
               "--threads", *how]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> str:
        """Ends the recording (py-spy writes its file on SIGINT); its error output if it failed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return "" if self.out.exists() else err.decode(errors="replace")[-500:]


def _function(frame: str) -> str:
    """'name (path/to/file.py:123)' -> 'file.py:name'; anything else as it is."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{Path(m['file']).name}:{m['name']}"


def summarize(path: Path, frames: int, thread_us_per_frame: float, top: int = 15) -> dict:
    """The busiest thread's samples by function: self and total, as % of its samples and as us per
    frame sent (that share of `thread_us_per_frame`, the thread's measured CPU per frame)."""
    threads: dict[str, list[tuple[list[str], int]]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        root = next((i for i, p in enumerate(parts) if p.startswith("thread ")), 0)
        funcs = [_function(p) for p in parts[root + 1:]]
        if funcs and funcs[-1].rpartition(":")[2] in IDLE:
            continue
        threads.setdefault(parts[root], []).append((funcs, int(count)))
    if not threads:
        return {}
    name, stacks = max(threads.items(), key=lambda kv: sum(c for _, c in kv[1]))
    samples = sum(c for _, c in stacks)
    own, total = Counter(), Counter()
    for funcs, count in stacks:
        if funcs:
            own[funcs[-1]] += count
        for f in set(funcs):
            total[f] += count
    # NOTE: the frames under (nearly) every sample (the process's entry, the event loop's run) say nothing
    for f in [f for f, c in total.items() if c >= 0.95 * samples]:
        del total[f]

    def rows(counter: Counter) -> list[dict]:
        return [{"function": f, "percent": round(100 * c / samples, 1),
                 "us_per_frame": round(thread_us_per_frame * c / samples, 1)} for f, c in counter.most_common(top)]

    return {"thread": name, "samples": samples, "frames": frames, "thread_us_per_frame": round(thread_us_per_frame, 1),
            "self": rows(own), "total": rows(total)}


def figures(out: Path, failed: str, frames: int, thread_us_per_frame: float, process: str, per: str) -> dict:
    """A stopped recording's figures (`failed`: what Recording.stop said): `summarize`'s, the process's
    role and what its figures are per, or the error."""
    if failed:
        return {"error": failed}
    return {"samples": 0, **summarize(out, frames, thread_us_per_frame), "process": process, "per": per}


def print_summary(s: dict, indent: str = "        ") -> None:
    if "error" in s:
        print(f"{indent}profile failed: {s['error']}", flush=True)
        return
    process, per = s.get("process", "frontend"), s.get("per", "frame sent")
    if not s.get("samples"):
        print(f"{indent}{process} profile: no samples (the process was idle)", flush=True)
        return
    print(f"{indent}{process} profile ({s['samples']} samples of its busiest thread, {s['thread_us_per_frame']:.0f} us "
          f"of its CPU per {per}), us per {per}:", flush=True)
    for kind in ("self", "total"):
        print(f"{indent}  {kind}: " + "; ".join(f"{r['function']} {r['us_per_frame']:.1f} ({r['percent']:.0f}%)"
                                              for r in s[kind][:12]), flush=True)
