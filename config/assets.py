"""The on-disk layout of a model: where its files are, what they hold, and how they are refused.

    <models_dir>/<id>/model.onnx
    <models_dir>/<id>/frames/           background frames, *.png or *.jpg, in natural name order
    <models_dir>/<id>/crop_rects.json   {"0": {"rect": [x1,y1,x2,y2]}, ...} or [[x1,y1,x2,y2], ...]

A rect is the face crop box in pixels, x2/y2 exclusive. Boxes that cross the frame edge are clipped;
empty boxes and boxes wholly outside the frame are refused, naming the file and the index.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import cv2
import numpy as np

from config.loader import resolve_path
from config.schema import MODEL_ID_PATTERN, Config

CROP_SIZE = 328          # SyncTalk_2D resizes the face crop to 328x328 ...
INNER = slice(4, 324)    # ... and the model sees / produces its centre 320x320
VISUAL_SHAPE = (6, 320, 320)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_MODEL_ID = re.compile(MODEL_ID_PATTERN)


def mouths_to_uint8(mouths: np.ndarray) -> np.ndarray:
    """SyncTalk_2D's `np.uint8(P * 255)`: floor(255 * P) clipped to 0..255, layout kept (CHW).
    The compositor and the bridge both use it, so pixels match wherever the conversion runs."""
    scaled = np.multiply(mouths, np.float32(255), dtype=np.float32)
    np.clip(scaled, 0, 255, out=scaled)
    return scaled.astype(np.uint8)


class AssetError(ValueError):
    """A model's files cannot be used; the message names the file (and index) and the fix."""


def valid_model_id(model_id: object) -> bool:
    return isinstance(model_id, str) and _MODEL_ID.match(model_id) is not None


@dataclass(frozen=True)
class ModelPaths:
    model_id: str
    onnx: Path
    frames: Path
    crop_rects: Path
    frame_order: str = "mirror"


def model_paths(config: Config, model_id: str) -> Optional[ModelPaths]:
    """Where model `model_id`'s files are, or None if the config knows no such model."""
    if not valid_model_id(model_id):
        return None
    entry = config.models.get(model_id)
    if isinstance(entry, str):  # a directory laid out like one under models_dir
        root = resolve_path(config, entry)
        return ModelPaths(model_id, root / "model.onnx", root / "frames", root / "crop_rects.json")
    if entry is not None:
        return ModelPaths(model_id, resolve_path(config, entry.onnx), resolve_path(config, entry.frames),
                          resolve_path(config, entry.crop_rects), entry.frame_order)
    if config.models_dir is None:
        return None
    root = resolve_path(config, config.models_dir) / model_id
    if not root.is_dir():
        return None
    return ModelPaths(model_id, root / "model.onnx", root / "frames", root / "crop_rects.json")


def list_model_ids(config: Config) -> list[str]:
    ids = set(config.models)
    if config.models_dir is not None:
        root = resolve_path(config, config.models_dir)
        if root.is_dir():
            ids.update(p.name for p in root.iterdir() if p.is_dir() and valid_model_id(p.name))
    return sorted(ids)


def _natural_key(path: Path) -> list:
    # "frame_10.png" after "frame_9.png": SyncTalk_2D writes frames as 0.jpg, 1.jpg, ... 
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def list_frames(frames_dir: Path) -> list[Path]:
    if not frames_dir.is_dir():
        raise AssetError(f"{frames_dir}: frames directory is missing")
    files = sorted((p for p in frames_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=_natural_key)
    if not files:
        raise AssetError(f"{frames_dir}: no *.png or *.jpg background frames in it")
    return files


def parse_crop_rects(path: Path) -> np.ndarray:
    """Both forms of crop_rects.json -> int64 array [n, 4] (x1, y1, x2, y2), not yet clipped."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AssetError(f"{path}: crop rects file is missing") from None
    except (OSError, ValueError) as err:
        raise AssetError(f"{path}: not readable JSON: {err}") from None
    if isinstance(data, dict):
        try:
            keys = sorted(data, key=int)
        except ValueError:
            raise AssetError(f"{path}: keys must be frame indices \"0\", \"1\", ...") from None
        if [int(k) for k in keys] != list(range(len(keys))):
            raise AssetError(f"{path}: frame indices must run 0..{len(keys) - 1} without gaps")
        items = [(k, data[k].get("rect") if isinstance(data[k], dict) else None) for k in keys]
    elif isinstance(data, list):
        items = list(enumerate(data))
    else:
        raise AssetError(f"{path}: expected {{\"0\": {{\"rect\": [x1,y1,x2,y2]}}, ...}} or [[x1,y1,x2,y2], ...]")
    rects = np.zeros((len(items), 4), np.int64)
    for i, (key, rect) in enumerate(items):
        if not (isinstance(rect, list) and len(rect) == 4 and all(isinstance(v, (int, float)) for v in rect)):
            raise AssetError(f"{path}: index {key}: expected a rect [x1, y1, x2, y2] of numbers, got {rect!r}")
        rects[i] = [int(v) for v in rect]
    return rects


def frame_index(k: int, n: int, order: str = "mirror") -> int:
    """Background index of stream frame k: mirror goes 0..n-1, n-1..0, 0..; loop goes 0..n-1, 0.."""
    i = k % n
    if order == "mirror" and (k // n) % 2 == 1:
        return n - 1 - i
    return i


def clip_rects(rects: np.ndarray, width: int, height: int, source: Path) -> np.ndarray:
    for i, (x1, y1, x2, y2) in enumerate(rects):
        if x2 <= x1 or y2 <= y1:
            raise AssetError(f"{source}: index {i}: empty box {[int(v) for v in (x1, y1, x2, y2)]} "
                             "(x2 must exceed x1 and y2 exceed y1)")
        if x2 <= 0 or y2 <= 0 or x1 >= width or y1 >= height:
            raise AssetError(f"{source}: index {i}: box {[int(v) for v in (x1, y1, x2, y2)]} lies wholly outside "
                             f"the {width}x{height} frame")
    clipped = rects.copy()
    clipped[:, [0, 2]] = np.clip(rects[:, [0, 2]], 0, width)
    clipped[:, [1, 3]] = np.clip(rects[:, [1, 3]], 0, height)
    return clipped


def read_image(path: Path) -> np.ndarray:
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise AssetError(f"{path}: cannot decode this image")
    return image


@dataclass(frozen=True)
class AvatarAssets:
    """A model's validated background: frame files, clipped crop boxes, size and frame order."""

    model_id: str
    frame_files: tuple[Path, ...]
    rects: np.ndarray     # [n, 4] int64, clipped to the frame
    width: int
    height: int
    order: str
    version: int = 0      # changes when a frame file or the rects file is replaced (see files_version)

    @property
    def n_frames(self) -> int:
        return len(self.frame_files)

    @property
    def store_id(self) -> str:
        """The shared store's name for these very files: replaced files never meet old decoded frames."""
        return f"{self.model_id}@{self.version:016x}"

    def frame_index(self, k: int) -> int:
        return frame_index(k, self.n_frames, self.order)

    def decode(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Background frame `index` and its 328x328 bicubic crop C (step 1 of the compositing)."""
        bg = read_image(self.frame_files[index])
        if bg.shape[:2] != (self.height, self.width):
            raise AssetError(f"{self.frame_files[index]}: frame is {bg.shape[1]}x{bg.shape[0]}, the others are "
                             f"{self.width}x{self.height}; every frame of a model must have one size")
        return bg, crop_328(bg, self.rects[index])


def crop_328(bg: np.ndarray, rect: np.ndarray) -> np.ndarray:
    x1, y1, x2, y2 = (int(v) for v in rect)
    return cv2.resize(bg[y1:y2, x1:x2], (CROP_SIZE, CROP_SIZE), interpolation=cv2.INTER_CUBIC)


def files_version(files) -> int:
    """A token that changes when any of the files is replaced, rewritten or renamed (name, inode, size,
    mtime): no file is read, ~2 us per file."""
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        st = path.stat()
        digest.update(f"{path.name}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return int.from_bytes(digest.digest(), "little")


def load_assets(paths: ModelPaths) -> AvatarAssets:
    """Validate a model's background assets (decodes only the first frame, for the size)."""
    files = list_frames(paths.frames)
    rects = parse_crop_rects(paths.crop_rects)
    if len(rects) < len(files):
        raise AssetError(f"{paths.crop_rects}: {len(rects)} rects for {len(files)} frames in {paths.frames}; "
                         f"index {len(rects)} and later have no crop box")
    first = read_image(files[0])
    height, width = first.shape[:2]
    clipped = clip_rects(rects[: len(files)], width, height, paths.crop_rects)
    return AvatarAssets(paths.model_id, tuple(files), clipped, width, height, paths.frame_order,
                        files_version([paths.crop_rects, *files]))


# -- the model file -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelIO:
    """A model's input/output names and shapes, found by rank and shape, never by name."""

    visual: str
    audio: str
    output: str
    audio_shape: tuple[int, ...]
    batch: Optional[int]   # None: dynamic batch dimension

    @cached_property
    def audio_elements(self) -> int:
        return int(np.prod(self.audio_shape))


def classify_io(inputs: list[tuple[str, list]], outputs: list[tuple[str, list]], source: str) -> ModelIO:
    """Pick the visual input ([B,6,320,320]) and the audio input (the other one) from (name, shape)
    lists; dims are ints, or strings/None when symbolic."""
    def static(dims) -> bool:
        return all(isinstance(d, int) and d > 0 for d in dims)

    if len(inputs) != 2 or len(outputs) != 1:
        raise AssetError(f"{source}: expected 2 inputs (visual [B,6,320,320], audio [B,...]) and 1 output, "
                         f"found inputs {inputs} and outputs {outputs}")
    visual = [(n, s) for n, s in inputs if len(s) == 4 and list(s[1:]) == list(VISUAL_SHAPE)]
    if len(visual) != 1:
        raise AssetError(f"{source}: no input of shape [B,6,320,320] (found {inputs})")
    (v_name, v_shape), = visual
    a_name, a_shape = next((n, s) for n, s in inputs if n != v_name)
    o_name, o_shape = outputs[0]
    if len(a_shape) < 2 or not static(a_shape[1:]):
        raise AssetError(f"{source}: audio input {a_name} must have a static shape after the batch dim, got {a_shape}")
    if len(o_shape) != 4 or list(o_shape[1:]) != [3, 320, 320]:
        raise AssetError(f"{source}: output {o_name} must be [B,3,320,320], got {o_shape}")
    batches = {d for d in (v_shape[0], a_shape[0], o_shape[0]) if isinstance(d, int) and d > 0}
    if len(batches) > 1:
        raise AssetError(f"{source}: inputs and output disagree on the batch size: {sorted(batches)}")
    return ModelIO(v_name, a_name, o_name, tuple(int(d) for d in a_shape[1:]), batches.pop() if batches else None)


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, start, end) of each length-delimited field of a protobuf message; others skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield number, pos, pos + length
            pos += length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")


_GRAPH, _INPUT, _OUTPUT, _INITIALIZER, _TENSOR_NAME = 7, 11, 12, 5, 8


def _scan_io(path: Path):
    """Graph inputs, outputs and initializer names, read without decoding the weights (a 48 MB model
    takes ~1 ms instead of ~190 ms for onnx.load: it matters with thousands of models)."""
    import mmap

    import onnx

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        graph = next(((a, b) for n, a, b in _fields(buf, 0, len(buf)) if n == _GRAPH), None)
        if graph is None:
            raise ValueError("no graph")
        inputs, outputs, initializers = [], [], set()
        for number, a, b in _fields(buf, *graph):
            if number == _INPUT:
                inputs.append(onnx.ValueInfoProto.FromString(buf[a:b]))
            elif number == _OUTPUT:
                outputs.append(onnx.ValueInfoProto.FromString(buf[a:b]))
            elif number == _INITIALIZER:
                name = next((buf[x:y] for n, x, y in _fields(buf, a, b) if n == _TENSOR_NAME), b"")
                initializers.add(name.decode())
    return inputs, outputs, initializers


def read_model_io(path: Path) -> ModelIO:
    """Read a model's I/O from the ONNX file without creating an inference session."""
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    try:
        inputs, outputs, initializers = _scan_io(path)
    except Exception:  # not what the fast scan expects: let onnx itself read (and judge) the file
        import onnx
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as err:  # onnx raises DecodeError and friends on garbage
            raise AssetError(f"{path}: not a readable ONNX model ({type(err).__name__}: {err})") from None
        inputs, outputs = list(model.graph.input), list(model.graph.output)
        initializers = {t.name for t in model.graph.initializer}

    def dims(value) -> list:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in value.type.tensor_type.shape.dim]

    return classify_io([(v.name, dims(v)) for v in inputs if v.name not in initializers],
                       [(v.name, dims(v)) for v in outputs], str(path))


class AssetCache:
    """Validated assets per model id, loaded on first use in this process.

    `version` is the frontend's token for the files it last read (tasks carry it): a task with another
    token than the cached entry was loaded for makes this process read the files again, once."""

    def __init__(self, config: Config):
        self._config = config
        self._assets: dict[str, tuple[int, AvatarAssets]] = {}

    def get(self, model_id: str, version: int = 0) -> AvatarAssets:
        cached = self._assets.get(model_id)
        if cached is not None and (cached[0] == version or not version):
            return cached[1]
        paths = model_paths(self._config, model_id)
        if paths is None:
            raise AssetError(f"unknown model {model_id!r}: no such entry in `models` and no such directory "
                             "in `models_dir`")
        assets = load_assets(paths)
        self._assets[model_id] = (version, assets)
        return assets
