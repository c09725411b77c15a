"""A SyncTalk_2D dataset folder -> the server's frames/ and crop_rects.json.

    <dataset>/full_body_img/<i>.jpg (or .png)   the video's frames, i = 0, 1, ...
    <dataset>/landmarks/<i>.lms                 110 PFLD points, one "x y" per line

The crop box of frame i is SyncTalk_2D's, from its landmarks truncated to integers:
x1 = lms[1].x, y1 = lms[52].y, x2 = lms[31].x, y2 = y1 + (x2 - x1) (a square). A box that crosses the frame
edge is written as it is: the server clips it (config/assets.py), as it clips every model's boxes.
Frames are linked (or copied across file systems) under their own names, never decoded and encoded again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from config.assets import IMAGE_SUFFIXES, AssetError, image_size
from config.schema import CompositingConfig
from supervisor.importer import ImportFailed

N_POINTS = 110
_HEAD_BYTES = 4096            # holds a frame header as ffmpeg writes it: the first read of a frame
_MAX_HEAD_BYTES = 64 * 1024   # a JPEG's frame header may follow its EXIF data
_JPEG_END = b"\xff\xd9"
_PNG_END = b"IEND\xaeB`\x82"
DEFAULT_MAX_SIZE = (CompositingConfig().max_frame_width, CompositingConfig().max_frame_height)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Dataset:
    frames: list[Path]
    rects: np.ndarray       # [n, 4] int64, x1 y1 x2 y2, not clipped
    width: int
    height: int
    notes: list[str]        # what the user should know: frames left out, boxes the server clips


def _numbered(folder: Path, suffixes: tuple[str, ...], what: str) -> dict[int, Path]:
    if not folder.is_dir():
        raise ImportFailed(f"{folder}: missing: a SyncTalk_2D dataset has {what} here")
    found: dict[int, Path] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            stem, dot, suffix = entry.name.rpartition(".")
            if dot and stem.isdigit() and f".{suffix.lower()}" in suffixes:
                if int(stem) in found:
                    raise ImportFailed(f"{folder}: both {found[int(stem)].name} and {entry.name}: keep one")
                found[int(stem)] = Path(entry.path)
    return found


def _pairs(root: Path) -> tuple[list[tuple[Path, Path]], list[str]]:
    """(frame, landmarks) for frames 0..n-1: up to the first frame without landmarks when only the tail
    lacks them (landmark detection stopped early), refused when a gap has frames after it."""
    frames = _numbered(root / "full_body_img", IMAGE_SUFFIXES, "the video's frames, <i>.jpg")
    marks = _numbered(root / "landmarks", (".lms",), "the frames' landmarks, <i>.lms")
    if not frames:
        raise ImportFailed(f"{root / 'full_body_img'}: no frames named <i>.jpg or <i>.png (i = 0, 1, ...)")
    n = 0
    while n in frames and n in marks:
        n += 1
    notes = []
    if n < len(frames):
        later = sorted(i for i in frames if i > n and i in marks)
        first = frames.get(n)
        if first is None:
            raise ImportFailed(f"{root / 'full_body_img'}: frame {n} is missing, but frames after it exist "
                               f"({len(frames)} frames in all)")
        if later:
            raise ImportFailed(f"{first}: no landmarks ({root / 'landmarks' / f'{n}.lms'} is missing), but frames "
                               f"after it have them ({later[0]}, ...): re-run landmark detection on the frames")
        if n == 0:
            raise ImportFailed(f"{first}: no landmarks ({root / 'landmarks' / '0.lms'} is missing): run SyncTalk_2D's "
                               "preprocessing (data_utils/process.py) on the video first")
        notes.append(f"{first} is the first frame without landmarks: importing frames 0..{n - 1} "
                     f"({n} of {len(frames)})")
    elif len(marks) > n:
        notes.append(f"{len(marks) - n} landmark files have no frame; ignored")
    return [(frames[i], marks[i]) for i in range(n)], notes


def _box(path: Path) -> list[int]:
    """SyncTalk_2D's crop box from a .lms file."""
    try:
        text = path.read_text()
        points = np.array(text.split(), dtype=np.float32)
    except OSError as err:
        raise ImportFailed(f"{path}: cannot read it: {err.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise ImportFailed(f"{path}: not landmarks: expected {N_POINTS} lines of two numbers \"x y\"") from None
    lines = len(text.strip().splitlines())
    if points.size != 2 * N_POINTS or lines != N_POINTS:
        raise ImportFailed(f"{path}: {lines} lines of {points.size} numbers, expected {N_POINTS} points, one "
                           "\"x y\" per line (SyncTalk_2D's PFLD landmarks, data_utils/get_landmark.py)")
    if not np.isfinite(points).all() or np.abs(points).max() > 1e6:
        raise ImportFailed(f"{path}: landmark coordinates must be finite pixel positions")
    lms = points.reshape(N_POINTS, 2).astype(np.int32)   # SyncTalk_2D: np.array(..., dtype=np.int32), truncating
    x1, y1, x2 = int(lms[1, 0]), int(lms[52, 1]), int(lms[31, 0])
    if x2 <= x1:
        raise ImportFailed(f"{path}: crop box of zero width: x1 = lms[1].x = {x1}, x2 = lms[31].x = {x2} "
                           "(x2 must exceed x1: are these a face's 110 PFLD points, in order?)")
    return [x1, y1, x2, y1 + (x2 - x1)]


def _header_size(f, path: Path) -> tuple[int, int]:
    head = f.read(_HEAD_BYTES)
    try:
        return image_size(head, path)
    except AssetError:
        if len(head) < _HEAD_BYTES:
            raise
        return image_size(head + f.read(_MAX_HEAD_BYTES - _HEAD_BYTES), path)   # EXIF data before the header


def _frame_size(path: Path) -> tuple[int, int]:
    """(width, height) from the header, and a check that the file ends as a whole image does."""
    try:
        with open(path, "rb") as f:
            size = _header_size(f, path)
            f.seek(0)
            png = f.read(4) == b"\x89PNG"
            f.seek(max(f.seek(0, os.SEEK_END) - 32, 0))
            tail = f.read()
    except OSError as err:
        raise ImportFailed(f"{path}: cannot read it: {err.strerror}") from None
    except AssetError as err:
        raise ImportFailed(str(err)) from None
    if (_PNG_END if png else _JPEG_END) not in tail:
        raise ImportFailed(f"{path}: truncated: it does not end as a whole {'PNG' if png else 'JPEG'} file does "
                           "(copy it again, or extract the frames again)")
    return size


def read_dataset(root: Path, progress: Optional[Progress] = None) -> Dataset:
    """Every frame's size (header only) and crop box, checked; nothing is written."""
    pairs, notes = _pairs(root)
    every = max(1, len(pairs) // 100)
    size: Optional[tuple[int, int]] = None
    rects = np.zeros((len(pairs), 4), np.int64)
    for i, (frame, marks) in enumerate(pairs):
        got = _frame_size(frame)
        if size is None:
            size = got
        elif got != size:
            raise ImportFailed(f"{frame}: {got[0]}x{got[1]}, frame 0 is {size[0]}x{size[1]}: every frame of an "
                               "avatar must have one size")
        rects[i] = _box(marks)
        if progress and (i % every == 0 or i == len(pairs) - 1):
            progress("reading frames ", i + 1, len(pairs))
    assert size is not None
    width, height = size
    x1, y1, x2, y2 = rects.T
    outside = np.flatnonzero((x2 <= 0) | (y2 <= 0) | (x1 >= width) | (y1 >= height))
    if outside.size:
        i = int(outside[0])
        raise ImportFailed(f"{pairs[i][1]}: crop box {rects[i].tolist()} lies wholly outside the {width}x{height} "
                           f"frame {pairs[i][0].name}")
    if width > DEFAULT_MAX_SIZE[0] or height > DEFAULT_MAX_SIZE[1]:
        notes.append(f"frames are {width}x{height}: raise the server's compositing.max_frame_width and "
                     f"max_frame_height (default {DEFAULT_MAX_SIZE[0]}x{DEFAULT_MAX_SIZE[1]}) to serve them")
    crossing = int(((x1 < 0) | (y1 < 0) | (x2 > width) | (y2 > height)).sum())
    if crossing:
        notes.append(f"{crossing} crop boxes cross the frame edge: the server clips them to the frame")
    return Dataset([f for f, _ in pairs], rects, width, height, notes)


def write_frames(dataset: Dataset, frames_dir: Path, progress: Optional[Progress] = None, link: bool = True) -> str:
    """Hard links to the dataset's frames (copies across file systems, or with link=False), named as they
    were. Returns 'linked' or 'copied'."""
    frames_dir.mkdir()
    every = max(1, len(dataset.frames) // 100)
    for i, src in enumerate(dataset.frames):
        dst = frames_dir / src.name
        if link:
            try:
                os.link(src, dst)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise ImportFailed(f"{dst}: cannot write it: {err.strerror}") from None
                link = False   # another file system (or links refused): copy this one and the rest
        if not link:
            shutil.copyfile(src, dst)
        if progress and (i % every == 0 or i == len(dataset.frames) - 1):
            progress("writing frames ", i + 1, len(dataset.frames))
    return "linked" if link else "copied"


def write_crop_rects(dataset: Dataset, path: Path) -> None:
    path.write_text(json.dumps({str(i): {"rect": r} for i, r in enumerate(dataset.rects.tolist())}))
