"""Errors that no restart can cure end the server at once: `python -m supervisor` exits non-zero, its
stderr names the setting to change, and nothing of the run is left (no process, no /dev/shm entry).
Every port the server binds (frontend.bind, viewer.port, metrics.port, bridge.bind), a models_dir
that is not there, a key file that cannot be read; and a role whose every process ran out of
restarts (supervisor.max_restarts). A role with a process left keeps serving, degraded.

Also: each process role imports only what its start needs (the start-up time is in bench/startup.py).
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from shm import list_segments
from tests.conftest import TEST_PREFIX
from tests.helpers import ROOT, Server, base_config, free_port, make_avatar

pytestmark = pytest.mark.slow
EXIT_WITHIN_S = 60   # a liveness bound, far above the few seconds it takes: the old supervisor never exited


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "a", n_frames=2)
    return root


def _taken_port() -> tuple[socket.socket, int]:
    """A port that another program holds (listening), as a second server on the host would find it."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    return blocker, blocker.getsockname()[1]


class Run:
    """`python -m supervisor` in a subprocess, with every child process it had while it was watched."""

    def __init__(self, tmp_path: Path, config: dict, role: str = "all"):
        path = tmp_path / f"server-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.stderr = path.with_suffix(".err")
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--role", role, "--config", str(path)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        self.server = Server(self.proc, config["frontend"]["bind"][0], self.stderr)
        self.children: dict[int, psutil.Process] = {}

    def watch(self) -> list[psutil.Process]:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.children.setdefault(child.pid, child)
        except psutil.Error:
            pass
        return [c for c in self.children.values() if c.is_running()]

    def child(self, name: str, not_pid: int = 0) -> psutil.Process:
        """The live child process titled `name` (lsync-cpu0 ...), waiting for a new one if `not_pid` is."""
        deadline = time.monotonic() + EXIT_WITHIN_S
        while time.monotonic() < deadline:
            for c in self.watch():
                try:
                    if c.name() == name and c.pid != not_pid and c.status() != psutil.STATUS_ZOMBIE:
                        return c
                except psutil.Error:
                    pass
            assert self.proc.poll() is None, self.log()
            time.sleep(0.02)
        raise AssertionError(f"no process {name}:\n{self.log()}")

    def exit_code(self) -> int:
        deadline = time.monotonic() + EXIT_WITHIN_S
        while self.proc.poll() is None:
            self.watch()
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the server still runs {EXIT_WITHIN_S}s later, serving nothing:\n{self.log()}")
            time.sleep(0.02)
        return self.proc.returncode

    def kill(self) -> None:
        for c in self.watch():
            c.kill()
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.stderr.read_text()[-4000:]

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            alive = [c.pid for c in self.children.values() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not alive, f"processes left behind: {alive}\n{self.log()}"
        left = [s for s in list_segments(TEST_PREFIX) if f"-{self.proc.pid}-" in s]
        assert not left, f"/dev/shm entries left behind: {left}"


def _ends_naming(run: Run, setting: str, says: str = "cannot start") -> str:
    """The server exits non-zero, its own last words ("cannot start: ...", or "cannot go on serving: ...")
    name `setting`; no process, no segment is left."""
    code = run.exit_code()
    log = run.stderr.read_text()
    assert code != 0, log[-3000:]
    last_words = [line[line.index(says):] for line in log.splitlines() if f"{says}: " in line]
    assert last_words and setting in last_words[-1], log[-3000:]
    run.assert_nothing_left()
    return last_words[-1]


# -- ports another program holds ---------------------------------------------------------------

@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
def test_a_taken_port_ends_the_start_of_several_client_facing_processes(tmp_path, models, shared):
    """frontend.processes > 1 share each port (SO_REUSEPORT): a port another program holds ends the
    start, also when that program shares it too (another server of this user), which the processes
    would otherwise join, each taking some of the other's connections."""
    blocker = socket.socket()
    if shared:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        run = Run(tmp_path, base_config(models, **{"frontend.bind": [f"tcp://127.0.0.1:{port}"],
                                                   "frontend.processes": 2}))
        words = _ends_naming(run, "frontend.bind")
    finally:
        blocker.close()
    assert "Address already in use" in words and f"127.0.0.1:{port}" in words, words

@pytest.mark.parametrize("setting", ["viewer.port", "metrics.port", "frontend.bind"])
def test_a_taken_port_ends_the_start_naming_its_setting(tmp_path, models, setting):
    """A second server on a host whose port is taken: it ends at once, no restart, and says which setting."""
    blocker, port = _taken_port()
    overrides = {"viewer.port": {"viewer": {"port": port}}, "metrics.port": {"metrics.port": port},
                 "frontend.bind": {"frontend.bind": [f"tcp://127.0.0.1:{port}"]}}[setting]
    try:
        run = Run(tmp_path, base_config(models, **overrides))
        words = _ends_naming(run, setting)
    finally:
        blocker.close()
    assert "Address already in use" in words and f"127.0.0.1:{port}" in words, words
    assert "restarting" not in run.stderr.read_text()


@pytest.mark.parametrize("setting", ["bridge.bind", "metrics.port"])
def test_a_taken_port_ends_a_gpu_hosts_start_naming_its_setting(tmp_path, models, setting):
    blocker, port = _taken_port()
    bridge = free_port() if setting != "bridge.bind" else port
    cfg = base_config(models, bridge={"bind": f"tcp://127.0.0.1:{bridge}", "insecure_plaintext": True},
                      **({"metrics.port": port} if setting == "metrics.port" else {}))
    try:
        words = _ends_naming(Run(tmp_path, cfg, role="gpu"), setting)
    finally:
        blocker.close()
    assert words.startswith("cannot start: bridge0 ") and "Address already in use" in words, words


def test_a_port_taken_while_the_frontend_restarts_ends_the_server(tmp_path, models):
    """The frontend is killed; meanwhile another program takes its metrics port. Its restart cannot bind
    it, and no later restart would: the supervisor stops everything and exits non-zero."""
    port = free_port()
    run = Run(tmp_path, base_config(models, **{"metrics.port": port, "supervisor.restart_backoff_s": 2.0}))
    blocker = socket.socket()
    try:
        run.server.wait_ready()
        frontend = run.child("lsync-frontend0")
        frontend.kill()
        frontend.wait(10)
        deadline = time.monotonic() + 10
        while True:   # the port is free once the dead frontend's socket is closed
            try:
                blocker.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        blocker.listen()
        words = _ends_naming(run, "metrics.port", says="cannot go on serving")
    finally:
        blocker.close()
        if run.proc.poll() is None:
            run.kill()
    assert "frontend0" in words and "Address already in use" in words, words
    assert "restarting frontend0 (restart 2)" not in run.stderr.read_text()


# -- files --------------------------------------------------------------------------------------

def test_a_models_dir_that_is_not_there_ends_the_start(tmp_path):
    words = _ends_naming(Run(tmp_path, base_config(tmp_path / "no-such-dir")), "models_dir")
    assert str(tmp_path / "no-such-dir") in words, words


def test_an_unreadable_key_file_ends_the_start(tmp_path, models):
    cfg = base_config(models, frontend={"bind": [f"tcp://127.0.0.1:{free_port()}"],
                                        "curve": {"secret_key": str(tmp_path / "missing.key_secret")}})
    words = _ends_naming(Run(tmp_path, cfg), "frontend.curve.secret_key")
    assert "missing.key_secret" in words, words


# -- restarts -----------------------------------------------------------------------------------

def test_a_role_out_of_restarts_ends_the_server_and_one_with_a_process_left_serves(tmp_path, models):
    """supervisor.max_restarts: 1. One compositor killed twice stays down and the server serves on the
    other, degraded; the other killed twice too leaves no compositor: the server ends, non-zero."""
    cfg = base_config(models, **{"supervisor.max_restarts": 1, "supervisor.restart_window_s": 300,
                                 "supervisor.restart_backoff_s": 0.1})
    run = Run(tmp_path, cfg)
    try:
        run.server.wait_ready()
        for name in ("lsync-cpu0", "lsync-cpu1"):
            first = run.child(name)
            first.kill()
            run.child(name, not_pid=first.pid).kill()   # its restart, killed too: no restart left
            if name == "lsync-cpu0":
                deadline = time.monotonic() + EXIT_WITHIN_S
                while (states := _states(run, "cpu")) != {0: "failed", 1: "ready"}:
                    assert time.monotonic() < deadline, states
                    time.sleep(0.1)
                assert run.server.health()["status"] == "degraded"
                with run.server.client() as c:
                    header, images = c.composite("a", np.zeros((2, 32, 16, 16), np.float32))
                assert header["ok"] and len(images) == 2
        _ends_naming(run, "supervisor.max_restarts", says="cannot go on serving")
    finally:
        if run.proc.poll() is None:
            run.kill()


def _states(run: Run, role: str) -> dict[int, str]:
    return {p["index"]: p["state"] for p in run.server.health()["processes"] if p["role"] == role}


# -- what each role imports before READY --------------------------------------------------------

HEAVY = ("cv2", "av", "aiortc", "aiohttp", "onnxruntime", "simplejpeg", "cupy")


@pytest.mark.parametrize("role, modules, allowed", [
    ("supervisor", "supervisor.__main__, supervisor.tree", ()),
    ("frontend", "supervisor.entry, frontend.server.process", ()),
    ("gpu worker", "supervisor.entry, gpu_actor.worker", ("onnxruntime",)),
    ("compositor", "supervisor.entry, cpu_actor.worker", ("cv2",)),
])
def test_each_role_imports_only_what_its_start_needs(role, modules, allowed):
    """In a fresh interpreter, as a spawned child imports its entry: the supervisor imports no actor
    and none of their libraries; the frontend neither OpenCV nor the viewer's stack (loaded after READY);
    a GPU worker no PyAV nor OpenCV; a compositor no PyAV (loaded by its first H.264 session)."""
    code = (f"import sys, {modules}; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} "
            "or m.startswith(('gpu_actor.worker', 'cpu_actor.worker', 'frontend.server', 'frontend.live.viewer'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    own = {"frontend": ("frontend.server",), "gpu worker": ("gpu_actor.worker",),
           "compositor": ("cpu_actor.worker",)}.get(role, ())
    extra = [m for m in ast.literal_eval(out) if not m.startswith(own) and m.split(".")[0] not in allowed]
    assert not extra, f"the {role} imports {extra}"


def test_fp16_on_the_cpu_provider_ends_the_start_naming_the_setting(tmp_path, models):
    cfg = base_config(models, **{"inference.precision": "fp16"})
    words = _ends_naming(Run(tmp_path, cfg), "inference.precision")
    assert "fp32" in words, words
