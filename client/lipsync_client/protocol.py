"""The client-facing wire protocol (docs/protocol.md): ops, header schema, replies, error codes, and the
roles and states a health reply names.

A request is a ZeroMQ multipart message `[header, payload...]` (after the empty delimiter frame
that REQ adds and DEALER clients must add); a reply is `[header, data...]`.
The one module both sides import: the server (frontend/, shm/codes.py) takes it from here, so the wire is
defined once, in the light client distribution, and it imports nothing of the server.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from lipsync_client.contract import MODEL_ID_PATTERN, MOUTH_SHAPE


class ErrorCode(str, enum.Enum):
    """Why a request failed; the wire protocol's `error.code` (docs/protocol.md)."""

    BAD_REQUEST = "bad_request"      # malformed header, unknown op, wrong frames or sizes, bad range or id, bad model files
    UNKNOWN_MODEL = "unknown_model"  # no such model, or its files are missing
    OVERLOADED = "overloaded"        # the worker's queue is full: retry later
    BUSY = "busy"                    # session_open: this server is full; retry after error.retry_after_ms or elsewhere
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


class Op(str, enum.Enum):
    HEALTH = "health"
    MODELS = "models"
    LOAD = "load"
    UNLOAD = "unload"
    STATS = "stats"
    INFER = "infer"
    COMPOSITE = "composite"
    SESSION_OPEN = "session_open"
    SESSION_AUDIO = "session_audio"
    SESSION_INTERRUPT = "session_interrupt"
    SESSION_CLOSE = "session_close"
    SESSION_STATS = "session_stats"
    SESSION_KEYFRAME = "session_keyframe"


MODEL_OPS = frozenset({Op.LOAD, Op.UNLOAD, Op.INFER, Op.COMPOSITE, Op.SESSION_OPEN})
TENSOR_OPS = frozenset({Op.INFER, Op.COMPOSITE})
SESSION_OPS = frozenset({Op.SESSION_AUDIO, Op.SESSION_INTERRUPT, Op.SESSION_CLOSE, Op.SESSION_STATS,
                         Op.SESSION_KEYFRAME})


RequestId = Union[str, int, None]
ImageFormat = Literal["jpeg", "png", "raw"]
FrameFormat = Literal["jpeg", "png", "raw", "h264"]     # h264: live sessions only
PixelFormat = Literal["bgr24", "rgb24", "rgba", "i420"]  # a live session's raw frames


class RequestHeader(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    op: Op
    id: RequestId = None
    model: Optional[Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]] = None
    batch: Optional[Annotated[int, msgspec.Meta(ge=1)]] = None
    start_frame: Annotated[int, msgspec.Meta(ge=0)] = 0
    format: Optional[FrameFormat] = None
    quality: Optional[Annotated[int, msgspec.Meta(ge=1, le=100)]] = None
    timeout_ms: Optional[Annotated[int, msgspec.Meta(ge=1)]] = None
    audio_format: Literal["float32", "pcm16"] = "float32"   # pcm16: 16 kHz mono int16 LE speech (ave models)
    return_audio: bool = False      # pcm16: the reply also carries each frame's 40 ms of PCM
    # live sessions
    session: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]] = None
    fps: Optional[Annotated[float, msgspec.Meta(gt=0, le=60)]] = None
    audio: Optional[Literal["window", "features", "pcm16"]] = None
    last: bool = False
    # session_audio: the utterance this chunk belongs to (the client's ids: 1, 2, ..., increasing; a
    # new id starts an utterance, after the previous one's `last`); session_interrupt: the last
    # utterance it retires (default: every one so far). Chunks of a retired utterance are never rendered.
    utterance: Optional[Annotated[int, msgspec.Meta(ge=1, le=2**53)]] = None
    webrtc: bool = False            # session_open (h264): also stream it to a browser through the viewer
    sample_rate: Optional[Annotated[int, msgspec.Meta(ge=8000, le=48000)]] = None   # session_open, pcm16: Hz
    pixel_format: Optional[PixelFormat] = None    # session_open, raw: the frames' layout (bgr24)


# -- replies ----------------------------------------------------------------------------------

class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: ErrorCode
    message: str
    retry_after_ms: Optional[int] = None   # busy: when this server may have room again


class ErrorReply(msgspec.Struct, kw_only=True):
    ok: bool = False
    id: RequestId = None
    error: ErrorBody


class Timing(msgspec.Struct, kw_only=True):
    queue_ms: float = 0.0
    input_ms: float = 0.0
    inference_ms: float = 0.0
    composite_ms: float = 0.0
    total_ms: float = 0.0


class WorkerInfo(msgspec.Struct, kw_only=True):
    device: str
    index: int


class CompositeReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    batch: int
    format: ImageFormat
    width: int
    height: int
    frames: list[int]
    timing: Timing
    worker: WorkerInfo


class InferReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    batch: int
    shape: tuple[int, ...] = MOUTH_SHAPE
    dtype: str = "float32"
    timing: Timing
    worker: WorkerInfo


class ProcessInfo(msgspec.Struct, kw_only=True):
    role: Role
    index: int
    pid: Optional[int]
    state: ProcState
    restarts: int = 0
    device: Optional[str] = None


class HealthReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    status: Literal["starting", "ready", "degraded"]
    processes: list[ProcessInfo]
    models_loaded: dict[str, list[int]]
    version: str


class ModelInfo(msgspec.Struct, kw_only=True):
    id: str
    frames: Optional[int] = None
    width: Optional[int] = None
    height: Optional[int] = None
    audio_shape: Optional[list[int]] = None
    loaded_on: list[int] = []
    error: Optional[str] = None
    pending: bool = False          # its files are still being read: ask again for its sizes


class ModelsReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    models: list[ModelInfo]


class LoadReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    model: str
    loaded_on: list[int]
    load_ms: float = 0.0


class StatsReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    models: dict[str, dict[str, Any]]
    workers: list[dict[str, Any]]
    store: dict[str, Any] = {}


class SessionOpenReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    session: str
    fps: float
    width: int
    height: int
    audio_shape: list[int]
    feature_shape: list[int]        # features mode: one vector per frame is [F]; windows are [16, F]
    start_frame: int
    format: FrameFormat = "jpeg"
    viewer_url: Optional[str] = None   # webrtc: the page that plays this session (valid while it is open)
    sample_rate: Optional[int] = None      # pcm16: the PCM's rate, in and out
    pixel_format: Optional[PixelFormat] = None   # raw: the frames' layout
    ready_ms: float = 0.0          # how long the session took to be ready (model loaded and warm, frames rendered)


class SessionAudioReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    session: str
    first_frame: int
    frames: int
    utterance: Optional[int] = None   # the utterance the chunk went to
    retired: bool = False             # its utterance was interrupted: nothing of it is rendered (frames: 0)


class SessionInterruptReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    session: str
    dropped: int
    utterance: int = 0                # every utterance up to this one is retired


class SessionKeyframeReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    session: str
    frame: int                      # the first frame that can be the IDR (frames before it are encoded)


class SessionStatsReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    id: RequestId = None
    session: str
    frames_speech: int
    frames_idle: int
    missed: int
    dropped: int
    late: int
    frames_encoded: int = 0         # h264: frames its own encoder encoded (the others came from the idle loop)
    shed: int = 0                   # speech frames not rendered because the server was full (the newest sessions first)
    max_late_ms: float
    latency_ms_p50: Optional[float]
    latency_ms_p99: Optional[float]
    # Speech frames sent: ms in each stage ({"n", "p50", "p99", "max"}; docs/architecture.md), and the
    # stage each missed speech frame was still in when it was due.
    stages_ms: dict[str, dict[str, float]] = {}
    missed_in: dict[str, int] = {}


# -- pushes: messages a session sends without a request ------------------------------------------

class FrameEvent(msgspec.Struct, kw_only=True):
    """Followed by one frame: the encoded image."""

    event: Literal["frame"] = "frame"
    session: str
    index: int
    pts_ms: float
    kind: Literal["speech", "idle"]
    frame: int                        # background frame index
    keyframe: bool = False            # h264: this access unit starts with an IDR (decoding can start here)
    utterance: Optional[int] = None   # the utterance (1, 2, ... per session) whose speech or audio it carries
    last: bool = False                # the utterance's last frame: its last samples, or where an interrupt cut it


_encoder = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def error_reply(request_id: RequestId, code: ErrorCode, message: str, retry_after_s: Optional[float] = None) -> bytes:
    """Always encodable: text a client sent (an id, a key name) may hold what UTF-8 cannot carry."""
    retry = None if retry_after_s is None else max(round(retry_after_s * 1000), 1)
    try:
        return encode(ErrorReply(id=request_id, error=ErrorBody(code, message, retry)))
    except UnicodeEncodeError:
        scrubbed = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return encode(ErrorReply(id=None, error=ErrorBody(code, scrubbed, retry)))
