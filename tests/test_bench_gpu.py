"""`python -m bench gpu` on the CPU provider with its smallest settings and the stand-in device (two
variants: fp32 and fp16): every section runs to its figures, so the GPU host's bench keeps working where
CI has no GPU; its JSON is there after each section, whole; a signal stops it with its servers and keeps
what it measured; a section that would not fit the run's budget is skipped and named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench import pyspy
from bench.gpu import Budget, SectionRunner, Signals
from tests.helpers import ROOT

SECTIONS = ("first call per shape after ready", "onnxruntime alone, inputs and outputs on the device",
            "served infer per batch, fp32", "live sessions on the tiny model",
            "live sessions speaking 16 kHz PCM on the tiny model",
            "live sessions speaking 16 kHz PCM, each on an avatar of its own", "model load -> first frame",
            "a load while 1 sessions speak", "a model's own session vs its architecture's prepared session",
            "calls alternating between shapes", "served infer per batch, fp16", "variants against the fp32 anchor",
            "models resident on the device")
# the JSON's sections, in the order they run
ORDER = ("first_call", "anchor", "served", "live", "live_pcm", "live_avatars", "first_frame", "load_while_speaking",
         "own_vs_shared", "alternating", "served_fp16", "variants", "residency")
STALL_S = 0.5   # the stand-in's first call per (session, shape)


def _bench(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """The bench in a process group of its own (as `timeout` runs it), its output in tmp_path/out.txt."""
    with open(tmp_path / "out.txt", "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "bench", "gpu", "--device", "cpu", "--model", "tiny", "--seconds", "1", "--live-s",
             "2", "--levels", "1", "--pcm-levels", "1", "--avatars", "1", "--speaking", "1", "--max-models", "2",
             "--stand-in", str(STALL_S), "--variants", "fp32,fp16", "--cache-dir", str(tmp_path / "cache"),
             "--json", str(tmp_path / "gpu.json"), *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _watch(proc: subprocess.Popen, path: Path, until=lambda doc: False, limit_s: float = 240) -> tuple[list, set]:
    """Until the process ends (or `until(the JSON's gpu part)`): every distinct JSON it wrote, in order (each
    read must parse: it is replaced whole), and every process it started."""
    seen, pids, deadline = [], set(), time.monotonic() + limit_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the bench ran past {limit_s} s"
        try:
            pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        if text is not None and (not seen or text != seen[-1][0]):
            seen.append((text, json.loads(text)["gpu"]))   # NOTE: a half-written file fails here
            if until(seen[-1][1]):
                break
        time.sleep(0.05)
    return [doc for _, doc in seen], pids


def _sections_in(doc: dict) -> list[str]:
    return [name for name in ORDER if name in doc]


def _left_behind(pids: set) -> tuple[list, list]:
    """The bench's processes still running, and /dev/shm entries of its servers."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    deadline = time.monotonic() + 30   # (a server's child dies with it, by PR_SET_PDEATHSIG, a moment later)
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    shm = [name for name in os.listdir("/dev/shm") if any(f"-{pid}-" in name for pid in pids)]
    return alive, shm


@pytest.mark.slow
def test_the_gpu_bench_runs_every_section_on_the_cpu_and_writes_its_json_after_each(tmp_path):
    proc = _bench(tmp_path, "--profile", str(tmp_path / "profile"))
    seen, pids = _watch(proc, tmp_path / "gpu.json")
    output = (tmp_path / "out.txt").read_text()
    assert proc.wait() == 0, output[-6000:]
    for heading in SECTIONS:
        assert heading in output, f"no {heading!r} section in:\n{output[-4000:]}"
    assert "section failed" not in output and "  skipped: " not in output, output[-6000:]
    figures = json.loads((tmp_path / "gpu.json").read_text())["gpu"]
    assert _sections_in(figures) == list(ORDER)
    # the JSON was written while the bench ran, one section after another: each version holds the sections
    # done so far, in order (a JSON written only at the end is seen once, whole)
    partial = [_sections_in(doc) for doc in seen[:-1]]
    assert len({tuple(p) for p in partial if 0 < len(p) < len(ORDER)}) >= 3, partial
    assert all(p == list(ORDER[:len(p)]) for p in partial), partial
    assert all(len(a) <= len(b) for a, b in zip(partial, partial[1:])), partial
    assert figures["run"]["interrupted"] is None and not figures["run"]["skipped"]
    assert list(figures["run"]["sections"]) == list(ORDER)
    assert _left_behind(pids) == ([], [])
    # the stand-in batches as a GPU does: every batch size up to limits.max_batch (4) had its first call timed,
    # and none of them after ready paid the first-call stall (the load prepared every size)
    first = figures["first_call"]["batches"]
    assert sorted(first) == ["1", "2", "3", "4"]
    assert figures["first_call"]["load"]["client_ms"] >= 3 * STALL_S * 1000
    for b, row in first.items():
        assert row["first_ms"] - row["steady_ms"] < STALL_S * 1000 / 2, (b, row)
    assert figures["served"]["4"]["ratio"] > 0
    # each variant on a server of its own, against the same fp32 anchor
    assert list(figures["variants"]) == ["fp32", "fp16"]
    assert figures["variants"]["fp16"]["4"]["ratio"] > 0
    assert figures["variants"]["fp16"]["4"]["worker_cpu_per_1000_fps"] > 0
    # on the CPU both sessions are compared at one frame a call, a further model loaded beside each
    assert list(figures["own_vs_shared"]["batches"]) == ["1"]
    assert figures["own_vs_shared"]["batches"]["1"]["ratio"] > 0
    assert figures["own_vs_shared"]["shared"]["further"]["ms"] > 0
    assert figures["live"][0]["sessions"] == 1 and not figures["live"][0]["pcm"]
    assert figures["live_pcm"][0]["sessions"] == 1 and figures["live_pcm"][0]["pcm"]
    assert figures["first_frame"][0]["first_frame_ms"] > 0
    assert sorted(figures["alternating"]) == ["1", "2", "4"]
    assert figures["residency"]["loaded"] == 2
    # --profile: the frontend and the inference process recorded over each live level, a directory per
    # section, where py-spy is installed; else each level says why it has none
    if pyspy.find() is None:
        assert output.count("py-spy is not installed here") == 3, output[-6000:]
    else:
        for section in ("live", "live_pcm", "live_avatars"):
            for process in ("frontend", "inference"):
                assert list((tmp_path / "profile" / section).glob(f"{process}-*.txt")), (section, process)
            # (a level of one session may leave the inference process idle throughout: no samples, said so)
            assert figures[section][-1]["profile"]["samples"] > 0, figures[section][-1].get("profile")
            assert figures[section][-1]["profile_inference"]["process"] == "inference", figures[section][-1]
        assert output.count("inference profile") == 3, output[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["SIGINT-to-its-group", "SIGTERM-to-the-bench"])
def test_a_signal_stops_the_gpu_bench_and_its_server_keeping_what_it_measured(tmp_path, sig, group):
    """SIGINT to the process group (`timeout -s INT`, Ctrl-C: the server gets it too) or SIGTERM to the
    bench alone, while the live level runs: the bench stops its server, keeps its JSON and exits 128 + the
    signal's number, soon (not after the level, nor after its sessions' closes time out on a server that
    is gone), leaving no process or /dev/shm entry behind."""
    proc = _bench(tmp_path, "--live-s", "8")
    try:
        _, pids = _watch(proc, tmp_path / "gpu.json", until=lambda doc: "served" in doc)
        time.sleep(2)   # (into the 8-s level: its sessions open and streaming, their closes to wait for)
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-4000:]
        (os.killpg if group else os.kill)(proc.pid, sig)
        t = time.monotonic()
        code = proc.wait(60)
        stopped_s = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = (tmp_path / "out.txt").read_text()
    assert code == 128 + sig, output[-4000:]
    assert stopped_s < 30, f"{stopped_s:.1f} s from the signal to the exit"
    assert _left_behind(pids) == ([], [])
    figures = json.loads((tmp_path / "gpu.json").read_text())["gpu"]
    assert _sections_in(figures) == ["first_call", "anchor", "served", "live"]
    assert sorted(figures["served"]) == ["1", "2", "3", "4"]
    live = figures["live"]   # (not the level's figures: it was stopped, not waited for)
    assert isinstance(live, dict) and list(live) == ["interrupted"] and live["interrupted"].startswith(sig.name), live
    assert figures["run"]["interrupted"] == f"{sig.name} during live" and figures["run"]["signal"] == sig
    assert not figures["run"]["server_errors"]
    assert f"stopped by {sig.name} during live" in output


def test_a_section_that_would_not_fit_the_budget_is_skipped_and_named():
    """On a virtual clock: a section runs when its estimate fits what is left of the budget (less a
    running server's stop), else it is skipped with the reason; the figures are saved after each."""
    now, saved = [100.0], []
    results = {"run": {"sections": {}, "skipped": {}}}
    run = SectionRunner(results, Budget(60.0, started=100.0, clock=lambda: now[0]), Signals(),
               lambda r: saved.append(json.loads(json.dumps(r))))

    def takes(seconds: float, figures: dict):
        def body():
            now[0] += seconds
            return figures
        return body

    run.section("a", "a:", 20.0, takes(25.0, {"x": 1}))                 # fits 60 s; takes 25
    run.section("b", "b:", 40.0, takes(1.0, {"x": 2}))                  # 35 s left: skipped
    run.section("c", "c:", 30.0, takes(1.0, {"x": 3}))                  # fits
    run.section("d", "d:", 0.0, takes(0.0, {"x": 4}))                   # free: runs whatever is left
    assert results["a"] == {"x": 1} and results["c"] == {"x": 3} and results["d"] == {"x": 4}
    assert results["b"] == {"skipped": "about 40 s, 35 s of --budget-s 60 left"}
    assert results["run"]["skipped"] == {"b": "about 40 s, 35 s of --budget-s 60 left"}
    assert [list(k for k in s if len(k) == 1) for s in saved] == [["a"], ["a", "b"], ["a", "b", "c"],
                                                                  ["a", "b", "c", "d"]]
    assert results["run"]["sections"]["a"] == {"s": 25.0, "estimate_s": 20.0}
    no_limit = SectionRunner({"run": {"sections": {}, "skipped": {}}}, Budget(None, started=0.0), Signals(),
                             lambda r: None)
    assert no_limit.fits(1e9)


def test_sections_not_asked_for_are_skipped_and_named_and_an_unknown_name_is_refused():
    from bench.gpu import options
    results = {"run": {"sections": {}, "skipped": {}}}
    ran = []
    run = SectionRunner(results, Budget(None, started=0.0), Signals(), lambda r: None, only=("b",))
    for name in ("a", "b"):
        run.section(name, f"{name}:", 1.0, lambda name=name: ran.append(name) or {"x": name})
    assert ran == ["b"] and results["b"] == {"x": "b"}
    assert results["a"] == {"skipped": "not in --sections"} and results["run"]["skipped"] == {"a": "not in --sections"}
    assert options("cpu", sections=("live_avatars", "served_fp16")).sections == ("live_avatars", "served_fp16")
    with pytest.raises(ValueError, match="--sections live_avatar: expected a comma list of first_call"):
        options("cpu", sections=("live_avatar",))
