"""What each client connection has not read yet: the bound on a client that stops reading.

libzmq queues a ROUTER's replies per connection until the peer reads them; with no bound, a client
that stops reading grows the frontend's memory without limit. Every reply to a connection is sent
with a MessageTracker; its bytes count as that connection's backlog until libzmq lets go of them
(written to the socket, or dropped when the connection closed). A reply that would take the backlog
past `limits.max_client_backlog_bytes` is dropped instead (one reply always goes to an idle
connection, however large), and so is one that would take all connections' unread bytes together
past `limits.max_backlog_bytes` (a hundred clients that stop reading must not hold a hundred times
the first bound). Checked lazily, when the next reply to that connection is sent: no timer per
reply; the total is settled over every connection only when it looks full.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Optional


class Backlog:
    def __init__(self) -> None:
        self.bytes = 0
        self._sent: deque[list] = deque()   # [tracker or None (still being queued), nbytes]

    def settle(self) -> int:
        """Forget what has left; return the bytes that did (the bytes still queued: `self.bytes`)."""
        left = 0
        while self._sent and self._sent[0][0] is not None and self._sent[0][0].done:
            left += self._sent.popleft()[1]
        self.bytes -= left
        return left

    def add(self, nbytes: int) -> list:
        entry = [None, nbytes]
        self._sent.append(entry)
        self.bytes += nbytes
        return entry


class Backlogs:
    """Per connection (ROUTER index, fd); forgotten when the connection closes. `limit` bounds one
    connection, `total_limit` all of them together (None: no bound over all)."""

    def __init__(self, limit: int, total_limit: Optional[int] = None) -> None:
        self.limit, self.total_limit = limit, total_limit
        self._by_conn: dict[Hashable, Backlog] = {}
        self._total = 0   # queued over all connections, as of each one's last settle

    def _settle(self, backlog: Backlog) -> int:
        self._total -= backlog.settle()
        return backlog.bytes

    def admit(self, conn: Optional[Hashable], nbytes: int) -> Optional[list]:
        """An entry to attach the send's tracker to, or None: drop the reply (a backlog is full).
        Connections without a file descriptor (inproc) are not bounded: their entry is a dummy."""
        if conn is None:
            return [None, nbytes]
        backlog = self._by_conn.setdefault(conn, Backlog())
        queued = self._settle(backlog)
        if queued and queued + nbytes > self.limit:
            return None
        if self.total_limit is not None and self._total and self._total + nbytes > self.total_limit:
            if self.total() and self._total + nbytes > self.total_limit:   # settled everywhere: still full
                return None
        self._total += nbytes
        return backlog.add(nbytes)

    def queued(self, conn: Optional[Hashable]) -> int:
        backlog = self._by_conn.get(conn)
        return self._settle(backlog) if backlog is not None else 0

    def closed(self, conn: Hashable) -> None:
        backlog = self._by_conn.pop(conn, None)
        if backlog is not None:
            self._total -= backlog.bytes

    def total(self) -> int:
        for backlog in self._by_conn.values():
            self._settle(backlog)
        return self._total
