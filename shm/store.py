"""The shared background store: decoded background frames and their 328x328 crops, once per host.

Two segments, created by the supervisor:

    index:  header (64 B: magic "LSSTORE1", n_entries u32, pad u32, entry_bytes u64, decodes u64)
            + n_entries x ENTRY (model hash, frame, state, loader pid, generation, h, w, c, last use, uses)
    data:   n_entries x entry_bytes, each [ background h*w*c uint8 ... | crop 328*328*3 uint8 ]

A background is BGR (c = 3, h x w x 3) or, for H.264 sessions, I420 (c = 1, (h * 3 / 2) x w): the
I420 copy is stored under its own id (the model id + "#i420"), converted once when it is decoded.

Entry states:  EMPTY --claim--> LOADING (one process decodes) --publish--> READY --evict--> LOADING ...

All index changes happen under an `flock` on a per-run lock file: the kernel drops it when its holder
dies, so a killed process can never wedge the store (a multiprocessing.Lock would stay held).
Readers copy an entry's bytes outside the lock and then re-check its generation (a seqlock): an entry
evicted mid-copy is read again, and nothing is pinned, so nothing leaks when a reader dies.
Concurrent misses on one frame decode it once; the others wait for READY (or take over if the
loading process died). When full, the least recently (lru) or least often (lfu) used entry goes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from shm.endpoints import StoreSpec
from shm.segment import Segment

MAGIC = b"LSSTORE1"
_HEADER = struct.Struct("<8sIIQQ")
_DECODES_OFFSET = 24
CROP_BYTES = 328 * 328 * 3
ENTRY = np.dtype([("model", "<u8"), ("frame", "<i8"), ("state", "<u4"), ("loader", "<u4"), ("gen", "<u8"),
                  ("h", "<u4"), ("w", "<u4"), ("c", "<u4"), ("last", "<f8"), ("uses", "<u8")])
EMPTY, LOADING, READY = 0, 1, 2
_POLL_S = 0.001

Loader = Callable[[], "tuple[np.ndarray, np.ndarray]"]


class StoreError(RuntimeError):
    """The store cannot hold or produce a frame; the message names the setting to change."""


def model_key(model_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(model_id.encode(), digest_size=8).digest(), "little") or 1


def entry_bytes(max_width: int, max_height: int) -> int:
    """The bytes every entry takes, whatever its frame's size: room for the largest frame and its crop.
    An avatar's frame takes one entry, two where H.264 sessions play it (its I420 copy has its own)."""
    return (max_width * max_height * 3 + CROP_BYTES + 4095) // 4096 * 4096


def store_spec(run_prefix: str, run_dir: str, cache_bytes: int, max_width: int, max_height: int,
               eviction: str) -> StoreSpec:
    entry = entry_bytes(max_width, max_height)
    n_entries = cache_bytes // entry
    if n_entries < 1:
        raise StoreError(f"compositing.cache_bytes ({cache_bytes}) cannot hold one {max_width}x{max_height} frame "
                         f"({entry} bytes); raise it or lower compositing.max_frame_width/height")
    return StoreSpec(f"{run_prefix}-store-index", f"{run_prefix}-store-data", n_entries, entry,
                     max_width, max_height, f"{run_dir}/store.lock", eviction)


class BackgroundStore:
    def __init__(self, spec: StoreSpec, index: Segment, data: Segment):
        self.spec = spec
        self._index_seg, self._data_seg = index, data
        self._table = np.ndarray((spec.n_entries,), ENTRY, buffer=index.buf, offset=_HEADER.size + 32)
        self._decodes = np.ndarray((1,), "<u8", buffer=index.buf, offset=_DECODES_OFFSET)
        self._data = np.ndarray((spec.n_entries, spec.entry_bytes), np.uint8, buffer=data.buf)
        self._lock_fd = os.open(spec.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._pid = os.getpid()
        # Where this process last found each frame: checked against the table (another process may
        # have evicted it since) before the scan of every entry, which the lock is held for (20 us at
        # 10,000 entries). At most one hint per entry.
        self._hints: dict[tuple[int, int], int] = {}
        self._hinted: dict[int, tuple[int, int]] = {}

    @staticmethod
    def _index_bytes(spec: StoreSpec) -> int:
        return _HEADER.size + 32 + spec.n_entries * ENTRY.itemsize

    @classmethod
    def create(cls, spec: StoreSpec) -> "BackgroundStore":
        index = Segment(spec.index_name, cls._index_bytes(spec), create=True)
        try:
            # NOTE: the data segment is not populated: pages are committed as frames arrive.
            data = Segment(spec.data_name, spec.n_entries * spec.entry_bytes, create=True)
        except BaseException:
            index.close()
            index.unlink()
            raise
        _HEADER.pack_into(index.buf, 0, MAGIC, spec.n_entries, 0, spec.entry_bytes, 0)
        return cls(spec, index, data)

    @classmethod
    def attach(cls, spec: StoreSpec) -> "BackgroundStore":
        return cls(spec, Segment(spec.index_name), Segment(spec.data_name))

    def close(self, unlink: bool = False) -> None:
        self._table = self._data = self._decodes = None
        os.close(self._lock_fd)
        for seg in (self._index_seg, self._data_seg):
            seg.close()
            if unlink:
                seg.unlink()

    @contextmanager
    def _locked(self):
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @property
    def decodes(self) -> int:
        """Frames decoded into the store since start, by every process together."""
        return int(self._decodes[0])

    def entries_used(self) -> int:
        return int(np.count_nonzero(self._table["state"] == READY))

    def bytes_used(self) -> int:
        ready = self._table[self._table["state"] == READY]
        return int(np.sum(ready["h"].astype(np.int64) * ready["w"] * ready["c"] + CROP_BYTES))

    # -- the one entry point ----------------------------------------------------------------------

    def fetch(self, model_id: str, frame: int, loader: Loader, want_background: bool = True,
              timeout_s: float = 60.0, out: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray, bool]:
        """(background copy or None, crop copy, hit) for a model's frame; on a miss `loader()` decodes
        it (in this process) and the result is shared with every other process. With `out`, the
        background is copied into it (and returned) instead of into a new array."""
        key = model_key(model_id)
        deadline = time.monotonic() + timeout_s
        while True:
            action, slot, gen = self._claim(key, frame)
            if action == "read":
                background, crop = self._copy(slot, want_background, out)
                if int(self._table[slot]["gen"]) == gen:
                    return background, crop, True
                continue  # evicted while we copied: look again
            if action == "load":
                background, crop, hit = self._load(slot, key, frame, loader, want_background)
                if out is not None and background is not None:
                    out[...] = background
                    background = out
                return background, crop, hit
            if time.monotonic() > deadline:
                raise StoreError(f"frame {frame} of model {model_id} stayed LOADING for {timeout_s:.0f}s "
                                 "in another process; is its storage slow?")
            time.sleep(_POLL_S)  # another process is decoding this very frame

    def has(self, model_id: str, frame: int) -> bool:
        """Whether a model's frame is in the store, decoded (it may be evicted right after)."""
        key = model_key(model_id)
        with self._locked():
            slot = self._find(key, frame)
            return slot is not None and self._table[slot]["state"] == READY

    def _find(self, key: int, frame: int) -> int | None:
        """The entry holding a model's frame (READY or LOADING), or None; under the lock."""
        table = self._table
        slot = self._hints.get((key, frame))
        if slot is not None:
            entry = table[slot]
            if entry["model"] == key and entry["frame"] == frame and entry["state"] != EMPTY:
                return slot
        hit = np.flatnonzero((table["model"] == key) & (table["frame"] == frame) & (table["state"] != EMPTY))
        return int(hit[0]) if hit.size else None

    def _hint(self, key: int, frame: int, slot: int) -> None:
        before = self._hints.get((key, frame))
        if before is not None and before != slot:
            del self._hinted[before]
        replaced = self._hinted.get(slot)
        if replaced is not None and replaced != (key, frame):
            del self._hints[replaced]
        self._hints[(key, frame)], self._hinted[slot] = slot, (key, frame)

    def _claim(self, key: int, frame: int) -> tuple[str, int, int]:
        with self._locked():
            table = self._table
            slot = self._find(key, frame)
            if slot is not None:
                self._hint(key, frame, slot)
                entry = table[slot]
                if entry["state"] == READY:
                    table["last"][slot] = time.monotonic()
                    table["uses"][slot] += 1
                    return "read", slot, int(entry["gen"])
                if _alive(int(entry["loader"])):
                    return "wait", slot, 0
                # The loading process died: take its claim over.
            else:
                slot = self._victim()
                if slot is None:
                    return "wait", -1, 0
                self._hint(key, frame, slot)
            table["model"][slot] = key
            table["frame"][slot] = frame
            table["state"][slot] = LOADING
            table["loader"][slot] = self._pid
            table["gen"][slot] += 1  # NOTE: before the bytes change, so a concurrent reader retries
            table["uses"][slot] = 1
            table["last"][slot] = time.monotonic()
            return "load", slot, 0

    def _victim(self) -> int | None:
        table = self._table
        empty = np.flatnonzero(table["state"] == EMPTY)
        if empty.size:
            return int(empty[0])
        ready = np.flatnonzero(table["state"] == READY)
        if not ready.size:
            return None  # every entry is being loaded right now: wait
        score = table["uses"][ready] if self.spec.eviction == "lfu" else table["last"][ready]
        return int(ready[np.argmin(score)])

    def _load(self, slot: int, key: int, frame: int, loader: Loader, want_background: bool):
        try:
            background, crop = loader()
            h, w = background.shape[:2]
            c = background.shape[2] if background.ndim == 3 else 1   # 1: an I420 frame, (h * 3 / 2, w)
            if w > self.spec.max_width or (h if c == 3 else h * 2 // 3) > self.spec.max_height:
                raise StoreError(f"background frame is {w}x{h if c == 3 else h * 2 // 3}, larger than "
                                 f"compositing.max_frame_width x max_frame_height ({self.spec.max_width}x"
                                 f"{self.spec.max_height}); raise them")
            row = self._data[slot]
            row[: h * w * c] = background.reshape(-1)
            row[h * w * c: h * w * c + CROP_BYTES] = crop.reshape(-1)
        except BaseException:
            with self._locked():
                if self._table["loader"][slot] == self._pid and self._table["state"][slot] == LOADING:
                    self._table["state"][slot] = EMPTY
            raise
        with self._locked():
            self._table["h"][slot] = h
            self._table["w"][slot] = w
            self._table["c"][slot] = c
            self._table["state"][slot] = READY
            self._decodes[0] += 1
        return (background if want_background else None), crop, False

    def _copy(self, slot: int, want_background: bool, out: np.ndarray | None = None):
        h, w, c = int(self._table["h"][slot]), int(self._table["w"][slot]), int(self._table["c"][slot])
        row = self._data[slot]
        background = None
        if want_background:
            stored = row[: h * w * c].reshape((h, w, 3) if c == 3 else (h, w))
            if out is None:
                background = stored.copy()
            else:
                out[...] = stored
                background = out
        crop = row[h * w * c: h * w * c + CROP_BYTES].reshape(328, 328, 3).copy()
        return background, crop


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
