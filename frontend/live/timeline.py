"""Live sessions, with no sockets: each session's timeline, where its speech lands, and which frame
goes out when.

A session streams frames k = 0, 1, 2, ... at `fps`; frame k is due at `t0 + k / fps` (the frontend's
monotonic clock). A frame is speech when audio was placed on it and its composited image is ready by
then; otherwise it is the avatar's own background frame (idle, no inference). Speech that is not
ready when due goes out as idle and counts as missed: the stream never waits.

Speech placement: a chunk of n frames lands right after the previous speech when that is still at
least `lead` frames ahead of the frame going out now, else at the earliest frame `lead` ahead (the
latency budget). In `features` mode the server keeps the utterance's feature vectors and builds
frame j's window from rows j-8 .. j+7 (zeros outside the utterance), as SyncTalk_2D's
`get_audio_features` does; frame j can be inferred once row j+7 has arrived or the utterance ended.
"""

from __future__ import annotations

import heapq
import math
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import numpy as np

from config.assets import frame_index
from config.audio import SAMPLES_PER_FRAME, PcmStream, frame_audio, gather_rows, window_rows

LOOKAHEAD = 7
PCM_LOOKAHEAD_FRAMES = 12  # pcm16: frame i's window needs 7,240 samples past its start (config/audio.PcmStream)


@dataclass
class Outgoing:
    """One frame to send now."""
    index: int
    kind: str                 # "speech" | "idle"
    background: int           # background frame index
    image: Any = None         # speech: the encoded frame; idle: None (the shell takes it from its cache)
    due: float = 0.0
    received: Optional[float] = None   # speech: when its audio arrived (for latency)
    audio: Optional[bytes] = None      # pcm16 sessions: the frame's 40 ms of PCM
    missed: bool = False               # idle where speech was placed (late, or its inference failed)


@dataclass
class Stats:
    speech: int = 0
    idle: int = 0
    missed: int = 0
    dropped: int = 0
    late: int = 0
    encoded: int = 0              # h264: frames the session's own encoder encoded (the rest: its avatar's idle loop)
    max_late_ms: float = 0.0
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=4096))

    def as_dict(self) -> dict:
        lat = np.asarray(self.latency_ms) if self.latency_ms else None
        return {"frames_speech": self.speech, "frames_idle": self.idle, "missed": self.missed,
                "dropped": self.dropped, "late": self.late, "frames_encoded": self.encoded,
                "max_late_ms": round(self.max_late_ms, 1),
                "latency_ms_p50": round(float(np.percentile(lat, 50)), 1) if lat is not None else None,
                "latency_ms_p99": round(float(np.percentile(lat, 99)), 1) if lat is not None else None}


@dataclass
class Speech:
    received: float
    image: Any = None
    failed: bool = False
    audio: Optional[bytes] = None


class LiveSession:
    def __init__(self, token: str, model: str, conn: Optional[Hashable], fps: float, t0: float, start_frame: int,
                 n_backgrounds: int, order: str, lead_frames: int, audio_mode: str, feature_shape: tuple[int, ...],
                 data: Any = None):
        self.token, self.model, self.conn, self.data = token, model, conn, data
        self.fps, self.t0, self.start_frame = fps, t0, start_frame
        self.n_backgrounds, self.order = n_backgrounds, order
        self.lead = lead_frames
        self.audio_mode = audio_mode
        self.next_index = 0                  # the next frame to go out
        self.speech_end = 0                  # the first frame after all speech placed so far
        self.speech: dict[int, Speech] = {}  # frame index -> its speech (pending or ready)
        self.stats = Stats()
        self.feature_shape = feature_shape   # features mode: (rows per window, F)
        self._rows: list[np.ndarray] = []    # features mode: this utterance's vectors
        self._row_frame: list[int] = []      # ... and the frame each one drives
        self._row_received: list[float] = []
        self._inferred_rows = 0              # rows whose frame was handed out for inference
        self._stream: Optional[PcmStream] = None   # pcm16: the utterance being received
        self._utterance_start = 0            # ... its frame 0 on the timeline
        self._utterance_pcm = bytearray()    # ... its samples, for each frame's audio out
        self._utterance_done = 0             # ... its frames handed out for inference
        self._utterances = 0
        self.last_image: Any = None          # the last frame sent (repeated if an idle frame is not ready)
        self.pinned_worker: Optional[int] = None   # the worker that keeps the model loaded for it
        self.ahead = 0.0                     # frames are decided this long before due (h264: to encode them)
        self.h264: Any = None                # h264 sessions: their frontend.live.h264_plan.H264Stream
        self.viewer = False                  # webrtc: frames go to the viewer (frontend/viewer.py)

    def due(self, k: int) -> float:
        return self.t0 + k / self.fps

    def background(self, k: int) -> int:
        return frame_index(self.start_frame + k, self.n_backgrounds, self.order)

    def now_index(self, now: float) -> int:
        """The first frame not yet due at `now`."""
        return max(self.next_index, math.floor((now - self.t0) * self.fps) + 1)

    # -- audio -----------------------------------------------------------------------------------

    def place(self, n: int, now: float) -> int:
        """Timeline frames for n new speech frames; returns the first."""
        earliest = self.now_index(now) + self.lead
        first = self.speech_end if self.speech_end >= earliest else earliest
        self.speech_end = first + n
        return first

    def windows(self, audio: np.ndarray, now: float) -> tuple[int, list[tuple[list[int], np.ndarray]]]:
        """Window mode: a chunk [n, *A] -> (first frame, [(frames, windows)]) ready for inference."""
        first = self.place(len(audio), now)
        frames = list(range(first, first + len(audio)))
        for k in frames:
            self.speech[k] = Speech(now)
        return first, [(frames, audio)]

    def features(self, rows: np.ndarray, last: bool, now: float,
                 audio_shape: tuple[int, ...]) -> tuple[int, list[tuple[list[int], np.ndarray]]]:
        """Features mode: n vectors [n, F] -> (first frame they drive, windows now computable)."""
        first = self.place(len(rows), now)
        for i, row in enumerate(rows):
            self._rows.append(np.asarray(row, np.float32))
            self._row_frame.append(first + i)
            self._row_received.append(now)
            self.speech[first + i] = Speech(now)
        ready = len(self._rows) if last else max(len(self._rows) - LOOKAHEAD, 0)
        js = list(range(self._inferred_rows, ready))
        self._inferred_rows = ready
        out = []
        if js:
            windows = np.stack([self._window(j).reshape(audio_shape) for j in js])
            out.append(([self._row_frame[j] for j in js], windows))
        if last:
            self._rows, self._row_frame, self._row_received, self._inferred_rows = [], [], [], 0
        return first, out

    def _window(self, j: int) -> np.ndarray:
        return gather_rows(np.stack(self._rows), [window_rows(j, len(self._rows))])[0]

    def pcm(self, chunk: bytes, last: bool, now: float):
        """pcm16 mode: a chunk of 16 kHz int16 PCM. Returns (first frame its audio plays in, frames it
        spans, ready) where ready is [(stream, frame, rows)]: each frame now computable, with the
        utterance's stream (its encoder inputs) and the frame's window rows into them."""
        if self._stream is None:   # a new utterance: its frames land once the look-ahead has arrived too
            self._utterances += 1
            self._stream = PcmStream(f"{self.token}/{self._utterances}")
            earliest = self.now_index(now) + self.lead + PCM_LOOKAHEAD_FRAMES
            self._utterance_start = self.speech_end if self.speech_end >= earliest else earliest
            self._utterance_pcm = bytearray()
            self._utterance_done = 0
        before = len(self._utterance_pcm) // 2
        self._utterance_pcm += chunk
        after = len(self._utterance_pcm) // 2
        stream = self._stream
        stream.push(np.frombuffer(chunk, "<i2").astype(np.float32) / 32768.0, last)
        first = self._utterance_start + before // SAMPLES_PER_FRAME
        spans = -(-after // SAMPLES_PER_FRAME) - before // SAMPLES_PER_FRAME
        ready = stream.frame_count()
        work = []
        for i in range(self._utterance_done, ready):
            k = self._utterance_start + i
            self.speech[k] = Speech(now, audio=frame_audio(bytes(self._utterance_pcm), 1, i)[0])
            work.append((stream, k, stream.frame_rows(i)))
        self._utterance_done = ready
        self.speech_end = max(self.speech_end, self._utterance_start + max(ready, -(-after // SAMPLES_PER_FRAME)))
        if last:
            self.speech_end = self._utterance_start + ready
            self._stream = None
        return first, max(spans, 0), work

    def interrupt(self) -> int:
        """Drop speech not yet sent; idle follows. Returns how many frames were dropped."""
        dropped = [k for k in self.speech if k >= self.next_index]
        for k in dropped:
            del self.speech[k]
        self.speech_end = self.next_index
        self._rows, self._row_frame, self._row_received, self._inferred_rows = [], [], [], 0
        self._stream = None
        return len(dropped)

    # -- results and pacing ----------------------------------------------------------------------

    def ready(self, frames: list[int], images: list) -> None:
        for k, image in zip(frames, images):
            speech = self.speech.get(k)
            if speech is not None:
                speech.image = image

    def failed(self, frames: list[int]) -> None:
        for k in frames:
            speech = self.speech.get(k)
            if speech is not None:
                speech.failed = True

    def advance(self, now: float) -> list[Outgoing]:
        """Every frame due by `now` + `ahead`, in order: speech when ready, else idle (speech missed)."""
        out = []
        while self.due(self.next_index) - self.ahead <= now:
            k = self.next_index
            speech = self.speech.pop(k, None)
            if speech is not None and speech.image is not None:
                out.append(Outgoing(k, "speech", self.background(k), speech.image, self.due(k), speech.received,
                                    speech.audio))
            else:
                if speech is not None:
                    self.stats.missed += 1
                out.append(Outgoing(k, "idle", self.background(k), None, self.due(k), missed=speech is not None,
                                    audio=speech.audio if speech is not None else None))
            self.next_index += 1
        return out

    def upcoming(self, horizon: int) -> list[int]:
        """Background indices of the next `horizon` frames (for the idle cache to hold them in time)."""
        return sorted({self.background(k) for k in range(self.next_index, self.next_index + horizon)})

    def sent(self, frame: Outgoing, now: float) -> None:
        late_ms = (now - frame.due) * 1000
        if frame.kind == "speech":
            self.stats.speech += 1
            self.stats.latency_ms.append((now - frame.received) * 1000)
        else:
            self.stats.idle += 1
        if late_ms > 40:
            self.stats.late += 1
        self.stats.max_late_ms = max(self.stats.max_late_ms, late_ms)


class SessionTable:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._by_token: dict[str, LiveSession] = {}
        # (due time of its next frame, token): one entry per open session; closed ones are skipped lazily.
        # NOTE: the pacer rings once per due frame of every session, so finding the due sessions must
        # not cost a pass over all of them.
        self._due: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._by_token)

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(12)

    def add(self, session: LiveSession) -> None:
        self._by_token[session.token] = session
        self.schedule(session)

    def schedule(self, session: LiveSession) -> None:
        """Queue the session for when its next frame is due (after it has sent what was due)."""
        heapq.heappush(self._due, (session.due(session.next_index) - session.ahead, session.token))

    def wake(self, session: LiveSession, when: float) -> None:
        """Also take the session off the queue at `when` (an H.264 unit waiting to be sent)."""
        heapq.heappush(self._due, (when, session.token))

    def due(self, now: float) -> list[LiveSession]:
        """The open sessions with a frame due by `now`, taken off the queue (schedule them again)."""
        out = {}
        while self._due and self._due[0][0] <= now:
            token = heapq.heappop(self._due)[1]
            session = self._by_token.get(token)
            if session is not None:
                out[token] = session   # once, however many times it was queued
        return list(out.values())

    def get(self, token: str) -> Optional[LiveSession]:
        return self._by_token.get(token)

    def sessions(self) -> list[LiveSession]:
        return list(self._by_token.values())

    def pop(self, token: str) -> Optional[LiveSession]:
        return self._by_token.pop(token, None)

    def on_conn(self, conn: Hashable) -> list[LiveSession]:
        return [s for s in self._by_token.values() if s.conn == conn]

    def next_due(self) -> Optional[float]:
        while self._due and self._due[0][1] not in self._by_token:
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else None
