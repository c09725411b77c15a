"""The host's live sessions, counted over its client-facing processes: one shared segment, one row per
process (frontend.processes), each row written by its process alone and read by all, so that each
process admits and sheds against the whole host's sessions and speech, not its share of them.

    row i (int64 each):  pid | sessions | speaking | speech_frames | opens

- pid: the process writing the row now (0 before its first start): whose CPU time the others count.
- sessions: the sessions it holds or is opening.
- speaking: of them, those speaking at its last shedding window.
- speech_frames, opens: cumulative over the row's life, carried over a restart of its process (the
  new process counts on from them), so that a sum over the rows only ever grows.

No hand-off rides on it: a reader takes each cell as it is (an aligned 8-byte load), a moment old at
worst, which is what admission's estimate can bear. The supervisor creates and unlinks the segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shm.segment import Segment

PID, SESSIONS, SPEAKING, SPEECH_FRAMES, OPENS = range(5)
COLUMNS = 5


@dataclass(frozen=True)
class HostCounts:
    """The rows summed: every process's sessions (held or opening), speaking sessions, speech frames
    sent and sessions opened."""
    sessions: int = 0
    speaking: int = 0
    speech_frames: int = 0
    opens: int = 0


class Board:
    def __init__(self, segment: Segment, row: int = -1):
        self._segment = segment
        self._rows = np.ndarray((segment.size // (8 * COLUMNS), COLUMNS), np.int64, segment.buf)
        self.row = row

    @classmethod
    def create(cls, name: str, processes: int) -> "Board":
        """The supervisor's: a zeroed segment of `processes` rows; later `close(unlink=True)`."""
        return cls(Segment(name, max(processes, 1) * 8 * COLUMNS, create=True))

    @classmethod
    def attach(cls, name: str, row: int) -> "Board":
        """Process `row`'s view: it writes that row. Its predecessor's sessions are gone with it (its
        cumulative counts stay)."""
        board = cls(Segment(name), row)
        if not 0 <= row < len(board._rows):
            board.close()
            raise ValueError(f"board {name} has {len(board._rows)} rows; no row {row}")
        mine = board._rows[row]
        mine[SESSIONS] = mine[SPEAKING] = 0
        return board

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def processes(self) -> int:
        return len(self._rows)

    def set(self, column: int, value: int) -> None:
        self._rows[self.row, column] = value

    def add(self, column: int, n: int) -> None:
        self._rows[self.row, column] += n

    def get(self, column: int) -> int:
        return int(self._rows[self.row, column])

    def others(self) -> HostCounts:
        """The other processes' rows, summed."""
        rows = self._rows.copy()
        rows[self.row] = 0
        total = rows.sum(axis=0)
        return HostCounts(int(total[SESSIONS]), int(total[SPEAKING]), int(total[SPEECH_FRAMES]), int(total[OPENS]))

    def pids(self) -> dict[int, int]:
        """Row -> the pid writing it, for every row but this process's with a pid set."""
        return {i: int(pid) for i, pid in enumerate(self._rows[:, PID].tolist()) if pid and i != self.row}

    def vacate(self, row: int) -> None:
        """The supervisor's, when process `row` died: its sessions went with it (its counts stay)."""
        self._rows[row, PID] = self._rows[row, SESSIONS] = self._rows[row, SPEAKING] = 0

    def close(self, unlink: bool = False) -> None:
        self._rows = None
        self._segment.close()
        if unlink:
            self._segment.unlink()
