"""The on-disk layout of a model: where its files are, what they hold, and how they are refused.

    <models_dir>/<id>/model.onnx
    <models_dir>/<id>/frames/           background frames, *.png or *.jpg, in natural name order
    <models_dir>/<id>/crop_rects.json   {"0": {"rect": [x1,y1,x2,y2]}, ...} or [[x1,y1,x2,y2], ...]

A rect is the face crop box in pixels, x2/y2 exclusive. Boxes that cross the frame edge are clipped;
empty boxes and boxes wholly outside the frame are refused, naming the file and the index.
"""

from __future__ import annotations

import hashlib
import struct
import json
import math
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np

from config.geometry import MOUTH_SHAPE, VISUAL_SHAPE, crop_328, valid_model_id
from config.schema import Config

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MAX_COORDINATE = 1_000_000
ERROR_TTL_S = 5.0        # a broken model's files are read again after this long
MAX_CACHED = 4096        # models whose assets (or errors) one process keeps


class AssetError(ValueError):
    """A model's files cannot be used; the message names the file (and index) and the fix."""


@dataclass(frozen=True)
class ModelPaths:
    model_id: str
    onnx: Path
    frames: Path
    crop_rects: Path
    frame_order: str = "mirror"
    audio_encoder: Optional[Path] = None   # mel -> features, for 16 kHz PCM input (config/audio.py)


def _encoder(config: Config, own: Optional[Path]) -> Optional[Path]:
    """A model's own audio_encoder.onnx, else the shared `audio.encoder`, else None."""
    from config.loader import resolve_path   # NOTE: here and below: no worker needs the loader
    if own is not None and own.exists():
        return own
    return resolve_path(config, config.audio.encoder) if config.audio.encoder else None


def model_paths(config: Config, model_id: str) -> Optional[ModelPaths]:
    """Where model `model_id`'s files are, or None if the config knows no such model."""
    if not valid_model_id(model_id):
        return None
    from config.loader import resolve_path
    entry = config.models.get(model_id)
    if isinstance(entry, str):  # a directory laid out like one under models_dir
        root = resolve_path(config, entry)
        return ModelPaths(model_id, root / "model.onnx", root / "frames", root / "crop_rects.json",
                          audio_encoder=_encoder(config, root / "audio_encoder.onnx"))
    if entry is not None:
        own = resolve_path(config, entry.audio_encoder) if entry.audio_encoder else None
        return ModelPaths(model_id, resolve_path(config, entry.onnx), resolve_path(config, entry.frames),
                          resolve_path(config, entry.crop_rects), entry.frame_order, _encoder(config, own))
    if config.models_dir is None:
        return None
    root = resolve_path(config, config.models_dir) / model_id
    if not root.is_dir():
        return None
    return ModelPaths(model_id, root / "model.onnx", root / "frames", root / "crop_rects.json",
                      audio_encoder=_encoder(config, root / "audio_encoder.onnx"))


def list_model_ids(config: Config) -> list[str]:
    ids = set(config.models)
    if config.models_dir is not None:
        from config.loader import resolve_path
        root = resolve_path(config, config.models_dir)
        if root.is_dir():
            with os.scandir(root) as entries:   # NOTE: scandir's is_dir needs no stat() per entry
                ids.update(e.name for e in entries if e.is_dir() and valid_model_id(e.name))
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
        if not (isinstance(rect, list) and len(rect) == 4 and all(_coordinate(v) for v in rect)):
            raise AssetError(f"{path}: index {key}: expected a rect [x1, y1, x2, y2] of finite pixel coordinates "
                             f"(|v| <= {MAX_COORDINATE}), got {str(rect)[:200]}")
        rects[i] = [int(v) for v in rect]
    return rects


def _coordinate(v: object) -> bool:
    # NOTE: JSON from Python's parser may hold NaN, Infinity and arbitrarily large integers; bool is an int.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= MAX_COORDINATE


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


def image_size(data: bytes, path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR or a JPEG's frame header, before anything is decoded: a file
    whose header claims 60000x60000 pixels is refused instead of allocating 10 GB."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if data[:2] == b"\xff\xd8":
        try:
            import simplejpeg   # NOTE: here: imported by the first JPEG read, not by every process at start
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except ValueError as err:
            raise AssetError(f"{path}: not a readable JPEG ({err})") from None
    raise AssetError(f"{path}: neither a PNG nor a JPEG file")


def read_image(path: Path, max_size: tuple[int, int], size: Optional[tuple[int, int]] = None) -> np.ndarray:
    """Decode a background frame of at most `max_size` pixels (and exactly `size`, when given)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise AssetError(f"{path}: cannot read it: {err.strerror}") from None
    width, height = image_size(data, path)
    _check_size(path, width, height, max_size, size)
    import cv2   # NOTE: here: the frontend imports this module for the layout alone, and needs no OpenCV
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise AssetError(f"{path}: cannot decode this image")
    return image


def _check_size(path: Path, width: int, height: int, max_size: tuple[int, int], size) -> None:
    if width > max_size[0] or height > max_size[1] or not width or not height:
        raise AssetError(f"{path}: frame is {width}x{height}, more than compositing.max_frame_width x "
                         f"max_frame_height ({max_size[0]}x{max_size[1]}); raise them or use smaller frames")
    if size is not None and (width, height) != size:
        raise AssetError(f"{path}: frame is {width}x{height}, the others are {size[0]}x{size[1]}; every frame of "
                         "a model must have one size")


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
    max_size: tuple[int, int] = (8192, 8192)   # compositing.max_frame_width, max_frame_height

    @property
    def n_frames(self) -> int:
        return len(self.frame_files)

    @property
    def store_id(self) -> str:
        """The shared store's name for these very files: replaced files never meet old decoded frames."""
        return f"{self.model_id}@{self.version:016x}"

    def frame_index(self, k: int) -> int:
        return frame_index(k, self.n_frames, self.order)

    def check_frames(self, frames) -> None:
        """Refuse background indices these files do not have (the files changed under a request)."""
        bad = next((k for k in frames if not 0 <= k < self.n_frames), None)
        if bad is not None:
            raise AssetError(f"model {self.model_id}: background frame {bad} does not exist: "
                             f"{self.frame_files[0].parent} has {self.n_frames} frames (were its files replaced? "
                             "`unload` the model after replacing them)")

    def decode(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Background frame `index` and its 328x328 bicubic crop C (step 1 of the compositing)."""
        self.check_frames((index,))
        bg = read_image(self.frame_files[index], self.max_size, (self.width, self.height))
        return bg, crop_328(bg, self.rects[index])


def files_version(files) -> int:
    """A token that changes when any of the files is replaced, rewritten or renamed (name, inode, size,
    mtime): no file is read, ~2 us per file."""
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        st = path.stat()
        digest.update(f"{path.name}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return int.from_bytes(digest.digest(), "little")


def load_assets(paths: ModelPaths, max_size: tuple[int, int]) -> AvatarAssets:
    """Validate a model's background assets (reads only the first frame's header, for the size)."""
    files = list_frames(paths.frames)
    rects = parse_crop_rects(paths.crop_rects)
    if len(rects) < len(files):
        raise AssetError(f"{paths.crop_rects}: {len(rects)} rects for {len(files)} frames in {paths.frames}; "
                         f"index {len(rects)} and later have no crop box")
    try:
        with open(files[0], "rb") as f:
            head = f.read(64 * 1024)   # a JPEG's frame header may follow its EXIF data
    except OSError as err:
        raise AssetError(f"{files[0]}: cannot read it: {err.strerror}") from None
    width, height = image_size(head, files[0])
    _check_size(files[0], width, height, max_size, None)
    clipped = clip_rects(rects[: len(files)], width, height, paths.crop_rects)
    return AvatarAssets(paths.model_id, tuple(files), clipped, width, height, paths.frame_order,
                        files_version([paths.crop_rects, *files]), max_size)


def max_frame_size(config: Config) -> tuple[int, int]:
    return config.compositing.max_frame_width, config.compositing.max_frame_height


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
    if len(o_shape) != 4 or list(o_shape[1:]) != list(MOUTH_SHAPE):
        raise AssetError(f"{source}: output {o_name} must be [B,3,320,320], got {o_shape}")
    batches = {d for d in (v_shape[0], a_shape[0], o_shape[0]) if isinstance(d, int) and d > 0}
    if len(batches) > 1:
        raise AssetError(f"{source}: inputs and output disagree on the batch size: {sorted(batches)}")
    return ModelIO(v_name, a_name, o_name, tuple(int(d) for d in a_shape[1:]), batches.pop() if batches else None)


class AssetCache:
    """Validated assets per model id, loaded on first use in this process.

    `version` is the frontend's token for the files it last read (tasks carry it): a task with another
    token than the cached entry was loaded for makes this process read the files again, once.
    A failure is cached too (for ERROR_TTL_S), so a broken model costs one read, not one per request;
    at most MAX_CACHED models are kept, least recently used first out."""

    def __init__(self, config: Config):
        self._config = config
        self._assets: OrderedDict[str, tuple[int, AvatarAssets | AssetError, float]] = OrderedDict()

    def get(self, model_id: str, version: int = 0) -> AvatarAssets:
        cached = self._assets.get(model_id)
        if cached is not None and (cached[0] == version or not version):
            found, at = cached[1], cached[2]
            if isinstance(found, AvatarAssets):
                self._assets.move_to_end(model_id)
                return found
            if time.monotonic() - at < ERROR_TTL_S:
                raise found
        try:
            found = self._read(model_id)
        except AssetError as err:
            found = err
        self._assets[model_id] = (version, found, time.monotonic())
        self._assets.move_to_end(model_id)
        while len(self._assets) > MAX_CACHED:
            self._assets.popitem(last=False)
        if isinstance(found, AssetError):
            raise found
        return found

    def _read(self, model_id: str) -> AvatarAssets:
        paths = model_paths(self._config, model_id)
        if paths is None:
            raise AssetError(f"unknown model {model_id!r}: no such entry in `models` and no such directory "
                             "in `models_dir`")
        return load_assets(paths, max_frame_size(self._config))
