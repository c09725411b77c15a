"""A fresh session's first words are all there: on a freshly started server, the first session of a
model sends a 1-s utterance the moment `session_open` returns, and every one of its speech frames is
speech; sessions after it alike. `session_open` answers only once the session can deliver its frames
on time: its model loaded and warm on a worker (the health reply lists it as loaded), its first
frames rendered. (`python -m bench first_words` runs the same over 10 fresh servers per case.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from config.audio import speech
from lipsync_client import Session
from tests.helpers import base_config, make_video_avatar, run_server

pytestmark = pytest.mark.slow
N_FRAMES = 12
SPEECH_S = 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_video_avatar(root, "face", n_frames=N_FRAMES)
    return root


def utterance(audio: str, seed: int) -> np.ndarray:
    if audio == "pcm16":
        return speech(SPEECH_S, seed=seed)
    return np.random.default_rng(seed).standard_normal((int(SPEECH_S * 25), 32, 16, 16)).astype(np.float32)


def say(endpoint: str, fmt: str, audio: str, seed: int, check_loaded=None) -> dict:
    """One session: the utterance right after the open reply, then its stats once it has played."""
    with Session(endpoint, "face", format=fmt, audio=audio, timeout_s=120.0) as s:
        if check_loaded is not None:
            check_loaded()
        s.send_audio(utterance(audio, seed), last=True)
        # NOTE: no deadline of its own: frames come at 25 fps until the utterance's last one (bounded
        # by the client's per-frame timeout, which only a hung server reaches)
        while True:
            frame = s.next_frame(timeout_s=30.0)
            assert frame is not None, "the server stopped sending frames"
            if frame[0].get("last"):
                break
        return s.close()


@pytest.mark.parametrize("audio", ["window", "pcm16"])
@pytest.mark.parametrize("fmt", ["jpeg", "raw", "h264"])
def test_the_first_session_on_a_fresh_server_says_every_word(models, tmp_path, fmt, audio):
    # NOTE: a generous latency budget: what is judged is the cold start, not this machine's speed
    cfg = base_config(models, sessions={"latency_budget_ms": 800, "start_delay_ms": 200})
    with run_server(tmp_path, cfg) as srv:
        def loaded():
            with srv.client() as c:
                assert "face" in c.health()["models_loaded"], "session_open answered before its model was loaded"
        t = time.monotonic()
        first = say(srv.endpoint, fmt, audio, seed=1, check_loaded=loaded)
        assert first["missed"] == 0 and first["frames_speech"] >= SPEECH_S * 25 - 1, first
        print(f"{fmt}/{audio}: first session {time.monotonic() - t:.2f} s, stages {first['stages_ms']}")
        for seed in (2, 3):
            after = say(srv.endpoint, fmt, audio, seed)
            assert after["missed"] == 0 and after["frames_speech"] == first["frames_speech"], after
