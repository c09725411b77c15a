"""The two distributions as users install them: each wheel built from the source, installed into a clean
venv (pip's own configuration and cache; from the package index) and run from outside the repository.

- the client (`lipsync-client`): alone it installs none of the server's dependencies or packages; with
  `[pipecat,livekit]` the frameworks bring some of those dependencies themselves (pipecat-ai: onnxruntime
  for its Silero VAD and soxr; livekit-agents: PyAV and prometheus-client), which the test allows only
  when a framework, not the client, requires them; then its CLI and the Pipecat service talk to a server.
- the server (`lipsync-serve`, CPU extra): `python -m supervisor` builds the demo, serves it, and the
  installed client gets a frame from it.
- the collision check: a `supervisor` distribution installed first makes the server exit naming it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, TEST_PREFIX, free_port

pytestmark = pytest.mark.slow

# What a client must not bring: the server's own dependencies and packages
SERVER_DEPENDENCIES = {"onnx", "onnxruntime", "onnxruntime-gpu", "opencv-python", "opencv-python-headless",
                       "opencv-contrib-python", "opencv-contrib-python-headless", "av", "aiortc", "soxr",
                       "prometheus-client", "lipsync-serve"}
SERVER_PACKAGES = ("supervisor", "gpu_actor", "cpu_actor", "shm", "frontend", "config", "bench")
FRAMEWORKS = {"pipecat-ai", "livekit-agents"}

# Run by the client venv's Python: what it has installed, and who requires what (no `packaging` there).
INVENTORY = """
import importlib.util, json, re
from importlib import metadata
requires = {}
for dist in metadata.distributions():
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    deps = [r for r in (dist.requires or []) if "extra ==" not in r]
    requires[name] = sorted({re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group()).lower() for r in deps})
packages = [p for p in %r if importlib.util.find_spec(p) is not None]
import pathlib, sysconfig
size = sum(f.stat().st_size for f in pathlib.Path(sysconfig.get_paths()["purelib"]).rglob("*") if f.is_file())
print(json.dumps({"requires": requires, "packages": packages, "site_bytes": size}))
""" % (SERVER_PACKAGES,)

PIPECAT_UTTERANCE = """
import asyncio, json, sys
import numpy as np
from pipecat.frames.frames import ErrorFrame, OutputImageRawFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame
from pipecat.tests.utils import SleepFrame, run_test
from lipsync_client.pipecat import LipsyncVideoService
from lipsync_client.speech import speech

endpoint, model = sys.argv[1:3]
rate, chunk = 16000, 320
pcm = speech(2.0)
tts = [TTSAudioRawFrame(audio=pcm[i:i + chunk].tobytes(), sample_rate=rate, num_channels=1)
       for i in range(0, len(pcm), chunk)]
service = LipsyncVideoService(model=model, endpoint=endpoint)
down, up = asyncio.run(run_test(service, frames_to_send=[SleepFrame(0.5), TTSStartedFrame(), *tts, TTSStoppedFrame(),
                                                         SleepFrame(4.0)], start_timeout=60))
audio = np.frombuffer(b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame)), "<i2")
print(json.dumps({"errors": [str(f.error) for f in up if isinstance(f, ErrorFrame)],
                  "images": [list(f.size) for f in down if isinstance(f, OutputImageRawFrame)],
                  "same_audio": bool(len(audio) >= len(pcm) and np.array_equal(audio[:len(pcm)], pcm)),
                  "server": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (SERVER_PACKAGES,)


def _run(cmd, cwd: Path, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=_clean_env())
    if check and done.returncode:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


def _clean_env() -> dict:
    """This environment without what would put the repository or the test's venv on a venv's path."""
    import os
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _pip(venv: Path, *args, cwd: Path) -> None:
    """This interpreter's pip installing into `venv` (pip >= 22.3: --python), with pip's configuration and cache."""
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", venv / "bin" / "python", "install",
          "-q", *args], cwd=cwd)


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    return path


def _inventory(venv: Path, cwd: Path) -> dict:
    return json.loads(_run([venv / "bin" / "python", "-c", INVENTORY], cwd=cwd).stdout)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, built from a copy of the sources (no build/ or egg-info left in the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "wheels", "tests", "docs", "bench", "deploy",
                                    "__pycache__", "*.egg-info", ".pytest_cache")
    shutil.copytree(ROOT, src / "repo", ignore=ignore)
    for folder in (src / "repo" / "client", src / "repo"):
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, folder], cwd=src)
    found = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    return {"client": found["lipsync_client"], "server": found["lipsync_serve"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this checkout on `face`, which the installed client speaks to."""
    pytest.importorskip("pipecat", reason="the Pipecat service runs against the server's avatar")
    from tests.voice import face_avatar, warm_server
    with warm_server(face_avatar(tmp_path_factory, 6), tmp_path_factory) as srv:
        yield srv


def _forbidden(requires: dict) -> set[str]:
    return set(requires) & SERVER_DEPENDENCIES


def _required_by(requires: dict, name: str) -> set[str]:
    """Every installed distribution that requires `name`, directly or through others."""
    found, todo = set(), [name]
    while todo:
        target = todo.pop()
        for dist, deps in requires.items():
            if target in deps and dist not in found:
                found.add(dist)
                todo.append(dist)
    return found


def test_the_client_installs_nothing_of_the_server_and_speaks_to_it(wheels, server, tmp_path):
    venv = _venv(tmp_path / "client-venv")
    _pip(venv, wheels["client"], cwd=tmp_path)
    alone = _inventory(venv, tmp_path)
    assert not _forbidden(alone["requires"]), sorted(_forbidden(alone["requires"]))
    assert not alone["packages"], f"the client installed the server's packages {alone['packages']}"
    assert set(alone["requires"]["lipsync-client"]) == {"numpy", "pyzmq", "msgspec"}

    # its command line, as a console script and as a module, from outside the repository
    health = _run([venv / "bin" / "lipsync-client", "--endpoint", server.endpoint, "health"], cwd=tmp_path).stdout
    assert json.loads(health)["status"] == "ready", health
    models = _run([venv / "bin" / "python", "-m", "lipsync_client", "--endpoint", server.endpoint, "models"],
                  cwd=tmp_path).stdout
    assert "face" in models, models

    _pip(venv, f"{wheels['client']}[pipecat,livekit]", cwd=tmp_path)
    full = _inventory(venv, tmp_path)
    assert not full["packages"], f"the extras installed the server's packages {full['packages']}"
    assert not set(full["requires"]["lipsync-client"]) & SERVER_DEPENDENCIES
    # NOTE: pipecat-ai requires onnxruntime (its VAD) and soxr, livekit-agents PyAV and prometheus-client:
    # each one found must come from a framework, not from the client
    for name in _forbidden(full["requires"]):
        assert name != "lipsync-serve"
        requirers = _required_by(full["requires"], name)
        assert requirers & FRAMEWORKS, f"{name} is installed, required by {sorted(requirers)}, not by a framework"
    print(f"\nclient venv site-packages: alone {alone['site_bytes'] / 1e6:.0f} MB, with [pipecat,livekit] "
          f"{full['site_bytes'] / 1e6:.0f} MB; the frameworks bring {sorted(_forbidden(full['requires']))}")

    # the Pipecat service: one utterance, images and the same audio back
    script = tmp_path / "utterance.py"
    script.write_text(PIPECAT_UTTERANCE)
    result = json.loads(_run([venv / "bin" / "python", script, server.endpoint, "face"], cwd=tmp_path).stdout
                        .strip().splitlines()[-1])
    assert not result["errors"], result["errors"]
    assert result["images"] and all(size == [320, 240] for size in result["images"]), result["images"][:3]
    assert result["same_audio"], "the service did not give back the utterance's samples"
    assert not result["server"], f"the client loaded the server's {result['server']}"


def _server_config(tmp_path: Path) -> tuple[Path, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {"frontend": {"bind": [endpoint]}, "metrics": {"port": 0}, "viewer": {"port": 0},
              "demo": {"cache_dir": str(tmp_path / "demo"), "frames": 10},
              "inference": {"devices": "cpu", "intra_op_threads": 1}, "compositing": {"workers": 1},
              "shm": {"slots": 2, "prefix": TEST_PREFIX},
              "supervisor": {"start_timeout_s": 300, "shutdown_timeout_s": 10}}
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, endpoint


def test_the_server_wheel_serves_the_demo_from_outside_the_repository(wheels, tmp_path):
    from tests.helpers import Server
    venv = _venv(tmp_path / "server-venv")
    _pip(venv, wheels["client"], f"{wheels['server']}[cpu]", cwd=tmp_path)
    where = _run([venv / "bin" / "python", "-c", "import supervisor, config; print(supervisor.__file__, "
                  "config.__file__)"], cwd=tmp_path).stdout
    assert str(ROOT) not in where and str(venv) in where, where
    config, endpoint = _server_config(tmp_path)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "supervisor", "--config", str(config)],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=_clean_env())
    server = Server(proc, endpoint, log)
    try:
        server.wait_ready(timeout_s=600)      # it builds the demo first (wheel's package data: default.yaml)
        frames = tmp_path / "frames"
        _run([venv / "bin" / "python", "-m", "lipsync_client", "--endpoint", endpoint, "composite", "demo",
              "--batch", "1", "--out", frames], cwd=tmp_path)
        (image,) = frames.glob("frame_*")
        assert image.read_bytes()[:2] == b"\xff\xd8", "a JPEG frame"
        assert "building the demo avatar" in log.read_text()
    finally:
        if proc.poll() is None:
            assert server.stop() == 0, log.read_text()[-3000:]


def _fake_supervisor_wheel(out: Path) -> Path:
    """A distribution called `supervisor` with a package `supervisor`, as the process manager of that name."""
    wheel = out / "supervisor-9.9.9-py3-none-any.whl"
    info = "supervisor-9.9.9.dist-info"
    files = {"supervisor/__init__.py": "# another project's supervisor\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: supervisor\nVersion: 9.9.9\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/top_level.txt": "supervisor\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def test_a_server_beside_another_supervisor_distribution_refuses_to_start_and_names_it(wheels, tmp_path):
    venv = _venv(tmp_path / "collision-venv")
    _pip(venv, _fake_supervisor_wheel(tmp_path), cwd=tmp_path)
    # NOTE: --no-deps: the check runs before the server imports any of its dependencies
    _pip(venv, "--no-deps", wheels["client"], wheels["server"], cwd=tmp_path)
    done = _run([venv / "bin" / "python", "-m", "supervisor", "--check-config", ROOT / "config" / "default.yaml"],
                cwd=tmp_path, check=False, timeout=120)
    assert done.returncode != 0
    assert re.search(r"`supervisor` is also installed by the distribution supervisor\b", done.stderr), done.stderr
    assert "environment of its own" in done.stderr, done.stderr
