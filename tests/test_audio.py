"""The ave audio contract (config/audio.py) against librosa and SyncTalk_2D's own recipe, written out
here as its training/inference code does it, and the random-weight AudioEncoder's shapes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from config import audio as A
from gpu_actor.model_builder import write_audio_encoder

librosa = pytest.importorskip("librosa", reason="librosa is in the test extra: python3 dev.py test installs it")
from scipy import signal  # noqa: E402  (librosa depends on scipy)


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Tones with a syllable-rate envelope and noise: what a mel of speech looks like, roughly."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * A.SAMPLE_RATE)) / A.SAMPLE_RATE
    tone = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) / (i + 1) for i, f in enumerate((180, 360, 720, 2400)))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 2
    return (0.3 * tone * envelope + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def synctalk_mel(wav: np.ndarray) -> np.ndarray:
    """SyncTalk_2D's melspectrogram(wav).T, with librosa and scipy as it uses them."""
    emphasised = signal.lfilter([1, -0.97], [1], wav)
    d = librosa.stft(y=emphasised, n_fft=800, hop_length=200, win_length=800)
    basis = librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)
    s = 20 * np.log10(np.maximum(np.exp(-5 * np.log(10)), basis @ np.abs(d))) - 20
    return np.clip((2 * 4.) * ((s + 100) / 100) - 4., -4., 4.).T


def test_mel_filters_equal_librosa():
    want = librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)
    np.testing.assert_allclose(A.mel_filters(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seconds", [0.5, 1.37, 3.0])
def test_mel_equals_synctalk_with_librosa(seconds):
    wav = speech_like(seconds)
    got, want = A.melspectrogram(wav), synctalk_mel(wav)
    assert got.shape == want.shape == (1 + len(wav) // A.HOP, 80)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_encoder_inputs_and_frame_windows_follow_synctalk():
    wav = speech_like(2.0, seed=1)
    mel = A.melspectrogram(wav)
    inputs = A.encoder_inputs(mel)
    count = int((len(mel) - 16) / 80 * 25) + 2
    assert inputs.shape == (count, 1, 80, 16)
    for j in (0, 7, count - 1):   # AudDataset.crop_audio_window
        start = int(80.0 * (j / 25.0))
        end = start + 16
        if end > len(mel):
            start, end = len(mel) - 16, len(mel)
        np.testing.assert_array_equal(inputs[j, 0], mel[start:end].T)
    features = np.random.default_rng(2).standard_normal((count, 512)).astype(np.float32)
    windows = A.frame_windows(features)
    assert windows.shape == (count + 2, 32, 16, 16) and A.frame_count(len(wav)) == count + 2
    padded = np.concatenate([features[:1], features, features[-1:]])
    for i in (0, 3, count + 1):
        rows = [padded[r] if 0 <= r < len(padded) else np.zeros(512, np.float32) for r in range(i - 8, i + 8)]
        np.testing.assert_array_equal(windows[i], np.stack(rows).reshape(32, 16, 16))


def test_pcm16_and_a_too_short_utterance():
    assert A.pcm16_to_float(np.array([0, 16384, -32768], "<i2").tobytes()).tolist() == [0.0, 0.5, -1.0]
    with pytest.raises(ValueError, match="at least 16 mel rows"):
        A.encoder_inputs(A.melspectrogram(np.zeros(1000, np.float32)))


def test_the_random_weight_audio_encoder_has_synctalks_shapes(tmp_path):
    path = write_audio_encoder(tmp_path / "audio_encoder.onnx", seed=3)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert inp.shape[1:] == [1, 80, 16] and out.shape[1:] == [512]
    mel = A.encoder_inputs(A.melspectrogram(speech_like(1.0)))
    features = session.run(None, {inp.name: mel})[0]
    assert features.shape == (len(mel), 512) and np.isfinite(features).all()


# -- 16 kHz PCM through a real server ----------------------------------------------------------------

def _pcm(wav: np.ndarray) -> bytes:
    return np.clip(np.round(wav * 32767), -32768, 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def pcm_server(tmp_path_factory):
    from tests.helpers import base_config, make_avatar, run_server
    root = tmp_path_factory.mktemp("models")
    write_audio_encoder(make_avatar(root, "a", n_frames=6) / "audio_encoder.onnx", seed=1)
    make_avatar(root, "plain", n_frames=3)
    write_audio_encoder(make_avatar(root, "h", n_frames=3, audio="hubert") / "audio_encoder.onnx")
    with run_server(tmp_path_factory.mktemp("srv"), base_config(root, **{"limits.max_batch": 32})) as srv:
        srv.models_dir = root
        yield srv


def test_pcm_composite_equals_the_windows_computed_offline(pcm_server):
    from tests.helpers import decode_image
    pcm = _pcm(speech_like(1.0, seed=4))
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    encoder = ort.InferenceSession(str(pcm_server.models_dir / "a" / "audio_encoder.onnx"),
                                   providers=["CPUExecutionProvider"])
    inputs = A.encoder_inputs(A.melspectrogram(samples))
    windows = A.frame_windows(encoder.run(None, {"mel": inputs})[0])
    with pcm_server.client() as c:
        header, images = c.request("composite", [pcm], model="a", audio_format="pcm16", format="png",
                                   return_audio=True)
        n = header["batch"]
        assert n == len(windows) == A.frame_count(len(samples)) == len(images) // 2
        _, want = c.composite("a", windows, format="png")
    for got, expected in zip(images[:n], want):
        np.testing.assert_array_equal(decode_image(got, "png", {}), decode_image(expected, "png", {}))
    for i, piece in enumerate(images[n:]):   # each frame's 40 ms of the PCM sent, zeros past its end
        want_piece = pcm[i * 1280:(i + 1) * 1280]
        assert bytes(piece) == want_piece + bytes(1280 - len(want_piece))


@pytest.mark.parametrize("model, fields, hint", [
    ("a", {"batch": 5}, "16000 samples of PCM give 24 frames; set batch to 24"),
    ("h", {}, "hubert or wenet"),
    ("plain", {}, "no audio encoder"),
    ("a", {"return_audio": True, "audio_format": "float32", "batch": 1}, "only with audio_format pcm16"),
])
def test_pcm_requests_that_cannot_be_served_are_bad_requests(pcm_server, model, fields, hint):
    from lipsync_client import ServerError
    pcm = _pcm(speech_like(1.0, seed=4))
    with pcm_server.client() as c, pytest.raises(ServerError) as err:
        c.request("composite", [pcm], model=model, **{"audio_format": "pcm16", **fields})
    assert err.value.code == "bad_request" and hint in err.value.message, err.value.message


def test_pcm_longer_than_a_batch_is_refused_with_the_limit(pcm_server):
    from lipsync_client import ServerError
    with pcm_server.client() as c, pytest.raises(ServerError) as err:
        c.request("composite", [_pcm(speech_like(2.0))], model="a", audio_format="pcm16")
    assert err.value.code == "bad_request" and "limits.max_batch (32)" in err.value.message


def test_pcm_in_20_ms_chunks_gives_the_whole_utterances_inputs_and_windows():
    wav = speech_like(1.3, seed=6)
    mel = A.melspectrogram(wav)
    inputs = A.encoder_inputs(mel)
    features = np.random.default_rng(7).standard_normal((len(inputs), 512)).astype(np.float32)
    whole = A.frame_windows(features)
    stream, seen_frames, seen_inputs = A.PcmStream(), 0, 0
    chunks = [wav[k:k + 320] for k in range(0, len(wav), 320)]
    for n, chunk in enumerate(chunks):
        stream.push(chunk, last=n == len(chunks) - 1)
        for j in range(seen_inputs, stream.encoder_count()):   # final as soon as they are counted
            np.testing.assert_array_equal(stream.encoder_input(j), inputs[j])
        if stream.encoder_count():   # (as a frame's request takes them: several in one copy)
            np.testing.assert_array_equal(stream.encoder_inputs(0, stream.encoder_count()),
                                          inputs[:stream.encoder_count()])
        if not stream.ended:
            with pytest.raises(ValueError, match="is not final yet"):
                stream.encoder_inputs(0, stream.encoder_count() + 1)
        seen_inputs = stream.encoder_count()
        ready = stream.frame_count()
        assert ready >= seen_frames
        if ready > seen_frames and not stream.ended:   # the look-ahead the docs state: 7,240 samples
            assert stream.samples >= 640 * (ready - 1) + 7240 - 320
        for i in range(seen_frames, ready):
            rows = np.array([stream.frame_rows(i)])
            np.testing.assert_array_equal(A.windows_from_rows(features, rows)[0], whole[i])
        seen_frames = ready
    assert seen_frames == len(whole) and seen_inputs == len(inputs)
