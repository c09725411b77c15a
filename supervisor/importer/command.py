"""python -m supervisor import-synctalk2d --dataset DIR --checkpoint FILE|DIR [--audio-encoder FILE] --out MODELS_DIR/<id>

Writes a whole model directory (model.onnx, audio_encoder.onnx, frames/, crop_rects.json) into a temporary
folder beside --out, then renames it into place: a server serving MODELS_DIR never sees half an avatar.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import onnx

from config.geometry import valid_model_id
from supervisor.importer import ImportFailed
from supervisor.importer.dataset import read_dataset, write_crop_rects, write_frames
from supervisor.importer.models import (audio_encoder_from_checkpoint, check_unet_onnx, describe_source,
                                        pick_checkpoint, unet_from_checkpoint)
from supervisor.progress import progress as show_progress


@dataclass(frozen=True)
class Imported:
    out: Path
    frames: int
    width: int
    height: int
    frames_written: str      # 'linked' or 'copied'
    model_source: str
    encoder_source: Optional[str]
    notes: list[str]
    seconds: dict[str, float]


def import_avatar(dataset: Path, out: Path, audio: str = "ave", checkpoint: Optional[Path] = None,
                  onnx_path: Optional[Path] = None, audio_encoder: Optional[Path] = None, force: bool = False,
                  progress: bool = True, link: bool = True) -> Imported:
    """Check every input, then write the model directory `out` whole (ImportFailed says what is wrong).
    Frames are hard-linked where the file system allows (link=False: copied)."""
    bar = show_progress if progress else None
    out = Path(out)
    _check_out(out, force)
    if (checkpoint is None) == (onnx_path is None):
        raise ImportFailed("give the unet as --checkpoint (a .pth file or the training run's folder) or as --onnx, "
                           "not both")
    if audio_encoder is not None and audio != "ave":
        raise ImportFailed(f"--audio-encoder makes ave features from speech; a {audio} model takes {audio} "
                           "features: leave it out")
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    steps = 2 if audio_encoder is not None else 1
    if bar:
        bar("building the graph", 0, steps)
    if checkpoint is not None:
        source = pick_checkpoint(Path(checkpoint))
        unet, model_source = unet_from_checkpoint(source, audio), describe_source(source, Path(checkpoint))
    else:
        unet, model_source = check_unet_onnx(Path(onnx_path), audio), f"{Path(onnx_path).name} (as exported)"
    if bar:
        bar("building the graph", 1, steps)
    encoder = audio_encoder_from_checkpoint(Path(audio_encoder)) if audio_encoder is not None else None
    if bar and encoder is not None:
        bar("building the graph", 2, steps)
    seconds["models"] = time.perf_counter() - t

    t = time.perf_counter()
    data = read_dataset(Path(dataset), bar)
    seconds["read_frames"] = time.perf_counter() - t

    t = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        onnx.save(unet, str(tmp / "model.onnx"))
        if encoder is not None:
            onnx.save(encoder, str(tmp / "audio_encoder.onnx"))
        written = write_frames(data, tmp / "frames", bar, link)
        write_crop_rects(data, tmp / "crop_rects.json")
        os.chmod(tmp, 0o755)   # mkdtemp's 0700 would hide the model from a server running as another user
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds["write"] = time.perf_counter() - t
    return Imported(out, len(data.frames), data.width, data.height, written, model_source,
                    Path(audio_encoder).name if audio_encoder is not None else None, data.notes, seconds)


def _check_out(out: Path, force: bool) -> None:
    if not valid_model_id(out.name):
        raise ImportFailed(f"--out {out}: its last part is the model id, {out.name!r} is not one (letters, digits, "
                           "'_', '.', '-', at most 64, starting with a letter or digit)")
    if out.exists() and not force:
        raise ImportFailed(f"--out {out}: already exists; --force replaces it")
    if out.exists() and not out.is_dir():
        raise ImportFailed(f"--out {out}: exists and is not a folder")


def _publish(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)   # NOTE: fails, rather than merging, if another import published `out` meanwhile
        return
    # --force: the old directory steps aside, the new one takes its name; a request that reads the directory
    # between the two renames finds no model, never a mixture of the two.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.rename(out, old / out.name)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def import_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m supervisor import-synctalk2d",
        description="Turn a trained SyncTalk_2D avatar (its dataset folder and checkpoints) into a model directory "
                    "the server serves: model.onnx, audio_encoder.onnx, frames/, crop_rects.json. No torch needed.")
    parser.add_argument("--dataset", required=True, type=Path, metavar="DIR",
                        help="SyncTalk_2D's dataset folder: full_body_img/<i>.jpg and landmarks/<i>.lms")
    unet = parser.add_mutually_exclusive_group(required=True)
    unet.add_argument("--checkpoint", type=Path, metavar="FILE|DIR",
                      help="the unet checkpoint training saved (<epoch>.pth), or the run's checkpoint folder (the "
                           "largest epoch is taken)")
    unet.add_argument("--onnx", type=Path, metavar="FILE", help="an already exported unet_328 ONNX model instead")
    parser.add_argument("--audio-encoder", type=Path, metavar="FILE",
                        help="audio_visual_encoder.pth, the mel -> 512 AudioEncoder the unet was trained with: lets "
                             "the server take speech (16 kHz PCM) for this model")
    parser.add_argument("--audio", choices=["ave", "hubert", "wenet"], default="ave",
                        help="the audio features the unet was trained on (training's --asr); default ave")
    parser.add_argument("--out", required=True, type=Path, metavar="MODELS_DIR/ID",
                        help="the model directory to write; its name is the model id")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        done = import_avatar(args.dataset, args.out, args.audio, args.checkpoint, args.onnx, args.audio_encoder,
                             args.force)
    except ImportFailed as err:
        print(f"import-synctalk2d: {err}", file=sys.stderr)
        return 2
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    print(_summary(done, args.audio, args.force))
    return 0


def _summary(done: Imported, audio: str, replaced: bool) -> str:
    lines = [f"wrote {done.out}: {done.frames} frames {done.width}x{done.height} ({done.frames_written}), "
             f"unet_328 {audio} from {done.model_source}" +
             (f", audio encoder from {done.encoder_source}" if done.encoder_source else ""),
             f"serve it with models_dir: {done.out.parent} (model id {done.out.name}); a running server reads it on "
             "its first request" + (f", after `python -m lipsync_client unload {done.out.name}`" if replaced else ""),
             "its background plays in the server's mirror order (0..n-1, n-1..0): docs/protocol.md#frame-order"]
    if audio != "ave":
        lines.append(f"{audio} model: clients send {audio} feature windows; the server does not compute them from "
                     "speech (pcm16 needs an ave model and its audio encoder)")
    elif not done.encoder_source:
        lines.append("no --audio-encoder: the model takes feature windows, or speech when the server's "
                     "`audio.encoder` names an encoder")
    return "\n".join(lines)
