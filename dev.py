#!/usr/bin/env python3
"""Set up a local virtualenv and run the server or the tests: the README's two commands.

    python3 dev.py run [ARGS...]    create/refresh .venv, then `python -m supervisor ARGS...`
    python3 dev.py test [ARGS...]   create/refresh .venv, then `python -m pytest ARGS...`

Only the standard library is used here, so this works on a fresh machine with Python >= 3.10.
The venv is refreshed whenever pyproject.toml changes (a hash is kept in .venv/.installed).
Extras: `LIPSYNC_EXTRAS=gpu` installs onnxruntime-gpu + cupy instead of onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"


def _want_stamp(extras: str) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return f"{digest} {extras}"


def _bootstrap_pip() -> None:
    # NOTE: Debian's python3 ships without ensurepip (python3-venv); fetch pip's wheel from PyPI
    # and run pip from the wheel itself, which is how get-pip works.
    index = "https://pypi.org/pypi/pip/json"
    with urllib.request.urlopen(index, timeout=60) as resp:
        meta = json.load(resp)
    # Mirrors may answer with relative file URLs: resolve them against the JSON's own address.
    url = urllib.parse.urljoin(resp.url, next(f["url"] for f in meta["urls"] if f["filename"].endswith(".whl")))
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(tmp) / url.rsplit("/", 1)[1]
        with urllib.request.urlopen(url, timeout=120) as resp:
            wheel.write_bytes(resp.read())
        subprocess.run([str(PYTHON), f"{wheel}/pip", "install", "-q", str(wheel)], check=True)


def ensure_venv() -> None:
    extras = os.environ.get("LIPSYNC_EXTRAS", "cpu")
    want = _want_stamp(extras)
    if STAMP.exists() and STAMP.read_text() == want and PYTHON.exists():
        return
    print(f"setting up {VENV.name} (extras: {extras}) ...", flush=True)
    if not PYTHON.exists():
        try:
            venv.EnvBuilder(with_pip=True).create(VENV)
        except subprocess.CalledProcessError:
            venv.EnvBuilder(with_pip=False, clear=True).create(VENV)
            _bootstrap_pip()
    pip = [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + ["-e", f"{ROOT}[{extras},test]"], check=True)
    STAMP.write_text(want)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    ensure_venv()
    module = "supervisor" if argv[0] == "run" else "pytest"
    os.chdir(ROOT)
    os.execv(str(PYTHON), [str(PYTHON), "-m", module, *argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
