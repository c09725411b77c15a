"""`python -m bench sessions` at its smallest: one session per level (audio windows, PCM in 20-ms chunks,
PCM as a TTS gives it) runs its seconds and is counted, through the command a user runs."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_the_sessions_bench_runs_a_level_of_each_audio_mode(tmp_path):
    out = tmp_path / "sessions.json"
    run = subprocess.run([sys.executable, "-m", "bench", "sessions", "--seconds", "2", "--levels", "1", "--pcm-levels",
                          "1", "--silent", "", "--no-split", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    levels = json.loads(out.read_text())["sessions"]["levels"]
    assert [(level["sessions"], level["pcm"], level["tts"]) for level in levels] == \
        [(1, False, False), (1, True, False), (1, True, True)], levels
    # each level's session ran its 2 s at 25 fps (its first frames come after its open)
    assert all(25 <= level["frames"] <= 60 and level["missed"] == 0 for level in levels), levels
    assert "the frontend:" in run.stdout and "us of CPU per frame sent" in run.stdout, run.stdout
