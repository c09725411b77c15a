"""Live sessions in the frontend: the session ops, the pacer that sends every session's frames when
due, and the cache of encoded idle frames.

The timelines live in live/timeline.py (no sockets); speech chunks become ordinary `composite`
requests of the engine (routed, batched into slots, composited like any other, ended by a dead worker
or a closed connection), whose frames are held until due instead of being replied. Idle frames are
the avatar's backgrounds, encoded once by a compositing process (the engine's `render` requests) and
kept in a bounded cache: a silent session costs the send and nothing else, no inference.

`Live` reaches its host process only through the `Host` interface (live/host.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from config.audio import AUDIO_SHAPE, SAMPLE_RATE, WINDOW_ROWS
from lipsync_client import protocol as P
from frontend.core.alarm import LOOP_CLOCK, Alarm, Clock
from frontend.core.backlog import Backlogs
from frontend.core.request import Inputs, Kind, Request, RequestError
from frontend.live.h264_sessions import H264Sessions, frame_bytes
from frontend.live.host import Host, OpenCall
from frontend.live.idle import IdleCache
from frontend.live.timeline import LiveSession, SessionTable
from shm.codes import ErrorCode
from shm.messages import RenderIdle

log = logging.getLogger(__name__)
PREFETCH_S = 2.0          # idle frames kept ready this far ahead of each session
RENDER_BATCH = 8
RENDER_TIMEOUT_S = 10.0
PACER_SLACK_S = 0.004      # frames due this soon go out with the frames due now (one tick for many sessions)
MIN_FPS = 1.0             # the slowest stream a session keeps (header.fps, sessions.fps)
BATCH_WAIT_FRAMES = 1    # how long speech frames wait for other sessions' to share a batch, in frames


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
        self.live.idle_failed(self, message)


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


@dataclass
class SpeechBatch:
    """The work of an engine `composite` request of speech frames: each frame's (session, frame index,
    utterance), held by its session until due instead of being replied."""
    targets: list[tuple[str, int, Optional[int]]]
    format: str
    live: "Live" = field(repr=False)

    def done(self, r: Request) -> None:
        self.live.speech_done(r, self)

    def failed(self, r: Request, code, message: str) -> None:
        self.live.speech_failed(self, message)


def speech_stages(timing: dict, answered: dict) -> dict:
    """A composited batch's stages after its batch was formed, in ms (timeline.STAGES), from the
    worker's and the compositors' own timings and when the host received their answers."""
    composite_ms = timing.get("composite_ms", 0.0)
    stages = {"queue": timing.get("queue_ms", 0.0), "inference": timing.get("inference_ms", 0.0),
              "composite": composite_ms}
    if "infer" in answered and "composite" in answered:   # (a reply can overtake the other on its way)
        stages["to_composite"] = max((answered["composite"] - answered["infer"]) * 1000 - composite_ms, 0.0)
    return stages


class Live:
    def __init__(self, host: Host, config: Any, metrics: Any, viewer: Any = None, clock: Clock = LOOP_CLOCK):
        self.host, self.config, self.metrics, self.viewer = host, config, metrics, viewer
        self.clock = clock   # every time read and timer set here: the loop's, or a test's virtual one
        self.cfg = config.sessions
        # NOTE: the label lookup once, not per frame sent
        self._counted = {kind: metrics.session_frames.labels(kind)
                         for kind in ("speech", "idle", "missed", "dropped", "skipped")}
        self._lateness = metrics.session_lateness
        self.table = SessionTable(self.cfg.max_sessions)
        self.idle = IdleCache(self.cfg.idle_cache_bytes)
        self.queued = Backlogs(self.cfg.max_queued_frames)   # frames sent and not read, per session
        self.pacer = Alarm(self._tick, clock)   # rings when the earliest session frame is due
        self.h264 = H264Sessions(host, self.cfg.h264, self.table, self.idle, metrics, self.send, self.arm,
                                 self._check_opens, self._opens_failed, clock)
        if viewer is not None:
            self.attach_viewer(viewer)
        # Speech frames waiting to share a batch, and their flush timers: by (model, version, -, format,
        # quality) for windows, by session token for pcm16 sessions.
        self._pending: dict = {}
        self._flush_timers: dict = {}
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
            self._unqueue(session)
            return P.encode(P.SessionInterruptReply(id=call.header.id, session=session.token, dropped=dropped,
                                                    utterance=session.retired))
        if op is P.Op.SESSION_CLOSE:
            self._close(session)
        return P.encode(P.SessionStatsReply(id=call.header.id, session=session.token, **session.stats.as_dict()))

    def _open(self, call: OpenCall) -> None:
        header, spec = call.header, call.spec
        if len(self.table) + len(self._opening) >= self.cfg.max_sessions:
            raise RequestError(ErrorCode.OVERLOADED, f"{len(self.table) + len(self._opening)} sessions are open "
                               "(sessions.max_sessions); "
                               "retry later or on another server", header.id)
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

    def _check_open(self, opening: "Opening") -> None:
        """Answer a session_open once its session is ready (`_open`)."""
        session = opening.session
        if not opening.pinned or opening.awaiting:
            return
        del self._opening[session.token]
        opening.timer.cancel()
        session.t0 = self.clock.now() + self.cfg.start_delay_ms / 1000
        self.table.add(session)
        self.metrics.sessions_open.set(len(self.table))
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
        self.host.send(opening.call.reply_to, P.error_reply(opening.call.header.id, code, message))

    def _opens_failed(self, keys, message: str) -> None:
        """Renders a session being opened waits for failed: it fails, saying why."""
        keys = set(keys)
        for opening in [o for o in self._opening.values() if o.awaiting & keys]:
            self._open_failed(opening.session.token, ErrorCode.UNAVAILABLE,
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
        per_frame = int(np.prod(spec.audio_shape)) if session.audio_mode == "window" else session.feature_shape[1]
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
        values = np.frombuffer(audio, "<f4").reshape(n, *shape)
        if session.audio_mode == "window":
            first, ready = session.windows(values, now, header.last, header.utterance)
        else:
            first, ready = session.features(values, header.last, now, spec.audio_shape, header.utterance)
        for frames, windows in ready:
            self._infer(session, frames, windows)
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
        first, frames, ready = session.pcm(bytes(audio), header.last, now, header.utterance)
        # NOTE: per session (its frames index that utterance's encoder inputs); at `last` nothing more comes.
        self._queue(session.token, ready, lambda items: self._infer_pcm(session, items), session, now=header.last)
        return P.encode(P.SessionAudioReply(id=header.id, session=session.token, first_frame=first, frames=frames,
                                            utterance=session.latest_utterance))

    def _infer_pcm(self, session: LiveSession, items: list) -> None:
        """Speech frames from PCM, batched per session (up to one frame period, like window chunks): the
        worker runs the encoder on the encoder inputs these frames need and builds each frame's window
        from its rows (-1: zeros)."""
        for stream in dict.fromkeys(s for s, _, _ in items):   # one request per utterance
            part = [(k, rows) for s, k, rows in items if s is stream]
            rows = np.array([r for _, r in part])
            used = rows[rows >= 0]
            a, b = int(used.min()), int(used.max())
            inputs = np.stack([stream.encoder_input(j) for j in range(a, b + 1)])
            self._submit_pcm(session, [k for k, _ in part], inputs, np.where(rows >= 0, rows - a, -1),
                             stream.name, a)

    def _submit_pcm(self, session: LiveSession, frames: list[int], inputs: np.ndarray, rows: np.ndarray,
                    utterance: str, first_input: int) -> None:
        spec = session.call.spec
        _, _, _, fmt, quality = self._key(session, -1)
        backgrounds = [session.background(k) for k in frames]
        encoder_inputs = inputs
        inputs = Inputs(spec.id, spec.version, backgrounds, np.ascontiguousarray(encoder_inputs, "<f4").tobytes(),
                        "encoder", rows=rows.tolist(), utterance=utterance, first_input=first_input, format=fmt,
                        quality=quality, enqueued=self.clock.now(), due=session.due(frames[0]))
        targets = [(session.token, k, session.utterance_at(k)) for k in frames]
        request = Request(Kind.COMPOSITE, session.model, len(frames), deadline=session.due(frames[-1]),
                          work=SpeechBatch(targets, fmt, self), inputs=inputs)
        session.submitted(frames, inputs.enqueued)
        self.host.submit(request)

    def _infer(self, session: LiveSession, frames: list[int], windows: np.ndarray) -> None:
        """Speech windows of every session on the same model (and output format) share a batch."""
        key = self._key(session, -1)
        items = [(session.token, k, session.background(k), session.due(k), w, session.utterance_at(k))
                 for k, w in zip(frames, windows)]
        self._queue(key, items, lambda part: self._submit_batch(key, part), session)

    def _queue(self, key, items: list, submit, session: LiveSession, now: bool = False) -> None:
        """Queue speech frames for inference under `key`: up to limits.max_batch per request, a full batch
        at once, the rest after at most one frame period (capped at a quarter of the latency budget), or
        at once with `now`. Fewer, larger requests are what keeps many sessions on time: each request
        holds an input and an output slot."""
        pending = self._pending.setdefault(key, [])
        pending += items
        step = self.config.limits.max_batch
        while len(pending) >= step:
            submit(pending[:step])
            del pending[:step]
        if pending and now:
            self._flush(key, submit)
        elif pending and key not in self._flush_timers:
            wait = min(BATCH_WAIT_FRAMES / session.fps, self.cfg.latency_budget_ms / 4000)
            self._flush_timers[key] = self.clock.call_at(self.clock.now() + wait, lambda: self._flush(key, submit))

    def _unqueue(self, session: LiveSession) -> None:
        """An interrupt: the session's speech frames waiting to share a batch go, wherever they wait
        (its own pcm16 queue, or its model's window queue with other sessions' frames)."""
        self._pending.pop(session.token, None)
        for key, pending in self._pending.items():
            pending[:] = [item for item in pending if item[0] != session.token]

    def _flush(self, key, submit) -> None:
        timer = self._flush_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        pending = self._pending.pop(key, [])
        if pending:
            submit(pending)

    def _submit_batch(self, key: tuple, items: list) -> None:
        items = [it for it in items if self.table.get(it[0]) is not None]   # sessions closed meanwhile
        if not items:
            return
        model, version, _, fmt, quality = key
        spec = self.table.get(items[0][0]).call.spec
        audio = np.ascontiguousarray(np.stack([w for _, _, _, _, w, _ in items]), "<f4")
        inputs = Inputs(model, version, [b for _, _, b, _, _, _ in items], audio.tobytes(), "windows",
                        tuple(spec.audio_shape), format=fmt, quality=quality, enqueued=self.clock.now(),
                        due=min(due for _, _, _, due, _, _ in items))
        request = Request(Kind.COMPOSITE, model, len(items), deadline=max(due for _, _, _, due, _, _ in items),
                          work=SpeechBatch([(token, k, u) for token, k, _, _, _, u in items], fmt, self),
                          inputs=inputs)
        for token, k, *_ in items:
            self.table.get(token).submitted([k], inputs.enqueued)
        self.host.submit(request)

    def _close(self, session: LiveSession) -> None:
        self._pending.pop(session.token, None)
        timer = self._flush_timers.pop(session.token, None)
        if timer is not None:
            timer.cancel()
        self._release(session)
        if self.viewer is not None:
            self.viewer.close(session.token)
        self.table.pop(session.token)
        self.queued.closed(session.token)
        self.metrics.sessions_open.set(len(self.table))

    def _release(self, session: LiveSession) -> None:
        """What a session holds beyond its frames: its model's pin, its H.264 encoder."""
        if session.pinned_worker is not None:
            self.host.unpin(session.pinned_worker, session.model)
            session.pinned_worker = None
        if session.h264 is not None:
            self.h264.close(session)

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

    def speech_done(self, r: Request, batch: SpeechBatch) -> None:
        """A batch of speech frames was composited: each session holds its own until due."""
        images = [img for start in sorted(r.images) for img in r.images[start]]
        if r.image_slots:   # raw frames: copy them out of the image ring now, they wait until due
            images = [bytes(img) for img in images]
            self.host.free_images(r.req, r.image_slots)
        elif batch.format == "i420":   # H.264 face boxes: they go on to the session's encoder
            images = [frame_bytes(img) for img in images]
        now = self.clock.now()
        stages = speech_stages(r.timing, r.answered)
        for (token, k, utterance), image in zip(batch.targets, images):
            session = self.table.get(token)
            if session is not None:
                session.ready(k, utterance, image, stages, now)

    def speech_failed(self, batch: SpeechBatch, message: str) -> None:
        for token, k, utterance in batch.targets:
            session = self.table.get(token)
            if session is not None:
                session.failed(k, utterance)   # it goes out idle, counted as missed; the stream goes on
        log.info("%d session speech frame(s) failed: %s", len(batch.targets), message)

    def idle_done(self, r: Request, render: IdleRender) -> None:
        images = [img for start in sorted(r.images) for img in r.images[start]]
        for key, image in zip(render.keys, images):
            self.idle.rendering.discard(key)
            self.idle.put(key, frame_bytes(image))
        self._check_opens(render.keys)

    def idle_failed(self, render: IdleRender, message: str) -> None:
        for key in render.keys:
            self.idle.rendering.discard(key)
        log.warning("encoding idle frames of model %s failed: %s", render.model, message)
        self._opens_failed(render.keys, message)

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
        for session in self.table.due(horizon):
            if session.h264 is not None:
                self.h264.tick(session, horizon)
            else:
                for frame in session.advance(horizon):
                    self.send(session, frame, now)
            if session.next_index % max(int(session.fps // 2), 1) == 0:
                self._prefetch(session)
            self.table.schedule(session)
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
        session.sent(frame, now)
        counted[frame.kind].inc()
        self._lateness.observe(max((now - frame.due) * 1000, 0.0))
        if frame.missed:
            counted["missed"].inc()
        return True
