"""The host's live sessions, counted over its client-facing processes: one shared segment, one row per
process (frontend.processes), each row written by its process alone and read by all, so that each
process admits and sheds against the whole host's sessions and speech, not its share of them.

    row i (int64 each):  pid | sessions | speaking | speech_frames | opens | tenant 0 | ... | tenant T-1

- pid: the process writing the row now (0 before its first start): whose CPU time the others count.
- sessions: the sessions it holds or is opening.
- speaking: of them, those speaking at its last shedding window.
- speech_frames, opens: cumulative over the row's life, carried over a restart of its process (the
  new process counts on from them), so that a sum over the rows only ever grows.
- tenant j: of its sessions, those of the j-th tenant with a session limit of its own
  (frontend.curve.tenants.NAME.max_sessions; the tenants' names sorted).

No hand-off rides on it: a reader takes each cell as it is (an aligned 8-byte load), a moment old at
worst, which is what admission's estimate can bear. The supervisor creates and unlinks the segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shm.segment import Segment

PID, SESSIONS, SPEAKING, SPEECH_FRAMES, OPENS = range(5)
COLUMNS = 5   # then one per tenant with a session limit


@dataclass(frozen=True)
class HostCounts:
    """The rows summed: every process's sessions (held or opening), speaking sessions, speech frames
    sent and sessions opened."""
    sessions: int = 0
    speaking: int = 0
    speech_frames: int = 0
    opens: int = 0
    tenants: tuple[int, ...] = ()   # sessions of each tenant with a limit (its column's order)


class Board:
    def __init__(self, segment: Segment, rows: int, row: int = -1):
        self._segment = segment
        self._rows = np.ndarray((rows, segment.size // (8 * rows)), np.int64, segment.buf)
        self.row = row

    @classmethod
    def create(cls, name: str, processes: int, tenants: int = 0) -> "Board":
        """The supervisor's: a zeroed segment of `processes` rows, with a column for each of `tenants`
        tenants with a session limit; later `close(unlink=True)`."""
        rows = max(processes, 1)
        return cls(Segment(name, rows * 8 * (COLUMNS + tenants), create=True), rows)

    @classmethod
    def attach(cls, name: str, row: int, processes: int) -> "Board":
        """Process `row`'s view (of `processes` rows): it writes that row. Its predecessor's sessions are
        gone with it (its cumulative counts stay)."""
        segment = Segment(name)
        if not 0 <= row < processes or segment.size % (8 * processes) or segment.size < processes * 8 * COLUMNS:
            segment.close()
            raise ValueError(f"board {name} of {segment.size} bytes has no row {row} of {processes}")
        board = cls(segment, processes, row)
        mine = board._rows[row]
        mine[SESSIONS] = mine[SPEAKING] = 0
        mine[COLUMNS:] = 0
        return board

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def processes(self) -> int:
        return len(self._rows)

    def set(self, column: int, value: int) -> None:
        self._rows[self.row, column] = value

    def get(self, column: int) -> int:
        return int(self._rows[self.row, column])

    def set_tenants(self, counts: list[int]) -> None:
        """This process's sessions of each tenant with a limit (in their columns' order)."""
        self._rows[self.row, COLUMNS:COLUMNS + len(counts)] = counts

    def others(self) -> HostCounts:
        """The other processes' rows, summed."""
        rows = self._rows.copy()
        rows[self.row] = 0
        total = rows.sum(axis=0).tolist()
        return HostCounts(total[SESSIONS], total[SPEAKING], total[SPEECH_FRAMES], total[OPENS], tuple(total[COLUMNS:]))

    def pids(self) -> dict[int, int]:
        """Row -> the pid writing it, for every row but this process's with a pid set."""
        return {i: int(pid) for i, pid in enumerate(self._rows[:, PID].tolist()) if pid and i != self.row}

    def vacate(self, row: int) -> None:
        """The supervisor's, when process `row` died: its sessions went with it (its counts stay)."""
        self._rows[row, PID] = self._rows[row, SESSIONS] = self._rows[row, SPEAKING] = 0
        self._rows[row, COLUMNS:] = 0

    def close(self, unlink: bool = False) -> None:
        self._rows = None
        self._segment.close()
        if unlink:
            self._segment.unlink()
