"""`inference.precision`: the arithmetic a GPU worker runs a model in.

    fp32   the model as its file has it (the default; the only one the CPU provider runs)
    fp16   the model's float tensors and weights in float16, its inputs and output still float32
           (a Cast after each input and before the output), so the buffers and the shm layout do not
           change with the precision

`to_fp16` converts with onnxconverter-common's `float16.convert_float_to_float16(keep_io_types=True)`
and gives a model it cannot convert back unchanged, with a warning to log. Ops onnxconverter-common
keeps in float32 (its default block list: Resize among them) get Casts around them. `fp16_architecture`
finds how many leading convolutions must stay float32 for the composited crop to stay within 45 dB of
fp32's, on the worker's device. Which precisions a device runs is the device's (`Device.precisions`:
the CPU provider runs fp32 only, gpu_actor/device.py says why).

The crops graph that makes a GPU worker's visual input (gpu_actor/visual_onnx.py) is a session of its
own, never converted: it stays float32 and equal to build_visual's, and the converted model's input
Cast takes its output to float16.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from gpu_actor.model_split import Architecture, Split, split_proto
from gpu_actor.onnx_sessions import session_options

log = logging.getLogger(__name__)
FP16_MIN_PSNR_DB = 45.0  # inference.precision fp16: the crop's PSNR against fp32's
FP16_KEEP_FP32 = (0, 2, 4, 8, 16, 32, 1 << 30)   # leading convolutions kept in fp32, tried in turn

def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose nodes all have unique names.

    NOTE: onnxconverter-common names the Casts it puts around a blocked op after the op's node name:
    two unnamed Resize nodes (torch.onnx.export leaves many nodes unnamed) give two tensors called
    `_input_cast_0`, and the checker refuses the result (the same bug was fixed in onnxruntime's copy
    of the converter, microsoft/onnxruntime#27469)."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {n.name for n in named.graph.node if n.name}
    counter = 0
    for node in named.graph.node:
        if node.name:
            continue
        while f"{node.op_type}_{counter}" in taken:
            counter += 1
        node.name = f"{node.op_type}_{counter}"
        taken.add(node.name)
    return named


def _culprit(err: Exception, model: onnx.ModelProto) -> str:
    """The op a conversion error is about, where its message names a node of `model`, and the error."""
    text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    names = {n.name: n.op_type for n in model.graph.node if n.name}
    for word in re.findall(r"[\w./:-]+", str(err)):
        for name in (word, re.sub(r"_(input|output)_cast_?\d+$", "", word)):
            if name in names:
                return f"op {names[name]} (node {name}): {text}"
    return text


def to_fp16(model: onnx.ModelProto, keep_fp32: int = 0) -> tuple[onnx.ModelProto, Optional[str]]:
    """(`model` in float16 with float32 inputs and outputs, None; its first `keep_fp32` convolutions kept
    in float32: an error there is carried through the whole network), or, where it cannot be converted (the
    converter raises, or onnx.checker refuses its result, types included), (`model` unchanged, a warning
    naming the op or the error). Values below float16's range (|x| < 1e-7) are clamped to +-1e-7, as the converter does,
    without its warning per tensor."""
    try:
        from onnxconverter_common import float16
    except ImportError as err:
        return model, f"inference.precision: fp16 needs onnxconverter-common ({err}); running fp32"
    named = _named(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # NOTE: one "will be truncated" warning per small weight tensor
            kept = [n.name for n in named.graph.node if n.op_type == "Conv"][:keep_fp32]
            converted = float16.convert_float_to_float16(named, keep_io_types=True, node_block_list=kept)
        # NOTE: full_check adds type inference: an op whose schema has no float16 (Celu) fails here, by
        # name, rather than when onnxruntime makes the session
        onnx.checker.check_model(converted, full_check=True)
    except Exception as err:  # the converter and the checker raise many types, for one reason: not this model
        return model, f"inference.precision: fp16: the model cannot be converted, running fp32: {_culprit(err, named)}"
    return converted, None


def crop(mouths: dict | np.ndarray) -> np.ndarray:
    """Mouths as the compositor pastes them, floor(255 * P) in 0..255 (cpu_actor/composite.py)."""
    mouths = mouths["out"] if isinstance(mouths, dict) else mouths
    return np.clip(np.floor(255 * mouths.astype(np.float64)), 0, 255)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def fp16_architecture(path: Path, split: Split, device, threads: int, spin: bool) -> Architecture:
    """(The load thread) `split`'s architecture in float16 (inputs and output float32), its first
    convolutions kept in float32 until its mouths, run on `device`, keep the crop within FP16_MIN_PSNR_DB
    of fp32's (a probe of random frames; SyncTalk_2D's imported unet_328 needs its first 8 of 93); fp32's
    if none does."""
    probe = _probe(device, threads, spin, split.architecture, split.weights, None)
    reference = crop(probe)
    convs = sum(1 for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "Conv")
    for keep in FP16_KEEP_FP32:
        converted, warning = to_fp16(onnx.load(str(path)), keep_fp32=min(keep, convs))
        if warning:
            log.warning("%s: %s", path, warning)
            return split.architecture
        half = split_proto(converted, path)
        mouths = _probe(device, threads, spin, half.architecture, half.architecture.weights_of(str(path), split), probe)
        db = psnr(crop(mouths), reference)
        if db >= FP16_MIN_PSNR_DB:
            log.info("%s: fp16 with its first %d of %d convolutions in fp32: crop %.1f dB from fp32's",
                     path, min(keep, convs), convs, db)
            return half.architecture
        if keep >= convs:
            break
    log.warning("%s: inference.precision fp16 keeps the crop within %.1f dB of fp32's at best, under %.0f dB: "
                "running fp32", path, db, FP16_MIN_PSNR_DB)
    return split.architecture


def _probe(device, threads: int, spin: bool, architecture: Architecture, weights: list,
           inputs: Optional[dict]) -> dict:
    """Run `architecture` once on `device` (a batch of 2, a session of its own): {"out": mouths}, and the
    probe's inputs the first time (None): random frames, seeded."""
    names = set(architecture.weights)
    with device.lock:
        session = device.session(architecture.graph, session_options(threads, spin))
        feeds = [i for i in session.get_inputs() if i.name not in names]
        if inputs is None:
            rng = np.random.default_rng(0)
            inputs = {i.name: rng.random((2, *[d if isinstance(d, int) else 1 for d in i.shape[1:]]), dtype=np.float32)
                      for i in feeds}
        out = device.infer(session, {**{k: v for k, v in inputs.items() if k != "out"},
                                     **dict(zip(architecture.weights, weights))})[0]
        del session   # NOTE: freed under the lock too
    return {**inputs, "out": out}
