"""Every enumerated value that crosses a process boundary, defined once: error codes, process roles
and states, model events. msgspec validates them when a message is decoded, so a peer that sends
anything else is refused at the door. `str` enums: they compare equal to, and encode as, their value.
Error codes, roles and process states are also the wire's: they are defined in the client's protocol
module (lipsync_client.protocol) and re-exported here; model events stay inside the server.
"""

from __future__ import annotations

import enum

from lipsync_client.protocol import ErrorCode, ProcState, Role

__all__ = ["ErrorCode", "ModelEventKind", "ProcState", "Role"]


class ModelEventKind(str, enum.Enum):
    LOADED = "loaded"
    UNLOADED = "unloaded"
    EVICTED = "evicted"
    FAILED = "failed"
    PREPARED = "prepared"   # the worker's device runs more frames a second now (frames_per_s): no model changed
