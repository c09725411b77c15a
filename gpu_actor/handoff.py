"""What an inference worker, local or a GPU host's forwarder (gpu_actor/worker.py, gpu_actor/remote.py),
does alike: route each message from the frontend to its handler by type, and hand a finished batch on (an
output slot for its mouths, then each chunk to the compositing process the frontend planned for it)."""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from config.geometry import MOUTH_BYTES
from shm.messages import CompositeTask, InferTask, pack, unpack
from shm.ring import SlotRing, TensorRef

log = logging.getLogger(__name__)


def route(handlers: dict[type, Callable[[object], None]], msg: object, who: str) -> None:
    """Handle `msg` with its type's handler; a type with none (a message of another role's: a bug in the
    sender, never this process's end) is logged and dropped."""
    handler = handlers.get(type(msg))
    if handler is None:
        log.warning("%s: no handler for %s", who, type(msg).__name__)
        return
    handler(msg)


def mouth_slots(outputs: SlotRing, frames: int) -> int:
    """The output slots `frames` frames' mouths take (a slot holds one frame's)."""
    return outputs.slots_for(frames * MOUTH_BYTES)


def acquire_slot(outputs: SlotRing, req: int, frames: int, timeout_s: float, tasks: zmq.Socket,
                 handle: Callable[[object], None]) -> int:
    """The first of the output slots (one frame's mouths each) of request `req`'s `frames`. While they
    are taken, the worker keeps handling its task socket's messages (`handle`): a ReleaseTask frees some.
    RingError past `timeout_s`."""
    def wait(remaining_s: float) -> None:
        if tasks.poll(int(remaining_s * 1000) + 1):
            handle(unpack(tasks.recv()))
    return outputs.acquire(req, timeout_s=timeout_s, wait=wait, count=mouth_slots(outputs, frames))


def hand_off(to_cpu: list[zmq.Socket], task: InferTask, worker: int, mouths: TensorRef) -> None:
    """Send each chunk of a finished batch to the compositing process the frontend planned for it."""
    for chunk in task.plan:
        to_cpu[chunk.compositor].send(pack(CompositeTask(
            req=task.req, model=task.model, worker=worker, mouths=mouths, start=chunk.start, end=chunk.end,
            frames=task.frames[chunk.start:chunk.end], format=task.format, quality=task.quality,
            deadline=task.deadline, version=task.version, due=task.due, keep=chunk.keep)))
