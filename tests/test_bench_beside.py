"""`python -m bench beside` at its smallest: a live session, then another client, beside a client keeping
one request of unet_328 in flight; its figures are the session's speech, the other client's answers and
their times, and the client's answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_beside_bench_counts_the_sessions_speech_and_the_clients_answers(tmp_path):
    out = tmp_path / "beside.json"
    run = subprocess.run([sys.executable, "-m", "bench", "beside", "--levels", "1", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())["beside"]["1"]
    # six 1-s chunks of 25 frames: each frame went out as speech or was counted missed
    assert figures["speech"] + figures["missed"] == 150, figures
    assert figures["client"].get("ok", 0) >= 1, figures
    assert figures["other_answered"] >= 1 and 0 < figures["other_p50_ms"] <= figures["other_max_ms"], figures
    assert "N=1: speech missed" in run.stdout and "another client's 1-frame requests" in run.stdout, run.stdout
