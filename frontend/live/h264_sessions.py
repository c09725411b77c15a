"""Live sessions in H.264, the shell of live/h264_stream.py: each session's encoder lives in one
compositing process (cpu_actor/h264.py encodes), and this module hands it the frames its stream
decided (a speech frame's face box was kept there when it was composited, live/speech.py), holds the
access units that come back until due, and asks for the avatar's idle loop chunks, encoded once and
shared by every session on that avatar. The frames one pacer tick decides go to each compositor in one
engine `render` request pinned there (sessions share the frame grid, live/timeline.on_frame_grid: a
tick serves them all), not one per session and frame.
A compositor that dies takes its in-flight frames with it: they are skipped, the session moves to a
ready compositor and its next frame is an IDR; speech whose box it kept goes out idle, missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from config.assets import frame_index
from frontend.core.alarm import LOOP_CLOCK, Clock
from frontend.core.request import Kind, Request
from frontend.live.h264_stream import ENCODE_AHEAD_FRAMES, H264Stream, Kept
from frontend.live.host import Host
from frontend.live.idle import IdleCache, frame_bytes
from frontend.live.timeline import LiveSession, SessionTable
from shm.messages import EncodeFrames, EncodeItem, EncodeLoop, EncodeSession, H264Settings

log = logging.getLogger(__name__)
ENCODE_GRACE_S = 0.5      # an encode not back this long after its frame was due is given up (skipped)
LOOP_TIMEOUT_S = 120.0


@dataclass
class EncodeJob:
    """The work of an engine `render` request that encodes the frames one tick decided for the sessions
    whose encoders one compositor keeps."""
    task: EncodeFrames        # what its compositor is sent (`message`)
    decided: float            # when its frames were decided (the clock's time)
    h264: "H264Sessions" = field(repr=False)

    def message(self, r: Request) -> EncodeFrames:
        return _addressed(self.task, r)

    def done(self, r: Request) -> None:
        self.h264.encoded(r, self)

    def failed(self, r: Request, code, message: str) -> None:
        self.h264.encode_failed(self, message)


@dataclass
class LoopJob:
    """The work of an engine `render` request that encodes a chunk of an avatar's idle loop (any compositor)."""
    key: tuple
    task: EncodeLoop          # what its compositor is sent (`message`)
    h264: "H264Sessions" = field(repr=False)

    def message(self, r: Request) -> EncodeLoop:
        return _addressed(self.task, r)

    def done(self, r: Request) -> None:
        self.h264.loop_done(r, self)

    def failed(self, r: Request, code, message: str) -> None:
        self.h264.loop_failed(r, self, code, message)


def _addressed(task, r: Request):
    """The compositor's message, with the id and deadline the engine gave its request."""
    task.req, task.deadline = r.req, r.deadline
    return task


class H264Sessions:
    """Every H.264 session's encoding: `send(session, frame, now, keyframe)` sends a frame (live/service.py),
    `arm()` re-arms the pacer after a session was woken early, `loop_ready(keys)` and
    `loop_failed(keys, code, message)` say that idle loop chunks are cached, or will not be."""

    def __init__(self, host: Host, cfg: Any, table: SessionTable, idle: IdleCache, metrics: Any,
                 send: Callable[..., bool], arm: Callable[[], None], loop_ready: Callable[[Iterable], None],
                 loop_failed: Callable[[Iterable, Any, str], None], clock: Clock = LOOP_CLOCK):
        self.host, self.cfg, self.table, self.idle, self.metrics = host, cfg, table, idle, metrics
        self.clock = clock
        self._send, self._arm = send, arm
        self._loop_ready, self._loop_failed = loop_ready, loop_failed   # sessions being opened wait for the loop
        self._skipped = metrics.session_frames.labels("skipped")
        self._placed: dict[str, int] = {}   # each H.264 session's compositor, from open (not from ready) to close
        self._encodes: dict[int, list[EncodeSession]] = {}   # this tick's frames to encode, per compositor
        self._last_due: dict[int, float] = {}   # per compositor: the `due` of the last EncodeFrames sent

    def settings(self, session: LiveSession) -> H264Settings:
        return H264Settings(fps=session.fps, bitrate=self.cfg.bitrate, preset=self.cfg.preset, gop=self.cfg.gop)

    # -- open / close ---------------------------------------------------------------------------

    def open(self, session: LiveSession) -> None:
        spec = session.call.spec
        period = spec.frames * (2 if spec.order == "mirror" else 1)
        compositor = self._placed[session.token] = self._compositor()
        stream = session.h264 = H264Stream(compositor, session.start_frame, period, self.cfg.loop_chunk)
        # (the idle loop chunks' cache keys, looked up for every frame: built once)
        stream.loop_keys = [("h264-loop", spec.id, spec.version, self.settings(session), self.cfg.loop_chunk, start)
                            for start in range(0, period, stream.chunk)]
        session.ahead = ENCODE_AHEAD_FRAMES / session.fps
        session.shed_whole = True   # a repeated speech frame is encoded all the same (live/shedding.py)
        # The latency budget holds from audio to frame: speech is decided that much before due.
        session.lead = max(1, session.lead - ENCODE_AHEAD_FRAMES)
        self.prefetch(session)

    def _compositor(self, avoid: Optional[int] = None) -> int:
        """The ready compositor with the fewest H.264 sessions, those still opening included (sessions
        that open together would otherwise all count none placed, and all go to the first)."""
        states, counts = self.host.compositors(), self.placed()
        ready = [i for i, c in enumerate(states) if c.ready and i != avoid] or list(range(len(states)))
        return min(ready, key=lambda i: (counts[i], i))

    def placed(self) -> list[int]:
        """H.264 sessions (opening or open) per compositor."""
        counts = [0] * len(self.host.compositors())
        for compositor in self._placed.values():
            if compositor < len(counts):
                counts[compositor] += 1
        return counts

    def close(self, session: LiveSession) -> None:
        self._placed.pop(session.token, None)
        self.host.close_encoder(session.h264.compositor, session.token)

    def keyframe(self, session: LiveSession) -> int:
        session.h264.need_idr = True
        return session.next_index

    # -- the idle loop --------------------------------------------------------------------------

    def _loop_key(self, session: LiveSession, start: int) -> tuple:
        """The cache key of the idle loop chunk at `start` (built at `open`)."""
        return session.h264.loop_keys[start // session.h264.chunk]

    def loop_keys(self, session: LiveSession) -> set:
        """The cache keys of the avatar's idle loop chunks (none without sessions.h264.idle_loop)."""
        return set(session.h264.loop_keys) if self.cfg.idle_loop else set()

    def prefetch(self, session: LiveSession) -> None:
        """Ask for the avatar's idle loop chunks not cached or coming (each once, any compositor)."""
        if not self.cfg.idle_loop:
            return
        stream, spec = session.h264, session.call.spec
        cache = self.idle
        for start in range(0, stream.period, stream.chunk):
            key = self._loop_key(session, start)
            if key in cache.rendering or cache.get(key) is not None:
                continue
            cache.rendering.add(key)
            positions = range(start, min(start + stream.chunk, stream.period))
            message = EncodeLoop(req=0, model=spec.id, version=spec.version, settings=self.settings(session),
                                 frames=[frame_index(p, spec.frames, spec.order) for p in positions],
                                 deadline=self.clock.now() + LOOP_TIMEOUT_S)
            request = Request(Kind.RENDER, spec.id, len(positions), deadline=message.deadline,
                              work=LoopJob(key, message, self))
            self.host.submit(request)

    # -- frames ---------------------------------------------------------------------------------

    def tick(self, session: LiveSession, now: float) -> None:
        """Decide the frames due within ENCODE_AHEAD_FRAMES, queue what the loop does not cover for its
        encoder (`send_encodes` sends the tick's), send what is due."""
        stream = session.h264
        if not self.host.compositors()[stream.compositor].ready:   # it died: its encoder went with it
            stream.compositor = self._placed[session.token] = self._compositor(avoid=stream.compositor)
            stream.need_idr = True
        items = []
        for frame in session.advance(now):
            if type(frame.image) is Kept and frame.image.compositor != stream.compositor:
                session.box_lost(frame)   # kept where the session's encoder no longer is
            start, _ = stream.chunk_of(frame.index)
            chunk = self.idle.get(self._loop_key(session, start)) if self.cfg.idle_loop else None
            todo = stream.decide(frame, chunk)
            if todo is not None:
                kept = type(todo.box) is Kept
                items.append(EncodeItem(index=todo.index, frame=todo.background, idr=todo.idr,
                                        box=b"" if kept else todo.box, kept=todo.box.index if kept else -1))
        if items:
            self._encode(session, items)
        self.flush(session, now)

    def _encode(self, session: LiveSession, items: list[EncodeItem]) -> None:
        session.stats.encoded += len(items)
        spec = session.call.spec
        part = EncodeSession(session=session.token, model=spec.id, version=spec.version,
                             settings=self.settings(session), items=items,
                             deadline=session.due(items[-1].index) + ENCODE_GRACE_S)
        self._encodes.setdefault(session.h264.compositor, []).append(part)

    def send_encodes(self) -> None:
        """Send the frames this tick decided: one request per compositor."""
        if not self._encodes:
            return
        encodes, self._encodes = self._encodes, {}
        now = self.clock.now()
        for compositor, parts in encodes.items():
            dues = [s.due(p.items[0].index) for p in parts if (s := self.table.get(p.session)) is not None]
            if not dues:   # (every one of them closed meanwhile)
                continue
            due = min(dues)
            # NOTE: the compositor takes its tasks by due time, in arrival order among equals; a session's
            # frames must be encoded in order, so a later tick's request is never due before an earlier one
            due = self._last_due[compositor] = max(due, self._last_due.get(compositor, due))
            message = EncodeFrames(req=0, sessions=parts, deadline=max(p.deadline for p in parts), due=due)
            request = Request(Kind.RENDER, parts[0].model, sum(len(p.items) for p in parts),
                              deadline=message.deadline, work=EncodeJob(message, now, self), compositor=compositor)
            self.host.submit(request)

    def flush(self, session: LiveSession, now: float) -> None:
        """Send the session's access units that are due, in order; wake again for the next one."""
        stream = session.h264
        for unit in stream.sendable(now):
            if unit.lost:
                session.stats.dropped += 1
                self._skipped.inc()
                continue
            unit.frame.image = unit.au
            if not self._send(session, unit.frame, now, keyframe=unit.keyframe):
                stream.lost(unit.frame.index)   # the client's decoder lost a picture: as a lost frame
        waiting = session.h264.waiting_due()
        if waiting is not None and waiting < session.due(session.next_index) - session.ahead:   # else: it ticks then
            self.table.wake(session, waiting)
            self._arm()

    # -- engine results (each request's work calls the one for its kind) -------------------------

    def loop_done(self, r: Request, job: LoopJob) -> None:
        units = [frame_bytes(u) for start in sorted(r.images) for u in r.images[start]]
        self.idle.rendering.discard(job.key)
        self.idle.put(job.key, units, sum(map(len, units)))
        self._loop_ready((job.key,))

    def loop_failed(self, r: Request, job: LoopJob, code, message: str) -> None:
        self.idle.rendering.discard(job.key)
        log.warning("encoding the idle loop of model %s failed: %s", r.model, message)
        self._loop_failed((job.key,), code, message)

    def encoded(self, r: Request, job: EncodeJob) -> None:
        """Sessions' frames came back encoded: each access unit waits until due."""
        units = [u for start in sorted(r.images) for u in r.images[start]]
        now = self.clock.now()
        encode_ms = r.timing.get("composite_ms", 0.0)   # the whole request's: its access units came back together
        waited = max((r.answered.get("composite", now) - job.decided) * 1000 - encode_ms, 0.0)
        at = 0
        for i, part in enumerate(job.task.sessions):
            mine, at = units[at:at + len(part.items)], at + len(part.items)
            if i in r.lost:
                self._lost(part, r.lost[i])
                continue
            session = self.table.get(part.session)
            if session is None:
                continue
            for item, au in zip(part.items, mine):
                unit = session.h264.encoded(item.index, frame_bytes(au))
                if unit is not None and unit.frame.kind == "speech":
                    unit.frame.stages = {**(unit.frame.stages or {}), "encode_wait": waited, "encode": encode_ms}
                    unit.frame.ready_at = now
            self.flush(session, now)

    def encode_failed(self, job: EncodeJob, message: str) -> None:
        for part in job.task.sessions:
            self._lost(part, message)

    def _lost(self, part: EncodeSession, message: str) -> None:
        session = self.table.get(part.session)
        if session is None:
            return
        for item in part.items:
            session.h264.lost(item.index)
        log.info("%d H.264 frame(s) of session %s were lost: %s", len(part.items), session.token, message)
        self.flush(session, self.clock.now())
