"""shm/ owns everything that lives in POSIX shared memory: slot rings that carry tensors between
local processes, the handles (`TensorRef`) that messages carry instead of tensors, and the
internal IPC messages that move those handles. Imports no other room of this project.
"""

from shm.ring import RingError, RingFull, RingSpec, SlotRing, SlotState, StaleHandle, TensorRef
from shm.segment import Segment, list_segments, run_prefix, sweep_dead_runs

__all__ = [
    "RingError", "RingFull", "RingSpec", "Segment", "SlotRing", "SlotState", "StaleHandle", "TensorRef",
    "list_segments", "run_prefix", "sweep_dead_runs",
]
