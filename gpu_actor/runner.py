"""The runner contract: what the registry and the worker ask of a loaded model (`Runner`) and of the way a
worker loads models (`Loader`), whichever the device. Two loaders, chosen once from the device
(`Device.shared_weights`):

- gpu_actor/own_session.py, `OwnSessions`: a session per model (the CPU provider, where prepacked
  constant weights run faster per frame than weights bound as inputs: gpu_actor/device.py);
- gpu_actor/architectures.py, `Architectures`: one prepared session per architecture and batch size,
  each model's weights bound per call (a GPU, and the stand-in device that behaves like one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Union

import numpy as np

from config.assets import AssetError, ModelIO


def dims(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


@dataclass
class Part:
    """One request's rows in a runner's call: visual [n,6,320,320] float32 (or the avatar's crops,
    gpu_actor/visual.VisualFrames, or a function giving rows [start, end) of it), audio [n,*A], and the
    destination of its mouths, out [n,3,320,320]."""

    visual: Union[np.ndarray, Callable[[int, int], np.ndarray]]
    audio: np.ndarray
    out: np.ndarray


class Runner(Protocol):
    """A loaded model, whichever the device: gpu_actor/own_session.OwnSessionRunner (a session of its own)
    or gpu_actor/architectures.PreparedRunner (its weights bound into its architecture's prepared sessions)."""

    io: ModelIO
    nbytes: int              # what it holds: its weights on a device that binds them, else what its load
                             # cost in resident memory
    frames_per_s: float      # the most frames a second it runs, measured (0: not measured)
    group: object            # runners whose rows may share a worker's step (one prepared architecture:
                             # gpu_actor/prepared.Prepared, whose prefers_grouped and run_grouped run several
                             # models' rows in one call; an OwnSessionRunner is its own, one model)
    step_rows: int           # the most frames one call of it holds: a step's size

    def end_step(self, kind: str) -> list[tuple[int, int]]:
        """A worker's step of `kind` (one_model, sub_calls, grouped) that this runner's group ran is over:
        counted, and the device calls it made, (prepared size, frames held) each."""

    def run(self, visual: Union[np.ndarray, Callable[[int, int], np.ndarray]], audio: np.ndarray,
            out: np.ndarray) -> None: ...

    def run_parts(self, parts: list[Part]) -> None: ...


def check_audio(path: Path, io: ModelIO, audio: np.ndarray, batch: int) -> None:
    """A runner's audio must be [batch, *the model's audio shape]; AssetError says which."""
    if audio.shape != (batch, *io.audio_shape):
        raise AssetError(f"{path}: audio must be [{batch}, {', '.join(map(str, io.audio_shape))}], "
                         f"got {list(audio.shape)}")




class Loader(Protocol):
    """How a worker's models become runners (the registry's load thread calls it)."""

    def load(self, path: Path, model: str = "") -> Runner:
        """(The load thread) the model at `path` (its id: `model`) loaded, warmed and ready to run;
        AssetError says what is wrong with its file."""

    def prepare_more(self, runner: Callable[[], Optional[Runner]]) -> bool:
        """(A thread beside the load thread, once `runner`, a weak reference, counts as loaded) what serves
        its model faster once ready but no load waits for (an architecture's N-model form); nothing where
        there is none. True when something became ready (the runners' frames_per_s may have risen)."""

    def describe(self) -> dict[str, dict]:
        """What the loader holds beside the models, for stats (the prepared architectures), or {}."""
