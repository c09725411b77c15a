"""The container images, built and run for real: deploy/Containerfile and deploy/Containerfile.gpu
built by podman on a Debian bookworm base made here from Debian's own packages (debootstrap), each
image checked for what it holds, and each image's server started by `podman run` the way Kubernetes
runs it (deploy/kubernetes/): the image's user and entrypoint, a read-only root, only /tmp and
/dev/shm writable, config and models mounted read-only. A user's checks: a composite whose JPEGs
decode at the avatar's size, /readyz 200, every process uid 10001, nothing written outside /tmp and
/dev/shm, nothing left in either after SIGTERM.

What a container runtime normally does and may not be able to do on the machine that runs this:
- raise the container's open-files and process limits (podman asks for 1048576 and more). Without
  CAP_SYS_RESOURCE that fails (`setrlimit RLIMIT_NOFILE: Operation not permitted`), so the test
  asks for limits no higher than its own (`--ulimit`).
- crun, Debian's default runtime, refuses a hybrid cgroup layout (v1, with a controller left in the
  v2 hierarchy); where it cannot start a container, the test uses runc.
- RUN steps of the build run with `--isolation chroot`, without a runtime, for the same reasons.
- the GPU image's GPU path needs a GPU, the driver and the NVIDIA container toolkit: without them
  the test checks that every CUDA library onnxruntime's CUDA provider and cupy load is in the image
  and loads, and serves from the GPU image on its CPU fallback.

Slow, and needs root (debootstrap; podman's own storage) and the Debian packages podman, debootstrap
and runc (.ci/run installs them); without them it skips and says what is missing. The base, podman's
storage and build cache stay in ~/.cache/lipsync-serve-images between runs (delete it to start over).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import simplejpeg
import yaml

from tests.helpers import ROOT, base_config, free_port, make_avatar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lipsync-serve-images"
BASE = "localhost/lipsync-serve-base:bookworm"
CONTAINERFILES = {"cpu": ROOT / "deploy" / "Containerfile", "gpu": ROOT / "deploy" / "Containerfile.gpu"}
# Debian's CA bundle (the base's own path too): pip in the build trusts what this machine trusts,
# e.g. a proxy's own certificate, while the Containerfiles stay free of anything machine-specific.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
USER = 10001
# The mount points a container of these images has (deploy/kubernetes/): only /tmp and /dev/shm rw.
READ_ONLY = ("/", "/etc/lipsync/config.yaml", "/models")
WRITABLE = ("/tmp", "/dev/shm")


class Podman:
    """podman on storage of its own under CACHE: the images built here stay out of the machine's."""

    def __init__(self, driver: str):
        self.driver = driver
        self.base = ["podman", "--root", str(CACHE / f"storage-{driver}"), "--runroot", str(CACHE / f"run-{driver}"),
                     "--storage-driver", driver]
        # NOTE: podman keeps temporary files and the build's cache mounts (pip's downloads) in TMPDIR.
        self.env = {**os.environ, "TMPDIR": str(CACHE / "tmp")}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout, env=self.env,
                              **kw)
        assert not check or done.returncode == 0, \
            f"podman {' '.join(args)}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done

    def popen(self, *args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.base, *args], env=self.env, **kw)

    def size(self, tag: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", tag).stdout)

    def config(self, tag: str) -> dict:
        return json.loads(self("image", "inspect", tag).stdout)[0]["Config"]

    @contextmanager
    def mounted(self, tag: str):
        """The image's filesystem, as its containers see it."""
        root = Path(self("image", "mount", tag).stdout.strip())
        try:
            yield root
        finally:
            self("image", "unmount", tag, check=False)


@pytest.fixture(scope="module")
def podman() -> Podman:
    missing = [tool for tool in ("podman", "debootstrap") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"no {' or '.join(missing)} here (Debian packages of the same names; .ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("debootstrap (the base image) and podman on storage of its own need root")
    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    # overlay where the kernel and filesystem take it; vfs (a full copy per layer: slower, bigger) elsewhere.
    tried = {}
    for driver in ("overlay", "vfs"):
        tool = Podman(driver)
        info = tool("info", check=False)
        if info.returncode == 0:
            return tool
        tried[driver] = info.stderr.strip()[-300:]
    pytest.skip(f"podman has no storage driver that works here: {tried}")


@pytest.fixture(scope="module")
def base(podman) -> str:
    """Debian bookworm with Debian's Python 3.11: what python:3.11-slim-bookworm is, from Debian's
    packages (the registry need not be reachable). Made once per machine."""
    if podman("image", "exists", BASE, check=False).returncode:
        with tempfile.TemporaryDirectory(dir=CACHE / "tmp") as tmp:
            rootfs = Path(tmp) / "rootfs"
            boot = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                                   "bookworm", str(rootfs)], capture_output=True, text=True, timeout=1800)
            if boot.returncode:
                pytest.skip(f"debootstrap cannot make a Debian bookworm base here: {boot.stderr.strip()[-500:]}")
            (rootfs / "usr/bin/python").symlink_to("python3")
            # As Debian's own images: no downloaded packages, no package lists.
            for folder in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (rootfs / folder).iterdir():
                    if path.is_file():
                        path.unlink()
            with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
                podman("import", "-", BASE, stdin=tar.stdout)
    return BASE


@pytest.fixture(scope="module")
def runtime(podman, base) -> list[str]:
    """`podman run` options for a runtime and limits that start a container here (module docstring)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    nproc = 4096 if nproc == resource.RLIM_INFINITY else min(nproc, 4096)   # the server runs a few dozen
    limits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]
    errors = {}
    for runtime in ("default", "runc"):
        if runtime == "runc" and not shutil.which("runc"):
            errors[runtime] = "not installed (Debian package runc)"
            continue
        args = [*limits, *(["--runtime", runtime] if runtime != "default" else [])]
        probe = podman("run", "--rm", "--network", "host", *args, BASE, "true", check=False, timeout=120)
        if probe.returncode == 0:
            return args
        errors[runtime] = probe.stderr.strip()[-300:]
    pytest.skip(f"podman cannot start a container here, with its default runtime nor runc: {errors}")


@dataclass(frozen=True)
class Image:
    name: str
    tag: str
    build_s: float
    size: int
    base_size: int
    sources: dict[str, set[str]]   # package folder -> its files, as the build found them


@pytest.fixture(scope="module")
def built(podman, base):
    """build(name): the image built from this checkout (once per test session)."""
    images: dict[str, Image] = {}

    def build(name: str) -> Image:
        if name not in images:
            tag = f"localhost/lipsync-serve:{name}-test"
            ca = ["-v", f"{HOST_CA}:{HOST_CA}:ro"] if HOST_CA.exists() else []
            sources = {package: _files(folder) for package, folder in _packages().items()}
            started = time.monotonic()
            podman("build", "--isolation", "chroot", "--network", "host", *ca, "--build-arg", f"PYTHON_IMAGE={base}",
                   "-f", str(CONTAINERFILES[name]), "-t", tag, str(ROOT), timeout=3000)
            images[name] = Image(name, tag, time.monotonic() - started, podman.size(tag), podman.size(base), sources)
            print(f"\n{name} image: {images[name].size / 1e6:.0f} MB ({images[name].base_size / 1e6:.0f} MB of it the "
                  f"base), built in {images[name].build_s:.0f} s")
        return images[name]

    yield build
    # The layers of earlier builds (no tag left on them) go; the base and the images just built stay.
    podman("image", "prune", "-f", check=False)


def _packages() -> dict[str, Path]:
    """The packages the Containerfiles copy, by import name: a folder, or a distribution's folder of its
    own (client/, with its pyproject.toml) whose packages are one level down."""
    lines = CONTAINERFILES["cpu"].read_text().splitlines()
    sources = [ROOT / ln.split()[1] for ln in lines if ln.startswith("COPY ") and "--from" not in ln]
    folders = [s for source in sources if source.is_dir() for s in (
        [p.parent for p in source.glob("*/__init__.py")] if (source / "pyproject.toml").exists() else [source])]
    return {folder.name: folder for folder in folders}


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_symlink() or not p.is_dir())


@pytest.mark.parametrize("name", sorted(CONTAINERFILES))
def test_the_image_is_its_base_and_the_venv_with_nothing_it_does_not_need(podman, built, name):
    image = built(name)
    config = podman.config(image.tag)
    assert config["User"] == f"{USER}:{USER}"
    assert config["Entrypoint"] == ["python", "-m", "supervisor"], "the supervisor is PID 1 (SIGTERM drains)"
    assert {"5555/tcp", "5570/tcp", "9108/tcp", "8080/tcp"} <= set(config["ExposedPorts"])
    with podman.mounted(image.tag) as root:
        passwd = {int(line.split(":")[2]): line for line in (root / "etc/passwd").read_text().splitlines()}
        assert passwd[USER].split(":")[5] == "/nonexistent", passwd[USER]
        (site,) = root.glob("opt/venv/lib/python3*/site-packages")
        installed = {p.name.split("-")[0].lower().replace("_", "-") for p in site.glob("*.dist-info")}
        assert not installed & {"pip", "setuptools", "wheel", "pytest", "pytest-timeout", "librosa", "playwright",
                                "kubernetes-validate"}, "only what the server runs"
        assert {"lipsync-serve", "lipsync-client", "onnxruntime" if name == "cpu" else "onnxruntime-gpu"} <= installed
        assert not [p for p in site.glob("*/**/tests") if p.is_dir()] and not (site / "onnx/backend/test").exists()
        compilers = [p for d in ("usr/bin", "usr/local/bin") for c in ("cc", "gcc", "g++", "make")
                     if (p := root / d / c).exists()]
        assert not compilers and not (root / "src").exists() and not (root / "root/.cache").exists()
        # Every module and data file of the packages (sub-packages too): what pyproject.toml's packages
        # and package-data must name for the wheel to carry them.
        for package, files in image.sources.items():
            missing = sorted(files - _files(site / package))
            assert not missing, f"{package}: not in the image (pyproject.toml packages / package-data): {missing}"
        venv = _bytes(root / "opt/venv")
    # All the image adds to its base is the venv (and the user): no cache, no copy of the sources.
    added = image.size - image.base_size
    assert added <= venv * 1.02 + 8e6, f"the image adds {added / 1e6:.0f} MB to its base; its venv: {venv / 1e6:.0f} MB"
    print(f"{name} image: {image.size / 1e6:.0f} MB = base {image.base_size / 1e6:.0f} MB + venv {venv / 1e6:.0f} MB")


@dataclass
class Container:
    name: str
    proc: subprocess.Popen
    log: Path
    tmp: Path
    shm: Path


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    """Host folders for the container's /tmp and /dev/shm (the pod's emptyDirs), to look into afterwards."""
    tmp, shm = tmp_path / "container-tmp", tmp_path / "container-shm"
    for folder in (tmp, shm):
        folder.mkdir()
        folder.chmod(0o1777)   # as a tmpfs /tmp: anyone writes, only the owner removes
    return tmp, shm


def _run_options(runtime: list[str], tmp: Path, shm: Path) -> list[str]:
    """As deploy/kubernetes/ runs the image: its own user, entrypoint and environment, a read-only
    root, only /tmp and /dev/shm writable. The host's network: a client here reaches the ports as it
    would through a Service."""
    return ["--network", "host", *runtime, "--read-only", "--read-only-tmpfs=false",
            "-v", f"{tmp}:/tmp", "-v", f"{shm}:/dev/shm"]


@contextmanager
def container(podman: Podman, runtime: list[str], image: Image, tmp_path: Path, config: dict, models: Path):
    """The image's server under `podman run`, with its config and models mounted read-only."""
    name = f"lipsync-test-{image.name}-{os.getpid()}"
    tmp, shm = _folders(tmp_path)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp_path / f"{name}.log"
    podman("rm", "-f", name, check=False)
    with open(log, "w") as out:
        proc = podman.popen("run", "--name", name, *_run_options(runtime, tmp, shm),
                            "-v", f"{config_path}:/etc/lipsync/config.yaml:ro", "-v", f"{models}:/models:ro",
                            image.tag, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Container(name, proc, log, tmp, shm)
    finally:
        if proc.poll() is None:
            podman("kill", name, check=False)
            proc.wait(60)
        podman("rm", "-f", name, check=False)


def _environment(podman: Podman, image: Image) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in podman.config(image.tag)["Env"])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _wait_ready(box: Container, url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert box.proc.poll() is None, \
            f"the container exited with {box.proc.returncode}:\n{box.log.read_text()[-3000:]}"
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not 200 within {timeout_s}s:\n{box.log.read_text()[-3000:]}")


def _mounts(pid: int) -> dict[str, set[str]]:
    """Mount point -> its options, as the process sees them."""
    mounts = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        mounts[fields[4]] = set(fields[5].split(","))
    return mounts


@pytest.mark.parametrize("name", sorted(CONTAINERFILES))
def test_the_image_serves_as_its_container_would(podman, runtime, built, tmp_path, name):
    """The GPU image too, on the CPU fallback of `inference.devices: auto` (no GPU here)."""
    from lipsync_client import Client

    image = built(name)
    make_avatar(tmp_path / "models", "a", n_frames=3)   # 320x240 frames
    metrics, viewer = free_port(), free_port()
    config = base_config(Path("/models"), metrics={"port": metrics, "host": "127.0.0.1"},
                         viewer={"port": viewer, "host": "127.0.0.1"})
    if name == "gpu":
        config["inference"]["devices"] = "auto"
    with container(podman, runtime, image, tmp_path, config, tmp_path / "models") as box:
        _wait_ready(box, f"http://127.0.0.1:{metrics}/readyz")
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", box.name).stdout)
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        assert len(processes) >= 4, "supervisor, inference, compositing, frontend"
        for p in processes:
            assert p.uids().real == p.uids().effective == USER and p.gids().real == USER, (p.pid, p.cmdline())
        nspid = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("NSpid:"))
        assert nspid.split()[-1] == "1", "the supervisor is the container's PID 1"
        mounts = _mounts(pid)
        assert all("ro" in mounts[m] for m in READ_ONLY) and all("rw" in mounts[m] for m in WRITABLE), mounts

        with Client(config["frontend"]["bind"][0], timeout_s=60) as client:
            header, frames = client.composite("a", np.zeros((2, 32, 16, 16), np.float32))
            assert header["batch"] == 2 and len(frames) == 2
            for frame in frames:
                assert simplejpeg.decode_jpeg(bytes(frame), colorspace="BGR").shape == (240, 320, 3)
            # The viewer's page: package data, served through the wire protocol's session_open.
            opened, _ = client.request("session_open", model="a", format="h264", webrtc=True)
            status, page = _get(opened["viewer_url"])
            assert status == 200 and b"<video" in page
            client.request("session_close", session=opened["session"])
        status, body = _get(f"http://127.0.0.1:{metrics}/readyz")
        assert status == 200 and json.loads(body)["status"] == "ready", body
        assert list(box.tmp.iterdir()) and list(box.shm.iterdir()), "the run's sockets in /tmp, its rings in /dev/shm"

        podman("kill", "--signal", "TERM", box.name)
        assert box.proc.wait(90) == 0, f"SIGTERM: the supervisor drains and exits 0\n{box.log.read_text()[-3000:]}"
        # Written outside the mounts: nothing (what podman diff lists are the mount points themselves).
        changed = {line.split(maxsplit=1)[1] for line in podman("diff", box.name).stdout.splitlines()}
        assert changed <= {"/etc", "/etc/lipsync", "/etc/lipsync/config.yaml", "/models"}, changed
        # What the image's environment puts in /tmp on purpose (cupy's kernel cache) may stay, empty.
        kept = {box.tmp / Path(path).relative_to("/tmp") for path in _environment(podman, image).values()
                if path.startswith("/tmp/")}
        left = [p for p in [*box.tmp.iterdir(), *box.shm.iterdir()] if p not in kept or any(p.iterdir())]
        assert not left, f"left in /tmp or /dev/shm: {left}"
        alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes left behind: {alive}"


# Run in the GPU image: which libraries onnxruntime's CUDA provider links are not in the image (ldd,
# with the NVIDIA wheels' folders searched as preload_dlls() searches them), whether every library
# gpu_actor/cuda_libs.py requires loads after preload_dlls(), and cupy, imported as the server does.
CUDA_CHECK = """
import glob, json, os, subprocess
import onnxruntime as ort
from gpu_actor.cuda_libs import missing_libraries, preload
site = os.path.dirname(os.path.dirname(ort.__file__))
folders = sorted({os.path.dirname(p) for p in glob.glob(site + "/nvidia/**/lib*.so*", recursive=True)})
provider = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
ldd = subprocess.run(["ldd", provider], env={**os.environ, "LD_LIBRARY_PATH": ":".join(folders)},
                     capture_output=True, text=True, check=True).stdout
out = {"providers": ort.get_available_providers(),
       "not_found": sorted(line.split()[0] for line in ldd.splitlines() if "not found" in line)}
preload()
out["missing"] = missing_libraries(ort.__version__)
import cupy
out["cupy"] = cupy.__version__
try:
    out["devices"] = cupy.cuda.runtime.getDeviceCount()
except Exception as err:
    out["devices"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def test_the_gpu_image_brings_its_cuda_libraries_without_a_cuda_base(podman, runtime, built, tmp_path):
    """All but the driver: libcuda.so.1 is what the NVIDIA container toolkit mounts in, with the GPUs."""
    image = built("gpu")
    done = podman("run", "--rm", *_run_options(runtime, *_folders(tmp_path)), "--entrypoint", "python", image.tag,
                  "-c", CUDA_CHECK, timeout=300)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "CUDAExecutionProvider" in report["providers"]
    assert report["not_found"] == ["libcuda.so.1"], f"the CUDA provider links libraries the image lacks: {report}"
    assert report["missing"] == [], f"CUDA libraries not in the GPU image: {report['missing']}"
    print(f"\nGPU image, no GPU here: cupy {report['cupy']} imports; device count: {report['devices']}")
