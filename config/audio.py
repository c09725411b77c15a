"""The "ave" audio contract of SyncTalk_2D models, from 16 kHz PCM to each video frame's window.

    PCM (16 kHz mono) -> pre-emphasis 0.97 -> |STFT| (n_fft 800, hop 200, hann window 800, centred:
    the signal is padded by 400 zeros on each side, as librosa.stft does by default since 0.10)
    -> 80 mel bins (Slaney, 55 .. 7600 Hz) -> 20 * log10(max(1e-5, S)) - 20
    -> clip(8 * (S + 100) / 100 - 4, -4, 4)                            mel: [n_mel, 80], 80 rows per second

An utterance of n_mel mel rows gives L = int((n_mel - 16) / 80 * 25) + 2 encoder inputs; input j is
mel rows int(80 * j / 25) .. +16, moved back to end at the last row where it would run past it, as
[1, 80, 16]. The encoder (SyncTalk_2D's AudioEncoder) maps each to 512 features; the L outputs are
padded by repeating the first and the last ([f0, f0 .. f(L-1), f(L-1)]: L + 2 vectors), and video
frame i (0 .. L+1) takes rows i-8 .. i+7 of that, zeros outside, reshaped to [32, 16, 16].

numpy only; the mel filter bank is computed here (no librosa at run time) and tested against it.
"""

from __future__ import annotations

import numpy as np

# NOTE: the wire's rate and the demo utterance come from the client, so each is defined once
from lipsync_client.contract import SAMPLE_RATE
from lipsync_client.speech import speech

N_FFT = 800
HOP = 200
N_MELS = 80
FMIN, FMAX = 55.0, 7600.0
PREEMPHASIS = 0.97
MEL_WINDOW = 16                      # mel rows per encoder input
MEL_PER_S = SAMPLE_RATE / HOP        # 80
FPS = 25
FEATURES = 512                       # encoder output per input
WINDOW_ROWS = 16                     # feature rows per video frame: i-8 .. i+7
SAMPLES_PER_FRAME = SAMPLE_RATE // FPS   # 640: the 40 ms of audio that plays with one frame
ENCODER_INPUT_SHAPE = (1, N_MELS, MEL_WINDOW)   # one encoder input: a mel window
ENCODER_INPUT_BYTES = 4 * N_MELS * MEL_WINDOW
AUDIO_SHAPE = (32, 16, 16)           # WINDOW_ROWS * FEATURES, as the ave model takes it


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default, htk=False): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = f / (200.0 / 3)
    log_region = f >= 1000.0
    mel[log_region] = 15.0 + np.log(f[log_region] / 1000.0) / (np.log(6.4) / 27.0)
    return mel


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, np.float64)
    f = m * (200.0 / 3)
    log_region = m >= 15.0
    f[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m[log_region] - 15.0))
    return f


def mel_filters(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, fmin: float = FMIN,
                fmax: float = FMAX) -> np.ndarray:
    """[n_mels, 1 + n_fft // 2] triangular filters, Slaney-normalised (librosa.filters.mel's defaults)."""
    fft_freqs = np.linspace(0, sr / 2, 1 + n_fft // 2)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(np.array([fmin]))[0], _hz_to_mel(np.array([fmax]))[0], n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


_FILTERS = mel_filters()
_WINDOW = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT))   # periodic hann, scipy's fftbins=True
_FRAME = np.arange(N_FFT)
_WINDOW_ROWS = np.arange(MEL_WINDOW)


def _bands(filters: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each mel filter's non-zero bins (a run of 3 to 27 of the 401), all filters one after another:
    (the bins, their float64 weights, where each filter's run starts). 739 products a row, not 32,080."""
    runs = [np.flatnonzero(row) for row in filters]
    if any(not len(run) or run[-1] - run[0] + 1 != len(run) for run in runs):
        raise ValueError("a mel filter whose non-zero bins are not one run")
    bins = np.concatenate(runs)
    weights = np.concatenate([row[run] for row, run in zip(filters, runs)]).astype(np.float64)
    starts = np.cumsum([0] + [len(run) for run in runs[:-1]])
    return bins, weights, starts


_BINS, _BIN_WEIGHTS, _BAND_STARTS = _bands(_FILTERS)


def pcm16_to_float(pcm: bytes | memoryview) -> np.ndarray:
    """16-bit little-endian PCM -> float32 in [-1, 1)."""
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


def preemphasis(wav: np.ndarray, previous: float = 0.0) -> np.ndarray:
    """y[n] = x[n] - 0.97 x[n-1] (scipy.signal.lfilter([1, -0.97], [1], x)); `previous` continues a stream."""
    wav = np.asarray(wav, np.float64)
    out = wav.copy()
    out[0] -= PREEMPHASIS * previous
    out[1:] -= PREEMPHASIS * wav[:-1]
    return out


def stft_magnitude(y: np.ndarray) -> np.ndarray:
    """|STFT| of a pre-emphasised signal, centred with zero padding: [1 + len(y) // HOP, 401]."""
    padded = np.pad(np.asarray(y, np.float64), N_FFT // 2)
    n = 1 + (len(padded) - N_FFT) // HOP
    frames = np.lib.stride_tricks.as_strided(padded, (n, N_FFT), (padded.strides[0] * HOP, padded.strides[0]))
    return np.abs(np.fft.rfft(frames * _WINDOW, axis=1))


def normalize(magnitude: np.ndarray) -> np.ndarray:
    """[n, 401] |STFT| -> [n, 80] normalised log-mel rows.
    NOTE: each filter's run of bins summed row by row (`np.add.reduceat`), not a BLAS matmul: a row's
    result must not depend on how many rows are computed together, so that a stream computed chunk by
    chunk equals the whole utterance exactly."""
    mel = np.add.reduceat(magnitude[:, _BINS] * _BIN_WEIGHTS, _BAND_STARTS, axis=1)
    db = 20 * np.log10(np.maximum(1e-5, mel)) - 20
    return np.clip(8 * (db + 100) / 100 - 4, -4, 4).astype(np.float32)


def melspectrogram(wav: np.ndarray) -> np.ndarray:
    """A whole utterance (float samples at 16 kHz) -> mel rows [n_mel, 80] (SyncTalk_2D's melspectrogram().T)."""
    return normalize(stft_magnitude(preemphasis(wav)))


def encoder_inputs(mel: np.ndarray) -> np.ndarray:
    """[n_mel, 80] -> [L, 1, 80, 16]: SyncTalk_2D's AudDataset windows (crop_audio_window)."""
    n_mel = len(mel)
    if n_mel < MEL_WINDOW:
        raise ValueError(f"an utterance needs at least {MEL_WINDOW} mel rows ({(MEL_WINDOW - 1) * HOP} samples), "
                         f"got {n_mel}")
    count = int((n_mel - MEL_WINDOW) / MEL_PER_S * FPS) + 2
    out = np.empty((count, 1, N_MELS, MEL_WINDOW), np.float32)
    for j in range(count):
        start = int(MEL_PER_S * (j / FPS))
        end = start + MEL_WINDOW
        if end > n_mel:
            start, end = n_mel - MEL_WINDOW, n_mel
        out[j, 0] = mel[start:end].T
    return out


def window_rows(i: int, n: int) -> list[int]:
    """Frame i's window as SyncTalk_2D's get_audio_features takes it from n feature rows: rows i-8 .. i+7,
    -1 (a row of zeros) outside 0 .. n-1."""
    return [r if 0 <= r < n else -1 for r in range(i - 8, i + 8)]


def gather_rows(features: np.ndarray, rows) -> np.ndarray:
    """[n, 16, F]: each frame's rows of `features` [J, F] (-1: zeros)."""
    rows = np.asarray(rows)
    return np.where((rows >= 0)[..., None], features[np.clip(rows, 0, None)], np.float32(0)).astype(np.float32)


def frame_windows(features: np.ndarray) -> np.ndarray:
    """Encoder outputs [L, 512] -> every video frame's window [L + 2, 32, 16, 16] (first and last repeated,
    then rows i-8 .. i+7, zeros outside)."""
    padded = np.concatenate([features[:1], features, features[-1:]]).astype(np.float32)
    n = len(padded)
    return gather_rows(padded, [window_rows(i, n) for i in range(n)]).reshape(n, *AUDIO_SHAPE)


def frame_count(n_samples: int) -> int:
    """Video frames an utterance of n_samples yields (L + 2)."""
    n_mel = 1 + n_samples // HOP
    return int((n_mel - MEL_WINDOW) / MEL_PER_S * FPS) + 4 if n_mel >= MEL_WINDOW else 0


def frame_audio(pcm: bytes, frames: int, first: int = 0) -> list[bytes]:
    """Frame i's 40 ms of int16 PCM (samples i*640 .. +640 of the utterance, zeros past its end)."""
    out = []
    for i in range(first, first + frames):
        piece = pcm[i * SAMPLES_PER_FRAME * 2: (i + 1) * SAMPLES_PER_FRAME * 2]
        out.append(piece + bytes(SAMPLES_PER_FRAME * 2 - len(piece)))
    return out


RATES = (8000, 48000)                # PCM a live session takes, in Hz; the mel runs on a 16 kHz copy


def frame_samples(rate: int) -> int:
    """Samples of `rate` Hz PCM that play with one video frame (40 ms: 960 at 24 kHz)."""
    if not RATES[0] <= rate <= RATES[1] or rate % FPS:
        raise ValueError(f"sample_rate {rate}: PCM at {RATES[0]} to {RATES[1]} Hz, a multiple of {FPS} "
                         f"(a whole number of samples per {1000 // FPS}-ms frame)")
    return rate // FPS


class Resampler:
    """PCM at `rate` Hz arriving in chunks -> the same at 16 kHz, for the mel (python-soxr, its HQ
    setting: the output of a stream fed chunk by chunk equals `soxr.resample` on the whole, and lags
    the input by a few milliseconds until `last`)."""

    def __init__(self, rate: int):
        import soxr   # NOTE: here, not at the top: a client that imports these constants needs no soxr
        self._stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32")

    def push(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        return self._stream.resample_chunk(np.asarray(samples, np.float32), last=last)


class PcmStream:
    """One utterance of 16 kHz PCM arriving in chunks: its encoder inputs and each frame's feature rows,
    exactly as the whole-utterance computation gives them, as soon as what they depend on has arrived.

    Mel row r covers samples r*200-400 .. r*200+399 (centred, zero padded): it is final once those have
    arrived. Encoder input j (rows int(80j/25) .. +15) is final once its rows are, and is then the same
    at the utterance's end (the end only moves back inputs that would run past the last row). Frame i
    takes encoder outputs i-9 .. i+6, so while the utterance goes on frame i can be inferred once
    encoder input i+6 is final; at the end (`last`) every frame can. Look-ahead: frame i needs samples up
    to 640 * (i + 6) + 3400, that is 7,240 samples (453 ms) past its own start.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name                        # unique per utterance: workers key their encoder outputs by it
        # the centred signal (N_FFT // 2 zeros, then the pre-emphasised samples) from the next row's start on
        self._x = np.zeros(N_FFT // 2, np.float64)
        self._samples = 0
        self._previous = 0.0                    # the last raw sample (pre-emphasis continues across chunks)
        self._mel = np.empty((64, N_MELS), np.float32)   # the mel rows computed: the first self._rows
        self._rows = 0
        self.ended = False

    @property
    def samples(self) -> int:
        return self._samples

    def push(self, samples: np.ndarray, last: bool = False) -> None:
        if self.ended:
            raise ValueError("the utterance has ended (last: true); start a new one")
        samples = np.asarray(samples, np.float64)
        if len(samples):
            self._x = np.concatenate([self._x, preemphasis(samples, self._previous)])
            self._previous = float(samples[-1])
            self._samples += len(samples)
        self.ended = last
        n = self._samples
        total = 1 + n // HOP if last else max(0, (n - N_FFT // 2) // HOP + 1)   # rows final
        # NOTE: rows are computed once the next encoder input's last row is final, or at the end: 20-ms
        # chunks then compute 3 or 4 rows every other chunk rather than 1 or 2 every chunk (each numpy call
        # costs microseconds whatever its rows), and every count this stream gives is the same.
        if total > self._rows and (last or total >= self._input_end(self.encoder_count())):
            self._compute_rows(total)

    def _compute_rows(self, total: int) -> None:
        first = self._rows
        x = np.concatenate([self._x, np.zeros(N_FFT // 2)]) if self.ended else self._x
        frames = x[(np.arange(total - first) * HOP)[:, None] + _FRAME]
        rows = normalize(np.abs(np.fft.rfft(frames * _WINDOW, axis=1)))
        if total > len(self._mel):
            grown = np.empty((max(total, 2 * len(self._mel)), N_MELS), np.float32)
            grown[:first] = self._mel[:first]
            self._mel = grown
        self._mel[first:total] = rows
        self._rows = total
        # NOTE: only the samples from the next row's start on are kept, so that a long utterance costs
        # each chunk its own samples, not a copy of everything before them.
        self._x = self._x[(total - first) * HOP:]

    @staticmethod
    def _input_end(j: int) -> int:
        """Mel rows encoder input j needs while the utterance goes on."""
        return int(MEL_PER_S * (j / FPS)) + MEL_WINDOW

    def encoder_count(self) -> int:
        """Encoder inputs final so far (at the end: all L)."""
        m = self._rows
        if self.ended:
            return int((m - MEL_WINDOW) / MEL_PER_S * FPS) + 2 if m >= MEL_WINDOW else 0
        # the first j whose rows run past the mel so far: near (m - MEL_WINDOW) * FPS / MEL_PER_S
        j = max(int((m - MEL_WINDOW) * FPS / MEL_PER_S) - 1, 0)
        while self._input_end(j) <= m:
            j += 1
        return j

    def encoder_input(self, j: int) -> np.ndarray:
        """Encoder input j, [1, 80, 16]."""
        return self.encoder_inputs(j, j + 1)[0]

    def encoder_inputs(self, a: int, b: int) -> np.ndarray:
        """Encoder inputs a .. b-1, [b - a, 1, 80, 16], in one copy (input j: mel rows int(80j/25) .. +15,
        moved back at the end to end at the last row)."""
        m = self._rows
        starts = (MEL_PER_S * (np.arange(a, b) / FPS)).astype(np.intp)
        late = starts + MEL_WINDOW > m
        if late.any():
            if not self.ended:
                raise ValueError(f"encoder input {a + int(np.argmax(late))} is not final yet")
            starts[late] = m - MEL_WINDOW
        return np.ascontiguousarray(self._mel[starts[:, None] + _WINDOW_ROWS].transpose(0, 2, 1))[:, None]

    def frame_count(self) -> int:
        """Frames whose windows are final so far (at the end: all L + 2)."""
        count = self.encoder_count()
        if self.ended:
            return count + 2 if count else 0
        return max(0, count - 7)

    def frame_rows(self, i: int) -> list[int]:
        """Frame i's 16 window rows as encoder output indices (-1: a row of zeros)."""
        count = self.encoder_count()
        # Rows of the padded outputs [f0, f0 .. f(L-1), f(L-1)]: padded row p is output p-1, clamped. While
        # the utterance goes on, the padding's end is not known yet and no ready frame reaches it.
        padded = count + 2 if self.ended else i + 8
        return [min(max(p - 1, 0), count - 1) if p >= 0 else -1 for p in window_rows(i, padded)]


def windows_from_rows(features: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Frame windows [n, 32, 16, 16] from encoder outputs [J, 512] and each frame's row indices [n, 16]
    (into `features`; -1 for zeros)."""
    return gather_rows(features, rows).reshape(len(rows), *AUDIO_SHAPE)


def write_speech(path, seconds: float = 3.0, seed: int = 0):
    """`speech()` as a 16 kHz mono 16-bit WAV file."""
    import wave
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(speech(seconds, seed).tobytes())
    return path
