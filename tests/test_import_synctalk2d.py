"""`python -m supervisor import-synctalk2d`: checkpoints read without torch (and never run), the ONNX models
against an independent forward pass, SyncTalk_2D's crop boxes, bad inputs, and an imported avatar speaking
in a live session of a running server."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from config import audio as A
from lipsync_client import Session
from gpu_actor.model_builder import StateDictWeights, write_model
from gpu_actor.model_split import split_model
from supervisor.importer import ImportFailed
from supervisor.importer.checkpoint import CheckpointError, read_checkpoint, write_state_dict
from supervisor.importer.command import import_avatar
from tests.helpers import ROOT, base_config, decode_image, make_avatar, reference_composite, reference_visual, run_server
from tests.synctalk2d_reference import Net, conv2d

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "synctalk2d"
SIZE = (480, 360)


# -- what training leaves: checkpoints and a dataset -----------------------------------------------------

@pytest.fixture(scope="module")
def unet_state():
    """A full-size unet_328 (ave) state_dict: known random weights, batch-norm statistics as training
    leaves them (of what reaches each layer), far from 0 and 1."""
    rng = np.random.default_rng(3)
    net = Net(seed=3)
    net.unet(rng.random((2, 6, 320, 320)), rng.standard_normal((2, 32, 16, 16)))
    return net.state


@pytest.fixture(scope="module")
def encoder_state():
    """The AudioEncoder's 91 entries, as audio_visual_encoder.pth holds them (no `audio_encoder.` prefix)."""
    net = Net(seed=4)
    net.audio_encoder(np.random.default_rng(4).standard_normal((64, 1, 80, 16)))
    return {k[len("audio_encoder."):]: v for k, v in net.state.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory, unet_state, encoder_state):
    d = tmp_path_factory.mktemp("checkpoints")
    (d / "run").mkdir()
    write_state_dict(d / "unet.pth", unet_state)
    # A training run's folder: DataParallel's `module.` keys, wrapped with the epoch; 9.pth sorts last by name.
    write_state_dict(d / "run" / "10.pth", {f"module.{k}": v for k, v in unet_state.items()})
    (d / "run" / "9.pth").write_bytes(b"not the largest epoch")
    write_state_dict(d / "audio_visual_encoder.pth", encoder_state)
    return d


def box(k: int) -> tuple[float, float, float]:
    """Frame k's landmark positions lms[1].x, lms[52].y, lms[31].x (fractions: SyncTalk_2D truncates);
    frame 0's box crosses the left edge."""
    return (-20.6 if k == 0 else 140.7 + 6 * k, 90.3 + 2 * k, 300.9 + 6 * k)


def expected_rect(k: int) -> list[int]:
    x1, y1, x2 = (int(np.float32(v)) for v in box(k))   # int() truncates toward zero, as astype(int32) does
    return [x1, y1, x2, y1 + x2 - x1]


def make_dataset(root: Path, n: int = 6, ext: str = "jpg", landmarks: int | None = None) -> Path:
    """SyncTalk_2D's layout: full_body_img/<i>.jpg and landmarks/<i>.lms (110 "x y" lines)."""
    (root / "full_body_img").mkdir(parents=True)
    (root / "landmarks").mkdir()
    rng = np.random.default_rng(5)
    w, h = SIZE
    y, x = np.mgrid[0:h, 0:w]
    for k in range(n):
        img = np.stack([x * 0.4 + 30, y * 0.5 + 40, (x + y) * 0.2 + 50], -1)
        cv2.ellipse(img, (220 + 6 * k, 200), (90, 120), 0, 0, 360, (110, 150, 200), -1)
        cv2.ellipse(img, (220 + 6 * k, 250), (30, 10), 0, 0, 360, (80, 80, 160), -1)
        img = np.clip(img + rng.normal(0, 3, img.shape), 0, 255).astype(np.uint8)
        cv2.imwrite(str(root / "full_body_img" / f"{k}.{ext}"), img)
    for k in range(n if landmarks is None else landmarks):
        points = rng.uniform(100, 300, (110, 2))
        x1, y1, x2 = box(k)
        points[1, 0], points[52, 1], points[31, 0] = x1, y1, x2
        (root / "landmarks" / f"{k}.lms").write_text("\n".join(f"{px} {py}" for px, py in points) + "\n")
    return root


# -- the checkpoint reader, on what torch.save wrote ------------------------------------------------------

@pytest.mark.parametrize("name", ["conv_bn", "conv_bn_legacy", "conv_bn_module", "conv_bn_wrapped", "conv_bn_half"])
def test_reads_torch_save_output_without_torch(name):
    expected = np.load(FIXTURES / "expected.npz")
    got = read_checkpoint(FIXTURES / f"{name}.pth")
    if name == "conv_bn_wrapped":
        assert got["epoch"] == 99 and got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
        got = got["state_dict"]
    got = {k.removeprefix("module."): v for k, v in got.items()}
    assert sorted(got) == sorted(k for k in expected.files if k not in ("input", "output"))
    for key, value in got.items():
        want = expected[key].astype(np.float16) if name == "conv_bn_half" and expected[key].dtype.kind == "f" \
            else expected[key]
        assert value.dtype == want.dtype and value.shape == want.shape, key
        np.testing.assert_array_equal(value, want, err_msg=key)
    assert "torch" not in sys.modules


def test_reads_strided_views_as_torch_stores_them():
    weight = np.load(FIXTURES / "expected.npz")["0.weight"].reshape(4, 27)
    got = read_checkpoint(FIXTURES / "views.pth")
    np.testing.assert_array_equal(got["transposed"], weight.T)
    np.testing.assert_array_equal(got["row"], weight[2])


def test_batch_norm_folds_into_the_convolution_as_torch_computes_it():
    expected = np.load(FIXTURES / "expected.npz")
    w, b = StateDictWeights(read_checkpoint(FIXTURES / "conv_bn.pth")).conv("0", (4, 3, 3, 3), True, "1", 1.0)
    out = conv2d(expected["input"].astype(np.float64), w, (1, 1), 1, 1) + b[None, :, None, None]
    np.testing.assert_allclose(out, expected["output"], rtol=0, atol=1e-5)
    assert np.abs(expected["output"]).max() > 10   # the statistics are far from 0 and 1: a wrong fold would show


def _malicious_pickle(marker: Path) -> bytes:
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    return pickle.dumps({"inc.inconv.0.conv.0.weight": Payload()}, protocol=2)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_a_checkpoint_that_calls_anything_else_is_refused_and_never_run(tmp_path, layout):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    if layout == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("evil/data.pkl", _malicious_pickle(marker))
    else:
        path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2) +
                         pickle.dumps({"little_endian": True}, protocol=2) + _malicious_pickle(marker))
    with pytest.raises(CheckpointError, match=r"refused: it asks to call posix\.system.*Nothing of it was run"):
        read_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "not a checkpoint"])
def test_a_corrupt_or_truncated_checkpoint_is_named(tmp_path, damage):
    data = bytearray((FIXTURES / "conv_bn.pth").read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped byte":
        at = data.index(b"conv_bn/data/0") + 200   # inside the first storage: its CRC no longer matches
        data[at] ^= 0xFF
    else:
        data = b"version https://git-lfs.github.com/spec/v1\n"
    (tmp_path / "bad.pth").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="bad.pth: (corrupt or truncated|not a PyTorch checkpoint)"):
        read_checkpoint(tmp_path / "bad.pth")


# -- the models: against an independent forward pass ------------------------------------------------------

def _run(path: Path, **feeds) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})[0]


def test_the_imported_models_compute_what_synctalk2ds_networks_compute(tmp_path, files, unet_state, encoder_state):
    out = import_avatar(make_dataset(tmp_path / "data"), tmp_path / "models" / "may", checkpoint=files / "run",
                        audio_encoder=files / "audio_visual_encoder.pth", progress=False).out
    rng = np.random.default_rng(11)
    visual, audio = rng.random((2, 6, 320, 320)), rng.standard_normal((2, 32, 16, 16))
    want = Net(dict(unet_state)).unet(visual, audio)
    got = _run(out / "model.onnx", input=visual, audio=audio)
    assert got.shape == (2, 3, 320, 320) and want.std() > 0.1   # not saturated: the comparison means something
    assert np.abs(got - want).max() <= 1e-4
    # one architecture with the demo's unet_328: a GPU worker serves both from one prepared session
    demo = write_model(tmp_path / "demo-unet328.onnx", kind="unet328", audio="ave", seed=9)
    assert split_model(out / "model.onnx").architecture.key == split_model(demo).architecture.key

    mel = rng.standard_normal((5, 1, 80, 16))
    want = Net({f"audio_encoder.{k}": v for k, v in encoder_state.items()}).audio_encoder(mel)
    got = _run(out / "audio_encoder.onnx", mel=mel)
    assert got.shape == (5, 512)
    assert np.abs(got - want).max() <= 1e-4

    # The same test catches a fold that forgets the running statistics.
    means = [k for k in unet_state if k.endswith("running_mean")]
    assert max(np.abs(unet_state[k]).max() for k in means) > 5
    stale = {**unet_state, **{k: np.zeros_like(unet_state[k]) for k in means}}
    write_state_dict(tmp_path / "stale.pth", stale)
    wrong = import_avatar(tmp_path / "data", tmp_path / "models" / "stale", checkpoint=tmp_path / "stale.pth",
                          progress=False).out
    assert np.abs(_run(wrong / "model.onnx", input=visual, audio=audio) - Net(dict(unet_state)).unet(visual, audio)
                  ).max() > 0.05


def test_the_imported_model_in_fp16_on_the_gpu_path_keeps_the_crop_within_45_db_of_fp32(tmp_path, files):
    """inference.precision: fp16 converts the graph at load (the GPU path, here on the stand-in device:
    the CPU provider runs the converted graph with its weights rounded to float16), keeping leading
    convolutions in fp32 where the crop would fall under 45 dB of fp32's (all in fp16: 39.5 dB on this
    checkpoint). The mouth as the compositor pastes it, floor(255 * P), against fp32's: PSNR >= 45 dB,
    on other frames than the load's probe. On a card, tests/test_gpu.py."""
    from gpu_actor.architectures import Architectures
    from gpu_actor.device import StandInDevice
    out = import_avatar(make_dataset(tmp_path / "data"), tmp_path / "models" / "may", checkpoint=files / "unet.pth",
                        progress=False).out
    rng = np.random.default_rng(12)
    visual = rng.random((2, 6, 320, 320), dtype=np.float32)
    audio = rng.standard_normal((2, 32, 16, 16)).astype(np.float32)
    mouths = {}
    for precision in ("fp32", "fp16"):
        runner = Architectures(StandInDevice(0.0), 2, 0, False, precision).load(out / "model.onnx")
        mouths[precision] = np.empty((2, 3, 320, 320), np.float32)
        runner.run(visual, audio, mouths[precision])
    assert runner.nbytes < 0.6 * Architectures(StandInDevice(0.0), 1, 0, False).load(out / "model.onnx").nbytes
    crop = {p: np.clip(np.floor(255 * m), 0, 255) for p, m in mouths.items()}
    mse = float(np.mean((crop["fp16"] - crop["fp32"]) ** 2))
    psnr = 10 * np.log10(255 ** 2 / max(mse, 1e-12))
    print(f"\nfp16 vs fp32, imported unet_328: crop PSNR {psnr:.1f} dB, largest difference "
          f"{np.abs(mouths['fp16'] - mouths['fp32']).max():.1e}")
    assert psnr >= 45, psnr


def test_the_dataset_becomes_frames_and_synctalk2d_crop_boxes(tmp_path, files):
    data = make_dataset(tmp_path / "data", n=7, landmarks=5)   # landmark detection stopped after frame 4
    done = import_avatar(data, tmp_path / "models" / "may", checkpoint=files / "unet.pth", progress=False)
    rects = json.loads((done.out / "crop_rects.json").read_text())
    assert [rects[str(k)]["rect"] for k in range(5)] == [expected_rect(k) for k in range(5)]
    assert sorted(p.name for p in (done.out / "frames").iterdir()) == [f"{k}.jpg" for k in range(5)]
    assert (done.out / "frames" / "3.jpg").read_bytes() == (data / "full_body_img" / "3.jpg").read_bytes()
    assert any("full_body_img/5.jpg is the first frame without landmarks: importing frames 0..4" in n
               for n in done.notes), done.notes
    assert any("1 crop boxes cross the frame edge" in n for n in done.notes), done.notes
    assert not (done.out / "audio_encoder.onnx").exists()
    assert [p.name for p in done.out.parent.iterdir()] == ["may"]   # no temporary folder left


def test_png_frames_and_an_exported_onnx_in_place_of_the_checkpoint(tmp_path):
    data = make_dataset(tmp_path / "data", n=3, ext="png")
    write_model(tmp_path / "exported.onnx", kind="tiny", audio="ave", batch=1)
    write_model(tmp_path / "hubert.onnx", kind="tiny", audio="hubert")
    done = import_avatar(data, tmp_path / "models" / "may", onnx_path=tmp_path / "exported.onnx", progress=False)
    assert (done.out / "model.onnx").read_bytes() == onnx.load(str(tmp_path / "exported.onnx")).SerializeToString()
    assert sorted(p.name for p in (done.out / "frames").iterdir()) == ["0.png", "1.png", "2.png"]
    with pytest.raises(ImportFailed, match=r"audio input audio is \[32, 32, 32\].*this is a hubert model, pass "
                                           r"--audio hubert"):
        import_avatar(data, tmp_path / "models" / "h", onnx_path=tmp_path / "hubert.onnx", progress=False)


def test_a_hubert_checkpoint_imports_as_a_model_that_takes_hubert_features(tmp_path, files):
    data = make_dataset(tmp_path / "data", n=2)
    done = import_avatar(data, tmp_path / "models" / "h", audio="hubert", checkpoint=files / "unet.pth",
                         progress=False)
    audio = onnx.load(str(done.out / "model.onnx")).graph.input[1]
    assert [d.dim_value for d in audio.type.tensor_type.shape.dim[1:]] == [32, 32, 32]
    with pytest.raises(ImportFailed, match="--audio-encoder makes ave features from speech; a hubert model takes"):
        import_avatar(data, tmp_path / "models" / "h2", audio="hubert", checkpoint=files / "unet.pth",
                      audio_encoder=files / "audio_visual_encoder.pth", progress=False)


# -- bad inputs -----------------------------------------------------------------------------------------

BAD_CHECKPOINTS = {
    "missing key": (lambda s: {k: v for k, v in s.items() if k != "up3.conv.double_conv.1.conv.4.running_var"},
                    r"missing key up3\.conv\.double_conv\.1\.conv\.4\.running_var \(expected shape \[64\]\)"),
    "wrong shape": (lambda s: {**s, "outc.conv.weight": np.zeros((3, 32, 1, 1), np.float32)},
                    r"key outc\.conv\.weight has shape \[3, 32, 1, 1\], expected \[3, 16, 1, 1\]"),
    "unexpected key": (lambda s: {**s, "outc.extra": np.zeros((7,), np.float32)},
                       r"unexpected key outc\.extra \(shape \[7\]\)"),
    "wenet": (lambda s: {**s, "audio_model.conv1.conv.0.weight": np.zeros((512, 256, 1, 1), np.float32)},
              r"looks like a wenet checkpoint: --audio wenet imports it.*does not run wenet's front end"),
    "encoder as unet": (None, r"looks like the audio encoder's checkpoint .*pass it as --audio-encoder"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_a_checkpoint_that_is_not_unet_328_names_the_first_key_that_does_not_fit(tmp_path, files, unet_state, case):
    change, message = BAD_CHECKPOINTS[case]
    path = files / "audio_visual_encoder.pth" if change is None else write_state_dict(tmp_path / "c.pth",
                                                                                      change(dict(unet_state)))
    (tmp_path / "models").mkdir()
    with pytest.raises(ImportFailed, match=message):
        import_avatar(make_dataset(tmp_path / "data", n=2), tmp_path / "models" / "may", checkpoint=path,
                      progress=False)
    assert not any((tmp_path / "models").iterdir())


def _bad_landmarks(data: Path) -> None:
    (data / "landmarks" / "1.lms").write_text("\n".join(["1 2"] * 68))


def _zero_width(data: Path) -> None:
    lines = (data / "landmarks" / "1.lms").read_text().splitlines()
    lines[31] = f"{lines[1].split()[0]} 5"
    (data / "landmarks" / "1.lms").write_text("\n".join(lines))


def _truncated_frame(data: Path) -> None:
    frame = data / "full_body_img" / "1.jpg"
    frame.write_bytes(frame.read_bytes()[:-500])


def _gap(data: Path) -> None:
    (data / "landmarks" / "1.lms").unlink()


BAD_DATASETS = {
    "landmark count": (_bad_landmarks, r"landmarks/1\.lms: 68 lines of 136 numbers, expected 110 points"),
    "zero width": (_zero_width, r"landmarks/1\.lms: crop box of zero width: x1 = lms\[1\]\.x = 146, x2 = "
                                r"lms\[31\]\.x = 146"),
    "truncated frame": (_truncated_frame, r"full_body_img/1\.jpg: truncated"),
    "gap": (_gap, r"full_body_img/1\.jpg: no landmarks \(.*landmarks/1\.lms is missing\), but frames after it have"),
    "no dataset": (lambda d: shutil.rmtree(d / "full_body_img"), r"full_body_img: missing"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATASETS))
def test_a_bad_dataset_gets_a_message_naming_the_file(tmp_path, files, case):
    change, message = BAD_DATASETS[case]
    data = make_dataset(tmp_path / "data", n=3)
    change(data)
    (tmp_path / "models").mkdir()
    with pytest.raises(ImportFailed, match=message):
        import_avatar(data, tmp_path / "models" / "may", checkpoint=files / "unet.pth", progress=False)
    assert not any((tmp_path / "models").iterdir())   # nothing half-written, no temporary folder


def test_an_existing_model_directory_is_replaced_only_with_force(tmp_path, files):
    data = make_dataset(tmp_path / "data", n=2)
    out = tmp_path / "models" / "may"
    out.mkdir(parents=True)
    (out / "old").write_text("x")
    with pytest.raises(ImportFailed, match=r"--out .*may: already exists; --force replaces it"):
        import_avatar(data, out, checkpoint=files / "unet.pth", progress=False)
    assert (out / "old").exists()
    import_avatar(data, out, checkpoint=files / "unet.pth", force=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["crop_rects.json", "frames", "model.onnx"]
    assert [p.name for p in out.parent.iterdir()] == ["may"]


# -- end to end: a running server serves the imported avatar ------------------------------------------------

def _import_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "import-synctalk2d", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_an_imported_avatar_speaks_in_a_live_session_while_the_server_keeps_serving(tmp_path, files):
    from tests.test_audio import speech_like

    models = tmp_path / "models"
    make_avatar(models, "a", n_frames=3)
    data = make_dataset(tmp_path / "data", n=6)
    (tmp_path / "srv").mkdir()
    budget_ms = 10000
    cfg = base_config(models, sessions={"latency_budget_ms": budget_ms, "start_delay_ms": 300})
    with run_server(tmp_path / "srv", cfg) as server:
        evil = tmp_path / "evil.pth"
        with zipfile.ZipFile(evil, "w") as zf:
            zf.writestr("evil/data.pkl", _malicious_pickle(tmp_path / "ran"))
        refused = _import_cli("--dataset", str(data), "--checkpoint", str(evil), "--out", str(models / "evil"))
        assert refused.returncode == 2 and "refused: it asks to call posix.system" in refused.stderr
        assert not (tmp_path / "ran").exists() and not (models / "evil").exists()

        done = _import_cli("--dataset", str(data), "--checkpoint", str(files / "run"), "--audio-encoder",
                           str(files / "audio_visual_encoder.pth"), "--out", str(models / "may"))
        assert done.returncode == 0, done.stderr
        assert "10.pth (epoch 10, the largest in" in done.stdout and "reading frames" in done.stderr
        with server.client() as c:
            assert sorted(m["id"] for m in c.models()) == ["a", "may"]
            _, images = c.composite("a", np.zeros((1, 32, 16, 16), np.float32), format="png")
            assert len(images) == 1

        # Speech that the imported network (timed here) turns into frames well within the latency budget.
        model = models / "may"
        t = time.perf_counter()
        _run(model / "model.onnx", input=np.zeros((1, 6, 320, 320)), audio=np.zeros((1, 32, 16, 16)))
        per_frame_s = time.perf_counter() - t
        seconds = float(np.clip(budget_ms / 1000 / (3 * per_frame_s) / 25, 0.2, 1.0))
        pcm = np.clip(np.round(speech_like(seconds, seed=8) * 32767), -32768, 32767).astype("<i2")
        encoder = ort.InferenceSession(str(model / "audio_encoder.onnx"), providers=["CPUExecutionProvider"])
        windows = A.frame_windows(encoder.run(None, {"mel": A.encoder_inputs(A.melspectrogram(pcm / 32768.0))})[0])
        speech, idle = {}, []
        with Session(server.endpoint, "may", format="png", audio="pcm16") as s:
            first = s.send_audio(pcm, last=True)["first_frame"]
            deadline = time.monotonic() + budget_ms / 1000 + len(windows) / 25 + 5
            while len(speech) < len(windows) and time.monotonic() < deadline:
                frame = s.next_frame(timeout_s=1.0)
                if frame is not None and frame[0].get("event") == "frame":
                    if frame[0]["kind"] == "speech":
                        speech[frame[0]["index"] - first] = frame[:2]
                    else:
                        idle.append(frame[:2])
    assert sorted(speech) == list(range(len(windows))), (sorted(speech), per_frame_s)

    rects = json.loads((model / "crop_rects.json").read_text())
    for header, image in idle[:3]:
        background = cv2.imread(str(data / "full_body_img" / f"{header['frame']}.jpg"))
        np.testing.assert_array_equal(decode_image(image, "png", {}), background)
    for i, (header, image) in sorted(speech.items()):
        k = header["frame"]
        background = cv2.imread(str(data / "full_body_img" / f"{k}.jpg"))
        rect = rects[str(k)]["rect"]
        assert rect == expected_rect(k)
        frame = decode_image(image, "png", {}).astype(int)
        x1, y1, x2, y2 = max(rect[0], 0), max(rect[1], 0), min(rect[2], SIZE[0]), min(rect[3], SIZE[1])
        outside = np.ones(frame.shape[:2], bool)
        outside[y1:y2, x1:x2] = False
        np.testing.assert_array_equal(frame[outside], background[outside])
        visual = reference_visual(background, rect)[None]
        mouth = _run(model / "model.onnx", input=visual, audio=windows[i:i + 1])[0]
        silent = _run(model / "model.onnx", input=visual, audio=np.zeros((1, 32, 16, 16)))[0]
        near = np.abs(frame - reference_composite(background, rect, mouth)).mean()
        far = np.abs(frame - reference_composite(background, rect, silent)).mean()
        assert near < 0.5 and far > 10 * near, (i, near, far)   # the mouth is this frame's speech, not silence's
