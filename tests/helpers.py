"""Test helpers: small avatars on disk, a straightforward reference of the compositing math, and a real
server (`python -m supervisor`) in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Callable, Optional

import cv2
import numpy as np
import onnxruntime as ort
import psutil
import simplejpeg
import yaml

from lipsync_client import AsyncClient, Client, ClientTimeout, ServerError
from gpu_actor.demo_model import write_demo_models
from gpu_actor.model_builder import write_model
from shm import list_segments
from tests.conftest import TEST_PREFIX

ROOT = Path(__file__).resolve().parent.parent


def make_avatar(models_dir: Path, model_id: str, n_frames: int = 6, size=(320, 240), rects=None,
                kind: str = "tiny", audio: str = "ave", seed: int = 0, batch: Optional[int] = None,
                rect_form: str = "dict") -> Path:
    """A model directory: tiny (or unet328) model, PNG frames with texture, crop rects."""
    d = models_dir / model_id
    (d / "frames").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    for k in range(n_frames):
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([(x * 3 + k * 7) % 256, (y * 2 + k * 5) % 256, (x + y + k) % 256], -1).astype(np.uint8)
        img = cv2.add(img, rng.integers(0, 30, img.shape, dtype=np.uint8))
        cv2.imwrite(str(d / "frames" / f"{k}.png"), img)
    if rects is None:
        rects = [[w // 4 + k, h // 4, w // 4 + k + w // 3, h // 4 + h // 3] for k in range(n_frames)]
    data = {str(i): {"rect": r} for i, r in enumerate(rects)} if rect_form == "dict" else rects
    (d / "crop_rects.json").write_text(json.dumps(data))
    write_model(d / "model.onnx", kind=kind, audio=audio, seed=seed, batch=batch)
    return d


def make_video_avatar(models_dir: Path, model_id: str, n_frames: int) -> Path:
    """An avatar whose frames look like video: smooth colour, shapes that move, texture in luma only
    (per-channel pixel noise alone would cap any 4:2:0 codec near 26 dB), with the talking demo's
    model and audio encoder (a mouth drawn into the face, not a random network's noise)."""
    avatar = make_avatar(models_dir, model_id, n_frames=n_frames)
    write_demo_models(avatar)
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:240, 0:320]
    for k in range(n_frames):
        img = np.stack([x * 0.6 + 40, y * 0.7 + 30, (x + y) * 0.3 + 60], -1)
        cv2.circle(img, (160 + 4 * k, 120), 60, (90, 140, 200), -1)
        cv2.rectangle(img, (30 + 3 * k, 30), (90 + 3 * k, 80), (200, 60, 40), -1)
        img = cv2.GaussianBlur(img, (0, 0), 2) + rng.normal(0, 2, (240, 320, 1))
        cv2.imwrite(str(avatar / "frames" / f"{k}.png"), np.clip(img, 0, 255).astype(np.uint8))
    return avatar


def reference_composite(background: np.ndarray, rect, mouth: np.ndarray) -> np.ndarray:
    """The three compositing steps exactly as SyncTalk_2D writes them, with nothing shared with the server."""
    h_img, w_img = background.shape[:2]
    x1, y1, x2, y2 = max(rect[0], 0), max(rect[1], 0), min(rect[2], w_img), min(rect[3], h_img)
    c = cv2.resize(background[y1:y2, x1:x2], (328, 328), interpolation=cv2.INTER_CUBIC)
    q = c.copy()
    q[4:324, 4:324] = np.clip(np.floor(255 * mouth.transpose(1, 2, 0)), 0, 255).astype(np.uint8)
    out = background.copy()
    out[y1:y2, x1:x2] = cv2.resize(q, (x2 - x1, y2 - y1), interpolation=cv2.INTER_CUBIC)
    return out


def reference_visual(background: np.ndarray, rect) -> np.ndarray:
    h_img, w_img = background.shape[:2]
    x1, y1, x2, y2 = max(rect[0], 0), max(rect[1], 0), min(rect[2], w_img), min(rect[3], h_img)
    c = cv2.resize(background[y1:y2, x1:x2], (328, 328), interpolation=cv2.INTER_CUBIC)
    r = c[4:324, 4:324].copy()
    m = r.copy()
    m[5:310, 5:315] = 0
    return np.concatenate([r.transpose(2, 0, 1), m.transpose(2, 0, 1)]).astype(np.float32) / 255


def expected_frames(models, model, audio, start, batch, visual=None):
    """What the server must return: the tiny model run by onnxruntime, composited by the reference."""
    d = models / model
    rects = json.loads((d / "crop_rects.json").read_text())
    n = len(rects)
    frames = [mirror_index(start + i, n) for i in range(batch)]
    backgrounds = [cv2.imread(str(d / "frames" / f"{k}.png")) for k in frames]
    if visual is None:
        visual = np.stack([reference_visual(bg, rects[str(k)]["rect"]) for bg, k in zip(backgrounds, frames)])
    session = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    audio = np.broadcast_to(audio, (batch, *audio.shape[-3:])) if audio.ndim == 3 else audio
    mouths = np.concatenate([session.run(None, {"input": visual[i:i + 1], "audio": audio[i:i + 1]})[0]
                             for i in range(batch)])
    return frames, [reference_composite(bg, rects[str(k)]["rect"], m) for bg, k, m in zip(backgrounds, frames, mouths)]


def decode_image(image: bytes, fmt: str, header: dict) -> np.ndarray:
    if fmt == "raw":
        return np.frombuffer(image, np.uint8).reshape(header["height"], header["width"], 3)
    if fmt == "png":
        return cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
    return simplejpeg.decode_jpeg(image, colorspace="BGR")


def mirror_index(k: int, n: int) -> int:
    seq = list(range(n)) + list(range(n - 1, -1, -1))
    return seq[k % (2 * n)]


def frames_for(session, seconds: float) -> list:
    """(arrival time, header, image) of every frame a live session (frontend.client.Session) pushes
    within `seconds`."""
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        frame = session.next_frame(timeout_s=max(deadline - time.monotonic(), 0.001))
        if frame is not None and frame[0].get("event") == "frame":
            out.append((time.monotonic(), *frame[:2]))
    return out


def frames_until(session, index: int, limit_s: float = 60.0) -> list:
    """(arrival time, header, image) of every frame a live session (lipsync_client.Session) pushes up
    to the one numbered `index`: a paced stream's own clock, not the test's. `limit_s` only bounds a
    stream that stalls."""
    out, deadline = [], time.monotonic() + limit_s
    while not out or out[-1][1]["index"] < index:
        assert time.monotonic() < deadline, f"no frame {index} within {limit_s} s: the stream stalled"
        frame = session.next_frame(timeout_s=max(deadline - time.monotonic(), 0.001))
        if frame is not None and frame[0].get("event") == "frame":
            out.append((time.monotonic(), *frame[:2]))
    return out


def speech_beside_a_flood(endpoint: str, model: str, clients: int, in_flight: int, full: Callable[[ServerError], bool],
                          limit_s: float) -> tuple[dict, int, int]:
    """A live session on `model` speaks 50 frames of windows at once while `clients` clients each keep
    `in_flight` `composite` requests of 8 frames on it, sent again as they are answered (after a refusal,
    5 ms later). The session opens once a refusal `full` says a queue was full (within `limit_s`).
    Returns its stats, and the count of such refusals when it spoke and once it had every frame."""
    import threading
    from lipsync_client import Session
    stop, codes = threading.Event(), []

    def flood() -> None:
        async def one(client: AsyncClient) -> None:
            while not stop.is_set():
                try:
                    await client.composite(model, np.zeros((8, 32, 16, 16), np.float32))
                    codes.append("ok")
                except ServerError as err:
                    codes.append("full" if full(err) else err.code)
                    await asyncio.sleep(0.005)

        async def main() -> None:
            async with AsyncExitStack() as stack:
                senders = [await stack.enter_async_context(AsyncClient(endpoint, timeout_s=60)) for _ in range(clients)]
                await asyncio.gather(*(one(c) for c in senders for _ in range(in_flight)))
        asyncio.run(main())

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        deadline = time.monotonic() + limit_s
        while "full" not in codes:
            assert time.monotonic() < deadline, f"the flood never filled the queue: {codes[-10:]}"
            time.sleep(0.01)
        with Session(endpoint, model) as s:
            frames_until(s, 0)
            before = codes.count("full")
            reply = s.send_audio(np.zeros((50, 32, 16, 16), np.float32), last=True)
            frames_until(s, reply["first_frame"] + 50)
            stats = s.stats()
        return stats, before, codes.count("full")
    finally:
        stop.set()
        thread.join()


def one_beside_many(many_endpoint: str, one_endpoint: str, model: str, audio: np.ndarray, many: int = 8) -> list[str]:
    """One client sends `many` `composite` requests at once (start frames 0 ..); another, sent once the
    first of them is answered, sends one. The order of the answers: "many0" .., "one"."""
    async def main() -> list[str]:
        order: list[str] = []
        async with AsyncClient(many_endpoint, timeout_s=120) as flood_client, \
                AsyncClient(one_endpoint, timeout_s=120) as one_client:
            async def send(client: AsyncClient, name: str, k: int) -> None:
                await client.composite(model, audio, start_frame=k)
                order.append(name)
            flood = [asyncio.create_task(send(flood_client, f"many{k}", k)) for k in range(many)]
            while not order:
                await asyncio.sleep(0.01)
            await send(one_client, "one", 0)
            await asyncio.gather(*flood)
        return order

    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A port p with p + 1 .. p + n - 1 free too (client-facing process i serves metrics.port + i)."""
    for _ in range(100):
        port = free_port()
        taken = False
        for k in range(1, n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + k))
                except OSError:
                    taken = True
                    break
        if not taken:
            return port
    raise RuntimeError(f"no {n} adjacent free ports")


def base_config(models_dir: Path, **overrides) -> dict:
    cfg = {
        "frontend": {"bind": [f"tcp://127.0.0.1:{free_port()}"]},
        "metrics": {"port": 0},
        "viewer": {"port": 0},
        "models_dir": str(models_dir),
        "limits": {"max_batch": 8, "queue_depth": 8, "request_timeout_s": 60},
        "inference": {"devices": "cpu", "intra_op_threads": 1},
        "compositing": {"workers": 2, "cache_bytes": 64 * 1024 * 1024, "max_frame_width": 640,
                        "max_frame_height": 480},
        "shm": {"slots": 2, "prefix": TEST_PREFIX},
        "supervisor": {"start_timeout_s": 60, "shutdown_timeout_s": 5, "restart_backoff_s": 0.2},
    }
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    return cfg


class Server:
    def __init__(self, proc: subprocess.Popen, endpoint: str, log: Path, curve: Optional[dict] = None):
        self.proc, self.endpoint, self.log, self.curve = proc, endpoint, log, curve

    def client(self, **kw) -> Client:
        return Client(self.endpoint, curve=kw.pop("curve", self.curve), **kw)

    def health(self) -> dict:
        with self.client(timeout_s=5) as c:
            return c.health()

    def pids(self, role: str) -> list[int]:
        return [p["pid"] for p in self.health()["processes"] if p["role"] == role]

    def restarted(self, role: str, old_pid: int, timeout_s: float = 60) -> tuple[dict, dict]:
        """Once the server is ready again with a new `role` process in place of `old_pid`: the health, and
        that process's entry in it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                health = self.health()
                proc = next(p for p in health["processes"] if p["role"] == role)
                if health["status"] == "ready" and proc["pid"] != old_pid:
                    return health, proc
                assert health["status"] in ("degraded", "ready")
            except ClientTimeout:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{role} did not come back within {timeout_s}s")

    def wait_ready(self, timeout_s: float = 60, states=("ready",)) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                last = self.health()
                if last["status"] in states:
                    return last
            except (ClientTimeout, ServerError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout_s}s: {last}\n{self.log.read_text()[-3000:]}")

    def wait_logged(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server never logged {text!r}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM, wait, and assert that nothing of the run is left behind."""
        children = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.assert_clean(children)
        return code

    def assert_clean(self, children: list[psutil.Process] = (), wait_s: float = 30.0) -> None:
        """No process of the run is left (a child the supervisor gave up on dies with it, by
        PR_SET_PDEATHSIG, a moment later: `wait_s` only bounds a child that never dies), and no
        /dev/shm entry of it."""
        deadline = time.monotonic() + wait_s
        while alive := [p.pid for p in children if _running(p)]:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        assert not alive, f"processes left behind: {alive}"
        left = [s for s in list_segments(TEST_PREFIX) if f"-{self.proc.pid}-" in s]
        assert not left, f"/dev/shm entries left behind: {left}"


def _running(proc: psutil.Process) -> bool:
    try:   # is_running: the same process, not another one that got its pid
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def run_server(tmp_path: Path, config: dict, curve: Optional[dict] = None, role: str = "all",
               states=("ready",), prefix: tuple[str, ...] = (), env: Optional[dict] = None, cwd: Path = ROOT):
    """The server as a process (`prefix`: a command to run it under, e.g. `ip netns exec NS`)."""
    cfg_path = tmp_path / f"server-{time.monotonic_ns()}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    log = cfg_path.with_suffix(".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "supervisor", "--role", role, "--config", str(cfg_path)],
                                cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, config["frontend"]["bind"][0], log, curve)
    try:
        server.wait_ready(states=states)
        if config.get("frontend", {}).get("processes", 1) > 1:
            # the first client-facing process up answers `ready` while another may not have taken its share
            # of the port yet: wait for the supervisor's start to end (its summary, once every process is up)
            server.wait_logged("serving on")
        yield server
    finally:
        if proc.poll() is None:
            code = server.stop()
            assert code == 0, f"server exited with {code} on SIGTERM:\n{log.read_text()[-3000:]}"
        else:
            server.assert_clean()


def bridge_keys(d: Path, *others: str) -> Path:
    """CURVE key pairs for a GPU host (`gpu`), an edge (`edge`) and `others` in `d`, and `d/authorized`
    holding the edge's public key: what a GPU host that accepts that edge is configured with."""
    subprocess.run([sys.executable, "-m", "supervisor", "keys", str(d), "gpu", "edge", *others], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    (d / "authorized").mkdir()
    (d / "authorized" / "edge.key").write_bytes((d / "edge.key").read_bytes())
    return d


def bridge_configs(models: Path, keys: Path, port: int, prefix: str, **settings) -> tuple[dict, dict]:
    """(GPU host, edge) configs on `models` with `settings`, the edge using the GPU host on `port`
    (keys from bridge_keys); each with its own shm prefix, as two hosts would have."""
    gpu = base_config(models, **settings, **{"shm.prefix": prefix + "g", "bridge": {
        "bind": f"tcp://127.0.0.1:{port}", "secret_key": str(keys / "gpu.key_secret"),
        "authorized_keys": str(keys / "authorized")}})
    edge = base_config(models, **settings, **{"shm.prefix": prefix + "e", "bridge": {
        "hosts": [{"endpoint": f"tcp://127.0.0.1:{port}", "server_key": str(keys / "gpu.key")}],
        "client_secret_key": str(keys / "edge.key_secret")}})
    return gpu, edge


@contextmanager
def gpu_host(tmp_path: Path, config: dict, clock_skew_s: float = 0.0, prefix: tuple[str, ...] = (),
             env: Optional[dict] = None):
    """A `--role gpu` supervisor; ready once it prints its summary. With `clock_skew_s`, every process of
    it reads a monotonic clock that far ahead (tests/skewed_clock): a host with another uptime. `env`:
    added to its environment."""
    cfg = tmp_path / f"gpu-{time.monotonic_ns()}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = cfg.with_suffix(".log")
    env = {**os.environ, **(env or {})}
    if clock_skew_s:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "skewed_clock"), env.get("PYTHONPATH", "")])
        env["LIPSYNC_TEST_CLOCK_SKEW_S"] = str(clock_skew_s)
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "supervisor", "--role", "gpu", "--config", str(cfg)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    while "role gpu: serving" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]


def infer_at_once(endpoint: str, work: list, timeout_s: float = 120) -> list:
    """`infer` of each (model, visual, audio) of `work`, all sent at once on one client: their answers."""
    async def burst() -> list:
        async with AsyncClient(endpoint, timeout_s=timeout_s) as client:
            return await asyncio.gather(*(client.infer(model, visual, audio) for model, visual, audio in work))
    return asyncio.run(burst())
