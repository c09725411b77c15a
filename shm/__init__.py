"""shm/ owns local inter-process plumbing: POSIX shared memory (slot rings that carry tensors between
processes, the shared background store), the handles (`TensorRef`) that messages carry instead of
tensors, the internal IPC messages (messages.py), every internal endpoint (endpoints.py), which
client-facing process a request id belongs to (requests.py), the host's live sessions counted over its
client-facing processes (board.py) and the common life of a child process (child.py).

Imports no other room of this project; the wire's enums (codes.py) come from lipsync_client.protocol.
"""

from shm.ring import RingError, RingFull, RingSpec, SlotRing, SlotState, StaleHandle, TensorRef
from shm.segment import Segment, list_segments, run_prefix, sweep_dead_runs

__all__ = [
    "RingError", "RingFull", "RingSpec", "Segment", "SlotRing", "SlotState", "StaleHandle", "TensorRef",
    "list_segments", "run_prefix", "sweep_dead_runs",
]
