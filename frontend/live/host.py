"""What live sessions need from the process that hosts them (the client-facing server), and nothing
more: they never hold the host itself, so they can be driven by a test's own host with no sockets."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from frontend.core.request import Request


class Host(Protocol):
    def submit(self, request: Request) -> None:
        """Hand a request to the engine (its end comes back through Live.done / Live.failed)."""

    def unpin(self, worker: int, model: str) -> None:
        """A session's model need no longer stay loaded on `worker`."""

    def compositors(self) -> Sequence:
        """Each compositing process's state (`.ready`), by index."""

    def send(self, reply_to: Any, header: bytes, data: list = (), req: int = 0, image_slots=(),
             also: Optional[list] = None) -> bool:
        """Send a message to a client; False if its unread backlog is full (the message is dropped)."""

    def free_images(self, req: int, compositors) -> None:
        """Free the raw frames a request holds in these compositors' image rings."""

    def close_encoder(self, compositor: int, session: str) -> None:
        """Close an H.264 session's encoder in its compositing process."""


class OpenCall(Protocol):
    """The session_open request a session keeps: its header, its model's spec, where frames go."""

    header: Any
    spec: Any
    reply_to: Any
