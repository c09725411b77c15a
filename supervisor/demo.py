"""The embedded default's demo avatars, on one background video of a simple scene with a face whose crop
box moves a little, as a real one does:

    demo           talks: a small graph that opens the mouth with the audio's loudness
                   (gpu_actor/demo_model.py), and an encoder that turns speech into that loudness
    demo-unet328   unet_328's architecture and cost with random weights (a square of noise where the
                   mouth is): what the benchmarks use for real inference cost

Built once into `demo.cache_dir` (with a progress bar), then reused; a marker file is written last,
so an interrupted build is redone rather than served half-made.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

from config import Config, resolve_path
from supervisor.progress import progress as _progress

# NOTE: OpenCV (and the speech writer) are imported where the avatar is drawn: a start whose demo is
# already built only checks its marker, and spawns its children ~20 ms of CPU sooner.

WIDTH, HEIGHT = 1280, 720
MODEL_ID = "demo"
UNET_MODEL_ID = "demo-unet328"
_VERSION = 3   # 2: audio encoders (PCM input); 3: the talking demo model, unet_328 as demo-unet328


def demo_root(config: Config) -> Path:
    d = config.demo
    return resolve_path(config, d.cache_dir) / f"demo-v{_VERSION}-{d.frames}f-seed{d.seed}"


def _scene(rng: np.random.Generator) -> np.ndarray:
    """A room: a graded wall, a window with sky, a floor, a shelf. Smooth, like video, not noise."""
    import cv2
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    wall = np.stack([150 + 30 * (x / WIDTH), 160 + 20 * (y / HEIGHT), 175 - 25 * (x / WIDTH)], -1)
    img = wall.astype(np.uint8)
    cv2.rectangle(img, (0, 560), (WIDTH, HEIGHT), (60, 90, 120), -1)               # floor
    cv2.rectangle(img, (880, 90), (1180, 380), (235, 200, 150), -1)                # window: sky (BGR)
    cv2.rectangle(img, (880, 90), (1180, 380), (80, 80, 80), 8)
    cv2.line(img, (1030, 90), (1030, 380), (80, 80, 80), 6)
    cv2.rectangle(img, (80, 200), (330, 215), (50, 70, 100), -1)                    # shelf
    for i, colour in enumerate(rng.integers(40, 220, (5, 3))):
        cv2.rectangle(img, (95 + 45 * i, 130), (125 + 45 * i, 200), tuple(int(c) for c in colour), -1)
    return cv2.GaussianBlur(img, (0, 0), 1.2)


def _frame(scene: np.ndarray, k: int, n: int) -> tuple[np.ndarray, list[int]]:
    import cv2
    t = 2 * math.pi * k / n
    cx, cy = int(640 + 18 * math.sin(t) + 6 * math.sin(3.1 * t)), int(330 + 10 * math.sin(1.7 * t))
    img = scene.copy()
    cv2.ellipse(img, (cx, cy + 250), (210, 140), 0, 180, 360, (90, 60, 40), -1)     # shoulders
    cv2.rectangle(img, (cx - 45, cy + 90), (cx + 45, cy + 170), (120, 160, 205), -1)  # neck
    cv2.ellipse(img, (cx, cy), (105, 135), 0, 0, 360, (130, 170, 215), -1)         # face
    cv2.ellipse(img, (cx, cy - 95), (112, 60), 0, 180, 360, (40, 50, 70), -1)      # hair
    for dx in (-40, 40):                                                           # eyes
        cv2.ellipse(img, (cx + dx, cy - 25), (16, 9), 0, 0, 360, (250, 250, 250), -1)
        cv2.circle(img, (cx + dx, cy - 25), 6, (60, 40, 30), -1)
    cv2.ellipse(img, (cx, cy + 55), (38, 12), 0, 0, 360, (90, 90, 170), -1)        # mouth
    img = cv2.GaussianBlur(img, (0, 0), 0.8)
    half = 150  # the face crop box, centred on the lower face as a detector would place it
    return img, [cx - half, cy - half + 40, cx + half, cy + half + 40]


def _link(src: Path, dst: Path) -> None:
    try:
        dst.hardlink_to(src)
    except OSError:   # another file system: a copy
        shutil.copy(src, dst)


def build_demo(config: Config) -> Path:
    """Build (or reuse) the demo model directory; returns the models_dir to serve."""
    root = demo_root(config)
    marker = root / "complete"
    if marker.exists():
        return root
    import cv2
    from config.audio import write_speech
    from gpu_actor.demo_model import write_demo_models
    from gpu_actor.model_builder import write_audio_encoder, write_model

    d = config.demo
    model_dir = root / MODEL_ID
    if root.exists():
        shutil.rmtree(root)
    (model_dir / "frames").mkdir(parents=True)
    print(f"building the demo avatar in {root} (first run only)", file=sys.stderr)
    rng = np.random.default_rng(d.seed)
    scene = _scene(rng)
    rects = []
    for k in range(d.frames):
        img, rect = _frame(scene, k, d.frames)
        cv2.imwrite(str(model_dir / "frames" / f"{k:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
        rects.append(rect)
        if k % 10 == 0 or k == d.frames - 1:
            _progress("background frames", k + 1, d.frames)
    (model_dir / "crop_rects.json").write_text(json.dumps({str(i): {"rect": r} for i, r in enumerate(rects)}))
    write_demo_models(model_dir)
    write_speech(model_dir / "speech.wav", seed=d.seed)   # the utterance `lipsync_client stream --pcm` speaks
    unet_dir = root / UNET_MODEL_ID   # the same avatar, with unet_328's cost
    (unet_dir / "frames").mkdir(parents=True)
    for frame in (model_dir / "frames").iterdir():
        _link(frame, unet_dir / "frames" / frame.name)
    _link(model_dir / "crop_rects.json", unet_dir / "crop_rects.json")
    _progress("unet_328 model   ", 0, 1)
    write_model(unet_dir / "model.onnx", kind="unet328", audio="ave", seed=d.seed)
    write_audio_encoder(unet_dir / "audio_encoder.onnx", seed=d.seed)   # random weights: 16 kHz PCM works
    _progress("unet_328 model   ", 1, 1)
    marker.write_text("ok\n")
    return root
