"""The one way every process shell over the engine carries out its actions and drains on shutdown.

The client frontend (frontend/server/) and the GPU host's bridge (frontend/bridge/) are both a
`Shell`: the actions that touch inference workers (write a request's inputs and send its task, send a
control message, free a slot) are carried out here, the same for both; what differs (sending a
compositor its work, freeing compositors' frames, which only the frontend has) is theirs. A request
ends through its own `Work` (core/request.py): `Done` and `Fail` call it.

Shutdown is the same too: `start_draining` (SIGTERM) stops new work; `drain_step` is called from the
shell's loop until the work in flight has ended, or until `supervisor.shutdown_timeout_s`, when
everything left is answered `unavailable` at once (never left to a client's or an edge's timeout).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

from frontend.core.request import Request
from frontend.core.scheduler import Dispatch, Done, Fail, FreeImages, ReleaseOutput, Render, Scheduler, SendWorker
from frontend.core.slots import write_inputs
from shm.codes import ErrorCode
from shm.messages import InferTask, ReleaseTask, pack
from shm.requests import first_id
from shm.ring import SlotRing

log = logging.getLogger(__name__)
SHUTDOWN_MESSAGE = "the server is shutting down; retry on another server"


def first_request_id(owner: int = 0) -> int:
    """The first request id of a shell process (frontend `owner`, a GPU host's bridge) starting now: this
    host's monotonic clock in microseconds, under the owner's bits (shm/requests.py). The shell it replaces
    began at an earlier microsecond and used fewer ids than microseconds went by (a million requests a
    second is far past any), so every id of the new shell is above every id of the old: a worker's answer
    to a dead shell's request can never be taken for the answer to a new one (the workers drop what the
    old held: ResetRequests.floor)."""
    return first_id(owner, time.monotonic_ns() // 1000)


class Shell:
    """Subclasses implement, where compositors exist, `render` and `free_images`; a request ends through
    the work it carries (`Request.work`), which `done` and `fail` call."""

    def __init__(self, engine: Scheduler, to_gpu: Sequence, input_rings: Sequence[SlotRing], shutdown_timeout_s: float):
        self.engine, self.to_gpu, self.input_rings = engine, to_gpu, input_rings
        self.first_req = engine.first_id   # what the supervisor is told at start (shm/messages Ready)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.draining = False
        self._drain_until = float("inf")

    # -- the engine's actions -------------------------------------------------------------------

    def apply(self, actions: list) -> None:
        for action in actions:
            try:
                self._carry_out(action)
            except Exception as err:  # a bug in carrying one out must not skip the others
                log.exception("carrying out %s failed", type(action).__name__)
                why = f"{type(err).__name__}: {err}"
                if isinstance(action, Dispatch):
                    self.apply(self.engine.fail(action.request.req, ErrorCode.INTERNAL, why))
                elif isinstance(action, Done):
                    r = action.request
                    self.free_images(r.req, r.image_slots)
                    self.fail(Fail(r, ErrorCode.INTERNAL, f"building the reply failed: {why}"))
        self.applied()

    def _carry_out(self, action) -> None:
        if isinstance(action, Dispatch):
            self.dispatch(action)
        elif isinstance(action, SendWorker):
            self.to_gpu[action.worker].send(pack(action.message))
        elif isinstance(action, ReleaseOutput):
            self.to_gpu[action.worker].send(pack(ReleaseTask(req=action.req)))
        elif isinstance(action, FreeImages):
            self.free_images(action.req, [action.compositor])
        elif isinstance(action, Render):
            self.render(action)
        elif isinstance(action, Done):
            self.done(action.request)
        elif isinstance(action, Fail):
            self.fail(action)

    def dispatch(self, action: Dispatch) -> None:
        """Write the request's inputs into the slots it holds in its worker's input ring, send the task."""
        r = action.request
        inputs = r.inputs
        visual, audio, shape = inputs.arrays(r.batch)
        visual_ref, audio_ref = write_inputs(self.input_rings[action.worker], r.req, visual, audio, shape)
        inputs.visual = inputs.audio = None   # in the slot now: the received buffers can go
        self.to_gpu[action.worker].send(pack(InferTask(
            req=r.req, model=inputs.model, batch=r.batch, audio=audio_ref, visual=visual_ref, frames=inputs.frames,
            plan=action.plan, format=inputs.format or "jpeg", quality=inputs.quality or 75, deadline=r.deadline,
            enqueued=inputs.enqueued or time.monotonic(), version=inputs.version, rows=inputs.rows,
            utterance=inputs.utterance[:200], first_input=inputs.first_input, due=inputs.due,
            client=r.client_no)))

    def applied(self) -> None:
        """After every batch of actions (the frontend re-arms its deadline timer here)."""

    def done(self, r: Request) -> None:
        r.work.done(r)

    def fail(self, action: Fail) -> None:
        action.request.work.failed(action.request, action.code, action.message)

    def render(self, action: Render) -> None:
        """Send the compositor the message its work built (`RenderWork.message`)."""
        raise RuntimeError("this process has no compositors to render on")

    def free_images(self, req: int, compositors) -> None:
        """Raw frames held in compositors' image rings; a process without compositors holds none."""

    # -- draining -------------------------------------------------------------------------------

    def start_draining(self, now: float) -> None:
        if not self.draining:
            self.draining = True
            self._drain_until = now + self.shutdown_timeout_s
            log.info("draining: %d request(s) in flight, at most %g s (supervisor.shutdown_timeout_s)",
                     len(self.engine.table), self.shutdown_timeout_s)

    def drain_due(self) -> Optional[float]:
        """When the drain ends at the latest (a shell's loop wakes for it); None when not draining."""
        return self._drain_until if self.draining else None

    def drain_step(self, now: float, message: Optional[str] = None) -> bool:
        """True once drained: nothing in flight, or the deadline passed and what was left has been
        answered `unavailable`."""
        if len(self.engine.table) and now < self._drain_until:
            return False
        self.apply(self.engine.shutdown(message or SHUTDOWN_MESSAGE))
        return True
