"""Live sessions, with no sockets: each session's timeline, where its speech lands, and which frame
goes out when.

A session streams frames k = 0, 1, 2, ... at `fps`; frame k is due at `t0 + k / fps` (the frontend's
monotonic clock), t0 on the frame grid that every session at that fps shares (`on_frame_grid`). A
frame is speech when audio was placed on it and its composited image is ready by then; otherwise it
is the avatar's own background frame (idle, no inference). Speech that is not ready when due goes out
as idle and counts as missed: the stream never waits.

Speech placement: a chunk of n frames lands right after the previous speech when that is still at
least `lead` frames ahead of the frame going out now, else at the earliest frame `lead` ahead (the
latency budget); a pcm16 utterance also waits for the samples its frame 0's window needs that its first
chunk lacks, at real time. In `features` mode the server keeps the utterance's feature vectors and builds
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
from config.audio import SAMPLE_RATE, SAMPLES_PER_FRAME, PcmStream, Resampler, frame_samples, gather_rows, window_rows
from frontend.live.shedding import FULL, HALF, Meter

LOOKAHEAD = 7
PCM_LOOKAHEAD_SAMPLES = 7240   # pcm16: frame i's window needs 7,240 samples (16 kHz) past its start (PcmStream)


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
    utterance: Optional[int] = None    # the utterance whose speech (or audio) this frame carries
    last: bool = False                 # ... and its last frame (its last samples, or where an interrupt cut it)
    stages: Optional[dict] = None      # speech: ms spent in each stage before it was ready (SpeechFrame.stages)
    ready_at: float = 0.0              # speech: when it was ready to go (composited, or encoded)
    shed: bool = False                 # its speech was not rendered, the host being full (a repeat, or idle)


@dataclass
class Stats:
    speech: int = 0
    idle: int = 0
    missed: int = 0
    dropped: int = 0
    late: int = 0
    encoded: int = 0              # h264: frames the session's own encoder encoded (the rest: its avatar's idle loop)
    shed: int = 0                 # speech frames not rendered because the host was full (live/shedding.py)
    max_late_ms: float = 0.0
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    stages_ms: dict = field(default_factory=dict)    # stage -> its ms for each speech frame sent (STAGES)
    missed_in: dict = field(default_factory=dict)    # stage a missed speech frame was still in when due

    def stage(self, name: str, ms: float) -> None:
        values = self.stages_ms.get(name)
        if values is None:   # (not setdefault: its default would be built for every value)
            values = self.stages_ms[name] = deque(maxlen=4096)
        values.append(ms)

    def as_dict(self) -> dict:
        lat = np.asarray(self.latency_ms) if self.latency_ms else None
        return {"frames_speech": self.speech, "frames_idle": self.idle, "missed": self.missed,
                "dropped": self.dropped, "late": self.late, "frames_encoded": self.encoded, "shed": self.shed,
                "max_late_ms": round(self.max_late_ms, 1),
                "latency_ms_p50": round(float(np.percentile(lat, 50)), 1) if lat is not None else None,
                "latency_ms_p99": round(float(np.percentile(lat, 99)), 1) if lat is not None else None,
                "stages_ms": {name: _summary(values) for name, values in self.stages_ms.items()},
                "missed_in": dict(self.missed_in)}


# A speech frame's life, stage by stage (docs/architecture.md, "Where a live frame's time goes"):
STAGES = ("batching",       # its audio arrived -> its batch was formed (look-ahead, batch wait)
          "queue",          # batch formed -> inference started (engine and worker queues)
          "inference",      # inference, input building included
          "to_composite",   # inference ended -> compositing started (hand-off, compositor queue)
          "composite",      # paste + encode (JPEG, PNG, raw) or the H.264 face box
          "encode_wait",    # h264: decided -> its encode started (the session's compositor queue)
          "encode",         # h264: the session's encoder
          "hold")           # ready -> sent (waiting until due: slack, not delay)


def _summary(values) -> dict:
    a = np.asarray(values, np.float64)
    return {"n": len(a), "p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "max": round(float(a.max()), 1)}


@dataclass
class SpeechFrame:
    """Speech placed on one frame of the timeline: its audio, then its composited image (or its failure)."""

    received: float
    image: Any = None
    failed: str = ""                    # its request's error code: it failed
    audio: Optional[bytes] = None
    utterance: Optional[int] = None
    last: bool = False                  # the utterance's last frame
    tail: bool = False                  # audio only: no image is made for it (goes out idle, not missed)
    shed: bool = False                  # not rendered, the host being full: goes out idle with its audio
    repeat: bool = False                # not rendered, the host being full: repeats the speech frame before it
    submitted: Optional[float] = None   # its batch was formed (handed to the engine)
    stages: Optional[dict] = None       # ms per stage up to composited (STAGES)
    ready_at: float = 0.0

    def where(self) -> str:
        """The stage it is in now (for a frame missed: where it was when due)."""
        if self.failed:
            return f"failed ({self.failed})"   # e.g. "failed (timeout)": what its request was answered
        return "batching" if self.submitted is None else "inference+composite"


class LiveSession:
    def __init__(self, token: str, model: str, conn: Optional[Hashable], fps: float, t0: float, start_frame: int,
                 n_backgrounds: int, order: str, lead_frames: int, audio_mode: str, feature_shape: tuple[int, ...],
                 call: Any = None, sample_rate: int = SAMPLE_RATE):
        self.token, self.model, self.conn = token, model, conn
        self.call = call                     # the session_open it was opened by (live/host.OpenCall)
        self.fps, self.t0, self.start_frame = fps, t0, start_frame
        self.n_backgrounds, self.order = n_backgrounds, order
        self.lead = lead_frames
        self.audio_mode = audio_mode
        self.next_index = 0                  # the next frame to go out
        self.speech_end = 0                  # the first frame after all speech placed so far
        self.speech: dict[int, SpeechFrame] = {}  # frame index -> its speech (pending or ready)
        self.stats = Stats()
        self.feature_shape = feature_shape   # features mode: (rows per window, F)
        self._rows: list[np.ndarray] = []    # features mode: this utterance's vectors
        self._row_frame: list[int] = []      # ... and the frame each one drives
        self._row_received: list[float] = []
        self._inferred_rows = 0              # rows whose frame was handed out for inference
        self._stream: Optional[PcmStream] = None   # pcm16: the utterance being received
        self.sample_rate = sample_rate       # pcm16: the rate the client sends (and gets back)
        self.frame_samples = frame_samples(sample_rate)
        self.silence = bytes(2 * self.frame_samples)
        self._resampler: Optional[Resampler] = None   # ... to 16 kHz for the mel, when it is another rate
        self._utterance: Optional[int] = None       # the utterance being received (every audio mode)
        self._utterance_start = 0            # ... its frame 0 on the timeline
        self._utterance_pcm = bytearray()    # ... its samples, for each frame's audio out
        self._utterance_done = 0             # ... its frames handed out for inference
        self._utterances = 0                 # the highest utterance id so far (the client's, or counted here)
        self.retired = 0                     # every utterance up to this id was interrupted: never rendered
        self.last_image: Any = None          # the last frame sent (repeated if an idle frame is not ready)
        self.shed = FULL                     # how much of its speech is rendered (live/shedding.py)
        self.meter = Meter()                 # ... and its speech frames' timeliness this window
        self.shed_whole = False              # ... without the half step (h264: encoding is most of its cost)
        self._said: Optional[tuple] = None   # the last speech frame rendered: (utterance, image)
        self.pinned_worker: Optional[int] = None   # the worker that keeps the model loaded for it
        self.ahead = 0.0                     # frames are decided this long before due (h264: to encode them)
        self.h264: Any = None                # h264 sessions: their frontend.live.h264_stream.H264Stream
        self.viewer = False                  # webrtc: frames go to the viewer (frontend/viewer.py)

    def due(self, k: int) -> float:
        return self.t0 + k / self.fps

    def needed_by(self, k: int) -> float:
        """When frame k's speech must be ready: it is decided `ahead` of due (h264: to encode it), and
        a speech frame ready after that goes out idle. Speech requests carry it as their deadline and
        due, so inference and compositing put them in order by it among the encodes due meanwhile."""
        return self.due(k) - self.ahead

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

    def admits(self, utterance: Optional[int]) -> bool:
        """Whether a chunk of `utterance` (the client's id; None: the one being received, else the next)
        is rendered: False for one that was interrupted. ValueError for an id that cannot come now."""
        if utterance is None:
            return True
        if utterance <= self.retired:
            return False
        if self._utterance is not None and utterance != self._utterance:
            raise ValueError(f"header.utterance: {utterance} while utterance {self._utterance} is still being "
                             "received; end that one first (last: true) or interrupt it")
        if self._utterance is None and utterance <= self._utterances:
            raise ValueError(f"header.utterance: {utterance} has ended already; a new utterance needs a higher id "
                             f"(> {self._utterances})")
        return True

    def _begin(self, utterance: Optional[int] = None) -> int:
        """The utterance a chunk belongs to: the one being received, else a new one (`utterance`: the
        client's id for it, checked by `admits`)."""
        if self._utterance is None:
            self._utterances = utterance if utterance is not None else self._utterances + 1
            self._utterance = self._utterances
        return self._utterance

    def _end(self, k: int) -> None:
        """The utterance ends at frame k (`last: true`): that frame says so, or the next frame to go out
        when k went out already (its `last` came after its audio had played)."""
        if k >= self.next_index:
            self.speech.setdefault(k, SpeechFrame(0.0, utterance=self._utterance, tail=True)).last = True
        elif self._utterance is not None:
            self.speech.setdefault(self.next_index, SpeechFrame(0.0, utterance=self._utterance, tail=True)).last = True
        self._utterance = None

    def windows(self, audio: np.ndarray, now: float, last: bool = False,
                utterance: Optional[int] = None) -> tuple[int, list[tuple[list[int], np.ndarray]]]:
        """Window mode: a chunk [n, *A] -> (first frame, [(frames, windows)]) ready for inference."""
        first = self.place(len(audio), now)
        frames = list(range(first, first + len(audio)))
        utterance = self._begin(utterance)
        for k in frames:
            self.speech[k] = SpeechFrame(now, utterance=utterance)
        if last:
            self._end(frames[-1])
        kept = [i for i, k in enumerate(frames) if self._rendered(k)]
        if len(kept) < len(frames):
            return first, [([frames[i] for i in kept], audio[kept])] if kept else []
        return first, [(frames, audio)]

    def features(self, rows: np.ndarray, last: bool, now: float, audio_shape: tuple[int, ...],
                 utterance: Optional[int] = None) -> tuple[int, list[tuple[list[int], np.ndarray]]]:
        """Features mode: n vectors [n, F] -> (first frame they drive, windows now computable)."""
        first = self.place(len(rows), now)
        utterance = self._begin(utterance)
        for i, row in enumerate(rows):
            self._rows.append(np.asarray(row, np.float32))
            self._row_frame.append(first + i)
            self._row_received.append(now)
            self.speech[first + i] = SpeechFrame(now, utterance=utterance)
        if last:
            self._end(first + len(rows) - 1)
        ready = len(self._rows) if last else max(len(self._rows) - LOOKAHEAD, 0)
        js = [j for j in range(self._inferred_rows, ready) if self._rendered(self._row_frame[j])]
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

    def pcm(self, chunk: bytes, last: bool, now: float, utterance: Optional[int] = None):
        """pcm16 mode: a chunk of int16 PCM at the session's rate. Returns (first frame its audio plays
        in, frames it spans, ready) where ready is [(stream, frame, rows)]: each frame now computable,
        with the utterance's stream (its encoder inputs, from a 16 kHz copy) and the frame's window rows
        into them. Each frame carries its own 1/25 s of the samples sent, at their rate; the samples past
        the last video frame go out with the frames after it (idle), so every sample comes back."""
        fs = self.frame_samples
        if self._stream is None:
            if not chunk:   # an empty `last` with nothing before it: no utterance
                return max(self.speech_end, self.now_index(now) + self.lead), 0, []
            self._utterance = self._begin(utterance)
            self._stream = PcmStream(f"{self.token}/{self._utterance}")
            self._resampler = Resampler(self.sample_rate) if self.sample_rate != SAMPLE_RATE else None
            # Speech lands by the audio in hand: frame 0 needs PCM_LOOKAHEAD_SAMPLES; those not here yet
            # arrive at least in real time (else its frames go out late: send audio in real time or faster).
            have = len(chunk) // 2 * SAMPLE_RATE // self.sample_rate
            wait = 0 if last else -(-max(PCM_LOOKAHEAD_SAMPLES - have, 0) // SAMPLES_PER_FRAME)
            earliest = self.now_index(now) + self.lead + wait
            self._utterance_start = self.speech_end if self.speech_end >= earliest else earliest
            self._utterance_pcm = bytearray()
            self._utterance_done = 0
        before = len(self._utterance_pcm) // 2
        self._utterance_pcm += chunk
        after = len(self._utterance_pcm) // 2
        stream, start, utterance = self._stream, self._utterance_start, self._utterance
        samples = np.frombuffer(chunk, "<i2").astype(np.float32) / 32768.0
        if self._resampler is not None:
            samples = self._resampler.push(samples, last)
        stream.push(samples, last)
        first = start + before // fs
        spans = -(-after // fs) - before // fs
        ready = stream.frame_count()
        work = []
        for i in range(self._utterance_done, ready):
            k = start + i
            self.speech[k] = SpeechFrame(now, audio=self._frame_pcm(i), utterance=utterance)
            if self._rendered(k):
                work.append((stream, k, stream.frame_rows(i)))
        self._utterance_done = ready
        heard = -(-after // fs)   # frames its samples so far play in
        self.speech_end = max(self.speech_end, start + max(ready, heard))
        if last:
            for i in range(ready, heard):   # its last samples, past its last video frame
                if start + i >= self.next_index:
                    self.speech[start + i] = SpeechFrame(now, audio=self._frame_pcm(i), utterance=utterance, tail=True)
            self.speech_end = start + max(ready, heard)
            self._end(self.speech_end - 1)
            self._stream = self._resampler = None
        return first, max(spans, 0), work

    def _rendered(self, k: int) -> bool:
        """Whether speech frame k goes to inference: all of them, unless the host sheds this session's
        speech (live/shedding.py): at HALF every other one (the one between repeats it), at NONE none
        (they go out idle, with their audio)."""
        speech = self.speech.get(k)
        if self.shed == FULL or speech is None:   # (features: its frame may have gone out before its rows came)
            return True
        before = self.speech.get(k - 1)
        if self.shed == HALF and (before is None or before.utterance != speech.utterance or before.repeat
                                  or before.shed or before.tail):
            return True
        speech.repeat, speech.shed = self.shed == HALF, self.shed != HALF
        return False

    def _frame_pcm(self, i: int) -> bytes:
        """Frame i of the utterance: its samples as sent (zeros past the end)."""
        size = 2 * self.frame_samples
        piece = bytes(memoryview(self._utterance_pcm)[i * size:(i + 1) * size])
        return piece + bytes(size - len(piece))

    def interrupt(self, upto: Optional[int] = None) -> int:
        """Retire every utterance up to `upto` (default: every one so far): their speech not yet sent is
        dropped, and chunks of them that arrive later are never rendered (`admits`). Idle follows, the
        first idle frame marked as the cut utterance's last. Returns how many frames were dropped."""
        upto = self._utterances if upto is None else upto
        self.retired = max(self.retired, upto)
        self._utterances = max(self._utterances, upto)
        dropped = [k for k in self.speech if k >= self.next_index and (self.speech[k].utterance or 0) <= self.retired]
        count = sum(not self.speech[k].tail for k in dropped)
        open_cut = self._utterance is not None and self._utterance <= self.retired
        cut = max((self.speech[k].utterance or 0 for k in dropped), default=0) or (self._utterance if open_cut else 0)
        for k in dropped:
            del self.speech[k]
        if cut and self.next_index not in self.speech:
            # the frame going out next tells the client that this utterance's playback ended here
            self.speech[self.next_index] = SpeechFrame(0.0, utterance=cut, last=True, tail=True)
        self.speech_end = max((k + 1 for k in self.speech), default=self.next_index)
        if open_cut or self._utterance is None:
            self._rows, self._row_frame, self._row_received, self._inferred_rows = [], [], [], 0
            self._stream = self._resampler = None
            self._utterance = None
        return count

    # -- results and pacing ----------------------------------------------------------------------

    @property
    def latest_utterance(self) -> Optional[int]:
        """The utterance the last chunk went to (ids only increase, so it is the highest so far)."""
        return self._utterances or None

    def utterance_at(self, k: int) -> Optional[int]:
        """The utterance whose speech frame k holds (what its inference result must match)."""
        speech = self.speech.get(k)
        return speech.utterance if speech is not None else None

    def _waiting(self, k: int, utterance: Optional[int]) -> Optional[SpeechFrame]:
        # NOTE: a result is taken only by the utterance it was made for: a batch of an interrupted
        # utterance still in flight must never fill a frame that a later utterance now holds.
        speech = self.speech.get(k)
        return speech if speech is not None and speech.utterance == utterance else None

    def submitted(self, frames: list[int], now: float) -> None:
        for k in frames:
            speech = self.speech.get(k)
            if speech is not None:
                speech.submitted = now

    def ready(self, k: int, utterance: Optional[int], image: Any, stages: Optional[dict] = None,
              now: float = 0.0) -> None:
        """Frame k of `utterance` was composited. `stages`: the batch's own timings (ms from batch
        formed to composited)."""
        speech = self._waiting(k, utterance)
        if speech is not None:
            speech.image, speech.ready_at = image, now
            if stages is not None and speech.submitted is not None:
                speech.stages = {"batching": (speech.submitted - speech.received) * 1000, **stages}

    def failed(self, k: int, utterance: Optional[int], code: str = "error") -> None:
        """Speech frame k's request failed with `code`: when due it goes out idle, counted missed."""
        speech = self._waiting(k, utterance)
        if speech is not None:
            speech.failed = code

    def box_lost(self, frame: Outgoing) -> None:
        """Speech frame `frame` (from `advance`) cannot be made after all (its H.264 face box stayed in a
        compositing process that died since): it goes out idle, counted missed ("failed")."""
        if frame.kind == "speech" and not frame.shed:
            self.stats.missed += 1
            self.stats.missed_in["failed"] = self.stats.missed_in.get("failed", 0) + 1
        frame.kind, frame.image, frame.missed = "idle", None, not frame.shed

    def advance(self, now: float) -> list[Outgoing]:
        """Every frame due by `now` + `ahead`, in order: speech when ready, else idle (speech missed)."""
        out = []
        t0, fps, ahead = self.t0, self.fps, self.ahead
        while t0 + self.next_index / fps - ahead <= now:   # (needed_by, inline: it runs for every frame sent)
            k = self.next_index
            speech = self.speech.pop(k, None)
            if speech is not None and (speech.repeat or speech.shed):   # the host sheds this session's speech
                self.stats.shed += 1
                said = self._said if speech.repeat and self._said and self._said[0] == speech.utterance else None
                out.append(Outgoing(k, "speech" if said else "idle", self.background(k), said and said[1],
                                    self.due(k), speech.received, speech.audio, utterance=speech.utterance,
                                    last=speech.last, shed=True))
            elif speech is not None and speech.image is not None:
                self.meter.speech += 1
                if self.needed_by(k) - speech.ready_at < 1 / self.fps:
                    self.meter.tight += 1
                self._said = (speech.utterance, speech.image)
                out.append(Outgoing(k, "speech", self.background(k), speech.image, self.due(k), speech.received,
                                    speech.audio, stages=speech.stages, ready_at=speech.ready_at,
                                    utterance=speech.utterance, last=speech.last))
            elif speech is not None and speech.tail:   # audio only (an utterance's last samples), or a cut
                out.append(Outgoing(k, "idle", self.background(k), None, self.due(k), audio=speech.audio,
                                    utterance=speech.utterance, last=speech.last))
            else:
                if speech is not None:
                    self.stats.missed += 1
                    self.meter.missed += 1
                    where = speech.where()
                    self.stats.missed_in[where] = self.stats.missed_in.get(where, 0) + 1
                out.append(Outgoing(k, "idle", self.background(k), None, self.due(k), missed=speech is not None,
                                    audio=speech.audio if speech is not None else None,
                                    utterance=speech and speech.utterance, last=speech is not None and speech.last))
            self.next_index += 1
        return out

    def sent(self, frame: Outgoing, now: float) -> None:
        late_ms = (now - frame.due) * 1000
        stats = self.stats
        if frame.kind == "speech":
            stats.speech += 1
            stats.latency_ms.append((now - frame.received) * 1000)
            if frame.stages:
                for name, ms in frame.stages.items():
                    stats.stage(name, ms)
            if frame.ready_at:
                stats.stage("hold", (now - frame.ready_at) * 1000)
        else:
            stats.idle += 1
        if late_ms > 40:
            stats.late += 1
        if late_ms > 1000 / self.fps:
            self.meter.late += 1
        if late_ms > stats.max_late_ms:
            stats.max_late_ms = late_ms


def on_frame_grid(t: float, fps: float) -> float:
    """The first frame time at or after `t` on the grid of period 1/fps from the clock's zero.

    NOTE: sessions at one fps all have their frames due at the same instants, so that one pacer tick
    serves them all (the frames of one tick's sessions are encoded in one message per compositor,
    live/h264_sessions.py); the price is that the last session of a tick goes out that tick's work later."""
    return math.ceil(t * fps - 1e-6) / fps


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
        heapq.heappush(self._due, (session.needed_by(session.next_index), session.token))

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
