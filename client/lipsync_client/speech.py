"""The demo's utterance: speech-like 16 kHz PCM, generated. `python -m lipsync_client stream` speaks it,
and the server's demo writes it as speech.wav."""

from __future__ import annotations

import numpy as np

from lipsync_client.contract import SAMPLE_RATE


def speech(seconds: float = 3.0, seed: int = 0) -> np.ndarray:
    """A speech-like utterance, int16 at 16 kHz: voiced harmonics under a syllable-rate envelope with
    short pauses. Generated (nothing is downloaded); it drives the demo, it is not language."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pitch = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 9))
    syllables = np.clip(np.sin(2 * np.pi * 3.5 * t + rng.uniform(0, 6)), 0, None) ** 1.5
    pauses = (np.sin(2 * np.pi * 0.45 * t) > -0.7).astype(float)
    samples = 0.25 * voice * syllables * pauses + 0.003 * rng.standard_normal(len(t))
    return np.clip(samples * 32767, -32768, 32767).astype("<i2")
