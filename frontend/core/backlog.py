"""What each client connection has not read yet: the bound on a client that stops reading.

libzmq queues a ROUTER's replies per connection until the peer reads them; with no bound, a client
that stops reading grows the frontend's memory without limit. Every reply to a connection is sent
with a MessageTracker; its bytes count as that connection's backlog until libzmq lets go of them
(written to the socket, or dropped when the connection closed). A reply that would take the backlog
past `limits.max_client_backlog_bytes` is dropped instead (one reply always goes to an idle
connection, however large). Checked lazily, when the next reply to that connection is sent:
no timer per reply.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Optional


class Backlog:
    def __init__(self) -> None:
        self.bytes = 0
        self._sent: deque[list] = deque()   # [tracker or None (still being queued), nbytes]

    def settle(self) -> int:
        """Forget what has left; return the bytes still queued."""
        while self._sent and self._sent[0][0] is not None and self._sent[0][0].done:
            self.bytes -= self._sent.popleft()[1]
        return self.bytes

    def add(self, nbytes: int) -> list:
        entry = [None, nbytes]
        self._sent.append(entry)
        self.bytes += nbytes
        return entry


class Backlogs:
    """Per connection (ROUTER index, fd); forgotten when the connection closes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_conn: dict[Hashable, Backlog] = {}

    def admit(self, conn: Optional[Hashable], nbytes: int) -> Optional[list]:
        """An entry to attach the send's tracker to, or None: drop the reply (the backlog is full).
        Connections without a file descriptor (inproc) are not bounded: their entry is a dummy."""
        if conn is None:
            return [None, nbytes]
        backlog = self._by_conn.setdefault(conn, Backlog())
        queued = backlog.settle()
        if queued and queued + nbytes > self.limit:
            return None
        return backlog.add(nbytes)

    def queued(self, conn: Optional[Hashable]) -> int:
        backlog = self._by_conn.get(conn)
        return backlog.settle() if backlog is not None else 0

    def closed(self, conn: Hashable) -> None:
        self._by_conn.pop(conn, None)

    def total(self) -> int:
        return sum(b.settle() for b in self._by_conn.values())
