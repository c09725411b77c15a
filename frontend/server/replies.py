"""How a reply leaves the client-facing process: one non-blocking send on the client's ROUTER, bounded
by the connection's unread backlog (limits.max_client_backlog_bytes, limits.max_backlog_bytes), large
parts without a copy, and the raw frames a reply carries straight from the compositors' image rings,
whose slots are freed once ZeroMQ has let go of the bytes.

Every reply and live frame of the process goes through `Replies.send`; what a reply says is its
call's (server/calls.py) or live/'s. The replies of one pass of the event loop (a pacer tick's frames
for every session, the answers to a burst of requests) leave together at its end, back to back: a
send that finds libzmq's I/O thread asleep wakes it (another thread, often another core, and on a
virtual machine the dearest thing a send does), and sends in a row find it awake.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import zmq

from frontend.core.backlog import Backlogs
from frontend.server.calls import ReplyTo
from lipsync_client import protocol as P
from shm.codes import ErrorCode
from shm.messages import ReleaseImages, pack

log = logging.getLogger(__name__)
TRACKER_POLL_S = 0.002
SENT = type("Sent", (), {"done": True})()   # the tracker of a message that has left (copied) or failed
ZERO_COPY_BYTES = 64 * 1024   # smaller message parts are copied (pyzmq's own threshold)


class Replies:
    """`readable`: each client ROUTER's reader (server/process.Reader), woken again after a pass of
    sends (`_end_of_pass`)."""

    def __init__(self, backlogs: Backlogs, metrics, to_cpu: Sequence, readable: dict):
        self.backlogs, self.metrics, self.to_cpu, self.readable = backlogs, metrics, to_cpu, readable
        self._out: list[tuple] = []   # admitted, to send at the end of this pass of the loop (`flush`)
        self._flush_due = False

    def send(self, reply_to: ReplyTo, header: bytes, data: list = (), req: int = 0, image_slots=(),
             also: Optional[list] = None) -> bool:
        """Send a reply (at the end of this pass of the loop) unless the connection's unread backlog is
        full (then drop it and return False). Raw frames leave from the image ring without a copy, except
        to a connection with a backlog: those are copied first, so a client that stops reading pins no
        image slot for long."""
        nbytes = len(header) + sum(map(_nbytes, data))
        entry = self.backlogs.admit(reply_to.conn, nbytes)
        if entry is None:
            self.metrics.replies_dropped.inc()
            log.warning("dropped a reply of %d bytes: the client has %d bytes unread (limits.max_client_backlog_bytes), "
                        "all clients %d (limits.max_backlog_bytes)", nbytes, self.backlogs.queued(reply_to.conn),
                        self.backlogs.total())
            self.metrics.backlog_bytes.set(self.backlogs.total())
            self.free_images(req, image_slots)
            return False
        if image_slots and self.backlogs.queued(reply_to.conn) > nbytes:   # it was not idle
            data = [bytes(d) for d in data]
            self.free_images(req, image_slots)
            image_slots = ()
        # (its entry counts the bytes as queued until `flush` gives it the send's tracker)
        self._out.append((reply_to.sock, (*reply_to.peer[1], header, *data), entry, also, req, image_slots))
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._end_of_pass)
        return True

    def _end_of_pass(self) -> None:
        self.flush()
        # NOTE: a send may take the socket's edge-triggered fd event for a request that came in
        # meanwhile: look once more after a pass of sends, so that its reader is not left waiting.
        for reader in self.readable.values():
            reader.wake()

    def flush(self) -> None:
        """Send the replies admitted so far, in order."""
        self._flush_due = False
        out, self._out = self._out, []
        for sock, parts, entry, also, req, image_slots in out:
            try:
                tracker = send_parts(sock, parts)
            except zmq.ZMQError as err:
                log.error("sending a reply failed: %s", err)
                tracker = SENT
            entry[0] = tracker
            if also is not None:   # another bound counts this message too (a session's queued frames)
                also[0] = tracker
            if image_slots:
                self._release_when_sent(tracker, req, set(image_slots))

    def error(self, reply_to: ReplyTo, request_id, code: ErrorCode, message: str,
              retry_after_s: Optional[float] = None) -> None:
        self.send(reply_to, P.error_reply(request_id, ErrorCode(code), message, retry_after_s))

    def free_images(self, req: int, compositors) -> None:
        for j in compositors:
            self.to_cpu[j].send(pack(ReleaseImages(req=req)))

    def _release_when_sent(self, tracker, req: int, compositors: set[int]) -> None:
        """Raw frames leave straight from the compositors' image rings: free the slots once ZeroMQ
        has let go of the bytes (its MessageTracker), not before."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if tracker.done:
                self.free_images(req, compositors)
            else:
                loop.call_later(TRACKER_POLL_S, check)

        check()


_MORE, _LAST = int(zmq.NOBLOCK) | int(zmq.SNDMORE), int(zmq.NOBLOCK)   # ints: no enum arithmetic per part
# NOTE: pyzmq's own send, under the Python-level wrapper of zmq.Socket (which only adds the draft
# routing_id and group arguments): every part of every reply and frame goes through it.
_send = zmq.backend.Socket.send


def _nbytes(part) -> int:
    # (bytes, most parts: routing ids, headers, frames, without a memoryview each)
    return len(part) if type(part) is bytes else memoryview(part).nbytes


def send_parts(sock: zmq.Socket, parts: tuple):
    """Send one message without blocking (a ROUTER never blocks: a peer past its high-water mark loses
    it). Small parts are copied; large ones leave without a copy, and the returned tracker covers
    every one of them (send_multipart tracks the last part only, which may be a small one)."""
    trackers = []
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = _MORE if i < last else _LAST
        if isinstance(part, zmq.Frame):
            # NOTE: pyzmq cannot track a received (untracked) frame: send its buffer instead (still no
            # copy; the memoryview keeps the received frame alive)
            part = part.buffer
        if _nbytes(part) < ZERO_COPY_BYTES:
            _send(sock, part, flags, True)
        else:
            trackers.append(_send(sock, part, flags, False, True))
    if not trackers:
        return SENT
    return trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers)
