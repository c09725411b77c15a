"""The compositing process: float32 mouths from an inference worker's output slot -> encoded frames.

Per task (frames [start, end) of one batch): convert the mouths to uint8 first, then check the slot's
generation (a slot freed by a timeout must not be composited as someone else's frames), then fetch
each background and crop from the shared store (decoding on a miss), paste, encode, and send the
encoded frames to the frontend in one multipart message.
"""

from __future__ import annotations

import logging
import time

import cv2
import zmq

from config import Config
from config.assets import AssetCache, AssetError
from cpu_actor.composite import encode, mouth_to_uint8, paste
from shm.child import child_main
from shm.endpoints import RunSpec, make_socket
from shm.messages import CompositeDone, CompositeTask, Shutdown, decode
from shm.messages import encode as encode_msg
from shm.ring import RingError, SlotRing, StaleHandle
from shm.store import BackgroundStore, StoreError

log = logging.getLogger(__name__)


class Compositor:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int):
        self.config, self.index = config, index
        self.device = "cpu"
        # NOTE: the pool of processes is the parallelism; cv2's own threads would oversubscribe cores.
        cv2.setNumThreads(1)
        self.tasks = make_socket(ctx, zmq.PULL, bind=run.endpoints.cpu[index])
        self.to_frontend = make_socket(ctx, zmq.PUSH, connect=run.endpoints.frontend)
        self.mouth_rings = {spec.name: SlotRing.attach(spec) for spec in run.output_rings}
        self.store = BackgroundStore.attach(run.store)
        self.assets = AssetCache(config)
        self._stopping = False
        self._preload = self._preload_frames(len(run.endpoints.cpu))

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        for ring in self.mouth_rings.values():
            ring.close()
        self.store.close()

    def _preload_frames(self, n_processes: int):
        """compositing.preload: this process's share (every n-th frame) of each listed model."""
        for model in self.config.compositing.preload:
            try:
                assets = self.assets.get(model)
            except AssetError as err:
                log.warning("compositing.preload: skipping %s: %s", model, err)
                continue
            for frame in range(self.index, assets.n_frames, n_processes):
                yield model, frame, assets

    def run(self) -> None:
        while not self._stopping:
            if not self.tasks.poll(0 if self._preload is not None else 1000):
                self._preload_one()
                continue
            msg = decode(self.tasks.recv())
            if isinstance(msg, CompositeTask):
                self._composite(msg)
            elif isinstance(msg, Shutdown):
                return

    def _preload_one(self) -> None:
        """Decode one preload frame between tasks, so preloading delays a request by one decode at most."""
        if self._preload is None:
            return
        item = next(self._preload, None)
        if item is None:
            self._preload = None
            return
        model, frame, assets = item
        try:
            self.store.fetch(model, frame, lambda: assets.decode(frame), want_background=False)
        except (AssetError, StoreError) as err:
            log.warning("compositing.preload: %s frame %d: %s", model, frame, err)

    def _reply(self, task: CompositeTask, frames=(), **fields) -> None:
        header = CompositeDone(req=task.req, compositor=self.index, start=task.start, end=task.end,
                               ok=not fields.get("code"), **fields)
        self.to_frontend.send_multipart([encode_msg(header), *frames], copy=False)

    def _composite(self, task: CompositeTask) -> None:
        t0 = time.perf_counter()
        if task.deadline and time.monotonic() > task.deadline:
            self._reply(task, code="timeout", message="the deadline passed before compositing started")
            return
        try:
            ring = self.mouth_rings[task.mouths.ring]
            mouths = ring.read(task.mouths)[task.start:task.end]
            mouths_u8 = [mouth_to_uint8(m) for m in mouths]
            ring.verify(task.mouths)
            assets = self.assets.get(task.model)
            encoded, hits = [], 0
            for frame, mouth in zip(task.frames, mouths_u8):
                background, crop, hit = self.store.fetch(task.model, frame, lambda f=frame: assets.decode(f))
                hits += hit
                image = paste(background, crop, mouth, assets.rects[frame])
                encoded.append(encode(image, task.format, task.quality))
        except StaleHandle as err:
            self._reply(task, code="timeout", message=f"request was cancelled before compositing ({err})")
            return
        except (AssetError, StoreError) as err:
            self._reply(task, code="bad_request", message=str(err))
            return
        except RingError as err:
            self._reply(task, code="internal", message=str(err))
            return
        self._reply(task, encoded, composite_ms=(time.perf_counter() - t0) * 1000, width=assets.width,
                    height=assets.height, hits=hits, misses=len(encoded) - hits)



def run_cpu_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("cpu", index, run, lambda ctx: Compositor(ctx, config, run, index))
