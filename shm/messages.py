"""Every internal IPC message between the supervisor, frontend, inference and compositing processes.

One typed struct per message, tagged so that one decoder reads any of them. A message goes as a
ZeroMQ multipart `[msgpack(struct), raw buffers...]`; tensors never ride along: they stay in a shm
slot and the message carries its `TensorRef`. Only encoded images (the final output, which must be
a ZeroMQ frame for the client anyway) travel as raw buffers.

Data walks one way: frontend -> InferTask -> gpu_actor -> CompositeTask -> cpu_actor -> CompositeDone
-> frontend. Control goes back: InferDone (the input slot is free) and ReleaseTask (the output slot
may be reused), both tied to a request id.
"""

from __future__ import annotations

from typing import Any, Annotated, Optional, Union

import msgspec

from shm.codes import ErrorCode, ModelEventKind, ProcState, Role
from shm.ring import TensorRef

Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class _Msg(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    pass


class Chunk(msgspec.Struct, array_like=True):
    """Frames [start, end) of a batch go to compositing process `compositor`."""

    compositor: int
    start: int
    end: int
    keep: Optional[list[tuple[str, int]]] = None   # CompositeTask.keep


# -- frontend -> inference worker ------------------------------------------------------------

class InferTask(_Msg):
    req: int
    model: str
    batch: int
    audio: TensorRef                 # [batch, *A] float32; or [n] int16: one utterance of 16 kHz PCM
    visual: Optional[TensorRef]      # [batch, 6, 320, 320] float32; None: build it from the avatar
    frames: list[int]                # background index of each frame
    plan: list[Chunk]                # empty: an `infer` request (mouths go back to the frontend)
    format: str = "jpeg"
    quality: int = 75
    deadline: float = 0.0            # time.monotonic(): system-wide on one host, never sent to another
    enqueued: float = 0.0
    version: int = 0                 # the frontend's token for the model's background files
    rows: Optional[list[list[int]]] = None   # audio is encoder inputs [J,1,80,16]: frame i's window is their
                                             # outputs at rows[i] (-1: zeros); a pcm16 session's speech
    utterance: str = ""              # ... whose inputs are numbers first_input .. +J-1 of this utterance:
    first_input: int = 0             # the worker encodes each (utterance, number) once and keeps it
    due: float = 0.0                 # when its first frame must go out (a live session's); 0: at its deadline
    client: Count = 0                # whose share of the worker it takes, numbered by its frontend (0: none)


class ReleaseTask(_Msg):
    """The frontend is done with request `req`: free its output slot."""

    req: int


class LoadModel(_Msg):
    req: int
    model: str
    pin: int = 0          # +1: load and keep it loaded (a live session); -1: release such a pin, no answer


class UnloadModel(_Msg):
    req: int
    model: str


class StatsQuery(_Msg):
    req: int


class ResetRequests(_Msg):
    """The frontend (or a GPU host's bridge) restarted: every request its predecessor sent, those whose ids
    are below `floor` (the new one's first id: frontend/core/shell.first_request_id), is gone: drop them,
    free their slots, answer none of them, and drop the live session pins they made. Requests at or above `floor` are the new one's, even those that
    came before this message (it comes from the supervisor, not down the same socket)."""

    floor: Count


# -- edge -> GPU host, over the bridge (CURVE) -----------------------------------------------------

class RemoteInfer(_Msg):
    """An InferTask as it crosses hosts: tensors follow as raw frames ([visual], audio), and the
    deadline (and a live session's due time) travels as the budget left when it was sent, re-anchored on
    the GPU host's own clock."""

    req: Count
    model: str
    batch: Positive
    audio_shape: tuple[Positive, ...]   # per frame
    visual: bool                        # a visual frame precedes the audio frame
    frames: list[Count]                 # background index of each frame (audio-only visual input)
    composite: bool                     # mouths go back as uint8 (what compositing truncates to anyway)
    budget_ms: Annotated[float, msgspec.Meta(ge=0)]
    version: int = 0
    pcm: bool = False                   # the audio frame is 16 kHz int16 PCM (audio_shape is then ignored)
    rows: Optional[list[list[int]]] = None   # the audio frame is encoder inputs (InferTask.rows)
    utterance: str = ""
    first_input: int = 0
    # a live session's speech: ms left until its first frame must go out (InferTask.due), re-anchored
    # like budget_ms, so that the GPU host gives it what the edge would; None: a client's request
    due_ms: Optional[Annotated[float, msgspec.Meta(ge=0)]] = None
    client: Count = 0                   # InferTask.client: the edge's number for the client it is for


# -- inference worker -> compositing process -----------------------------------------------

class CompositeTask(_Msg):
    req: int
    model: str
    worker: int
    mouths: TensorRef                # the whole batch [batch, 3, 320, 320]
    start: int
    end: int
    frames: list[int]                # background indices of frames start..end-1
    format: str
    quality: int
    deadline: float
    version: int = 0
    due: float = 0.0                 # InferTask.due: compositors take the task due soonest first
    # H.264 speech (format i420) whose sessions' encoders live in this process: frame i's face box is
    # kept here for (session, frame index) keep[i], and an empty frame goes back in its place
    keep: Optional[list[tuple[str, int]]] = None


class RenderIdle(_Msg):
    """Frontend -> compositing process: encode these background frames as they are (a live session's
    idle frames: no inference). Answered with a CompositeDone carrying the encoded frames."""

    req: int
    model: str
    frames: list[int]
    format: str
    quality: int
    deadline: float
    version: int = 0
    due: float = 0.0                 # when the first of them must go out (compositors: due soonest first)


class H264Settings(msgspec.Struct, array_like=True, frozen=True):
    """A live session's encoder (config sessions.h264); the frame size is the avatar's."""

    fps: float
    bitrate: Positive
    preset: str
    gop: Positive


class EncodeItem(msgspec.Struct, array_like=True):
    index: int                       # the session's frame index (the encoder's pts)
    frame: int                       # its background frame
    idr: bool                        # start a new GOP with this frame
    box: bytes = b""                 # speech: the face box (cpu_actor/h264.pack_box); empty: idle
    kept: int = -1                   # speech whose face box this process kept for the session's frame
                                     # `kept` (CompositeTask.keep; a repeated frame names the first's)


class EncodeSession(msgspec.Struct, array_like=True):
    """One live session's frames in an EncodeFrames, in order, for the session's encoder."""

    session: str
    model: str
    version: int
    settings: H264Settings
    items: list[EncodeItem]
    deadline: float                  # not started by then: its frames are lost (given up by the frontend)


class EncodeFrames(_Msg):
    """Frontend -> compositing process: the frames that one pacer tick decided for the live sessions
    whose encoders this process keeps. Answered with a CompositeDone carrying one Annex-B access unit
    per item, session after session; a session that failed (`CompositeDone.lost`) has empty ones."""

    req: int
    sessions: list[EncodeSession]
    deadline: float                  # the latest of the sessions'
    due: float = 0.0                 # when the first frame must go out


class EncodeLoop(_Msg):
    """Frontend -> compositing process: the avatar's idle loop, background `frames` encoded as they are
    by a new encoder (the first one an IDR). Low priority: encoded between other tasks."""

    req: int
    model: str
    version: int
    settings: H264Settings
    frames: list[int]
    deadline: float


class CloseEncoder(_Msg):
    """Frontend -> compositing process: the session closed; drop its encoder."""

    session: str


# -- workers -> frontend ---------------------------------------------------------------------

class InferDone(_Msg):
    req: int
    worker: int
    ok: bool
    code: Optional[ErrorCode] = None
    message: str = ""
    output: Optional[TensorRef] = None
    queue_ms: float = 0.0
    inference_ms: float = 0.0
    input_ms: float = 0.0            # building an audio-only request's visual input from the avatar


class StepDone(_Msg):
    """A GPU worker's device step is over (gpu_actor/worker.py): its kind (one_model, sub_calls, grouped),
    its device calls, (prepared size, frames held) each, and the seconds its device thread ran it; for the
    frontend's metrics."""

    worker: int
    kind: str
    calls: list[tuple[int, int]]
    seconds: float = 0.0


class CompositeDone(_Msg):
    """Followed by end - start raw frames, one encoded image each."""

    req: int
    compositor: int
    start: int
    end: int
    ok: bool
    code: Optional[ErrorCode] = None
    message: str = ""
    composite_ms: float = 0.0
    width: int = 0
    height: int = 0
    hits: int = 0
    misses: int = 0
    images: Optional[TensorRef] = None   # raw format: uint8 [n, h, w, 3] in the compositor's image ring
    lost: dict[int, str] = {}            # EncodeFrames: the sessions (by position) whose frames failed, and why


class ReleaseImages(_Msg):
    """Frontend -> compositing process: the raw frames of request `req` have left; free their slot."""

    req: int


class LoadDone(_Msg):
    req: int
    worker: int
    model: str
    ok: bool
    code: Optional[ErrorCode] = None
    message: str = ""
    load_ms: float = 0.0


class ModelEvent(_Msg):
    """A model was loaded, unloaded, evicted or failed to load on a worker (for routing/metrics)."""

    worker: int
    model: str
    event: ModelEventKind
    load_ms: float = 0.0
    nbytes: int = 0
    # a GPU worker: the frames a second its steps run with the models it holds after the event (the lowest of
    # its architectures', measured per prepared size: gpu_actor/prepared.Prepared.frames_per_s); 0: not measured
    frames_per_s: float = 0.0


class StatsReport(_Msg):
    req: int
    worker: int
    device: str
    models: dict[str, dict[str, float]]
    loaded: list[str]
    queue: int
    # a GPU worker's prepared architectures: key -> {"sizes": [...], "frames_per_s": ..., "models": n}
    architectures: dict[str, dict[str, Any]] = {}
    # a worker's steps: run, prepared while another ran, the seconds its device thread spent running them
    steps: dict[str, float] = {}


# -- supervisor <-> children -----------------------------------------------------------------

class Ready(_Msg):
    role: Role
    index: int
    pid: int
    device: str = ""
    state: ProcState = ProcState.READY   # VACANT: a GPU-host slot (DNS) with no host behind it yet
    first_req: Count = 0   # a frontend's or bridge's first request id (ResetRequests.floor on a restart)


class Fatal(_Msg):
    role: Role
    index: int
    pid: int
    message: str


class ProcessEvent(_Msg):
    """Supervisor (or a RemoteWorker, for its GPU host) -> frontend: a child changed state."""

    role: Role
    index: int
    pid: Optional[int]
    state: ProcState
    restarts: int = 0
    device: str = ""


# -- the remote bridge (edge <-> GPU host, over CURVE) -------------------------------------------

class Ping(_Msg):
    sent: float


class Pong(_Msg):
    sent: float
    loaded: list[str]                # models loaded on the GPU host, for the edge's routing
    workers_ready: int = 0           # the GPU host serves only while at least one of its workers is ready
    draining: bool = False           # the GPU host is shutting down: it takes no new work
    # the answering bridge process's first request id: another one means another process (restarted, or
    # the connection moved to another of the host's bridges), which has none of the requests sent before
    epoch: int = 0


class Goodbye(_Msg):
    """GPU host -> edge once every request of the edge's is answered, just before the host closes;
    the edge answers with a Goodbye. Until that answer the host keeps its socket open: replies sent
    right before a socket closes can be lost, and the Goodbye, sent after them on the same connection,
    arrives only after them."""


class Pins(_Msg):
    """Edge -> GPU host: every pin the edge's live sessions hold on the host, by model (no answer). The
    bridge pins or releases to match, for this edge: sent each time the edge finds the host ready (a
    bridge process it had not reached, or one that lost it for a while, may hold others), and when a
    frontend of the edge restarted (its sessions' pins went with it)."""
    models: dict[str, int]


Message = Union[
    InferTask, ReleaseTask, LoadModel, UnloadModel, StatsQuery, ResetRequests, CompositeTask, InferDone, StepDone,
    CompositeDone, ReleaseImages, LoadDone, ModelEvent, StatsReport, Ready, Fatal, ProcessEvent, Ping, Pong,
    Goodbye, Pins, RemoteInfer, RenderIdle, EncodeFrames, EncodeLoop, CloseEncoder,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def pack(message: _Msg) -> bytes:
    """An internal message as msgpack bytes (the client-facing wire is JSON: lipsync_client.protocol.encode)."""
    return _encoder.encode(message)


def unpack(data) -> Message:
    return _decoder.decode(data)
