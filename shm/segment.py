"""POSIX shared-memory segments with per-run names, and the start-up sweep of dead runs.

Why not `multiprocessing.shared_memory.SharedMemory`: before Python 3.13 every attacher registers
the segment with its resource tracker, which unlinks it when that attacher exits, under the feet
of the owner. Here only the owner (the supervisor) creates and unlinks, and nobody registers.

Names: `/<prefix>-<pid>-<start>-<role>`, where pid and start (process start time, hex seconds)
identify the creating supervisor, so a later run can tell whether the creator is still alive.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import _posixshmem  # CPython's own shm_open/shm_unlink, used by multiprocessing.shared_memory
import psutil

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^(?P<prefix>[a-z][a-z0-9]*)-(?P<pid>\d+)-(?P<start>[0-9a-f]+)-")


def run_prefix(prefix: str) -> str:
    """The name prefix of this run's segments: `<prefix>-<pid>-<start>-<random>`."""
    me = psutil.Process()
    return f"{prefix}-{me.pid}-{int(me.create_time()):x}-{secrets.token_hex(3)}"


def _creator_alive(pid: int, start_hex: str) -> bool:
    try:
        proc = psutil.Process(pid)
        # A zombie (killed, not yet reaped) still reports its start time but holds nothing.
        return proc.status() != psutil.STATUS_ZOMBIE and int(proc.create_time()) == int(start_hex, 16)
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True  # not ours to judge


def sweep_dead_runs(prefix: str) -> list[str]:
    """Unlink segments named with `prefix` whose creating process is gone; return their names.
    Only this user's segments are touched: another user's (or one we may not remove) is skipped,
    never a reason to refuse start-up."""
    swept = []
    uid = os.getuid()
    for entry in SHM_DIR.glob(f"{prefix}-*"):
        match = _NAME.match(entry.name)
        if match is None or match["prefix"] != prefix:
            continue
        try:
            if entry.lstat().st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if _creator_alive(int(match["pid"]), match["start"]):
            continue
        try:
            _posixshmem.shm_unlink("/" + entry.name)
            swept.append(entry.name)
        except (FileNotFoundError, PermissionError):
            pass
    return swept


def list_segments(name_prefix: str) -> list[str]:
    """Names in /dev/shm that start with `name_prefix` (tests use it to check for leftovers)."""
    return sorted(p.name for p in SHM_DIR.glob(f"{name_prefix}*"))


class Segment:
    """One mapped segment. `create=True` only in the owner, which alone may `unlink()`."""

    def __init__(self, name: str, size: int = 0, create: bool = False, populate: bool = False):
        if not name or "/" in name:
            raise ValueError(f"shm segment name must be a plain name, got {name!r}")
        self.name = name
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            # MAP_POPULATE faults the pages in now, not on the first request through each slot.
            map_flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(fd, size, flags=map_flags)
        except BaseException:
            if create:
                _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        self.size = size
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Drop this process's mapping. Views into `buf` must be gone first."""
        if self._mmap is None:
            return
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            # NOTE: numpy views still alive; the mapping goes when they do. Never fatal on shutdown.
            pass
        self._mmap = None

    def unlink(self) -> None:
        if not self.owner:
            raise PermissionError(f"segment {self.name}: only its creator (the supervisor) unlinks it")
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
