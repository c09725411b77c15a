"""Live sessions in the frontend: the session ops, the pacer that sends every session's frames when
due, and the cache of encoded idle frames.

The timelines live in live/timeline.py (no sockets); speech chunks become ordinary `composite`
requests of the engine (live/speech.py: routed, batched into slots, composited like any other, ended
by a dead worker or a closed connection), whose frames are held until due instead of being replied.
Idle frames are the avatar's backgrounds, encoded once by a compositing process (the engine's `render`
requests) and kept in a bounded cache: a silent session costs the send and nothing else, no inference.

`Live` reaches its host process only through the `Host` interface (live/host.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np

from config.audio import AUDIO_SHAPE, SAMPLE_RATE, WINDOW_ROWS
from lipsync_client import protocol as P
from frontend.core.alarm import LOOP_CLOCK, Alarm, Clock
from frontend.core.backlog import Backlogs
from frontend.core.request import Kind, Request, RequestError
from frontend.live.capacity import SAMPLE_S, Capacity, host_cores
from frontend.live.h264_sessions import H264Sessions
from frontend.live.host import Host, OpenCall
from frontend.live.idle import IdleCache, frame_bytes
from frontend.live.shedding import LEVELS, NONE, WINDOW_S, Shedder
from frontend.live.speech import SpeechBatcher
from frontend.live.timeline import LiveSession, SessionTable, on_frame_grid
from shm.board import OPENS, SESSIONS, SPEAKING, SPEECH_FRAMES, Board, HostCounts
from shm.codes import ErrorCode
from shm.messages import RenderIdle

log = logging.getLogger(__name__)
PREFETCH_S = 2.0          # idle frames kept ready this far ahead of each session
RENDER_BATCH = 8
RENDER_TIMEOUT_S = 10.0
PACER_SLACK_S = 0.004      # frames due this soon go out with the frames due now (one tick for many sessions)
MIN_FPS = 1.0             # the slowest stream a session keeps (header.fps, sessions.fps)
BUSY_RETRY_S = 2.0        # sessions.max_sessions reached: when to ask again
LOGGED_CHANGES = 5        # sessions named in a shedding window's log line


@dataclass
class IdleRender:
    """The work of an engine `render` request for idle frames: which cache keys it fills."""
    keys: list
    model: str
    version: int
    frames: list[int]
    format: str
    quality: int
    due: float             # when the first of them must go out
    live: "Live" = field(repr=False)

    def message(self, r: Request) -> RenderIdle:
        return RenderIdle(req=r.req, model=self.model, frames=self.frames, format=self.format,
                          quality=self.quality, deadline=r.deadline, version=self.version, due=self.due)

    def done(self, r: Request) -> None:
        self.live.idle_done(r, self)

    def failed(self, r: Request, code, message: str) -> None:
        self.live.idle_failed(self, code, message)


@dataclass
class Opening:
    """A session_open not answered yet: its session waits for its model and first frames (`Live._open`)."""
    session: LiveSession
    call: OpenCall
    timer: Any                 # fails the open past limits.request_timeout_s
    format: str                # the frames' format (the header's, or output.format)
    started: float             # when it was asked for
    pinned: bool = False
    awaiting: set = field(default_factory=set)   # the idle renders (cache keys) it waits for


@dataclass
class Pin:
    """The work of the engine `load` a session makes at open: its model is kept loaded on that worker
    until close."""
    token: str
    live: "Live" = field(repr=False)

    def done(self, r: Request) -> None:
        self.live.pinned(r, self.token)

    def failed(self, r: Request, code, message: str) -> None:
        self.live.pin_failed(r, self.token, message)


class Live:
    def __init__(self, host: Host, config: Any, metrics: Any, viewer: Any = None, clock: Clock = LOOP_CLOCK,
                 cpu: Optional[Callable[[], Mapping[str, float]]] = None, cores: Optional[float] = None,
                 board: Optional[Board] = None):
        """`cpu`: the CPU seconds each of the host's server processes has used so far (named frontend,
        cpuN, gpuN); with it, session_open is refused `busy` past the host's capacity (live/capacity.py)
        on `cores` (default: what this process may use). `board`: the host's other client-facing
        processes' sessions (shm/board.py), counted with this one's by admission, sessions.max_sessions
        and shedding; None: this process is the host's only one."""
        self.host, self.config, self.metrics, self.viewer = host, config, metrics, viewer
        self.clock = clock   # every time read and timer set here: the loop's, or a test's virtual one
        self.cfg = config.sessions
        self._cpu = cpu
        self.capacity = (Capacity(cores or host_cores(), self.cfg.max_cpu_load, self.cfg.max_process_load,
                                  single_threaded=lambda name: not name.startswith("gpu"),
                                  speaking_share=self.cfg.speaking_share, fps=self.cfg.fps,
                                  burst_share=self.cfg.burst_share, max_burst_load=self.cfg.max_burst_load,
                                  processes=board.processes if board is not None else 1)
                         if cpu is not None and (self.cfg.max_cpu_load > 0 or self.cfg.shed_speech) else None)
        self.board = board
        # the tenants with a session limit of their own (frontend.curve.tenants.NAME.max_sessions), in
        # their board columns' order
        self._tenant_limits = config.frontend.session_limits()
        self._tenant_column = {name: i for i, name in enumerate(self._tenant_limits)}
        # speech frames rendered and sent, all sessions (what the capacity model fits), and sessions whose
        # opening began (its warm-up: a cost apart from holding it); on a board, counted on from its row
        self._speech_sent = board.get(SPEECH_FRAMES) if board is not None else 0
        self._opens = board.get(OPENS) if board is not None else 0
        self._sampler: Any = None   # the timer of the next CPU sample, once the first session_open came
        self.shedder = Shedder() if self.cfg.shed_speech else None
        self._shed_timer: Any = None   # the next shedding window, while sessions are open
        # NOTE: the label lookup once, not per frame sent
        self._counted = {kind: metrics.session_frames.labels(kind)
                         for kind in ("speech", "idle", "missed", "dropped", "skipped", "shed")}
        self._refused, self._cpu_load, self._shedding = metrics.sessions_refused, metrics.cpu_load, metrics.sessions_shed
        self._lateness = metrics.session_lateness
        self.table = SessionTable(self.cfg.max_sessions)
        self.idle = IdleCache(self.cfg.idle_cache_bytes)
        self.queued = Backlogs(self.cfg.max_queued_frames)   # frames sent and not read, per session
        self.pacer = Alarm(self._tick, clock)   # rings when the earliest session frame is due
        self._ticking: Optional[list] = None   # during a tick: its frames sent, stamped when it ends
        self.h264 = H264Sessions(host, self.cfg.h264, self.table, self.idle, metrics, self.send, self.arm,
                                 self._check_opens, self._opens_failed, clock)
        self.speech = SpeechBatcher(host, self.table, config.limits.max_batch, self.cfg.latency_budget_ms, self._key,
                                    clock, next_tick=lambda: self.pacer.at)
        if viewer is not None:
            self.attach_viewer(viewer)
        self._opening: dict[str, Opening] = {}   # session_opens not answered yet (`_open`), by token

    # -- ops ------------------------------------------------------------------------------------

    def handle(self, call: OpenCall, payload: list) -> Optional[bytes]:
        """A session op's reply (RequestError for a refusal); None for a session_open, answered once its
        session is ready (`_open`)."""
        op = call.header.op
        if op is P.Op.SESSION_OPEN:
            return self._open(call)
        session = self.table.get(call.header.session)
        # NOTE: only the connection that opened a session may drive it or read it; to any other, a
        # session it does not own is one that does not exist (the same error: ids are not probed).
        if session is None or session.call.reply_to.peer != call.reply_to.peer:
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.session: no open session {call.header.session!r} "
                               "on this connection (closed, its client disconnected, or opened by another "
                               "connection); open one with session_open", call.header.id)
        if op is P.Op.SESSION_AUDIO:
            return self._audio(session, call, payload[0])
        if op is P.Op.SESSION_KEYFRAME:
            if session.h264 is None:
                raise RequestError(ErrorCode.BAD_REQUEST, "session_keyframe: this session is not h264 (open it with "
                                   "format: h264)", call.header.id)
            return P.encode(P.SessionKeyframeReply(id=call.header.id, session=session.token,
                                                   frame=self.h264.keyframe(session)))
        if op is P.Op.SESSION_INTERRUPT:
            dropped = session.interrupt(call.header.utterance)
            self.speech.interrupt(session)
            return P.encode(P.SessionInterruptReply(id=call.header.id, session=session.token, dropped=dropped,
                                                    utterance=session.retired))
        if op is P.Op.SESSION_CLOSE:
            self._close(session)
        return P.encode(P.SessionStatsReply(id=call.header.id, session=session.token, **session.stats.as_dict()))

    def _open(self, call: OpenCall) -> None:
        header, spec = call.header, call.spec
        self._admit(header.id, call.reply_to.tenant)
        elements = int(np.prod(spec.audio_shape))
        mode = header.audio or "window"
        if mode == "pcm16" and (tuple(spec.audio_shape) != AUDIO_SHAPE or not spec.encoder):
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.audio: model {spec.id} cannot take PCM: "
                               + ("it has no audio encoder (audio_encoder.onnx in its directory, or audio.encoder)"
                                  if spec.encoder else f"it takes {list(spec.audio_shape)} feature windows"), header.id)
        if mode == "features" and elements % WINDOW_ROWS:
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.audio: model {spec.id}'s audio window "
                               f"{list(spec.audio_shape)} is not 16 feature vectors; use audio: window", header.id)
        fmt = header.format or self.config.output.format
        if fmt == "h264" and (spec.width % 2 or spec.height % 2):
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.format: h264 needs even frame sizes; model {spec.id}'s "
                               f"frames are {spec.width}x{spec.height}", header.id)
        if header.webrtc and self.viewer is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "header.webrtc: this server has no viewer (viewer.port is 0, "
                               "or its role is gpu)", header.id)
        rate = header.sample_rate or SAMPLE_RATE
        if rate != SAMPLE_RATE and (rate % 25 or header.webrtc):
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.sample_rate: {rate}; " + (
                "a webrtc session takes 16000 Hz" if header.webrtc else
                "a multiple of 25 Hz (a whole number of samples per 40-ms frame)"), header.id)
        if header.pixel_format == "i420" and (spec.width % 2 or spec.height % 2):
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.pixel_format: i420 needs even frame sizes; model "
                               f"{spec.id}'s frames are {spec.width}x{spec.height}", header.id)
        fps = header.fps or self.cfg.fps
        if fps < MIN_FPS:   # the encoders' time base, and a stream that would send nothing for minutes
            raise RequestError(ErrorCode.BAD_REQUEST, f"header.fps: {fps:g}; a live session runs at {MIN_FPS:g} to "
                               "60 frames/s", header.id)
        now = self.clock.now()
        session = LiveSession(self.table.new_token(), spec.id, call.reply_to.conn, fps,
                          now + self.cfg.start_delay_ms / 1000, header.start_frame, spec.frames, spec.order,
                          max(1, round(self.cfg.latency_budget_ms / 1000 * fps) - 1), mode,
                          (WINDOW_ROWS, elements // WINDOW_ROWS), call=call, sample_rate=rate)
        if fmt == "h264":
            self.h264.open(session)
        # NOTE: the reply waits until the session can deliver its frames on time: its model loaded and
        # warm on a worker (and kept there while the session is open), its first idle frames (or its
        # avatar's H.264 idle loop) rendered, which puts its backgrounds in the shared store. Answered
        # at once, the first utterance of a cold model met all of that while its frames were due.
        timeout_s = self.config.limits.request_timeout_s
        opening = self._opening[session.token] = Opening(session, call, self.clock.call_at(
            now + timeout_s, lambda: self._open_failed(session.token, ErrorCode.TIMEOUT,
                                                       f"model {spec.id} was not ready to stream within {timeout_s:g}s "
                                                       "(limits.request_timeout_s); retry")), fmt, now)
        self._opens += 1
        self._publish()
        self.host.submit(Request(Kind.LOAD, spec.id, deadline=now + timeout_s, work=Pin(session.token, self),
                                 pin=1))
        self._prefetch(session)
        # the renders it waits for: its first PREFETCH_S of idle frames (h264: its avatar's idle loop),
        # those it just asked for and those another session asked for before
        keys = (self.h264.loop_keys(session) if session.h264 is not None else
                {self._key(session, session.background(k)) for k in range(math.ceil(PREFETCH_S * session.fps))})
        opening.awaiting = {key for key in keys if key in self.idle.rendering}
        self._check_open(opening)
        return None

    def _others(self) -> HostCounts:
        """The host's other client-facing processes' sessions (none without a board)."""
        return self.board.others() if self.board is not None else HostCounts()

    def _publish(self) -> None:
        """This process's sessions (held or opening) and counts, for the host's other client-facing
        processes' admission."""
        if self.board is not None:
            self.board.set(SESSIONS, len(self.table) + len(self._opening))
            self.board.set(OPENS, self._opens)
            if self._tenant_limits:
                self.board.set_tenants([self._tenant_sessions(name) for name in self._tenant_limits])

    def _tenant_sessions(self, name: str) -> int:
        """This process's sessions (held or opening) of tenant `name`."""
        sessions = [*self.table.sessions(), *(o.session for o in self._opening.values())]
        return sum(1 for s in sessions if s.call is not None and getattr(s.call.reply_to.tenant, "name", None) == name)

    def _admit(self, request_id, tenant=None) -> None:
        """Refuse a session_open `busy` past sessions.max_sessions, past its tenant's own limit, or past
        the host's measured capacity, counting the sessions of every client-facing process of the host."""
        others = self._others()
        opened = len(self.table) + len(self._opening) + others.sessions
        if opened >= self.cfg.max_sessions:
            self._refused.inc()
            raise RequestError(ErrorCode.BUSY, f"{opened} sessions are open on this host (sessions.max_sessions); "
                               "retry later or on another server", request_id, retry_after_s=BUSY_RETRY_S)
        limit = self._tenant_limits.get(tenant.name) if tenant is not None else None
        if limit is not None:
            column = self._tenant_column[tenant.name]
            held = self._tenant_sessions(tenant.name) + (others.tenants[column] if column < len(others.tenants) else 0)
            if held >= limit:
                self._refused.inc()
                raise RequestError(ErrorCode.BUSY, f"tenant {tenant.name} holds {held} live sessions on this host "
                                   f"(frontend.curve.tenants.{tenant.name}.max_sessions); close one, or retry later",
                                   request_id, retry_after_s=BUSY_RETRY_S)
        if self.capacity is None:
            return
        if self._sampler is None:
            self._sample()
        if not self.cfg.max_cpu_load:   # measured for shedding only
            return
        busy = self.capacity.refuse(self.clock.now(), opened)
        if busy is not None:
            self._refused.inc()
            raise RequestError(ErrorCode.BUSY, busy.message, request_id, retry_after_s=busy.retry_after_s)

    def _sample(self) -> None:
        now = self.clock.now()
        others = self._others()
        self.capacity.sample(now, self._cpu(), len(self.table) + others.sessions, self._speech_sent + others.speech_frames,
                             self._opens + others.opens)
        if self.capacity.load is not None:
            self._cpu_load.set(self.capacity.load.total / self.capacity.cores)
        self._sampler = self.clock.call_at(now + SAMPLE_S, self._sample)

    def _shed(self) -> None:
        """A shedding window (live/shedding.py): the newest speaking sessions give up a step of their speech
        when frames were missed, late or tight; steps are given back after calm windows."""
        sessions = self.table.sessions()   # oldest first
        now = self.clock.now()
        speaking, others = len(self._speaking(sessions, now)), self._others()
        if self.board is not None:
            self.board.set(SPEAKING, speaking)
        held = self.capacity.speakers_held(len(sessions) + others.sessions) if self.capacity is not None else None
        room = None if held is None else held - speaking - others.speaking
        changes = self.shedder.window(sessions, room)
        self._log_shed(changes, sessions)
        self._shed_timer = self.clock.call_at(now + WINDOW_S, self._shed) if sessions else None

    def _crowd(self, session: LiveSession, now: float) -> None:
        """A session starting to speak past the sessions the host can hold speaking at once: the newest
        speaking give up their speech before it is late (live/shedding.py, `Shedder.crowd`)."""
        if (self.shedder is None or self.capacity is None or session.shed == NONE
                or session.speech_end > session.now_index(now)):
            return   # (shed already, or speaking already: counted when it started)
        sessions, others = self.table.sessions(), self._others()
        held = self.capacity.speakers_held(len(sessions) + others.sessions)
        speaking = self._speaking(sessions, now, starting=session)
        if self.board is not None:
            self.board.set(SPEAKING, len(speaking))
        if held is not None and len(speaking) + others.speaking > held:
            self._log_shed(self.shedder.crowd(speaking, held, others.speaking), sessions)

    @staticmethod
    def _speaking(sessions: list[LiveSession], now: float, starting: Optional[LiveSession] = None) -> list:
        """The sessions with speech placed ahead of the frame going out and not shed to nothing, and
        `starting` (about to), in the order given."""
        return [s for s in sessions if s is starting or (s.shed < NONE and s.speech_end > s.now_index(now))]

    def _log_shed(self, changes: list, sessions: list[LiveSession]) -> None:
        shed = sum(s.shed > 0 for s in sessions)
        if changes:   # one line a window, however many sessions changed
            shown = ", ".join(f"{c.token} {LEVELS[c.level]}" for c in changes[:LOGGED_CHANGES])
            more = f" and {len(changes) - LOGGED_CHANGES} more" if len(changes) > LOGGED_CHANGES else ""
            log.warning("%s: speech of %d session(s) %s: %s%s (%d of %d sessions shed)",
                        "the host is full" if changes[0].full else "calm again", len(changes),
                        "shed" if changes[0].full else "given back", shown, more, shed, len(sessions))
        self._shedding.set(shed)

    def _check_open(self, opening: "Opening") -> None:
        """Answer a session_open once its session is ready (`_open`)."""
        session = opening.session
        if not opening.pinned or opening.awaiting:
            return
        del self._opening[session.token]
        opening.timer.cancel()
        session.t0 = on_frame_grid(self.clock.now() + self.cfg.start_delay_ms / 1000, session.fps)
        self.table.add(session)
        self.metrics.sessions_open.set(len(self.table))
        if self.shedder is not None and self._shed_timer is None:
            self._shed_timer = self.clock.call_at(self.clock.now() + WINDOW_S, self._shed)
        header, spec = opening.call.header, opening.call.spec
        viewer_url = self.viewer.open(session) if header.webrtc else None
        self.arm()
        self.host.send(opening.call.reply_to, P.encode(P.SessionOpenReply(
            id=header.id, session=session.token, fps=session.fps, width=spec.width, height=spec.height,
            audio_shape=list(spec.audio_shape), feature_shape=[session.feature_shape[1]],
            start_frame=header.start_frame, format=opening.format, viewer_url=viewer_url,
            sample_rate=session.sample_rate if session.audio_mode == "pcm16" else None,
            pixel_format=(header.pixel_format or "bgr24") if opening.format == "raw" else None,
            ready_ms=round((self.clock.now() - opening.started) * 1000, 1))))

    def _open_failed(self, token: str, code: ErrorCode, message: str) -> None:
        opening = self._opening.pop(token, None)
        if opening is None:
            return
        opening.timer.cancel()
        self._release(opening.session)
        self._publish()
        self.host.send(opening.call.reply_to, P.error_reply(opening.call.header.id, code, message))

    def _opens_failed(self, keys, code, message: str) -> None:
        """Renders a session being opened waits for failed: it fails, saying why, with the render's code
        where it says the avatar's files are bad (bad_request: retrying cannot help), else unavailable."""
        keys = set(keys)
        bad_files = getattr(code, "value", code) == ErrorCode.BAD_REQUEST.value
        code = ErrorCode.BAD_REQUEST if bad_files else ErrorCode.UNAVAILABLE
        for opening in [o for o in self._opening.values() if o.awaiting & keys]:
            self._open_failed(opening.session.token, code,
                              f"model {opening.session.model}: its frames could not be rendered: {message}")

    def _audio(self, session: LiveSession, call: OpenCall, audio) -> bytes:
        spec = session.call.spec
        header = call.header
        try:
            admitted = session.admits(header.utterance)
        except ValueError as err:
            raise RequestError(ErrorCode.BAD_REQUEST, str(err), header.id) from None
        if not admitted:   # sent before the interrupt that retired its utterance reached here: dropped
            return P.encode(P.SessionAudioReply(id=header.id, session=session.token, first_frame=session.next_index,
                                                frames=0, utterance=header.utterance, retired=True))
        if session.audio_mode == "pcm16":
            return self._pcm(session, call, audio)
        per_frame = math.prod(spec.audio_shape) if session.audio_mode == "window" else session.feature_shape[1]
        shape = list(spec.audio_shape) if session.audio_mode == "window" else [per_frame]
        n, rest = divmod(len(audio), 4 * per_frame)
        if rest or not n:
            raise RequestError(ErrorCode.BAD_REQUEST, f"payload[0] (audio): {len(audio)} bytes; expected float32 "
                               f"[n, {', '.join(map(str, shape))}] with n >= 1 ({4 * per_frame} bytes per frame)",
                               header.id)
        limit = self.cfg.max_chunk_frames
        if n > limit:
            raise RequestError(ErrorCode.BAD_REQUEST, f"payload[0] (audio): {n} frames in one chunk, more than "
                               f"sessions.max_chunk_frames ({limit}); send smaller chunks", header.id)
        now = self.clock.now()
        ahead = (max(session.speech_end, session.now_index(now)) + n - session.now_index(now)) / session.fps
        if ahead > self.cfg.max_ahead_s:
            raise RequestError(ErrorCode.OVERLOADED, f"this session's speech would reach {ahead:.1f} s ahead of its "
                               f"stream (sessions.max_ahead_s = {self.cfg.max_ahead_s:g}); send audio in real time",
                               header.id)
        self._crowd(session, now)
        values = np.frombuffer(audio, "<f4").reshape(n, *shape)
        if session.audio_mode == "window":
            first, ready = session.windows(values, now, header.last, header.utterance)
        else:
            first, ready = session.features(values, header.last, now, spec.audio_shape, header.utterance)
        for frames, windows in ready:
            self.speech.windows(session, frames, windows)
        return P.encode(P.SessionAudioReply(id=header.id, session=session.token, first_frame=first, frames=n,
                                            utterance=session.latest_utterance))

    def _pcm(self, session: LiveSession, call: OpenCall, audio) -> bytes:
        header = call.header
        limit = self.cfg.max_chunk_frames * session.frame_samples
        if len(audio) % 2 or len(audio) // 2 > limit:
            raise RequestError(ErrorCode.BAD_REQUEST, f"payload[0] (audio): {len(audio)} bytes; expected "
                               f"{session.sample_rate} Hz int16 "
                               f"PCM, at most {limit} samples (sessions.max_chunk_frames)", header.id)
        now = self.clock.now()
        ahead = (session.speech_end - session.now_index(now)) / session.fps
        if ahead > self.cfg.max_ahead_s:
            raise RequestError(ErrorCode.OVERLOADED, f"this session's speech reaches {ahead:.1f} s ahead of its "
                               f"stream (sessions.max_ahead_s); send audio in real time", header.id)
        self._crowd(session, now)
        first, frames, ready = session.pcm(bytes(audio), header.last, now, header.utterance)
        self.speech.pcm(session, ready, header.last)
        return P.encode(P.SessionAudioReply(id=header.id, session=session.token, first_frame=first, frames=frames,
                                            utterance=session.latest_utterance))

    def _close(self, session: LiveSession) -> None:
        self.speech.close(session)
        self._release(session)
        if self.viewer is not None:
            self.viewer.close(session.token)
        self.table.pop(session.token)
        self.queued.closed(session.token)
        self.metrics.sessions_open.set(len(self.table))
        self._publish()

    def _release(self, session: LiveSession) -> None:
        """What a session holds beyond its frames: its model's pin, its H.264 encoder."""
        if session.pinned_worker is not None:
            self.host.unpin(session.pinned_worker, session.model)
            session.pinned_worker = None
        if session.h264 is not None:
            self.h264.close(session)

    def device_capacity(self, worker: int, frames_per_s: float) -> None:
        """A GPU worker measured what its device runs: admission holds sessions' speech within it."""
        if self.capacity is not None:
            self.capacity.device(worker, frames_per_s)

    def attach_viewer(self, viewer: Any) -> None:
        """The WebRTC viewer, once it runs (its host starts it after the first clients are served)."""
        self.viewer = viewer
        viewer.keyframe = self.request_keyframe

    def request_keyframe(self, token: str) -> None:
        """The viewer asks for an IDR (a new browser, or one that lost a picture)."""
        session = self.table.get(token)
        if session is not None and session.h264 is not None:
            self.h264.keyframe(session)

    def client_gone(self, conn) -> None:
        for session in self.table.on_conn(conn):
            self._close(session)
        for opening in [o for o in self._opening.values() if o.session.conn == conn]:
            del self._opening[opening.session.token]
            opening.timer.cancel()
            self._release(opening.session)
        self._publish()

    # -- engine results (each request's work calls the one for its kind) -------------------------

    def pinned(self, r: Request, token: str) -> None:
        """A session's model is loaded and pinned on a worker."""
        opening = self._opening.get(token)
        session = opening.session if opening is not None else self.table.get(token)
        worker = r.results[0].worker if r.results else None
        if session is None and worker is not None:   # closed before the load finished
            self.host.unpin(worker, r.model)
        elif session is not None:
            session.pinned_worker = worker
        if opening is not None:
            opening.pinned = True
            self._check_open(opening)

    def pin_failed(self, r: Request, token: str, message: str) -> None:
        if token in self._opening:   # its model could not be loaded: the open fails, saying why
            self._open_failed(token, ErrorCode.UNAVAILABLE, f"model {r.model}: {message}")
        else:
            log.info("pinning the model of a session failed: %s", message)   # its frames still route as usual

    def idle_done(self, r: Request, render: IdleRender) -> None:
        images = [img for start in sorted(r.images) for img in r.images[start]]
        for key, image in zip(render.keys, images):
            self.idle.rendering.discard(key)
            self.idle.put(key, frame_bytes(image))
        self._check_opens(render.keys)

    def idle_failed(self, render: IdleRender, code, message: str) -> None:
        for key in render.keys:
            self.idle.rendering.discard(key)
        log.warning("encoding idle frames of model %s failed: %s", render.model, message)
        self._opens_failed(render.keys, code, message)

    def _check_opens(self, keys) -> None:
        """These renders are done: the sessions being opened that waited for them may be ready."""
        for opening in list(self._opening.values()):
            if opening.awaiting:
                opening.awaiting.difference_update(keys)
                self._check_open(opening)

    # -- pacing ---------------------------------------------------------------------------------

    def _key(self, session: LiveSession, background: int) -> tuple:
        header, spec = session.call.header, session.call.spec
        fmt = header.format or self.config.output.format
        quality = header.quality or self.config.output.quality
        if fmt == "h264":   # speech frames are composited into face boxes, the session's encoder does the rest
            fmt = "i420"
        elif fmt == "raw" and header.pixel_format not in (None, "bgr24"):   # cpu_actor/composite.py: raw-<layout>
            fmt = "raw-" + header.pixel_format
        return (spec.id, spec.version, background, fmt, quality)

    def _prefetch(self, session: LiveSession) -> None:
        """Ask the compositors for the idle frames this session needs in the next PREFETCH_S."""
        if session.h264 is not None:
            self.h264.prefetch(session)
            return
        needed: dict[int, float] = {}   # background -> when it is first due
        for k in range(session.next_index, session.next_index + math.ceil(PREFETCH_S * session.fps)):
            needed.setdefault(session.background(k), session.due(k))
        missing = []
        for background, due in needed.items():
            key = self._key(session, background)
            if key not in self.idle.rendering and self.idle.get(key) is None:
                missing.append((key, background, due))
        missing.sort(key=lambda m: m[2])
        for i in range(0, len(missing), RENDER_BATCH):
            part = missing[i:i + RENDER_BATCH]
            keys = [k for k, _, _ in part]
            self.idle.rendering.update(keys)
            spec, fmt, quality = session.call.spec, keys[0][3], keys[0][4]
            # NOTE: due when the session needs the first of them: compositors take it in turn with
            # speech, never starved behind it
            render = IdleRender(keys, spec.id, spec.version, [b for _, b, _ in part], fmt, quality, part[0][2], self)
            request = Request(Kind.RENDER, spec.id, len(part), deadline=self.clock.now() + RENDER_TIMEOUT_S,
                              work=render)
            self.host.submit(request)

    def arm(self) -> None:
        self.pacer.arm(self.table.next_due())

    def _tick(self) -> None:
        # NOTE: every session due within PACER_SLACK_S goes now, in one pass: one timer per tick
        # instead of one per session and frame (sessions' frame times are staggered), at the price of
        # frames leaving up to PACER_SLACK_S early.
        now = self.clock.now()
        horizon = now + PACER_SLACK_S
        self._ticking = sent = []
        try:
            for session in self.table.due(horizon):
                if session.h264 is not None:
                    self.h264.tick(session, horizon)
                else:
                    for frame in session.advance(horizon):
                        self.send(session, frame, now)
                if session.next_index % max(int(session.fps // 2), 1) == 0:
                    self._prefetch(session)
                self.table.schedule(session)
            self.speech.tick()
            self.h264.send_encodes()
        finally:
            self._ticking = None
        # NOTE: the tick's frames leave together when it ends (server/replies.py): that is when they
        # count as sent, so a tick's own length shows in their lateness
        self._sent(sent, self.clock.now())
        self.arm()

    def send(self, session: LiveSession, frame, now: float, keyframe: bool = False) -> bool:
        """Send one frame to the session's client (and viewer); False if it was dropped."""
        image = frame.image
        if image is None:
            image = self.idle.get(self._key(session, frame.background))
            if image is None:   # not encoded yet (a cold start): repeat the last frame sent
                image = session.last_image
        counted = self._counted
        if image is None:
            session.stats.dropped += 1
            counted["skipped"].inc()
            return False
        audio = None
        if session.audio_mode == "pcm16":   # every frame carries its 40 ms of audio: silence when idle
            audio = frame.audio if frame.audio is not None else session.silence
        if session.viewer:   # webrtc sessions stream to the viewer, not to the client
            self.viewer.push(session, frame, image, audio, keyframe)
        else:
            entry = self.queued.admit(session.token, 1)
            header = P.encode(P.FrameEvent(session=session.token, index=frame.index,
                                           pts_ms=frame.index * 1000 / session.fps, kind=frame.kind,
                                           frame=frame.background, keyframe=keyframe, utterance=frame.utterance,
                                           last=frame.last))
            # entry None: the client is not reading; frames past sessions.max_queued_frames go
            if entry is None or not self.host.send(session.call.reply_to, header,
                                                  [image] if audio is None else [image, audio], also=entry):
                session.stats.dropped += 1
                counted["dropped"].inc()
                return False
        session.last_image = image
        if self._ticking is not None:
            self._ticking.append((session, frame))
        else:
            self._sent([(session, frame)], now)
        return True

    def _sent(self, sent: list, now: float) -> None:
        """Frames that left at `now` ([(session, frame)]: a tick's, or one): their sessions' stats, and
        the counters and the lateness histogram once for them all, not per frame."""
        counts = dict.fromkeys(("speech", "idle", "missed", "shed"), 0)
        late = []
        for session, frame in sent:
            session.sent(frame, now)
            counts[frame.kind] += 1
            late.append(max((now - frame.due) * 1000, 0.0))
            if frame.missed:
                counts["missed"] += 1
            elif frame.shed:
                counts["shed"] += 1
            elif frame.kind == "speech":
                self._speech_sent += 1
        if self.board is not None and counts["speech"]:
            self.board.set(SPEECH_FRAMES, self._speech_sent)
        for kind, n in counts.items():
            if n:
                self._counted[kind].inc(n)
        self._lateness.observe(late)
