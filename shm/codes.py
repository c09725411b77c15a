"""Every enumerated value that crosses a process boundary, defined once: error codes, process roles
and states, model events. msgspec validates them when a message is decoded, so a peer that sends
anything else is refused at the door. `str` enums: they compare equal to, and encode as, their value.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Why a request failed; the wire protocol's `error.code` (docs/protocol.md)."""

    BAD_REQUEST = "bad_request"      # malformed header, unknown op, wrong frames or sizes, bad range or id, bad model files
    UNKNOWN_MODEL = "unknown_model"  # no such model, or its files are missing
    OVERLOADED = "overloaded"        # the worker's queue is full: retry later
    TIMEOUT = "timeout"              # the deadline passed before the work finished
    UNAVAILABLE = "unavailable"      # a worker died or is restarting, or no GPU host is reachable
    FORBIDDEN = "forbidden"          # the client's tenant may not use this model
    INTERNAL = "internal"            # a bug, or a model that fails to run: the message says which


class Role(str, enum.Enum):
    GPU = "gpu"              # an inference worker (local, or a GPU host behind the bridge)
    CPU = "cpu"              # a compositing process
    FRONTEND = "frontend"
    BRIDGE = "bridge"        # role gpu's stand-in for the frontend


class ProcState(str, enum.Enum):
    STARTING = "starting"        # spawned, not ready yet (a GPU host: answers, but no worker is ready)
    READY = "ready"
    RESTARTING = "restarting"    # died; the supervisor restarts it after a backoff
    FAILED = "failed"            # died too often within supervisor.restart_window_s: stays down
    UNREACHABLE = "unreachable"  # a GPU host that misses heartbeats
    STOPPED = "stopped"          # shut down on purpose
    VACANT = "vacant"            # a GPU-host slot with no host behind it (bridge.hosts by DNS name)


class ModelEventKind(str, enum.Enum):
    LOADED = "loaded"
    UNLOADED = "unloaded"
    EVICTED = "evicted"
    FAILED = "failed"
