"""The compositing process: float32 mouths from an inference worker's output slot -> encoded frames.

Per task (frames [start, end) of one batch): convert the mouths to uint8 first, then check the slot's
generation (a slot freed by a timeout must not be composited as someone else's frames), then fetch
each background and crop from the shared store (decoding on a miss), paste, encode, and send the
encoded frames to the frontend in one multipart message.

Raw frames are composited straight into a slot of this process's image ring (the background copy
that compositing needs anyway lands there): the frontend sends them to the client from shared memory
without a copy and returns the slot with ReleaseImages once ZeroMQ is done with the bytes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque

import cv2
import msgspec
import numpy as np
import zmq

from config import Config
from config.assets import AssetCache, AssetError
from cpu_actor.composite import RAW_I420, encode_image, mouth_to_uint8, paste
from cpu_actor.h264 import MAX_SESSION_FPS, Encoders, KeptBoxes, apply_box, encode_frame, open_encoder, pack_box, to_i420
from cpu_actor.jpeg import RowSplicer
from shm.child import child_main
from shm.codes import ErrorCode
from shm.endpoints import Owners, RunSpec, make_socket
from shm.messages import (CloseEncoder, CompositeDone, CompositeTask, EncodeFrames, EncodeLoop, EncodeSession,
                          ReleaseImages, RenderIdle, ResetRequests, pack, unpack)
from shm.requests import Floors, same_owner_below
from shm.ring import RingError, RingFull, SlotRing, StaleHandle
from shm.store import BackgroundStore, StoreError

log = logging.getLogger(__name__)


class DueQueue:
    """A compositing process's tasks (CompositeTask, RenderIdle, EncodeFrames), the one due soonest first:
    a live frame's due time, else the deadline (batch work, idle renders without a live frame); in arrival
    order among equals, which keeps a session's encodes in order. So a live frame waits for the task
    being run, never for batch work queued before it."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, object]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, task) -> None:
        heapq.heappush(self._heap, (task.due or task.deadline, next(self._arrivals), task))

    def pop(self):
        return heapq.heappop(self._heap)[2]

    def drop_below(self, floor: int) -> None:
        """A restarted frontend's predecessor's tasks go (ResetRequests)."""
        self._heap = [entry for entry in self._heap if not same_owner_below(entry[2].req, floor)]
        heapq.heapify(self._heap)


class Compositor:
    def __init__(self, ctx: zmq.Context, config: Config, run: RunSpec, index: int):
        self.config, self.index = config, index
        self.device = "cpu"
        # NOTE: the pool of processes is the parallelism; cv2's own threads would oversubscribe cores.
        cv2.setNumThreads(1)
        self.tasks = make_socket(ctx, zmq.PULL, bind=run.endpoints.cpu[index])
        self.to_frontend = Owners(ctx, run.endpoints.frontend)
        self.mouth_rings = {spec.name: SlotRing.attach(spec) for spec in run.output_rings}
        self.images = SlotRing.attach(run.image_rings[index], populate=False)
        self.images.become_writer()
        self.queue = DueQueue()
        self._floors = Floors()   # a dead frontend's request ids (ResetRequests)
        self.store = BackgroundStore.attach(run.store)
        self.assets = AssetCache(config)
        self.splicer = RowSplicer(config.compositing.jpeg_cache_bytes)
        self.encoders = Encoders()            # live H.264 sessions pinned to this process
        # ... their speech's face boxes: the frontend has boxes kept for frames needed within the latency
        # budget; room for four times that at a session's highest rate (boxes left by interrupts and late
        # frames until the session's next frame drops them)
        self.kept = KeptBoxes(4 * math.ceil(config.sessions.latency_budget_ms / 1000 * MAX_SESSION_FPS) + 1)
        self.loops: deque = deque()           # EncodeLoop tasks in progress: (task, encoder, access units so far)
        self._scratch = None                  # the I420 frame being encoded
        self._stopping = False
        self._preload = self._preload_frames(len(run.endpoints.cpu))

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        for ring in [*self.mouth_rings.values(), self.images]:
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
        handlers = {CompositeTask: self._composite, RenderIdle: self._render_idle, EncodeFrames: self._encode}
        while not self._stopping:
            # NOTE: every message waiting is taken before each task is chosen, so a live frame that
            # came in meanwhile goes before work due later. An idle loop frame after each task: loops
            # are short, and until one is whole its sessions encode every silent frame themselves.
            if self.queue:
                self._drain()
                task = self.queue.pop()
                handlers[type(task)](task)
                if self.loops:
                    self._loop_step()
            elif self.tasks.poll(0 if self._preload is not None or self.loops else 1000):
                self._drain()
            elif self.loops:
                self._loop_step()   # one frame of an idle loop between tasks: a live frame waits one encode at most
            else:
                self._preload_one()
                self.encoders.expire()
                self.kept.expire()

    def _drain(self) -> None:
        """Take every message waiting, so that the most urgent task is chosen among all of them."""
        while True:
            try:
                self._dispatch(unpack(self.tasks.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, (CompositeTask, RenderIdle, EncodeFrames)):
            if self._floors.gone(msg.req):   # a dead frontend's, read after the reset
                return
            self.queue.push(msg)
        elif isinstance(msg, EncodeLoop):
            self.loops.append((msg, None, []))
        elif isinstance(msg, CloseEncoder):
            self.encoders.close(msg.session)
            self.kept.drop(msg.session)
        elif isinstance(msg, ReleaseImages):
            self.images.release_request(msg.req)
        elif isinstance(msg, ResetRequests):   # a new frontend: its predecessor's requests are gone
            self._floors.raise_to(msg.floor)
            self.queue.drop_below(msg.floor)
            self.images.release_below(msg.floor)

    def _wait_for_release(self, remaining_s: float) -> None:
        """Every image slot is out with the frontend: keep taking messages until one comes back."""
        if self.tasks.poll(int(remaining_s * 1000) + 1):
            self._dispatch(unpack(self.tasks.recv()))

    def _preload_one(self) -> None:
        """Decode one preload frame between tasks, so preloading delays a request by one decode at most."""
        if self._preload is None:
            return
        item = next(self._preload, None)
        if item is None:
            self._preload = None
            if self.config.compositing.preload:
                log.info("compositing.preload: done, this process's share of %s is in the store",
                         ", ".join(self.config.compositing.preload))
            return
        model, frame, assets = item
        try:
            self.store.fetch(assets.store_id, frame, lambda: assets.decode(frame), want_background=False)
        except Exception as err:  # a broken avatar must not crash-loop the compositors
            log.warning("compositing.preload: %s frame %d: %s", model, frame, err)

    def _reply(self, task: CompositeTask, frames=(), **fields) -> None:
        header = CompositeDone(req=task.req, compositor=self.index, start=task.start, end=task.end,
                               ok=not fields.get("code"), **fields)
        self.to_frontend.send_multipart(header.req, [pack(header), *frames], copy=False)

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
            assets = self.assets.get(task.model, task.version)
            assets.check_frames(task.frames)
            targets, images = self._targets(task, assets.height, assets.width)
            encoded, hits = [], 0
            for i, (frame, mouth) in enumerate(zip(task.frames, mouths_u8)):
                if task.format == "i420":   # an H.264 session's frame: only its face box, in I420 (cpu_actor/h264.py)
                    i420, crop, hit = self._i420(assets, frame)
                    hits += hit
                    box = pack_box(i420, assets.width, assets.height, crop, mouth, assets.rects[frame])
                    if task.keep is not None:   # for this process's own encoder of that session
                        self.kept.put(*task.keep[i], box)
                        box = b""
                    encoded.append(box)
                    continue
                if task.format == RAW_I420:   # a whole raw I420 frame: the same box, written into the background
                    i420, crop, hit = self._i420(assets, frame)
                    hits += hit
                    box = pack_box(i420, assets.width, assets.height, crop, mouth, assets.rects[frame])
                    apply_box(i420, assets.width, assets.height, box)
                    encoded.append(memoryview(i420).cast("B"))
                    continue
                background, crop, hit = self.store.fetch(assets.store_id, frame, lambda f=frame: assets.decode(f),
                                                         out=None if targets is None else targets[i])
                hits += hit
                if task.format == "jpeg":   # only the rows under the face box are encoded (cpu_actor/jpeg.py)
                    key = (assets.store_id, frame, task.quality)
                    self.splicer.remember(key, background, task.quality)
                    image = paste(background, crop, mouth, assets.rects[frame])
                    _, y1, _, y2 = (int(v) for v in assets.rects[frame])
                    encoded.append(self.splicer.encode(key, image, y1, y2, task.quality))
                    continue
                image = paste(background, crop, mouth, assets.rects[frame])
                if targets is None:
                    encoded.append(encode_image(image, task.format, task.quality))
        except StaleHandle as err:
            self.images.release_request(task.req)
            self._reply(task, code="timeout", message=f"request was cancelled before compositing ({err})")
            return
        except (AssetError, StoreError) as err:
            self.images.release_request(task.req)
            self._reply(task, code="bad_request", message=str(err))
            return
        except RingFull as err:
            self._reply(task, code="timeout", message=str(err))
            return
        except RingError as err:
            self._reply(task, code="internal", message=str(err))
            return
        except Exception as err:  # a bug or a file nobody foresaw: fail this request, keep the process
            log.exception("compositing model %s failed", task.model)
            self.images.release_request(task.req)
            self._reply(task, code="internal", message=f"compositing model {task.model} failed: "
                        f"{type(err).__name__}: {err}")
            return
        self._reply(task, encoded, composite_ms=(time.perf_counter() - t0) * 1000, width=assets.width,
                    height=assets.height, hits=hits, misses=len(task.frames) - hits, images=images)

    def _render_idle(self, task: RenderIdle) -> None:
        """Background frames encoded as they are: a live session's idle frames."""
        t0 = time.perf_counter()
        reply = CompositeDone(req=task.req, compositor=self.index, start=0, end=len(task.frames), ok=True)
        try:
            assets = self.assets.get(task.model, task.version)
            assets.check_frames(task.frames)
            encoded, hits = [], 0
            for frame in task.frames:
                if task.format == RAW_I420:
                    i420, _, hit = self._i420(assets, frame)
                    hits += hit
                    encoded.append(memoryview(i420).cast("B"))
                    continue
                background, _, hit = self.store.fetch(assets.store_id, frame, lambda f=frame: assets.decode(f))
                hits += hit
                encoded.append(encode_image(background, task.format, task.quality))
        except (AssetError, StoreError) as err:
            reply = msgspec.structs.replace(reply, ok=False, code=ErrorCode.BAD_REQUEST, message=str(err))
            self.to_frontend.send(reply.req, pack(reply))
            return
        except Exception as err:  # never fatal: this request fails, the process serves on
            log.exception("encoding idle frames of model %s failed", task.model)
            reply = msgspec.structs.replace(reply, ok=False, code=ErrorCode.INTERNAL,
                                            message=f"{type(err).__name__}: {err}")
            self.to_frontend.send(reply.req, pack(reply))
            return
        reply = msgspec.structs.replace(reply, composite_ms=(time.perf_counter() - t0) * 1000, width=assets.width,
                                        height=assets.height, hits=hits, misses=len(task.frames) - hits)
        self.to_frontend.send_multipart(reply.req, [pack(reply), *encoded], copy=False)

    def _i420(self, assets, frame: int, scratch: bool = False):
        """(I420 background copy, crop copy, hit): converted once per frame, kept in the shared store.
        With `scratch`, the copy lands in this process's one reusable frame buffer (libx264 copies
        what it encodes, so the buffer is free again once a frame is encoded)."""
        def load():
            # NOTE: through the store's BGR entry: decoded once for both copies, and the crop the
            # inference workers read is in the store before an H.264 session's first speech needs it
            background, crop, _ = self.store.fetch(assets.store_id, frame, lambda: assets.decode(frame))
            return to_i420(background), crop
        out = None
        if scratch:
            shape = (assets.height * 3 // 2, assets.width)
            if self._scratch is None or self._scratch.shape != shape:
                self._scratch = np.empty(shape, np.uint8)
            out = self._scratch
        return self.store.fetch(assets.store_id + "#i420", frame, load, out=out)

    def _encode(self, task: EncodeFrames) -> None:
        """Live H.264 sessions' frames, each session's in order with its own encoder. A session whose
        frames fail loses them (its next frames start a new encoder); the others' go on."""
        t0 = time.perf_counter()
        units: list = []
        lost: dict[int, str] = {}
        for i, part in enumerate(task.sessions):
            if time.monotonic() > part.deadline:   # given up already: encoding it would only delay the next
                lost[i] = "the deadline passed before encoding started"
                units += [b""] * len(part.items)
                continue
            try:
                units += self._encode_session(part)
            except Exception as err:   # the session's next frames start a new encoder
                self.encoders.close(part.session)
                if not isinstance(err, (AssetError, StoreError, ValueError, BoxGone)):
                    log.exception("encoding a frame of session %s failed", part.session)
                lost[i] = f"encoding H.264 for model {part.model}: {err}"
                units += [b""] * len(part.items)
        self.to_frontend.send_multipart(task.req, [pack(CompositeDone(
            req=task.req, compositor=self.index, start=0, end=len(units), ok=True, lost=lost,
            composite_ms=(time.perf_counter() - t0) * 1000)), *units], copy=False)

    def _encode_session(self, part: EncodeSession) -> list:
        assets = self.assets.get(part.model, part.version)
        assets.check_frames([item.frame for item in part.items])
        ctx, _ = self.encoders.get(part.session, assets.width, assets.height, part.settings)
        units = []
        for item in part.items:
            i420, _, _ = self._i420(assets, item.frame, scratch=True)
            box = item.box if item.kept < 0 else self.kept.take(part.session, item.kept)
            if box is None:   # (this process restarted since): the frames are lost, the next is an IDR
                raise BoxGone(f"the face box of frame {item.kept} is not kept here (any more)")
            if box:
                apply_box(i420, assets.width, assets.height, box)
            units.append(encode_frame(ctx, i420, item.index, item.idr))
        return units

    def _loop_step(self) -> None:
        """Encode the next frame of the oldest idle-loop task; reply when it is whole."""
        task, ctx, units = self.loops[0]
        try:
            assets = self.assets.get(task.model, task.version)
            if ctx is None:
                assets.check_frames(task.frames)
                ctx = open_encoder(assets.width, assets.height, task.settings)
                self.loops[0] = (task, ctx, units)
            i420, _, _ = self._i420(assets, task.frames[len(units)], scratch=True)
            units.append(encode_frame(ctx, i420, len(units), not units))
        except Exception as err:
            self.loops.popleft()
            if not isinstance(err, (AssetError, StoreError, ValueError)):
                log.exception("encoding the idle loop of model %s failed", task.model)
            self.to_frontend.send(task.req, pack(CompositeDone(
                req=task.req, compositor=self.index, start=0, end=len(task.frames), ok=False,
                code=ErrorCode.BAD_REQUEST, message=f"encoding the idle loop of model {task.model}: {err}")))
            return
        if len(units) == len(task.frames):
            self.loops.popleft()
            done = CompositeDone(req=task.req, compositor=self.index, start=0, end=len(units), ok=True,
                                 width=assets.width, height=assets.height)
            self.to_frontend.send_multipart(done.req, [pack(done), *units], copy=False)

    def _targets(self, task: CompositeTask, height: int, width: int):
        """Raw format: (writable frames in an image slot, their handle); else (None, None)."""
        if task.format != "raw":
            return None, None
        shape = (len(task.frames), height, width, 3)
        timeout = max(task.deadline - time.monotonic(), 0.001) if task.deadline else 30.0
        slot = self.images.acquire(task.req, timeout, self._wait_for_release, setting="shm.slots")
        return self.images.writable(slot, 0, "uint8", shape), self.images.ref(slot, 0, "uint8", shape)



class BoxGone(LookupError):
    """An encode request names a face box this process does not keep."""


def run_cpu_process(config: Config, run: RunSpec, index: int) -> None:
    child_main("cpu", index, run, lambda ctx: Compositor(ctx, config, run, index))
