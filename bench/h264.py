"""H.264 per-frame CPU, in one run: what a live session's compositing process spends per frame
(composite + encode) against libx264 alone on a frame already in I420, and what an idle frame costs.

On the demo's 1280x720 background and crop rects, with unet_328-sized mouths (uniform noise, the
hardest case for the encoder), one thread (as a compositing process runs), sessions.h264 defaults:

  bare        libx264 encoding frames that are already I420 (the mouth already in them)
  speech      the server's path: the face box pasted and converted (pack_box, the speech compositing
              step), the I420 background copied from the store's entry, the box written, encoded
  whole-BGR   for scale: the mouth pasted in BGR and the whole frame converted to I420, then encoded
  idle live   an idle frame through the session's encoder (background copy + encode)
  idle loop   an idle frame from the avatar's pre-encoded loop: a cached access unit, no encoding
"""

from __future__ import annotations

import time
from pathlib import Path

import cv2
import numpy as np

from config.assets import ModelPaths, load_assets
from config.geometry import crop_328
from config.schema import H264Config
from cpu_actor.composite import mouth_to_uint8, paste
from cpu_actor.h264 import apply_box, encode_frame, open_encoder, pack_box, to_i420
from shm.messages import H264Settings


def run(models_dir: str, model: str = "demo", frames: int = 240) -> dict:
    cv2.setNumThreads(1)
    avatar = Path(models_dir) / model
    assets = load_assets(ModelPaths(model, avatar / "model.onnx", avatar / "frames", avatar / "crop_rects.json"),
                         (4096, 4096))
    n_bg = min(assets.n_frames, 24)
    backgrounds = [assets.decode(i)[0] for i in range(n_bg)]
    crops = [crop_328(bg, assets.rects[i]) for i, bg in enumerate(backgrounds)]
    i420s = [to_i420(bg) for bg in backgrounds]
    rng = np.random.default_rng(0)
    floats = [rng.random((3, 320, 320), dtype=np.float32) for _ in range(8)]
    mouths = [mouth_to_uint8(m) for m in floats]
    cfg = H264Config()
    w, h = assets.width, assets.height

    def encoder():
        return open_encoder(w, h, H264Settings(fps=25.0, bitrate=cfg.bitrate, preset=cfg.preset, gop=cfg.gop))

    # The composited frames, already I420: what bare libx264 gets.
    ready = []
    for k in range(frames):
        bg = backgrounds[k % n_bg].copy()
        ready.append(to_i420(paste(bg, crops[k % n_bg].copy(), mouths[k % 8], assets.rects[k % n_bg])))
    sizes = []
    scratch = np.empty_like(i420s[0])   # a compositing process's one reusable frame buffer

    def bare(ctx, k):
        encode_frame(ctx, ready[k], k, False)

    def speech(ctx, k):
        b = k % n_bg
        mouth = mouth_to_uint8(floats[k % 8])
        box = pack_box(i420s[b], w, h, crops[b].copy(), mouth, assets.rects[b])            # speech compositing
        np.copyto(scratch, i420s[b])                                                       # the store's copy
        apply_box(scratch, w, h, box)
        sizes.append(len(encode_frame(ctx, scratch, k, False)))

    def whole(ctx, k):
        b = k % n_bg
        image = paste(backgrounds[b].copy(), crops[b].copy(), mouth_to_uint8(floats[k % 8]), assets.rects[b])
        encode_frame(ctx, to_i420(image), k, False)

    def idle(ctx, k):
        np.copyto(scratch, i420s[k % n_bg])
        encode_frame(ctx, scratch, k, False)

    loop = [encode_frame(encoder(), i420s[0], 0, True)] * frames

    def from_loop(ctx, k):
        bytes(loop[k])

    # NOTE: the paths take turns frame by frame, each with its own encoder, so that whatever else the
    # machine does in the meantime weighs on all of them alike; CPU time of this thread per call.
    paths = {"bare": bare, "speech": speech, "whole": whole, "idle": idle, "loop": from_loop}
    encoders = {name: encoder() for name in paths}
    spent = dict.fromkeys(paths, 0.0)
    for k in range(frames):
        for name, fn in paths.items():
            t0 = time.thread_time()
            fn(encoders[name], k)
            spent[name] += time.thread_time() - t0
    bare, ours, whole_bgr, idle_live, idle_loop = (spent[name] / frames for name in paths)
    result = {"bare_ms": bare * 1e3, "speech_ms": ours * 1e3, "ratio": ours / bare, "whole_bgr_ms": whole_bgr * 1e3,
              "idle_live_ms": idle_live * 1e3, "idle_loop_ms": idle_loop * 1e3, "speech_kbit_s": np.mean(sizes) * 8 * 25 / 1e3,
              "preset": cfg.preset, "size": f"{w}x{h}"}
    print(f"  H.264 {w}x{h} {cfg.preset} {cfg.bitrate // 1000} kbit/s, CPU per frame: libx264 alone "
          f"{result['bare_ms']:.2f} ms; composite + encode {result['speech_ms']:.2f} ms = {result['ratio']:.2f}x "
          f"(goal <= 1.3x); whole frame BGR->I420 + encode {result['whole_bgr_ms']:.2f} ms; idle frame encoded "
          f"{result['idle_live_ms']:.2f} ms, from the idle loop {result['idle_loop_ms'] * 1000:.1f} us; "
          f"speech at {result['speech_kbit_s']:.0f} kbit/s", flush=True)
    return result
