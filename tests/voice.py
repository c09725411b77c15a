"""Speech for the integration tests, as a TTS would give it: espeak-ng's voice (Debian's `espeak-ng`,
no download) resampled to the TTS's rate; where espeak-ng is not installed, the project's generated
speech-like signal (config.audio.speech), so the tests still run and say which they used."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import soxr

from config.audio import SAMPLE_RATE, speech

TEXT = "Hello! I am your own avatar, served from your own machine, and my lips move with every word."


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def tts_speech(rate: int = 24000, text: str = TEXT, seconds: float = 0.0) -> np.ndarray:
    """int16 mono speech at `rate` Hz (at most `seconds` long when given)."""
    if espeak_available():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "speech.wav"
            subprocess.run(["espeak-ng", "-s", "160", "-w", str(path), text], check=True, capture_output=True)
            with wave.open(str(path)) as w:
                native, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    else:
        native, pcm = SAMPLE_RATE, speech(4.0, seed=3)
    out = soxr.resample(pcm.astype(np.float32) / 32768, native, rate) if native != rate else pcm / 32768
    out = np.clip(np.round(np.asarray(out) * 32767), -32768, 32767).astype("<i2")
    return out[: int(seconds * rate)] if seconds else out


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm, "<i2").tobytes())
    return path


def warm_up(server, model: str, seconds: float = 2.5) -> None:
    """One utterance through a fresh server, so that the tests' own speech does not meet a cold model
    (its first inference on a loaded machine can miss a few frames' deadlines)."""
    import time
    from lipsync_client import Session
    with Session(server.endpoint, model, audio="pcm16") as s:
        s.send_audio(tts_speech(SAMPLE_RATE, seconds=1.0), last=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s.next_frame(timeout_s=0.5)


def face_avatar(tmp_path_factory, n_frames: int) -> Path:
    """A models directory holding `face`, a video-like avatar: what the integration tests speak to."""
    from tests.helpers import make_video_avatar
    root = tmp_path_factory.mktemp("models")
    make_video_avatar(root, "face", n_frames=n_frames)
    return root


@contextmanager
def warm_server(models: Path, tmp_path_factory, **sessions):
    """A server on `models` with these `sessions` settings, `face` warmed up (warm_up)."""
    from tests.helpers import base_config, run_server
    with run_server(tmp_path_factory.mktemp("srv"), base_config(models, sessions=sessions)) as srv:
        warm_up(srv, "face")
        yield srv
