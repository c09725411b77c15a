"""Import: a 5-minute SyncTalk_2D avatar (7,500 frames of 1280x720, landmarks, a full-size unet_328 and
AudioEncoder checkpoint) through `import-synctalk2d`, timed by step, with frames hard-linked (dataset and
models on one file system) and copied. The dataset is generated once (frames are JPEGs of the demo's scene,
written as distinct files) and read from the page cache, as a dataset just produced by preprocessing is.

    python -m bench.importer [--frames 7500] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from supervisor.demo import _frame, _scene
from supervisor.importer.checkpoint import write_state_dict
from supervisor.importer.command import import_avatar
from tests.synctalk2d_reference import Net


def _dataset(root: Path, n: int) -> Path:
    (root / "full_body_img").mkdir(parents=True)
    (root / "landmarks").mkdir()
    scene = _scene(np.random.default_rng(0))
    distinct = []
    for k in range(25):   # a second of video, repeated: the importer reads headers, never pixels
        img, rect = _frame(scene, k, 25)
        distinct.append((cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes(), rect))
    rng = np.random.default_rng(1)
    for i in range(n):
        data, (x1, y1, x2, _) = distinct[i % 25]
        (root / "full_body_img" / f"{i}.jpg").write_bytes(data)
        points = rng.uniform(x1, x2, (110, 2))
        points[1, 0], points[52, 1], points[31, 0] = x1 + 0.5, y1 + 0.5, x2 + 0.5
        (root / "landmarks" / f"{i}.lms").write_text("\n".join(f"{x:.6f} {y:.6f}" for x, y in points) + "\n")
    return root


def _checkpoints(root: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(2)
    unet, encoder = Net(seed=2), Net(seed=3)
    unet.unet(rng.random((1, 6, 320, 320)), rng.standard_normal((1, 32, 16, 16)))
    encoder.audio_encoder(rng.standard_normal((8, 1, 80, 16)))
    (root / "run").mkdir()
    return (write_state_dict(root / "run" / "99.pth", unet.state),
            write_state_dict(root / "audio_visual_encoder.pth",
                             {k.removeprefix("audio_encoder."): v for k, v in encoder.state.items()}))


def run(frames: int, work: Path) -> dict:
    t = time.perf_counter()
    data = _dataset(work / "dataset", frames)
    unet, encoder = _checkpoints(work)
    print(f"generated {frames} frames and the checkpoints in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    results = {}
    for link in (True, False):
        out = work / "models" / ("linked" if link else "copied")
        t = time.perf_counter()
        done = import_avatar(data, out, checkpoint=unet.parent, audio_encoder=encoder, link=link)
        results[done.frames_written] = {"total_s": time.perf_counter() - t, **done.seconds}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.importer", description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=7500)
    parser.add_argument("--dir", type=Path, help="where to generate the dataset (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for how, r in run(args.frames, work).items():
            print(f"import of {args.frames} frames, {how}: {r['total_s']:.1f} s (models {r['models']:.1f} s, "
                  f"reading frames {r['read_frames']:.1f} s, writing {r['write']:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
