"""A request as the engine tracks it, what it carries to an inference worker, the work it carries for
whoever made it, and how one is refused.

No sockets and nothing else of frontend/: every shell (the client frontend, the GPU host's bridge) and
live sessions build these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Protocol, Union

import numpy as np

from config.audio import ENCODER_INPUT_SHAPE
from config.geometry import VISUAL_BYTES, VISUAL_SHAPE, audio_offset
from shm.codes import ErrorCode


class RequestError(Exception):
    """A request refused before the engine takes it: sent back as an error reply with `code`; the
    message says what to change."""

    def __init__(self, code: ErrorCode, message: str, request_id: Any = None, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id
        self.retry_after_s = retry_after_s   # busy: when to ask again (error.retry_after_ms)


@dataclass
class Inputs:
    """What an inference worker must infer for a request, as a shell writes it into the worker's input
    slot at Dispatch (core/shell.py). The engine never reads it."""

    model: str
    version: int
    frames: list[int]              # background frame of each output frame
    audio: Any                     # a buffer, laid out as `layout` says
    layout: str                    # "windows": [batch, *window] float32; "window": one [*window] for every
                                   # frame; "pcm": 16 kHz int16; "encoder": encoder inputs [J, 1, 80, 16]
    window: tuple[int, ...] = ()   # the model's audio window ("windows", "window")
    visual: Any = None             # float32 [batch, 6, 320, 320]; None: the worker builds it from the avatar
    rows: Optional[list] = None    # "encoder": each frame's window rows into the inputs (-1: zeros)
    utterance: str = ""            # "encoder": the utterance, and the number of its first input here
    first_input: int = 0
    format: str = ""               # composite: the compositors' output format and quality
    quality: int = 0
    enqueued: float = 0.0          # time.monotonic() when it arrived
    due: float = 0.0               # a live session's speech: when its first frame must go out (0: none)

    def nbytes(self, batch: int) -> int:
        """The room it takes in the worker's input slots: the visual input, then the audio at its
        alignment, as `arrays` gives them (core/slots.write_inputs)."""
        audio = batch * int(np.prod(self.window)) * 4 if self.layout == "window" else memoryview(self.audio).nbytes
        return (0 if self.visual is None else audio_offset(batch * VISUAL_BYTES)) + audio

    def arrays(self, batch: int) -> tuple[Optional[np.ndarray], np.ndarray, Optional[tuple[int, ...]]]:
        """(visual, audio, the shape to broadcast audio to) as the input slot takes them."""
        visual = None if self.visual is None else np.frombuffer(self.visual, "<f4").reshape(batch, *VISUAL_SHAPE)
        if self.layout == "encoder":
            return visual, np.frombuffer(self.audio, "<f4").reshape(-1, *ENCODER_INPUT_SHAPE), None
        if self.layout == "pcm":
            return visual, np.frombuffer(self.audio, "<i2"), None
        if self.layout == "window":
            return visual, np.frombuffer(self.audio, "<f4").reshape(self.window), (batch, *self.window)
        return visual, np.frombuffer(self.audio, "<f4").reshape(batch, *self.window), None


class Kind(str, enum.Enum):
    INFER = "infer"          # mouths back to the shell
    COMPOSITE = "composite"  # mouths on to the compositors, frames back to the shell
    LOAD = "load"            # one worker
    UNLOAD = "unload"        # every ready worker
    STATS = "stats"          # every ready worker; answered after stats_timeout_s with what came
    WARM = "warm"            # the engine's own load of a model that queued requests wait for
    RENDER = "render"        # compositor work with no inference (live sessions): idle frames, H.264 encodes


class State(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPOSITING = "compositing"
    GATHERING = "gathering"


CLIENT_GONE = "client_gone"   # an end with no reply to send (the connection closed)


class Work(Protocol):
    """What a request carries for whoever made it (`Request.work`): a client's call, a live session's
    speech batch, pin, idle render or H.264 encode. It knows how its request ends, so a shell routes an
    end by calling it, never by asking which kind of work it is."""

    def done(self, r: "Request") -> None:
        """The request ended well: reply, or hand its results on (`r.images`, `r.results`, `r.output`)."""

    def failed(self, r: "Request", code: Union[ErrorCode, str], message: str) -> None:
        """The request ended in error; `code` CLIENT_GONE: its connection closed, there is no one to tell."""


class RenderWork(Work, Protocol):
    """The work of a `render` request: compositor work with no inference."""

    def message(self, r: "Request") -> Any:
        """What its compositor is sent (shm.messages RenderIdle, EncodeFrames or EncodeLoop), for `r`'s
        id and deadline."""


@dataclass(eq=False)
class Request:
    kind: Kind
    model: Optional[str]
    batch: int = 0
    deadline: float = float("inf")
    conn: Optional[Hashable] = None       # the connection it came over: its close ends the request
    # whose share of a worker it takes: a client's tenant (shm/requests.py tenant_client: its number
    # wherever it connects), else its connection (None: no client's, e.g. a live session's speech); the
    # engine numbers a connection for the worker (`client_no`), which shares its steps by it
    client: Optional[Hashable] = None
    client_no: int = 0
    work: Optional[Work] = None           # whoever made it (a RenderWork for RENDER); never read here
    req: int = 0                          # set by the scheduler
    state: State = State.QUEUED
    worker: Optional[int] = None
    in_slot: bool = False                 # holds an input slot of its worker
    dispatched: bool = False              # its worker may hold an output slot for it
    chunks: dict[int, int] = field(default_factory=dict)        # chunk start -> compositor, until done
    images: dict[int, list] = field(default_factory=dict)       # chunk start -> the shell's frames
    image_slots: set[int] = field(default_factory=set)          # compositors holding raw frames for it
    waiting_on: set[int] = field(default_factory=set)           # workers a gathering op waits for
    results: list = field(default_factory=list)                 # their answers
    timing: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)   # when the shell received each answer (live stages)
    output: Any = None                    # InferDone.output (a TensorRef) of an `infer`
    size: tuple[int, int] = (0, 0)        # (width, height) of composited frames
    lost: dict[int, str] = field(default_factory=dict)   # RENDER of EncodeFrames: sessions whose frames failed
    gather_deadline: float = float("inf")
    pin: int = 0                          # LOAD: +1 keeps the model loaded on that worker (a live session)
    compositor: Optional[int] = None      # RENDER: only this compositor (an H.264 session's encoder lives there)
    # COMPOSITE of H.264 speech: frame i's (session, frame index, compositor of its encoder), frames of
    # one compositor together: each goes there and its face box stays there (CompositeTask.keep)
    keep: Optional[list[tuple[str, int, int]]] = None
    inputs: Optional[Inputs] = None       # INFER, COMPOSITE: what the worker infers (written at Dispatch)
