#!/usr/bin/env python3
"""Set up a local virtualenv and run the server or the tests: the README's two commands.

    python3 dev.py run [ARGS...]    create/refresh .venv, then `python -m supervisor ARGS...`
    python3 dev.py test [ARGS...]   create/refresh .venv, then `python -m pytest ARGS...`
    python3 dev.py watch [ARGS...]  the server (as `run`), and the demo avatar talking in your browser

Only the standard library is used here, so this works on a fresh machine with Python >= 3.10.
The venv holds the client distribution (client/, installed first) and the server, both editable; it is
refreshed whenever either pyproject.toml changes (a hash is kept in .venv/.installed).
Extras: `LIPSYNC_EXTRAS=gpu` installs onnxruntime-gpu + cupy (and NVIDIA's CUDA runtime wheels)
instead of onnxruntime, built for the CUDA major version this host's driver supports (13: extra
`gpu`, 12: extra `gpu-cu12`); `LIPSYNC_EXTRAS=gpu-cu12` or `gpu-cu13` forces one.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
CLIENT_PYPROJECT = "client/pyproject.toml"
NO_PIP = ("{python} has no pip to set up {venv} with: install Debian's python3-venv (it brings ensurepip) or "
          "python3-pip, or your system's equivalent, and run this again")


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the NVIDIA driver supports, (major, minor); None without a driver.
    cuDriverGetVersion from libcuda.so.1 (the driver's own library), else `nvidia-smi`'s banner."""
    import ctypes
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return version.value // 1000, version.value % 1000 // 10
    except (OSError, AttributeError):
        pass
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    import re
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def choose_extras(wanted: str, driver: tuple[int, int] | None) -> tuple[str, str]:
    """The pyproject extra to install for LIPSYNC_EXTRAS=`wanted`, and why."""
    if wanted == "gpu-cu13":
        return "gpu", "LIPSYNC_EXTRAS=gpu-cu13 asks for the CUDA 13 build"
    if wanted != "gpu":
        return wanted, f"LIPSYNC_EXTRAS={wanted}"
    if driver is None:
        raise SystemExit("LIPSYNC_EXTRAS=gpu: no NVIDIA driver found (no libcuda.so.1, no nvidia-smi); install the "
                         "driver, force a build with LIPSYNC_EXTRAS=gpu-cu12 or gpu-cu13, or leave LIPSYNC_EXTRAS unset "
                         "for the CPU")
    version = f"{driver[0]}.{driver[1]}"
    if driver[0] >= 13:
        return "gpu", f"the driver supports CUDA {version}: onnxruntime-gpu's CUDA 13 build"
    if driver[0] == 12:
        return "gpu-cu12", f"the driver supports CUDA {version}, not 13: onnxruntime-gpu's CUDA 12 build (< 1.27)"
    raise SystemExit(f"LIPSYNC_EXTRAS=gpu: the driver supports CUDA {version}; onnxruntime-gpu needs a driver for "
                     "CUDA 12 or 13: update the NVIDIA driver")


def _want_stamp(extras: str) -> str:
    digest = hashlib.sha256(b"".join((ROOT / p).read_bytes() for p in ("pyproject.toml", CLIENT_PYPROJECT))).hexdigest()
    return f"{digest} {extras}"


def _bootstrap_pip() -> None:
    """pip into a venv created without it (Debian's python3 ships without ensurepip: python3-venv), by
    the system's pip, so that its own configuration (index, proxy, certificates) applies."""
    system = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    try:
        version = subprocess.run(system + ["--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        raise SystemExit(NO_PIP.format(python=sys.executable, venv=VENV)) from None
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) >= (22, 3):
        subprocess.run(system + ["--python", str(PYTHON), "install", "-q", "pip"], check=True)
        return
    # NOTE: an older pip cannot install into another interpreter: it downloads pip's wheel, and pip
    # runs from the wheel itself to install it, which is how get-pip works
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(system + ["download", "-q", "--no-deps", "--only-binary", ":all:", "-d", tmp, "pip"], check=True)
        (wheel,) = Path(tmp).glob("pip-*.whl")
        subprocess.run([str(PYTHON), f"{wheel}/pip", "install", "-q", str(wheel)], check=True)


def ensure_venv() -> None:
    wanted = os.environ.get("LIPSYNC_EXTRAS", "cpu")
    extras, why = choose_extras(wanted, driver_cuda_version() if wanted == "gpu" else None)
    want = _want_stamp(extras)
    if STAMP.exists() and STAMP.read_text() == want and PYTHON.exists():
        return
    print(f"setting up {VENV.name} (extras: {extras}: {why}) ...", flush=True)
    if not PYTHON.exists():
        try:
            venv.EnvBuilder(with_pip=True).create(VENV)
        except subprocess.CalledProcessError:
            venv.EnvBuilder(with_pip=False, clear=True).create(VENV)
            _bootstrap_pip()
    pip = [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    # NOTE: the frameworks' extras only beside the CPU onnxruntime: pipecat-ai requires onnxruntime,
    # which would replace onnxruntime-gpu (the same module)
    frameworks = ",pipecat,livekit" if extras == "cpu" else ""
    # NOTE: the client first, in the same command: the server requires lipsync-client, which this
    # checkout's client/ provides (editable), not an index
    client = f"{ROOT / 'client'}[echo,livekit]" if frameworks else str(ROOT / "client")
    subprocess.run(pip + ["-e", client, "-e", f"{ROOT}[{extras},test{frameworks}]"], check=True)
    STAMP.write_text(want)


def watch(args: list[str]) -> int:
    """The server, and the demo avatar talking in a browser (lipsync_client watch) until Ctrl-C."""
    import signal
    server = subprocess.Popen([str(PYTHON), "-m", "supervisor", *args])
    try:
        return subprocess.call([str(PYTHON), "-m", "lipsync_client", "watch", "demo", "--wait", "600"])
    except KeyboardInterrupt:
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test", "watch"):
        print(__doc__, file=sys.stderr)
        return 2
    ensure_venv()
    if argv[0] == "watch":
        os.chdir(ROOT)
        return watch(argv[1:])
    module = "supervisor" if argv[0] == "run" else "pytest"
    os.chdir(ROOT)
    os.execv(str(PYTHON), [str(PYTHON), "-m", module, *argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
