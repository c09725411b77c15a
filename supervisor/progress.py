"""The progress bar of the steps a user waits on at the terminal (the demo's build, an import)."""

from __future__ import annotations

import sys


def progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
