"""A prepared architecture: one onnxruntime session per prepared batch size on a device, each model's
weights bound per call (devices whose `shared_weights` is set: a GPU, and the stand-in device that
behaves like one).

A `Prepared` architecture holds a session per prepared batch size (cuDNN rebuilds a session's plans when
its input shape changes, so calls that alternate sizes would pay again in one session), each warmed once,
largest first, before any model of the architecture is ready: after that no call ever meets a new shape.
Its staging buffers (visual, audio, output at the largest size) are allocated once on the device and
never move; `stage` fills them with a step's rows. With CUDA graphs its calls go through the one weight
slot its graphs replay (gpu_actor/cuda_graphs.GraphSlot). Its N-model form, where ready
(gpu_actor/mixed.py), runs several models' rows in one call.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Callable, Optional

import numpy as np

from config.assets import AssetError, ModelIO, classify_io
from config.geometry import CROP_SIZE, MOUTH_SHAPE, VISUAL_SHAPE
from gpu_actor.cuda_graphs import GraphSlot
from gpu_actor.mixed import GroupedCalls
from gpu_actor.model_split import Architecture
from gpu_actor.onnx_sessions import (DeviceError, DeviceMemoryError, least_time, out_of_memory, session_options,
                                     short)
from gpu_actor.runner import Part, check_audio, dims
from gpu_actor.shapes import BatchShapes
from gpu_actor.visual import VisualFrames
from gpu_actor.weights import Weights

log = logging.getLogger(__name__)


class Prepared:
    """One architecture on one device, prepared at every batch size.

    Threads: the load thread makes it and prepares it, holding `device.lock` around each call into the
    device, never a whole load; the device thread runs it. With CUDA graphs the device thread captures each
    size at its first calls there (gpu_actor/cuda_graphs.GraphSlot)."""

    def __init__(self, architecture: Architecture, device, max_batch: int, threads: int, spin: bool,
                 graphs: bool = False, mixed: str = "auto"):
        self.architecture, self.device = architecture, device
        self.mixed = mixed                  # inference.mixed_steps
        self.lock = device.lock
        self._options = (threads, spin)

        def session(graphs: bool):
            return self.session(architecture.graph, graphs)
        try:
            first = session(graphs)
        except (DeviceError, MemoryError):
            raise
        except Exception as err:  # onnxruntime raises its own exception types for graphs it cannot run
            if not graphs:
                raise AssetError(f"onnxruntime cannot load the model's graph: {short(err)}") from None
            # e.g. "cannot use the CUDA Graph feature ... all the graph nodes have not been partitioned"
            log.warning("architecture %s: no CUDA graphs for it (%s); plain runs", architecture.key, short(err))
            graphs = False
            first = session(graphs)   # NOTE: a graph that cannot load at all fails here as without graphs
        weights = set(architecture.weights)
        self.io: ModelIO = classify_io(
            [(i.name, dims(i.shape)) for i in first.get_inputs() if i.name not in weights],
            [(o.name, dims(o.shape)) for o in first.get_outputs()], f"architecture {architecture.key}")
        self.shapes = BatchShapes(device.sizes(max_batch, self.io.batch))
        self.sessions = {size: first if size == self.shapes.largest else session(graphs) for size in self.shapes.sizes}
        # the avatar's crops become the visual input on the device (gpu_actor/visual_onnx.py): a crop is
        # 0.32 MB on the bus where its float input is 2.46 MB; a client's own visual input goes as it is
        from gpu_actor.visual_onnx import visual_graph   # NOTE: here: it imports onnx, which READY does not need
        crops_graph = visual_graph().SerializeToString()
        largest = self.shapes.largest
        with self.lock:
            self.crop_session = device.session(crops_graph, session_options(*self._options))
            self.visual = device.empty((largest, *VISUAL_SHAPE))
            self.audio = device.empty((largest, *self.io.audio_shape))
            self.out = device.empty((largest, *MOUTH_SHAPE))
            self.crops = device.empty((largest, CROP_SIZE, CROP_SIZE, 3), np.uint8)
            self.crops_host = device.host_empty((largest, CROP_SIZE, CROP_SIZE, 3), np.uint8)
            # CUDA graphs: every call binds one weight slot (a graph replays the addresses it captured).
            # Without: each model's own buffer is bound.
            self.graph_slot: Optional[GraphSlot] = \
                GraphSlot(device, architecture, self.shapes.sizes, self._bind) if graphs else None
        self._crop_bindings: dict[tuple[int, int], object] = {}   # (first row, rows) -> binding
        self.users: weakref.WeakSet = weakref.WeakSet()   # its PreparedRunners: in use while any lives
        self.call_s: dict[int, float] = {}      # size -> a steady call's seconds, measured at preparation
        self.frame_bytes = 0                    # the device memory a frame takes: the largest size's growth
        self.calls: Counter[int] = Counter()    # the device thread's model calls per size (stats)
        self.call_rows: Counter[int] = Counter()   # ... per frames they held (the rest of their rows: padding)
        self.steps: Counter[str] = Counter()    # the worker's steps by kind: one model, sub-calls, grouped
        self.step_calls: list[tuple[int, int]] = []   # the step running: each call's (size, frames)
        self.grouped: Optional[GroupedCalls] = None   # the N-model form (gpu_actor/mixed.py), once ready
        self.grouped_tried = False

    def session(self, graph: bytes, graphs: bool = False):
        """(The load thread, or the one preparing the N-model form) a session of `graph` on the device."""
        with self.lock:
            return self.device.session(graph, session_options(*self._options), graphs)

    def prepare(self, weights: Weights) -> None:
        """Run every size, largest first: the first call pays the device's per-shape preparation (and the
        largest grows the memory pool once for all), the least of TIMED_CALLS more is the size's steady
        cost (`call_s`). No request runs this architecture yet, so its staging buffers are free; the main
        thread may be running other architectures meanwhile.
        A size the device has no memory for is dropped (its batches run as calls at smaller sizes); with
        none left, DeviceMemoryError (the registry evicts an idle model and loads again)."""
        device, dropped = self.device, []
        for size in sorted(self.shapes.sizes, reverse=True):
            try:
                with self.lock:
                    before = device.memory_used()
                    binding = self._warm(size, weights)
                    grown = device.memory_used() - before
                session = self.sessions[size]
                self.call_s[size] = least_time(self.lock, lambda: device.run(session, binding, size, graphs=False))
            except Exception as err:   # onnxruntime's own errors: a graph it loads but cannot run
                if not out_of_memory(err):
                    raise AssetError(f"the model's graph fails to run at batch {size}: {short(err)}") from None
                if size == self.shapes.sizes[0]:
                    raise DeviceMemoryError(f"no device memory to run the model at batch {size}: {short(err)}") \
                        from None
                log.warning("architecture %s: no device memory for batch %d (%s); its batches run smaller",
                            self.architecture.key, size, short(err))
                dropped.append(size)
                with self.lock:   # NOTE: its session goes now, its arena with it: bindings hold it too
                    if self.graph_slot is not None:
                        self.graph_slot.drop(size)
                    self._crop_bindings.pop((0, size), None)
                    del self.sessions[size]
                continue
            if not self.frame_bytes:
                self.frame_bytes = max(grown, 0) // size
        if dropped:
            self.shapes = BatchShapes(tuple(self.sessions))

    def prepare_grouped(self, weights: Callable[[], Optional[Weights]]) -> None:
        """`weights`: a model's, or None once it is gone (a weak reference: never held while preparing).
        (The registry's background thread, once: when a second model of the architecture has loaded, so
        an architecture with one avatar never pays it, and no avatar's load waits for it) the N-model form at each prepared
        size of 2 or more, warmed and timed, unless steps of several models run as sub-calls
        (`inference.mixed_steps`) or the form cannot express the graph (logged). Until it is ready such
        steps run as sub-calls."""
        from gpu_actor.grouped import GroupError   # NOTE: here: it imports onnx, which READY does not need
        sizes = tuple(size for size in self.shapes.sizes if size > 1)
        if self.grouped_tried or self.mixed == "sub_calls" or not sizes:
            return
        self.grouped_tried = True
        try:
            grouped = GroupedCalls(self, sizes, self.session)
        except GroupError as err:
            log.warning("architecture %s: steps of several models run one call per model: %s",
                        self.architecture.key, err)
            return
        except Exception as err:   # onnxruntime's own errors, or no device memory for the stacked weights
            log.warning("architecture %s: no N-model form (%s); steps of several models run one call per model",
                        self.architecture.key, short(err))
            return
        if grouped.warm(weights):
            self.grouped = grouped
            log.info("architecture %s: N-model form at sizes %s: %s ms a call (plain, one model: %s ms)",
                     self.architecture.key, tuple(grouped.sessions),
                     ", ".join(f"{grouped.call_s[s] * 1000:.1f}" for s in grouped.sessions),
                     ", ".join(f"{self.call_s[s] * 1000:.1f}" for s in grouped.sessions if s in self.call_s))

    def prefers_grouped(self, rows: list[int]) -> bool:
        """Whether a step whose models hold `rows` frames each (several models, all rows one call's worth)
        runs as one grouped call rather than a call per model: as `inference.mixed_steps` says, or (auto)
        whichever was measured faster at preparation."""
        if self.grouped is None:
            return False
        size = self.shapes.pad_to(sum(rows))
        if size not in self.grouped.sessions:
            return False
        if self.mixed == "grouped":
            return True
        sub_calls = sum(self.call_s.get(self.shapes.pad_to(n), 0.0) for n in rows)
        return self.grouped.call_s[size] < sub_calls

    def run_grouped(self, items: list[tuple[object, list[Part]]]) -> None:
        """(The device thread) the parts of several models (each item: a PreparedRunner, its parts) in one
        call of the N-model form."""
        parts = [part for _, part_list in items for part in part_list]
        weights = [runner.weights for runner, part_list in items for part in part_list for _ in range(len(part.out))]
        for runner, part_list in items:
            for part in part_list:
                check_audio(runner.path, self.io, part.audio, len(part.out))
        (step,) = self.shapes.plan(len(weights))
        pieces = self.stage(parts, step)
        self.grouped.run(step.size, weights)
        self.unstage(pieces, step)

    def stage(self, parts: list[Part], step) -> list:
        """(The device thread) the parts' rows [step.start, step.end) into the staging buffers, padded with
        zeros to step.size: the avatars' crops made into the visual input on the device, a client's visual
        input and every audio window copied. The pieces staged: (part, its rows a..b, the call's row)."""
        device = self.device
        pieces = list(_pieces(parts, step.start, step.end))
        rows = step.end - step.start
        if any(isinstance(part.visual, VisualFrames) for part, *_ in pieces):
            # a card builds the prepared size's rows in one call (padded rows from zero crops: zeros); a
            # CPU only the real rows, a few a call (`Device.crop_rows`), and zeroes the padded ones
            span = step.size if device.crop_rows is None else rows
            chunk = device.crop_rows or span
            host = self.crops_host[:span]
            host[rows:] = 0
            for part, a, b, at in pieces:
                if isinstance(part.visual, VisualFrames):
                    np.stack(part.visual.crops[a:b], out=host[at:at + b - a])
            device.upload(self.crops[:span], host)
            for first in range(0, span, chunk):
                n = min(chunk, span - first)
                device.run(self.crop_session, self.crop_binding(first, n), n, graphs=False, model=False)
            if span < step.size:
                device.zero(self.visual[rows:step.size])
        elif step.padding:   # NOTE: padded rows are zeros, whatever the last call left there
            device.zero(self.visual[rows:step.size])
        for part, a, b, at in pieces:
            if not isinstance(part.visual, VisualFrames):
                frames = part.visual(a, b) if callable(part.visual) else part.visual[a:b]
                device.upload(self.visual[at:at + b - a], frames)
            device.upload(self.audio[at:at + b - a], part.audio[a:b])
        if step.padding:
            device.zero(self.audio[rows:step.size])
        return pieces

    def _warm(self, size: int, weights: Weights):
        """A size's first call (and its crops graph's); the binding its timed calls use."""
        device, session = self.device, self.sessions[size]
        # with CUDA graphs the binding every call uses (captured at these addresses); else one of the
        # staging buffers, used once (no request runs this architecture before it is prepared)
        binding = self.binding(weights, size, {})
        # NOTE: graphs=False: no capture on this thread (onnxruntime keeps a graph per thread, and the
        # device thread's replays need their own: `call` captures them there)
        device.run(session, binding, size, graphs=False)
        # the crops graph at the shapes a step of `size` gives it: a card's one call, or (a CPU) each count
        # of rows a call may hold
        for n in (size,) if device.crop_rows is None else range(1, min(device.crop_rows, size) + 1):
            device.run(self.crop_session, self.crop_binding(0, n), n, graphs=False, model=False)
        return binding

    def call(self, size: int, binding) -> None:
        """(The device thread) one call at `size` (with CUDA graphs: captured at its first calls, replayed
        after: gpu_actor/cuda_graphs.GraphSlot.run)."""
        if self.graph_slot is None:
            self.device.run(self.sessions[size], binding, size)
        else:
            self.graph_slot.run(self.sessions[size], binding, size)

    def binding(self, weights: Weights, size: int, own: dict[int, object]):
        """The binding a call at `size` with `weights` uses: with CUDA graphs the slot's (its weights copied
        in), else the model's own, made once into `own` (its runner's, by size)."""
        if self.graph_slot is not None:
            return self.graph_slot.binding(self.sessions[size], weights, size)
        binding = own.get(size)
        if binding is None:
            binding = own[size] = self.sessions[size].io_binding()
            self._bind(binding, weights, size)
        return binding

    def unstage(self, pieces: list, step) -> None:
        """(The device thread) after a model call at `step`: each staged piece's mouths to its part's `out`,
        and the call counted (its size, the frames it held)."""
        for part, a, b, at in pieces:
            self.device.download(self.out[at:at + b - a], part.out[a:b])
        self.calls[step.size] += 1
        self.call_rows[step.end - step.start] += 1
        self.step_calls.append((step.size, step.end - step.start))

    def end_step(self, kind: str) -> list[tuple[int, int]]:
        """(The device thread) a worker's step of `kind` is over: counted, and its calls' (size, frames)."""
        self.steps[kind] += 1
        calls, self.step_calls = self.step_calls, []
        return calls

    def call_stats(self) -> dict:
        """The device thread's model calls: how many each size had, how many held each count of frames (a
        histogram), the mean frames a call held, the share of their rows that were padding; the steps by
        kind. (The main thread's, for stats: it copies the counters the device thread adds to, each in one
        step.)"""
        by_size, by_rows, steps = dict(self.calls), dict(self.call_rows), dict(self.steps)
        calls, slots = sum(by_size.values()), sum(size * n for size, n in by_size.items())
        frames = sum(rows * n for rows, n in by_rows.items())
        return {"calls_by_size": {str(size): n for size, n in sorted(by_size.items())},
                "frames_per_call_histogram": {str(rows): n for rows, n in sorted(by_rows.items())},
                "frames_per_call": round(frames / calls, 2) if calls else 0.0,
                "padded_share": round(1 - frames / slots, 3) if slots else 0.0, "steps": steps}

    def _bind(self, binding, weights: Weights, size: int) -> None:
        device = self.device
        for name, array in zip(self.architecture.weights, weights.views):
            device.bind(binding, name, array)
        device.bind(binding, self.io.visual, self.visual[:size])
        device.bind(binding, self.io.audio, self.audio[:size])
        device.bind(binding, self.io.output, self.out[:size], output=True)

    def crop_binding(self, first: int, n: int):
        """The crops graph's binding for rows [first, first + n): crops -> visual, made once."""
        binding = self._crop_bindings.get((first, n))
        if binding is None:
            binding = self.crop_session.io_binding()
            inputs, outputs = self.crop_session.get_inputs(), self.crop_session.get_outputs()
            self.device.bind(binding, inputs[0].name, self.crops[first:first + n])
            self.device.bind(binding, outputs[0].name, self.visual[first:first + n], output=True)
            self._crop_bindings[first, n] = binding
        return binding

    def frames_per_s(self) -> float:
        """The frames a second this architecture's steps run with the models it holds now, from the calls
        measured per prepared size. One model: at its best size. A models: a step of the largest size L
        holding max(L // A, 1) frames of each (every session speaking as often), as a call per model at
        that size (sub-calls) or, where ready and chosen (`inference.mixed_steps`), one call of the
        N-model form: with many avatars a call per frame, whatever the largest size."""
        one = max((size / s for size, s in self.call_s.items() if s > 0), default=0.0)
        models = len(self.users)
        if models < 2 or not one:
            return one
        each = max(self.shapes.largest // models, 1)
        size = self.shapes.pad_to(each)
        sub_calls = each / self.call_s[size] if self.call_s.get(size) else 0.0
        if self.grouped is None or self.mixed == "sub_calls":
            return sub_calls
        rows = min(each * models, self.shapes.largest)
        grouped = self.grouped.call_s.get(self.shapes.pad_to(rows))
        grouped = rows / grouped if grouped else 0.0
        return grouped if self.mixed == "grouped" and grouped else max(sub_calls, grouped)


def _pieces(parts: list[Part], start: int, end: int):
    """The parts' rows [start, end) of their concatenation: (part, its first row, its end, the row in the
    call)."""
    offset = 0
    for part in parts:
        n = len(part.out)
        a, b = max(start - offset, 0), min(end - offset, n)
        if a < b:
            yield part, a, b, offset + a - start
        offset += n
