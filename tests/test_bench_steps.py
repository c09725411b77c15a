"""`python -m bench steps` at its smallest: the stand-in with a card's cost curve, two PCM sessions on
avatars of their own speaking at once; its figures are the sessions' and the worker's own."""

from __future__ import annotations

import json
import subprocess
import sys

from bench import pyspy
from config.audio import frame_count, speech
from tests.helpers import ROOT


def test_the_steps_bench_counts_the_speech_and_the_device_calls_of_its_round(tmp_path):
    out = tmp_path / "steps.json"
    run = subprocess.run([sys.executable, "-m", "bench", "steps", "--levels", "2", "--rounds", "1", "--mixed-modes",
                          "sub_calls", "--speech-s", "1", "--json", str(out),
                          "--profile", str(tmp_path / "profile")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (figures,) = json.loads(out.read_text())["steps"]["levels"]["2"]["sub_calls"]
    # two 1-s utterances: their speech frames, each in some device call of the worker's
    assert figures["frames"] == sum(frame_count(len(speech(1.0, seed=k))) for k in range(2)), figures
    assert 0 <= figures["missed"] <= figures["frames"], figures
    assert figures["calls"] >= 2 and 1.0 <= figures["frames_per_call"] <= 16, figures
    assert figures["steps"] and set(figures["steps"]) <= {"one_model", "sub_calls"}, figures
    assert "2 sessions, sub_calls round 1: missed" in run.stdout, run.stdout
    # where the host's CPU went: each server process and the bench's client, and the worker per frame
    assert {"frontend0", "gpu0", "cpu0", "bench client", "machine"} <= set(figures["cpu_percent"]), figures
    assert figures["cpu_percent"]["gpu0"] > 0 and figures["inference_ms_per_frame"] > 0, figures
    # ... of which its main thread's: what a card's host still pays per frame
    assert 0 < figures["main_thread_ms_per_frame"] < figures["inference_ms_per_frame"], figures
    # --profile: the inference process recorded over the round where py-spy is installed; else said why not
    if pyspy.find() is None:
        assert run.stdout.count("py-spy is not installed here") == 1, run.stdout
    else:
        assert figures["profile"]["process"] == "inference" and figures["profile"]["samples"] > 0, figures
        assert list((tmp_path / "profile").glob("inference-sub_calls-2-1.txt")), run.stdout
        assert "inference profile" in run.stdout, run.stdout
