"""SyncTalk_2D's checkpoints -> the ONNX models the server runs: which file of a training run, which dict
of the file holds the weights, key prefixes, and what a checkpoint that does not fit looks like instead.

    unet checkpoint (<epoch>.pth, 556 entries for unet_328)   -> model.onnx          (gpu_actor/model_builder.py)
    audio_visual_encoder.pth (91 entries, no prefix)          -> audio_encoder.onnx
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import onnx

from config.assets import AssetError, classify_io
from gpu_actor.model_builder import AUDIO_SHAPES, WeightsError, build_audio_encoder, build_model
from supervisor.importer import ImportFailed
from supervisor.importer.checkpoint import CheckpointError, read_checkpoint

UNET_MARKER = "outc.conv.weight"
ENCODER_MARKER = "audio_encoder.0.conv_block.0.weight"
_FIRST_AUDIO_CONV = "audio_model.conv1.conv.0.weight"
# The first audio convolution's shape tells SyncTalk_2D's audio front ends apart (ave and hubert share it).
_AUDIO_LOOKS = {(64, 32, 1, 1): "ave or hubert", (512, 256, 1, 1): "wenet", (24, 12, 1, 1): "whisper"}


def pick_checkpoint(path: Path) -> Path:
    """A checkpoint file as given, or from a training run's folder the largest epoch (`99.pth`, not the
    name that sorts last), as SyncTalk_2D's inference picks it."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ImportFailed(f"{path}: no such checkpoint file or folder (--checkpoint)")
    epochs = {int(p.stem): p for p in path.glob("*.pth") if re.fullmatch(r"\d+", p.stem)}
    if epochs:
        return epochs[max(epochs)]
    others = sorted(path.glob("*.pth"))
    if len(others) == 1:
        return others[0]
    raise ImportFailed(f"{path}: no <epoch>.pth checkpoint in this folder" +
                       (f" and several others ({', '.join(p.name for p in others[:5])}): name the file" if others else ""))


def _read(path: Path) -> Any:
    try:
        return read_checkpoint(path)
    except CheckpointError as err:
        raise ImportFailed(str(err)) from None


def _state_dicts(obj: Any, depth: int = 0):
    """Every dict of arrays in `obj`: the bare state_dict, or one wrapped under a key ('state_dict', 'net', ...)."""
    if not isinstance(obj, dict) or depth > 2:
        return
    arrays = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, np.ndarray)}
    if arrays:
        yield arrays
    for value in obj.values():
        yield from _state_dicts(value, depth + 1)


def _strip_module(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """nn.DataParallel saves every key as `module.<key>`."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def _state_dict(path: Path, obj: Any, marker: str, normalise, what: str) -> dict[str, np.ndarray]:
    candidates = [normalise(_strip_module(s)) for s in _state_dicts(obj)]
    if not candidates:
        raise ImportFailed(f"{path}: holds no tensors (a {type(obj).__name__}); expected {what}'s state_dict")
    found = [s for s in candidates if marker in s]
    return found[0] if found else max(candidates, key=len)


def _looks_like(state: dict[str, np.ndarray]) -> str:
    if UNET_MARKER not in state and any(k.endswith("conv_block.0.weight") for k in state):
        return " It looks like the audio encoder's checkpoint (audio_visual_encoder.pth): pass it as --audio-encoder."
    first = state.get(_FIRST_AUDIO_CONV)
    looks = _AUDIO_LOOKS.get(tuple(first.shape)) if first is not None else None
    if looks == "wenet":
        return (" It looks like a wenet checkpoint: --audio wenet imports it, as a model that takes wenet feature "
                "windows [256, 16, 32]; the server does not run wenet's front end, so it cannot speak from PCM.")
    if looks == "whisper":
        return (" It looks like a whisper checkpoint (AudioConvWhisper, from a SyncTalk_2D fork): its audio front "
                "end is not served, and this importer does not build it.")
    return ""


def unet_from_checkpoint(path: Path, audio: str) -> onnx.ModelProto:
    obj = _read(path)
    state = _state_dict(path, obj, UNET_MARKER, lambda s: s, "unet_328")
    try:
        return build_model("unet328", audio, state_dict=state)
    except WeightsError as err:
        hint = _looks_like(state)
        raise ImportFailed(f"{path}: not SyncTalk_2D's unet_328 with {audio} audio ({len(state)} entries): "
                           f"{err}.{hint}") from None


def _encoder_keys(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file's keys lack the module's `audio_encoder.` prefix (SyncTalk_2D's inference adds it)."""
    if state and not any(k.startswith("audio_encoder.") for k in state):
        return {f"audio_encoder.{k}": v for k, v in state.items()}
    return state


def audio_encoder_from_checkpoint(path: Path) -> onnx.ModelProto:
    obj = _read(path)
    state = _state_dict(path, obj, ENCODER_MARKER, _encoder_keys, "the AudioEncoder")
    try:
        return build_audio_encoder(state_dict=state)
    except WeightsError as err:
        hint = (" It looks like a unet checkpoint: pass it as --checkpoint."
                if any(k.endswith(UNET_MARKER) for k in state) else "")
        raise ImportFailed(f"{path}: not SyncTalk_2D's AudioEncoder (audio_visual_encoder.pth, 91 entries; this "
                           f"one has {len(state)}): {err}.{hint}") from None


def check_unet_onnx(path: Path, audio: str) -> onnx.ModelProto:
    """An already exported unet: its inputs and output as the server finds them, audio features of `audio`."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:   # noqa: BLE001 - protobuf raises several types for a file that is not ONNX
        raise ImportFailed(f"{path}: not a readable ONNX model ({type(err).__name__}: {str(err)[:200]})") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise ImportFailed(f"{path}: keeps its weights in external data files; save it as one file "
                           "(onnx.save(model, path, save_as_external_data=False))")

    def dims(values) -> list:
        return [(v.name, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                          for d in v.type.tensor_type.shape.dim]) for v in values]

    weights = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in weights]
    try:
        io = classify_io(dims(inputs), dims(model.graph.output), str(path))
    except AssetError as err:
        raise ImportFailed(str(err)) from None
    if io.audio_shape != AUDIO_SHAPES[audio]:
        raise ImportFailed(f"{path}: audio input {io.audio} is {list(io.audio_shape)}, {audio} features are "
                           f"{list(AUDIO_SHAPES[audio])} (--audio {audio}): " +
                           next((f"this is a {name} model, pass --audio {name}" for name, shape in AUDIO_SHAPES.items()
                                 if shape == io.audio_shape), "no SyncTalk_2D audio mode has that shape"))
    return model


def describe_source(path: Path, given: Path) -> str:
    epoch: Optional[str] = path.stem if path != given and path.stem.isdigit() else None
    return f"{path.name} (epoch {epoch}, the largest in {given})" if epoch else path.name
