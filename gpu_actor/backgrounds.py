"""An avatar's background crops decoded off the inference worker's main thread.

An audio-only task's visual input is built from its frames' 328x328 crops in the shared store
(shm/store.py). A frame not there yet is decoded from the avatar's files, 10-30 ms at 720p, and a new
avatar's first speech needs a frame per 40 ms: decoded on the main thread, that would hold every
session's step up behind one avatar's first words. So the worker asks `ready` before it runs a task: the
frames missing from the store start decoding on threads of their own (each frame once), the task waits
in the queue meanwhile, the steps run the tasks that are ready, and a finished decode wakes the loop.

The threads use a store mapping of their own: the store's lock is an flock, which does not exclude two
threads holding the same open file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from config.assets import AvatarAssets
from shm.store import BackgroundStore, StoreSpec

log = logging.getLogger(__name__)
THREADS = 2          # decoding releases the GIL (OpenCV): frames of a new avatar decode side by side
KNOWN_MAX = 65536    # frames remembered as in the store; past it the memory starts over (they are probed again)


class Backgrounds:
    def __init__(self, spec: StoreSpec, probe: BackgroundStore, wake: Callable[[], None], threads: int = THREADS):
        """`probe`: the main thread's own store mapping, asked whether a frame is there; `wake()`: called
        (from a decoding thread) when a frame is in."""
        self._probe, self._wake = probe, wake
        self._store = BackgroundStore.attach(spec)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="backgrounds")
        self._lock = threading.Lock()
        self._known: set[tuple[str, int]] = set()     # (store id, frame) seen in the store (main thread)
        self._decoding: set[tuple[str, int]] = set()  # submitted, not done (both sides, under the lock)
        self._failed: set[tuple[str, int]] = set()    # failed to decode (both sides, under the lock)
        self.decoded = 0                              # frames these threads decoded (stats, tests)

    def ready(self, assets: AvatarAssets, frames: Iterable[int]) -> bool:
        """(The main thread) whether every one of `frames` is in the store; each missing one starts
        decoding, once. A frame that failed to decode counts as ready from then on: each task's own fetch
        tries it again, and meets the error (AssetError, StoreError) and is answered with it, or, the
        error having passed, serves. (An avatar's files fixed on disk come back as another version,
        under another store id.)"""
        sid = assets.store_id
        missing = [f for f in dict.fromkeys(frames) if (sid, f) not in self._known]
        if not missing:
            return True
        if len(self._known) > KNOWN_MAX:
            self._known.clear()
            with self._lock:
                self._failed.clear()
        ready = True
        for frame in missing:
            key = (sid, frame)
            with self._lock:
                if key in self._decoding:
                    ready = False
                    continue
                if key in self._failed:
                    continue
            if self._probe.has(sid, frame):
                self._known.add(key)
                continue
            with self._lock:
                self._decoding.add(key)
            self._pool.submit(self._decode, assets, frame)
            ready = False
        return ready

    def _decode(self, assets: AvatarAssets, frame: int) -> None:
        failed = False
        try:
            _, _, hit = self._store.fetch(assets.store_id, frame, lambda: assets.decode(frame), want_background=False)
            if not hit:
                self.decoded += 1
        except Exception as err:   # the task's own fetch meets it again, and answers with it
            failed = True
            log.info("background frame %d of %s: %s", frame, assets.model_id, err)
        finally:
            with self._lock:
                self._decoding.discard((assets.store_id, frame))
                if failed:   # NOTE: else each ask of the task decodes it again, until the task's deadline
                    self._failed.add((assets.store_id, frame))
            self._wake()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._store.close()
