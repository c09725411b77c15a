"""`python -m bench gpu` on the CPU provider with its smallest settings and the stand-in device (two
variants: fp32 and fp16): every section runs to its figures, so the GPU host's bench keeps working where
CI has no GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SECTIONS = ("onnxruntime alone, inputs and outputs on the device",
            "a model's own session vs its architecture's shared session", "first call per shape after ready",
            "calls alternating between shapes", "served infer per batch, fp32", "served infer per batch, fp16",
            "variants against the fp32 anchor", "live sessions on the tiny model",
            "model load -> first frame", "a load while 1 sessions speak", "models resident on the device")


@pytest.mark.slow
def test_the_gpu_bench_runs_every_section_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "gpu", "--device", "cpu", "--model", "tiny", "--seconds", "1",
                          "--levels", "1", "--avatars", "1", "--speaking", "1", "--max-models", "2", "--stand-in", "0.2",
                          "--variants", "fp32,fp16",
                          "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "gpu.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    for heading in SECTIONS:
        assert heading in out.stdout, f"no {heading!r} section in:\n{out.stdout[-4000:]}"
    assert "section failed" not in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
    figures = json.loads((tmp_path / "gpu.json").read_text())["gpu"]
    # the stand-in batches as a GPU does: every batch size up to limits.max_batch (4) had its first call timed
    assert sorted(figures["first_call"]["batches"]) == ["1", "2", "3", "4"]
    assert figures["served"]["4"]["ratio"] > 0
    # each variant on a server of its own, against the same fp32 anchor
    assert list(figures["variants"]) == ["fp32", "fp16"]
    assert figures["variants"]["fp16"]["4"]["ratio"] > 0
    assert figures["variants"]["fp16"]["4"]["worker_cpu_per_1000_fps"] > 0
    # on the CPU both sessions are compared at one frame a call, a further model loaded beside each
    assert list(figures["own_vs_shared"]["batches"]) == ["1"]
    assert figures["own_vs_shared"]["batches"]["1"]["ratio"] > 0
    assert figures["own_vs_shared"]["shared"]["further"]["ms"] > 0
    assert figures["first_frame"][0]["first_frame_ms"] > 0
    assert figures["residency"]["loaded"] == 2
