"""Live sessions' speech on its way to the engine and back: speech frames of every session on one
model and output format share `composite` requests (at most limits.max_batch frames, waiting at most
one frame period); a pcm16 session's share its own, one per utterance. The composited frames go back
to their sessions (live/timeline.py), held until due instead of being replied.

Fewer, larger requests are what keeps many sessions on time: each request holds an input and an
output slot.

Speech sent far ahead of real time (a TTS burst: up to sessions.max_ahead_s) waits here. A session's
reach is where speech spoken now lands (its `lead`, a latency budget, and a frame for the pacer's tick):
frames within HORIZON_REACHES reaches of the stream go to inference at once, later ones are held until
the first of them is within RELEASE_REACHES, and then go up to the horizon again, several together.
Each held frame still gets more than the budget a frame spoken in real time gets, chunks streamed in
real time are never held, and a session has at most a few requests in the engine whatever it sent.
Sent at once, 30 s of one session's speech were a hundred requests ahead of every other session's,
and filled the workers' queues (limits.queue_depth) and input rings.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from frontend.core.alarm import Clock
from frontend.core.request import Inputs, Kind, Request
from frontend.live.h264_stream import Kept
from frontend.live.host import Host
from frontend.live.idle import frame_bytes
from frontend.live.timeline import LiveSession, SessionTable

log = logging.getLogger(__name__)
BATCH_WAIT_FRAMES = 1    # how long speech frames wait for other sessions' to share a batch, in frames
HORIZON_REACHES = 3      # a session's speech within this many reaches goes to inference (module doc)
RELEASE_REACHES = 2      # held speech goes once its first frame is within this many


@dataclass
class Held:
    """A session's speech frames computable beyond the horizon, in frame order ([1] of each: its frame),
    and how they are queued once they come within it."""
    session: LiveSession
    items: list
    queue: Callable[[list, bool], tuple]   # (frames, at once) -> (queue key, its submit)


@dataclass
class SpeechBatch:
    """The work of an engine `composite` request of speech frames: each frame's (session, frame index,
    utterance), held by its session until due instead of being replied."""
    targets: list[tuple[str, int, Optional[int]]]
    format: str
    batcher: "SpeechBatcher" = field(repr=False)

    def done(self, r: Request) -> None:
        self.batcher.done(r, self)

    def failed(self, r: Request, code, message: str) -> None:
        self.batcher.failed(self, getattr(code, "value", code), message)


def speech_stages(timing: dict, answered: dict) -> dict:
    """A composited batch's stages after its batch was formed, in ms (timeline.STAGES), from the
    worker's and the compositors' own timings and when the host received their answers."""
    composite_ms = timing.get("composite_ms", 0.0)
    stages = {"queue": timing.get("queue_ms", 0.0), "inference": timing.get("inference_ms", 0.0),
              "composite": composite_ms}
    if "infer" in answered and "composite" in answered:   # (a reply can overtake the other on its way)
        stages["to_composite"] = max((answered["composite"] - answered["infer"]) * 1000 - composite_ms, 0.0)
    return stages


class SpeechBatcher:
    """`key(session, background)`: the (model, version, background, format, quality) of a session's
    encoded frame (live/service.py); speech frames of the same model, version, format and quality
    share a batch."""

    def __init__(self, host: Host, table: SessionTable, max_batch: int, latency_budget_ms: float,
                 key: Callable[[LiveSession, int], tuple], clock: Clock,
                 next_tick: Callable[[], Optional[float]] = lambda: None):
        """`next_tick()`: when the pacer rings next (None: not armed); frames that would wait past it
        are submitted by it (`tick`)."""
        self.host, self.table, self.clock = host, table, clock
        self.max_batch, self.latency_budget_ms = max_batch, latency_budget_ms
        self._key = key
        self._next_tick = next_tick
        # Speech frames waiting to share a batch, and their flush timers: by (model, version, -, format,
        # quality) for windows, by session token for pcm16 sessions; or, instead of a timer, the
        # pacer's next tick (how each key's batch is submitted).
        self._pending: dict = {}
        self._flush_timers: dict = {}
        self._at_tick: dict = {}
        self._held: dict[str, Held] = {}   # session token -> its speech beyond the horizon

    def windows(self, session: LiveSession, frames: list[int], windows: np.ndarray) -> None:
        """Speech windows of every session on the same model (and output format) share a batch."""
        key = self._key(session, -1)
        items = [(session.token, k, session.background(k), session.needed_by(k), w, session.utterance_at(k))
                 for k, w in zip(frames, windows)]

        def queue(part: list, at_once: bool) -> tuple:
            submit = lambda batch: self._submit_batch(key, batch)   # noqa: E731
            self._queue(key, part, submit, session, now=at_once)
            return key, submit
        self._admit(session, items, queue)

    def pcm(self, session: LiveSession, ready: list, last: bool) -> None:
        """A pcm16 session's frames now computable, [(stream, frame, rows)] (LiveSession.pcm)."""
        # NOTE: per session (its frames index that utterance's encoder inputs); at `last` nothing more comes.
        # A request's frames fall due within one latency budget: an utterance's end makes its last
        # lookahead's frames (about half a second's) computable at once, and its first frame, due a budget
        # from now, would wait for the whole request, frames due long after it included.
        most = max(1, round(self.latency_budget_ms / 1000 * session.fps))

        def queue(part: list, at_once: bool) -> tuple:
            submit = lambda items: self._infer_pcm(session, items)   # noqa: E731
            self._queue(session.token, part, submit, session, now=at_once, most=most)
            return session.token, submit
        self._admit(session, ready, queue, last)

    def _admit(self, session: LiveSession, items: list, queue, last: bool = False) -> None:
        """New computable speech frames of `session` ([1] of each: its frame, in order): those within
        the horizon are queued now, the rest held (behind any it holds already) until the pacer's ticks
        bring them within it (`_release`)."""
        held = self._held.get(session.token)
        if held is None:
            cut = self._cut(session, items)
            now_items, items = items[:cut], items[cut:]
            if now_items:
                # (nothing comes before the rest is released: no reason to wait for more)
                queue(now_items, last or bool(items))
            if not items:
                return
            held = self._held[session.token] = Held(session, [], queue)
        held.items += items

    def _cut(self, session: LiveSession, items: list, held: bool = False) -> int:
        """How many of a session's frames `items` go now: those within HORIZON_REACHES of the stream;
        `held` ones only once the first is within RELEASE_REACHES (so that they go several together)."""
        base, reach = session.now_index(self.clock.now()), session.lead + 1
        if not items or items[0][1] > base + (RELEASE_REACHES if held else HORIZON_REACHES) * reach:
            return 0
        return bisect.bisect_right(items, base + HORIZON_REACHES * reach, key=lambda item: item[1])

    def _release(self) -> dict:
        """Held speech now within the horizon, queued: {queue key: its submit} to flush."""
        touched = {}
        for token in list(self._held):
            held = self._held[token]
            cut = self._cut(held.session, held.items, held=True)
            if cut:
                part = held.items[:cut]
                del held.items[:cut]
                key, submit = held.queue(part, False)
                touched[key] = submit
            if not held.items:
                del self._held[token]
        return touched

    def interrupt(self, session: LiveSession) -> None:
        """An interrupt: the session's speech frames waiting to share a batch go, wherever they wait
        (its own pcm16 queue, or its model's window queue with other sessions' frames)."""
        self._pending.pop(session.token, None)
        self._held.pop(session.token, None)
        for key, pending in self._pending.items():
            pending[:] = [item for item in pending if item[0] != session.token]

    def close(self, session: LiveSession) -> None:
        self._pending.pop(session.token, None)
        self._held.pop(session.token, None)
        self._at_tick.pop(session.token, None)
        timer = self._flush_timers.pop(session.token, None)
        if timer is not None:
            timer.cancel()

    def _infer_pcm(self, session: LiveSession, items: list) -> None:
        """Speech frames from PCM, batched per session (up to one frame period, like window chunks): the
        worker runs the encoder on the encoder inputs these frames need and builds each frame's window
        from its rows (-1: zeros)."""
        for stream in dict.fromkeys(s for s, _, _ in items):   # one request per utterance
            part = [(k, rows) for s, k, rows in items if s is stream]
            rows = np.array([r for _, r in part])
            used = rows[rows >= 0]
            a, b = int(used.min()), int(used.max())
            inputs = stream.encoder_inputs(a, b + 1)
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
                        quality=quality, enqueued=self.clock.now(), due=session.needed_by(frames[0]))
        targets = [(session.token, k, session.utterance_at(k)) for k in frames]
        now = self.clock.now()
        keep = [(session.token, k, self._keeper(session, session.needed_by(k), now)) for k in frames] \
            if fmt == "i420" else None
        request = Request(Kind.COMPOSITE, session.model, len(frames), deadline=session.needed_by(frames[-1]),
                          work=SpeechBatch(targets, fmt, self), inputs=inputs, keep=keep)
        session.submitted(frames, inputs.enqueued)
        self.host.submit(request)

    def _keeper(self, session: LiveSession, due: float, now: float) -> int:
        """The compositor to keep a speech frame's H.264 face box (its session's encoder's), or -1: the
        frame is needed more than the latency budget from now (speech sent ahead of real time, a TTS
        burst), and its box comes back. A compositor that dies loses the boxes it keeps: so at most
        the latency budget's worth of a session's speech."""
        return session.h264.compositor if due - now <= self.latency_budget_ms / 1000 else -1

    def _queue(self, key, items: list, submit, session: LiveSession, now: bool = False,
               most: Optional[int] = None) -> None:
        """Queue speech frames for inference under `key`: up to limits.max_batch (or `most`) per request,
        a full batch at once, the rest after at most one frame period (capped at a quarter of the latency
        budget), or at once with `now`. Fewer, larger requests are what keeps many sessions on time: each
        request holds an input and an output slot."""
        pending = self._pending.setdefault(key, [])
        pending += items
        step = min(self.max_batch, most or self.max_batch)
        while len(pending) >= step:
            submit(pending[:step])
            del pending[:step]
        if pending and now:
            self._flush(key, submit)
        elif pending and key not in self._flush_timers and key not in self._at_tick:
            due = self.clock.now() + min(BATCH_WAIT_FRAMES / session.fps, self.latency_budget_ms / 4000)
            tick = self._next_tick()
            if tick is not None and tick <= due:
                # NOTE: the pacer rings first: its tick submits them, one wake-up of the process for both
                # (a timer of their own rang between ticks, some 25 times a second at 40 sessions)
                self._at_tick[key] = submit
            else:
                self._flush_timers[key] = self.clock.call_at(due, lambda: self._flush(key, submit))

    def tick(self) -> None:
        """The pacer rang: submit the frames that waited for it, and the held ones now within the
        horizon (every session's together: windows of one model share batches)."""
        released = self._release() if self._held else {}
        waiting, self._at_tick = self._at_tick, {}
        for key, submit in {**waiting, **released}.items():
            self._flush(key, submit)

    def _flush(self, key, submit) -> None:
        self._at_tick.pop(key, None)
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
        keep = None
        if fmt == "i420":   # H.264: each session's frames where its encoder is, their face boxes kept there
            now = self.clock.now()
            placed = sorted(((self._keeper(self.table.get(it[0]), it[3], now), it) for it in items),
                            key=lambda pair: pair[0])   # one run of frames per compositor
            items = [it for _, it in placed]
            keep = [(it[0], it[1], compositor) for compositor, it in placed]
        # (the batch's windows in one buffer, copied into the worker's input slot at dispatch)
        audio = np.ascontiguousarray(np.stack([w for _, _, _, _, w, _ in items]), "<f4")
        inputs = Inputs(model, version, [b for _, _, b, _, _, _ in items], audio, "windows",
                        tuple(spec.audio_shape), format=fmt, quality=quality, enqueued=self.clock.now(),
                        due=min(due for _, _, _, due, _, _ in items))
        request = Request(Kind.COMPOSITE, model, len(items), deadline=max(due for _, _, _, due, _, _ in items),
                          work=SpeechBatch([(token, k, u) for token, k, _, _, _, u in items], fmt, self),
                          inputs=inputs, keep=keep)
        for token, k, *_ in items:
            self.table.get(token).submitted([k], inputs.enqueued)
        self.host.submit(request)

    # -- results (a SpeechBatch calls these) ----------------------------------------------------------

    def done(self, r: Request, batch: SpeechBatch) -> None:
        """A batch of speech frames was composited: each session holds its own until due."""
        images = [img for start in sorted(r.images) for img in r.images[start]]
        if r.image_slots:   # raw frames: copy them out of the image ring now, they wait until due
            images = [bytes(img) for img in images]
            self.host.free_images(r.req, r.image_slots)
        elif batch.format == "i420":   # H.264 face boxes: they go on to the session's encoder, or stayed there
            images = [frame_bytes(img) or Kept(r.keep[i][2], r.keep[i][1]) for i, img in enumerate(images)]
        now = self.clock.now()
        stages = speech_stages(r.timing, r.answered)
        for (token, k, utterance), image in zip(batch.targets, images):
            session = self.table.get(token)
            if session is not None:
                session.ready(k, utterance, image, stages, now)

    def failed(self, batch: SpeechBatch, code: str, message: str) -> None:
        for token, k, utterance in batch.targets:
            session = self.table.get(token)
            if session is not None:
                session.failed(k, utterance, code)   # it goes out idle, counted as missed; the stream goes on
        log.info("%d session speech frame(s) failed: %s", len(batch.targets), message)
