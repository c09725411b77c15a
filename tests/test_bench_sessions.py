"""`python -m bench sessions` at its smallest: one session per level (audio windows, PCM in 20-ms chunks,
PCM as a TTS gives it) runs its seconds and is counted, through the command a user runs; and its level
through edges and a GPU host spreads its sessions over the edges it starts."""

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


def test_the_split_level_spreads_its_sessions_over_the_edges_it_starts(tmp_path):
    out = tmp_path / "sessions.json"
    run = subprocess.run([sys.executable, "-m", "bench", "sessions", "--seconds", "2", "--levels", "", "--pcm-levels", "",
                          "--silent", "", "--split-edges", "2", "--split-sessions", "2", "--split-pcm", "--json",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    [level] = json.loads(out.read_text())["sessions"]["split"]["levels"]
    assert (level["edges"], level["sessions"], level["pcm"], level["missed"]) == (2, 2, True, 0), level
    # one session on each edge, each running its 2 s at 25 fps; each edge's frontend measured on its own
    assert all(25 <= frames <= 60 for frames in level["frames_per_edge"]), level
    assert all(us > 0 for us in level["frontend_us_per_frame"]), level
    assert {"bridge0", "gpu0"} <= set(level["host_us_per_speech_frame"]), level
    assert "through 2 edge(s) + a GPU host" in run.stdout, run.stdout
