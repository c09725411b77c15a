"""frontend/live/ on its own: session ops, speech batching and the pacer driven through the `Host`
interface, with no sockets, no processes and no viewer stack, on a virtual clock (the pacer, the batch
timers and every time read are the test's): nothing here depends on how fast the machine is. The same
paths run end to end over real processes in test_sessions.py and test_h264.py; these pin down what
live/ asks of its host."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from config import parse_config
from lipsync_client import protocol as P
from frontend.core.request import Kind, RequestError
from frontend.core.scheduler import CompositorState
from frontend.live.capacity import Load
from frontend.live.h264_sessions import EncodeJob, LoopJob
from frontend.live.h264_stream import ENCODE_AHEAD_FRAMES
from frontend.live.service import Live, Pin
from frontend.live.speech import SpeechBatch
from frontend.metrics import Metrics
from shm.board import Board
from shm.codes import ErrorCode, ProcState
from shm.messages import RenderIdle

FPS = 25
SPEC = SimpleNamespace(id="a", version=3, audio_shape=(32, 16, 16), frames=6, width=320, height=240, order="mirror",
                       encoder=False)


@dataclass
class RecordingHost:
    """What live/ may ask of the process hosting it, recorded."""

    submitted: list = field(default_factory=list)
    sent: list = field(default_factory=list)            # (reply_to, header dict, data)
    unpinned: list = field(default_factory=list)
    freed: list = field(default_factory=list)
    closed_encoders: list = field(default_factory=list)
    states: list = field(default_factory=lambda: [CompositorState(ProcState.READY), CompositorState(ProcState.READY)])

    def submit(self, request) -> None:
        request.req = len(self.submitted) + 1
        self.submitted.append(request)

    def unpin(self, worker: int, model: str) -> None:
        self.unpinned.append((worker, model))

    def compositors(self):
        return self.states

    def send(self, reply_to, header: bytes, data=(), req: int = 0, image_slots=(), also=None) -> bool:
        self.sent.append((reply_to, msgspec.json.decode(header), list(data)))
        return True

    def free_images(self, req: int, compositors) -> None:
        self.freed.append((req, list(compositors)))

    def close_encoder(self, compositor: int, session: str) -> None:
        self.closed_encoders.append((compositor, session))

    def of(self, kind, work_type=None) -> list:
        return [r for r in self.submitted if r.kind is kind and (work_type is None or isinstance(r.work, work_type))]


class Peer:
    """A connection, as the server's ReplyTo presents it to live/."""

    def __init__(self, name: str):
        self.peer, self.tenant, self.conn = (0, (name.encode(),)), None, (0, hash(name) % 1000)


def _call(op: str, peer: Peer, spec=SPEC, **fields):
    return SimpleNamespace(header=P.RequestHeader(op=P.Op(op), id=1, **fields), spec=spec, reply_to=peer)


class VirtualClock:
    """The `Clock` live/ runs on, moved by the test: `advance` runs every timer that comes due, in order."""

    class _Timer:
        def __init__(self, callback):
            self.callback, self.cancelled = callback, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self, t: float = 1000.0):
        self.t = t
        self._timers: list = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback):
        timer = self._Timer(callback)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        end = self.t + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            self.t = max(self.t, when)
            if not timer.cancelled:
                timer.callback()
        self.t = end


def _live(**sessions) -> tuple[Live, RecordingHost, VirtualClock]:
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, **sessions}})
    host, clock = RecordingHost(), VirtualClock()
    return Live(host, config, Metrics(), clock=clock), host, clock


def _open(live: Live, peer: Peer, spec=SPEC, **fields) -> str:
    """Open a session as the engine would answer: its model pinned on worker 0, its idle frames rendered."""
    host = live.host
    assert live.handle(_call("session_open", peer, spec, model="a", **fields), []) is None, "answered before ready"
    for r in host.of(Kind.LOAD, Pin):
        if not r.results:
            r.results = [SimpleNamespace(worker=0)]
            _done(r)
    _finish_idle_renders(live, host)
    return _replies(host, peer)[-1]["session"]


def _replies(host: RecordingHost, peer: Peer) -> list[dict]:
    return [h for to, h, _ in host.sent if to is peer and "event" not in h]


def _audio(live: Live, peer: Peer, token: str, n: int, value: float = 1.0, **fields) -> dict:
    return msgspec.json.decode(live.handle(_call("session_audio", peer, session=token, **fields),
                                           [np.full((n, 32, 16, 16), value, np.float32).tobytes()]))


def _done(r) -> None:
    """The engine ended `r` well: the host calls its work, as core/shell.py does."""
    r.work.done(r)


def _failed(r, message: str) -> None:
    r.work.failed(r, ErrorCode.UNAVAILABLE, message)


def _finish_idle_renders(live: Live, host: RecordingHost) -> None:
    """The compositors' answer to every idle render asked for: one encoded image per frame."""
    for r in host.of(Kind.RENDER):
        if not r.images:
            message = r.work.message(r)   # what the host sends the compositor
            assert isinstance(message, RenderIdle) and message.req == r.req and message.frames == r.work.frames
            r.images = {0: [f"idle-{b}".encode() for b in message.frames]}
            _done(r)


def _composite(live: Live, r, label: str) -> None:
    """The compositors' answer to a speech batch: frame k of session t is `label-t-k`."""
    r.images = {0: [f"{label}-{t}-{k}".encode() for t, k, _ in r.work.targets]}
    _done(r)


def _serve(live: Live, host: RecordingHost, clock: VirtualClock, seconds: float, label: str) -> None:
    """Run the clock `seconds` a frame period at a time, compositing every speech batch as it comes."""
    end = clock.t + seconds
    while clock.t < end:
        clock.advance(min(1 / FPS, end - clock.t))
        for r in host.of(Kind.COMPOSITE, SpeechBatch):
            if not r.images:
                _composite(live, r, label)


def _frames(host: RecordingHost, peer: Peer) -> list[tuple[dict, list]]:
    return [(h, d) for to, h, d in host.sent if to is peer and h.get("event") == "frame"]


def test_open_answers_once_the_model_is_pinned_and_the_first_frames_are_rendered():
    """A fresh session's first words: session_open is answered only when the session can deliver its
    frames on time, so an utterance sent right after it meets no cold model, store or encoder."""
    live, host, clock = _live()
    owner = Peer("owner")
    assert live.handle(_call("session_open", owner, model="a"), []) is None
    [pin] = host.of(Kind.LOAD, Pin)
    assert pin.pin == 1 and pin.model == "a"
    renders = host.of(Kind.RENDER)
    assert renders and sum(r.batch for r in renders) == len({b for r in renders for b in r.work.frames})
    clock.advance(0.5)
    pin.results = [SimpleNamespace(worker=0)]
    _done(pin)
    assert not _replies(host, owner), "answered before its first frames were rendered"
    _finish_idle_renders(live, host)
    [reply] = _replies(host, owner)
    token = reply["session"]
    assert reply["ok"] and reply["ready_ms"] == 500.0
    session = live.table.get(token)
    assert session.pinned_worker == 0 and session.t0 == pytest.approx(clock.now() + 0.1), "frame 0 from ready on"
    # a second session on the same avatar finds it all done: answered at the pin
    other = Peer("other")
    assert live.handle(_call("session_open", other, model="a"), []) is None
    assert len(host.of(Kind.RENDER)) == len(renders), "its frames are rendered already"
    second = host.of(Kind.LOAD, Pin)[1]
    second.results = [SimpleNamespace(worker=0)]
    _done(second)
    assert _replies(host, other)[0]["ok"]
    live.handle(_call("session_close", owner, session=token), [])
    assert host.unpinned == [(0, "a")] and live.table.get(token) is None


def test_an_open_whose_model_cannot_load_or_be_ready_in_time_fails_and_holds_nothing():
    live, host, clock = _live()
    a, b, c = Peer("a"), Peer("b"), Peer("c")
    live.handle(_call("session_open", a, model="a"), [])
    _failed(host.of(Kind.LOAD, Pin)[0], "model a: bad_request: model.onnx is not an ONNX model")
    [error] = _replies(host, a)
    assert not error["ok"] and error["error"]["code"] == "unavailable" and "not an ONNX model" in error["error"]["message"]
    live.handle(_call("session_open", b, model="a"), [])
    clock.advance(live.config.limits.request_timeout_s + 1)
    [error] = _replies(host, b)
    assert error["error"]["code"] == "timeout" and "limits.request_timeout_s" in error["error"]["message"]
    pin = host.of(Kind.LOAD, Pin)[1]   # its load ends after all: nothing stays pinned for it
    pin.results = [SimpleNamespace(worker=1)]
    _done(pin)
    assert host.unpinned == [(1, "a")]
    live.handle(_call("session_open", c, model="a"), [])   # its client goes while it opens
    pin = host.of(Kind.LOAD, Pin)[2]
    pin.results = [SimpleNamespace(worker=0)]
    _done(pin)
    live.client_gone(c.conn)
    assert host.unpinned == [(1, "a"), (0, "a")] and not len(live.table) and not live._opening
    _finish_idle_renders(live, host)
    assert not _replies(host, c)


def test_speech_is_batched_across_sessions_then_paced_out_in_order():
    live, host, clock = _live()
    owners = [Peer("p0"), Peer("p1")]
    tokens = [_open(live, p) for p in owners]
    _finish_idle_renders(live, host)
    firsts = [_audio(live, peer, token, 3)["first_frame"] for token, peer in zip(tokens, owners)]
    assert not host.of(Kind.COMPOSITE, SpeechBatch), "frames wait (at most a frame period) for others to share"
    clock.advance(1 / FPS)
    speech = host.of(Kind.COMPOSITE, SpeechBatch)
    assert len(speech) == 1, "both sessions' frames share one request"
    r = speech[0]
    assert r.batch == 6 and r.inputs.layout == "windows" and r.inputs.window == (32, 16, 16)
    assert sorted((t, k) for t, k, _ in r.work.targets) == sorted(
        (t, f + i) for t, f in zip(tokens, firsts) for i in range(3))
    assert memoryview(r.inputs.audio).nbytes == 6 * 32 * 16 * 16 * 4
    _composite(live, r, "speech")
    clock.advance((max(firsts) + 4) / FPS + 0.1)
    for token, peer in zip(tokens, owners):
        frames = _frames(host, peer)
        indices = [h["index"] for h, _ in frames]
        assert indices == list(range(len(indices))), "frames leave in order, none skipped"
        kinds = {h["index"]: (h["kind"], d[0]) for h, d in frames}
        first = firsts[tokens.index(token)]
        for k in range(first, first + 3):
            assert kinds[k] == ("speech", f"speech-{token}-{k}".encode()), kinds.get(k)
        assert all(kind == "idle" for i, (kind, _) in kinds.items() if not first <= i < first + 3)
    for token in tokens:
        live.handle(_call("session_close", owners[tokens.index(token)], session=token), [])


def test_a_pcm_utterances_frames_go_in_requests_that_fall_due_within_one_latency_budget():
    """An utterance's end makes its last lookahead's frames computable at once (a TTS burst, all of it):
    its first frame is due a latency budget from now and would wait for the whole request. So a pcm16
    session's request holds the frames due within one budget (280 ms at 25 fps: 7), in order, all of
    them sent."""
    from config.audio import frame_count, speech
    live, host, clock = _live()
    peer = Peer("p")
    spec = SimpleNamespace(**{**vars(SPEC), "encoder": True})
    token = _open(live, peer, spec, audio="pcm16")
    pcm = speech(2.0, seed=1)
    live.handle(_call("session_audio", peer, spec, session=token, last=True, utterance=1), [pcm.tobytes()])
    clock.advance(2.0)   # (those beyond the horizon go as the stream comes near them: live/speech.py)
    sizes = [r.batch for r in host.of(Kind.COMPOSITE, SpeechBatch)]
    frames = [k for r in host.of(Kind.COMPOSITE, SpeechBatch) for _, k, _ in r.work.targets]
    assert sum(sizes) == frame_count(len(pcm)) == 49 and frames == sorted(frames), sizes
    assert max(sizes) == round(0.280 * FPS) == 7, sizes
    # each is due at its first frame (the worker runs live speech due soonest first), and ends by its last
    for r in host.of(Kind.COMPOSITE, SpeechBatch):
        assert r.deadline - r.inputs.due == pytest.approx((r.batch - 1) / FPS), (r.batch, r.inputs.due, r.deadline)
    live.handle(_call("session_close", peer, session=token), [])


def test_speech_sent_far_ahead_goes_to_inference_as_the_stream_nears_it_and_all_of_it_plays():
    """A TTS burst: 20 s of speech sent at once (ten chunks of 50 frames). Only what lies within the
    horizon goes to inference at once; the rest follows as the stream comes near it, several frames a
    request, each with more than a latency budget to spare; every frame is asked for once, in order,
    and plays as speech. An interrupt drops what is held, and nothing of the cut utterance is asked
    for after it."""
    from frontend.live.speech import HORIZON_REACHES, RELEASE_REACHES
    live, host, clock = _live(max_queued_frames=2000)   # (this host's client never reads: none dropped)
    owner = Peer("owner")
    token = _open(live, owner)
    session = live.table.get(token)
    reach = session.lead + 1
    first = _audio(live, owner, token, 50, utterance=1)["first_frame"]
    for i in range(9):
        _audio(live, owner, token, 50, utterance=1, last=i == 8)
    asked = [k for r in host.of(Kind.COMPOSITE, SpeechBatch) for _, k, _ in r.work.targets]
    assert asked == list(range(first, session.now_index(clock.now()) + HORIZON_REACHES * reach + 1)), asked
    seen = len(host.of(Kind.COMPOSITE, SpeechBatch))
    end = first + 500
    while session.next_index < end:
        _serve(live, host, clock, 1 / FPS, "speech")
        batches = host.of(Kind.COMPOSITE, SpeechBatch)
        base = session.now_index(clock.now())
        for r in batches[seen:]:
            ks = [k for _, k, _ in r.work.targets]
            assert max(ks) <= base + HORIZON_REACHES * reach, (base, ks)
            assert min(ks) >= base + RELEASE_REACHES * reach - 1, ("less than its budget to spare", base, ks)
            assert len(ks) >= reach - 1 or max(ks) == end - 1, ks
        seen = len(batches)
    asked = [k for r in host.of(Kind.COMPOSITE, SpeechBatch) for _, k, _ in r.work.targets]
    assert asked == list(range(first, end)), "each frame asked for once, in order"
    speech = [h["index"] for h, _ in _frames(host, owner) if h["kind"] == "speech"]
    assert speech == list(range(first, end))
    # an interrupt while most of an utterance is held: none of it is asked for after
    two = _audio(live, owner, token, 50, utterance=2)["first_frame"]
    for _ in range(3):
        _audio(live, owner, token, 50, utterance=2)
    before = len(host.of(Kind.COMPOSITE, SpeechBatch))
    live.handle(_call("session_interrupt", owner, session=token), [])
    _serve(live, host, clock, 8.0, "speech")
    assert not host.of(Kind.COMPOSITE, SpeechBatch)[before:], "held speech of a cut utterance was asked for"
    assert not [h for h, _ in _frames(host, owner) if h["index"] >= two and h["kind"] == "speech"]
    # a close while an utterance is held: nothing of it is kept, or asked for after
    for _ in range(4):
        _audio(live, owner, token, 50, utterance=3)
    before = len(host.of(Kind.COMPOSITE, SpeechBatch))
    live.handle(_call("session_close", owner, session=token), [])
    assert not live.speech._held
    _serve(live, host, clock, 8.0, "speech")
    assert len(host.of(Kind.COMPOSITE, SpeechBatch)) == before


def test_speech_waiting_to_share_a_batch_is_submitted_by_the_pacers_tick_when_it_rings_first():
    """Speech frames wait at most a frame period for other sessions' to share their batch. When the
    pacer rings within that wait, its tick submits them (the process wakes once for both); when it
    rings later (a 5-fps session: a tick every 200 ms), a timer of their own does, at the wait's end."""
    for fps, by_tick in ((FPS, True), (5, False)):
        live, host, clock = _live()
        peer = Peer(f"t{fps}")
        token = _open(live, peer, fps=fps)
        at = []
        record = host.submit
        host.submit = lambda r: (at.append((clock.t, r)), record(r))
        clock.advance(0.313)   # streaming, between two ticks
        _audio(live, peer, token, 2)
        sent, tick = clock.t, live.pacer.at
        wait = min(1 / fps, 0.280 / 4)   # a frame period, at most a quarter of the latency budget
        assert tick is not None and (tick <= sent + wait) == by_tick
        assert not [r for _, r in at if isinstance(r.work, SpeechBatch)], "they wait to share"
        clock.advance(0.5)
        [(when, batch)] = [(t, r) for t, r in at if isinstance(r.work, SpeechBatch)]
        assert batch.batch == 2
        assert when == pytest.approx(tick if by_tick else sent + wait), (fps, when - sent)


def test_a_failed_speech_batch_goes_out_idle_and_counts_missed():
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    _finish_idle_renders(live, host)
    first = _audio(live, owner, token, 2)["first_frame"]
    clock.advance(1 / FPS)
    _failed(host.of(Kind.COMPOSITE, SpeechBatch)[0], "a worker died")
    clock.advance((first + 3) / FPS + 0.1)
    stats = msgspec.json.decode(live.handle(_call("session_stats", owner, session=token), []))
    assert stats["missed"] == 2 and stats["frames_speech"] == 0, stats
    assert stats["missed_in"] == {"failed (unavailable)": 2}, stats   # what its request was answered


def test_a_cut_utterance_in_flight_never_fills_the_next_utterances_frames():
    """Barge-in: the batch of utterance 1 still being composited when it is interrupted comes back after
    utterance 2 was placed on the same frames; those frames are utterance 2's, or idle, never 1's."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    _finish_idle_renders(live, host)
    one = _audio(live, owner, token, 20, utterance=1)
    clock.advance(1 / FPS)
    [cut] = host.of(Kind.COMPOSITE, SpeechBatch)
    assert {u for _, _, u in cut.work.targets} == {1}
    interrupted = msgspec.json.decode(live.handle(_call("session_interrupt", owner, session=token), []))
    assert interrupted["dropped"] == 20 and interrupted["utterance"] == 1
    two = _audio(live, owner, token, 20, utterance=2)
    assert two["utterance"] == 2 and two["first_frame"] < one["first_frame"] + 20, "the two overlap on the timeline"
    clock.advance(1 / FPS)
    _composite(live, host.of(Kind.COMPOSITE, SpeechBatch)[1], "two")
    _composite(live, cut, "cut")   # utterance 1's images arrive last, on frames that utterance 2 holds
    _serve(live, host, clock, (two["first_frame"] + 22) / FPS, "two")
    frames = _frames(host, owner)
    assert not [h for h, d in frames if d[0].startswith(b"cut")], "a frame of the interrupted utterance went out"
    speech = [h for h, d in frames if h["kind"] == "speech"]
    assert len(speech) == 20 and all(h["utterance"] == 2 for h in speech)


def test_chunks_of_a_retired_utterance_are_never_rendered():
    """Chunks sent before the interrupt that retired their utterance, arriving after it: dropped, said
    so in the reply; ids that cannot come now are refused with what to do."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    _finish_idle_renders(live, host)
    _audio(live, owner, token, 3, utterance=1)
    live.handle(_call("session_interrupt", owner, session=token, utterance=1), [])
    late = _audio(live, owner, token, 3, utterance=1)
    assert late["retired"] and late["frames"] == 0
    clock.advance(2.0)
    assert not [h for h, _ in _frames(host, owner) if h["kind"] == "speech"]
    assert sum(r.batch for r in host.of(Kind.COMPOSITE, SpeechBatch)) == 0, "the cut speech was still inferred"
    # an interrupt may retire an utterance whose chunks have not come yet (the client cut it first)
    live.handle(_call("session_interrupt", owner, session=token, utterance=3), [])
    assert _audio(live, owner, token, 2, utterance=2)["retired"]
    assert _audio(live, owner, token, 2, utterance=3)["retired"]
    assert _audio(live, owner, token, 2, utterance=4)["utterance"] == 4
    with pytest.raises(RequestError) as err:
        _audio(live, owner, token, 1, utterance=5)
    assert err.value.code is ErrorCode.BAD_REQUEST and "still being received" in err.value.message
    _audio(live, owner, token, 1, utterance=4, last=True)
    with pytest.raises(RequestError) as err:
        _audio(live, owner, token, 1, utterance=4)
    assert "ended already" in err.value.message


def test_an_interrupt_takes_the_sessions_frames_out_of_a_shared_batch():
    """Window sessions on one model share a batch: an interrupt removes its own frames from it, not the
    other session's."""
    live, host, clock = _live()
    a, b = Peer("a"), Peer("b")
    ta, tb = _open(live, a), _open(live, b)
    _finish_idle_renders(live, host)
    _audio(live, a, ta, 3)
    _audio(live, b, tb, 3)
    live.handle(_call("session_interrupt", a, session=ta), [])
    clock.advance(1 / FPS)
    [r] = host.of(Kind.COMPOSITE, SpeechBatch)
    assert {t for t, _, _ in r.work.targets} == {tb} and r.batch == 3


@pytest.mark.parametrize("op", ["session_audio", "session_interrupt", "session_keyframe", "session_stats",
                                "session_close"])
def test_another_connection_cannot_drive_a_session(op):
    live, _, _ = _live()
    token = _open(live, Peer("owner"))
    payload = [np.ones((1, 32, 16, 16), np.float32).tobytes()] if op == "session_audio" else []
    with pytest.raises(RequestError) as err:
        live.handle(_call(op, Peer("intruder"), session=token), payload)
    assert err.value.code is ErrorCode.BAD_REQUEST and "no open session" in err.value.message
    assert live.table.get(token) is not None


def test_rates_a_stream_cannot_keep_are_refused():
    live, host, _ = _live()
    with pytest.raises(RequestError) as err:
        _open(live, Peer("p"), fps=0.5)
    assert err.value.code is ErrorCode.BAD_REQUEST and "header.fps" in err.value.message
    assert not host.submitted and not len(live.table)


def test_a_full_host_refuses_session_open_busy_with_when_to_retry():
    """The CPU the host's processes use is the test's: each open session costs 11 % of the frontend's
    core and 5 % of a compositor's; on 2 cores at sessions.max_cpu_load 0.75 (1.5 cores, 9 sessions) the
    frontend's own core is the limit first (max_process_load 0.9): 8 sessions, then `busy` naming it."""
    config = parse_config({"sessions": {"start_delay_ms": 100, "max_queued_frames": 10_000}})
    host, clock = RecordingHost(), VirtualClock()
    used = {"frontend": 0.0, "cpu0": 0.0}
    last = [clock.now()]

    def cpu():   # CPU seconds so far, as the open sessions have run since the last read
        sessions = len(live.table)
        elapsed, last[0] = clock.now() - last[0], clock.now()
        used["frontend"] += elapsed * 0.11 * sessions
        used["cpu0"] += elapsed * 0.05 * sessions
        return dict(used)

    live = Live(host, config, Metrics(), clock=clock, cpu=cpu, cores=2)
    peers, refused = [Peer(f"p{i}") for i in range(20)], None
    for peer in peers:
        try:
            _open(live, peer)
        except RequestError as err:
            refused = err
            break
        clock.advance(live.capacity.window_s)   # the window measures the sessions open now
    assert len(live.table) == 8
    assert refused.code is ErrorCode.BUSY and "frontend" in refused.message and "max_process_load" in refused.message
    assert refused.retry_after_s == live.capacity.window_s
    frames = len(_frames(host, peers[0]))
    clock.advance(1.0)
    assert len(_frames(host, peers[0])) == frames + FPS    # the sessions already open go on at their rate
    live.handle(_call("session_close", peers[0], session=_replies(host, peers[0])[0]["session"]), [])
    _open(live, peers[8])                                    # a closed session's room is free at once
    assert len(live.table) == 8


def test_past_max_sessions_session_open_is_busy():
    live, host, clock = _live(max_sessions=2)
    _open(live, Peer("a"))
    _open(live, Peer("b"))
    with pytest.raises(RequestError) as err:
        _open(live, Peer("c"))
    assert err.value.code is ErrorCode.BUSY and "sessions.max_sessions" in err.value.message
    assert err.value.retry_after_s > 0


def test_h264_sessions_opened_together_are_spread_over_the_compositors():
    """20 H.264 session_opens arrive before any is answered: each goes to the compositor with the fewest
    sessions, counting those still opening (it used to count only open ones: all 20 on compositor 0)."""
    live, host, clock = _live()
    peers = [Peer(f"h{i}") for i in range(20)]
    for peer in peers:
        assert live.handle(_call("session_open", peer, model="a", format="h264"), []) is None
    placed = [o.session.h264.compositor for o in live._opening.values()]
    assert sorted(placed.count(c) for c in (0, 1)) == [10, 10], placed
    token = next(iter(live._opening))
    live._open_failed(token, ErrorCode.TIMEOUT, "test")   # an open that fails frees its place
    assert live.handle(_call("session_open", Peer("late"), model="a", format="h264"), []) is None
    placed = [o.session.h264.compositor for o in live._opening.values()]
    assert sorted(placed.count(c) for c in (0, 1)) == [10, 10], placed


def test_h264_idle_loop_chunks_are_asked_for_once_while_encoding_and_again_after_a_failure():
    """An avatar's idle loop is encoded once for all its H.264 sessions: a session opening while its
    chunks are being encoded asks for none of them again; a chunk whose encode failed is asked for by the
    next session that opens."""
    live, host, clock = _live()

    def open_h264(name: str) -> None:
        assert live.handle(_call("session_open", Peer(name), model="a", format="h264"), []) is None
        for r in host.of(Kind.LOAD, Pin):
            if not r.results:
                r.results = [SimpleNamespace(worker=0)]
                _done(r)

    open_h264("l0")
    asked = host.of(Kind.RENDER, LoopJob)
    assert len(asked) >= 2, asked   # the avatar's loop, in chunks
    open_h264("l1")
    assert host.of(Kind.RENDER, LoopJob) == asked, "a chunk being encoded was asked for again"
    _failed(asked[0], "its compositor died")
    for r in asked[1:]:
        r.images = {0: [b"au"] * r.batch}
        _done(r)
    open_h264("l2")
    again = [r for r in host.of(Kind.RENDER, LoopJob) if r not in asked]
    assert [r.work.key for r in again] == [asked[0].work.key]


def test_an_h264_frame_the_client_could_not_take_is_followed_by_a_keyframe():
    """A frame dropped on its way to the client (its queue full) leaves the client's decoder without a
    picture the next ones refer to: those decided already (encoded ahead) are not sent either, and the
    next frame sent is a keyframe (an IDR encoded for it where the idle loop's next frame is not one)."""
    @dataclass
    class DroppingHost(RecordingHost):
        drop_next: bool = False

        def send(self, reply_to, header: bytes, data=(), req: int = 0, image_slots=(), also=None) -> bool:
            if self.drop_next:
                self.drop_next = False
                return False
            return super().send(reply_to, header, data, req, image_slots, also)

    # (one loop chunk, its first frame the loop's only keyframe: 12 frames of SPEC's mirrored 6)
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, "h264": {"loop_chunk": 12}}})
    host, clock = DroppingHost(), VirtualClock()
    live = Live(host, config, Metrics(), clock=clock)
    peer = Peer("k")
    assert live.handle(_call("session_open", peer, model="a", format="h264"), []) is None
    for r in host.of(Kind.LOAD, Pin):
        r.results = [SimpleNamespace(worker=0)]
        _done(r)
    for r in host.of(Kind.RENDER, LoopJob):   # the idle loop, encoded: frame k of a chunk is its AU k
        r.images = {0: [f"loop{k}".encode() for k in range(r.batch)]}
        _done(r)

    def frames() -> list[dict]:
        return [h for _, h, _ in host.sent if h.get("event") == "frame"]

    encoded = set()

    def run(seconds: float) -> None:
        end = clock.now() + seconds
        while clock.now() < end:
            clock.advance(1 / FPS)
            for r in host.of(Kind.RENDER, EncodeJob):
                if id(r) not in encoded:
                    encoded.add(id(r))
                    r.images = {0: [b"encoded"] * r.batch}
                    _done(r)
    run(0.5)
    while bytes(host.sent[-1][2][0]) != b"loop0":   # the loop's keyframe: the next is 12 frames on
        run(1 / FPS)
    sent = len(frames())
    assert sent > 3 and frames()[-1]["kind"] == "idle"
    host.drop_next = True
    run(0.5)
    after = frames()[sent:]
    assert after and after[0]["keyframe"], [(h["index"], h["keyframe"]) for h in after[:3]]
    skipped = after[0]["index"] - frames()[sent - 1]["index"] - 1   # the one dropped, and those after it
    assert skipped >= 1 and live.table.get(after[0]["session"]).stats.dropped == skipped, skipped
    assert skipped <= 1 + ENCODE_AHEAD_FRAMES, skipped   # the next decided is an IDR, not the loop's next chunk
    assert [h["index"] for h in after] == list(range(after[0]["index"], after[0]["index"] + len(after)))


def test_h264_speech_is_due_when_its_frame_is_decided_not_when_it_goes_out():
    """An H.264 frame is decided (and sent to its encoder) ENCODE_AHEAD_FRAMES before it goes out: its
    speech must be ready by then. Speech requests carry that time as deadline and due, so that the
    engine and the compositors put them before encodes due later (they carried the send time: a busy
    compositor did encodes first and speech missed its decision)."""
    live, host, clock = _live()
    peer = Peer("h")
    assert live.handle(_call("session_open", peer, model="a", format="h264"), []) is None
    for r in host.of(Kind.LOAD, Pin):
        r.results = [SimpleNamespace(worker=0)]
        _done(r)
    for r in host.of(Kind.RENDER, LoopJob):   # the idle loop's chunks, encoded
        r.images = {0: [b"au"] * r.batch}
        _done(r)
    session = live.table.get(_replies(host, peer)[-1]["session"])
    ahead = ENCODE_AHEAD_FRAMES / FPS
    assert session.ahead == pytest.approx(ahead)
    first = _audio(live, peer, session.token, 3)["first_frame"]
    clock.advance(1 / FPS)
    frames = [first, first + 1, first + 2]
    [r] = host.of(Kind.COMPOSITE, SpeechBatch)
    assert r.deadline == pytest.approx(session.due(frames[-1]) - ahead)
    assert r.inputs.due == pytest.approx(session.due(frames[0]) - ahead)


def test_h264_face_boxes_stay_with_the_sessions_encoder_and_a_dead_one_leaves_its_frames_idle():
    """H.264 speech is composited where the session's encoder is, the face box kept there: the batch
    names (session, frame, compositor) for each frame, the compositors answer with empty frames, and the
    encode requests name the kept frame instead of carrying a box. A session whose compositor died
    between the two sends those frames idle, counted missed, from an IDR on the other compositor."""
    live, host, clock = _live()
    peers = [Peer("h0"), Peer("h1")]
    for peer in peers:
        assert live.handle(_call("session_open", peer, model="a", format="h264"), []) is None
    for r in host.of(Kind.LOAD, Pin):
        r.results = [SimpleNamespace(worker=0)]
        _done(r)
    for r in host.of(Kind.RENDER, LoopJob):
        r.images = {0: [b"au"] * r.batch}
        _done(r)
    sessions = [live.table.get(_replies(host, peer)[-1]["session"]) for peer in peers]
    if sessions[0].h264.compositor == 1:
        sessions.reverse(), peers.reverse()
    assert [s.h264.compositor for s in sessions] == [0, 1]
    firsts = [_audio(live, peer, s.token, 3)["first_frame"] for peer, s in zip(peers, sessions)]
    clock.advance(1 / FPS)   # the batch waits a frame period for other sessions' speech
    [r] = host.of(Kind.COMPOSITE, SpeechBatch)
    assert r.keep == [(s.token, k, c) for c, (s, first) in enumerate(zip(sessions, firsts))
                      for k in range(first, first + 3)]
    r.images = {0: [b""] * 6}   # both compositors kept their boxes
    _done(r)
    host.states[1] = CompositorState(ProcState.STARTING)   # the second session's compositor died
    clock.advance(sessions[0].due(max(firsts) + 2) - clock.now())
    jobs = {s.token: [i for j in host.of(Kind.RENDER, EncodeJob) for p in j.work.task.sessions
                      if p.session == s.token for i in p.items] for s in sessions}
    kept = {i.index: i for i in jobs[sessions[0].token] if i.kept >= 0}
    assert sorted(kept) == list(range(firsts[0], firsts[0] + 3))
    assert all(i.kept == i.index and i.box == b"" for i in kept.values()), "the encode names the box kept"
    assert all(j.compositor == 0 for j in host.of(Kind.RENDER, EncodeJob))
    moved = [i for i in jobs[sessions[1].token] if firsts[1] <= i.index < firsts[1] + 3]
    assert len(moved) == 3 and all(i.kept < 0 and i.box == b"" for i in moved), "idle: its boxes died"
    assert moved[0].idr or any(i.idr for i in jobs[sessions[1].token] if i.index < firsts[1])
    assert sessions[1].stats.missed == 3 and sessions[0].stats.missed == 0


def test_h264_sessions_share_the_frame_grid_and_a_tick_encodes_in_one_request_per_compositor():
    """Sessions opened at different moments have their frames due at the same instants (the frame grid):
    one pacer tick decides every session's next frame and sends each compositor one request for all of
    its sessions' frames (it used to be one per session and frame). A session whose frames fail in that
    request loses them alone: the other session's frames go out as speech."""
    live, host, clock = _live()
    peers = [Peer(f"g{i}") for i in range(4)]
    for peer in peers:
        assert live.handle(_call("session_open", peer, model="a", format="h264"), []) is None
        for r in host.of(Kind.LOAD, Pin):
            if not r.results:
                r.results = [SimpleNamespace(worker=0)]
                _done(r)
        for r in host.of(Kind.RENDER, LoopJob):
            if not r.images:
                r.images = {0: [b"loop"] * r.batch}
                _done(r)
        clock.advance(0.013)   # opened 13 ms apart
    sessions = [live.table.get(_replies(host, peer)[-1]["session"]) for peer in peers]
    assert len({s.t0 for s in sessions}) > 1
    assert all(abs(s.t0 * FPS - round(s.t0 * FPS)) < 1e-6 for s in sessions), "t0 on the frame grid"
    assert sorted(s.h264.compositor for s in sessions) == [0, 0, 1, 1]
    for peer, s in zip(peers, sessions):
        _audio(live, peer, s.token, 3)
    clock.advance(1 / FPS)
    for r in host.of(Kind.COMPOSITE, SpeechBatch):
        r.images = {0: [b""] * r.batch}   # every box kept by its session's compositor
        _done(r)
    clock.advance(4 / FPS)
    jobs = host.of(Kind.RENDER, EncodeJob)
    assert len({(j.work.decided, j.compositor) for j in jobs}) == len(jobs), "one request per compositor a tick"
    assert all({s.h264.compositor for s in sessions if s.token in [p.session for p in j.work.task.sessions]}
               == {j.compositor} for j in jobs)
    [both] = [j for j in jobs if len(j.work.task.sessions) == 2 and j.compositor == 0][:1]
    first, second = (live.table.get(p.session) for p in both.work.task.sessions)
    sent_before = [len(_frames(host, p)) for p in peers]
    both.images = {0: [f"au-{p.session}-{i.index}".encode() for p in both.work.task.sessions for i in p.items]}
    both.lost = {0: "encoding H.264 for model a: test"}
    _done(both)
    for j in jobs:
        if j is not both:
            j.images = {0: [b"au"] * j.batch}
            _done(j)
    clock.advance(3 / FPS)
    by_session = {s.token: p for p, s in zip(peers, sessions)}
    ours = [(h["index"], h["kind"], d[0]) for h, d in _frames(host, by_session[second.token])]
    encoded = {f"au-{second.token}-{i.index}".encode() for i in both.work.task.sessions[1].items}
    assert encoded <= {au for _, _, au in ours}, "the other session's frames went out"
    lost = {i.index for i in both.work.task.sessions[0].items}
    assert not lost & {h["index"] for h, _ in _frames(host, by_session[first.token])}, "the failed ones did not"
    assert first.stats.dropped >= len(lost) and second.stats.dropped == 0   # (and what refers to them)
    assert first.h264.need_idr or any(p.session == first.token and p.items[0].idr
                                      for j in host.of(Kind.RENDER, EncodeJob)[len(jobs):] for p in j.work.task.sessions)
    assert [len(_frames(host, p)) for p in peers] > sent_before


def test_a_full_host_sheds_the_newest_speaking_sessions_speech_first():
    """Speech that comes back too late all the same: the newest sessions that speak give up every
    other speech frame, then all of them (idle frames, never counted missed), and the oldest keeps
    every speech frame; calm windows give the steps back."""
    from frontend.live.shedding import CALM_WINDOWS, FULL, HALF, NONE, WINDOW_S
    live, host, clock = _live(max_queued_frames=1000)   # the test's clients read nothing
    peers = [Peer(f"s{i}") for i in range(3)]
    tokens = [_open(live, p) for p in peers]   # oldest first; the windows run from here on, every WINDOW_S
    sessions = [live.table.get(t) for t in tokens]
    start = clock.now()
    n = 4   # speech frames each session says per window: all due within it

    def speak(on_time: bool) -> dict:
        """Every session says n frames; the compositors answer at once, or never (the host is full).
        Then on to the next window."""
        before = len(host.of(Kind.COMPOSITE, SpeechBatch))
        for p, t in zip(peers, tokens):
            _audio(live, p, t, n)
        clock.advance(1 / FPS)
        batches = host.of(Kind.COMPOSITE, SpeechBatch)[before:]
        if on_time:
            for r in batches:
                _composite(live, r, "speech")
        clock.advance(start + (round((clock.now() - start) / WINDOW_S) + 1) * WINDOW_S - clock.now())
        return {t: [k for r in batches for token, k, _ in r.work.targets if token == t] for t in tokens}

    speak(on_time=False)   # every frame missed: as many steps as sessions speaking, never the oldest's
    assert [s.shed for s in sessions] == [FULL, HALF, HALF]
    rendered = speak(on_time=True)
    assert [len(rendered[t]) for t in tokens] == [n, n // 2, n // 2], "the newest render every other frame"
    frames = {h["index"]: (h["kind"], d[0]) for h, d in _frames(host, peers[2])}
    said = [frames[k] for k in range(rendered[tokens[2]][0], rendered[tokens[2]][0] + n)]
    assert all(kind == "speech" for kind, _ in said) and said[1::2] == said[0::2], "the frame between repeats"
    speak(on_time=False)
    assert [s.shed for s in sessions] == [FULL, NONE, NONE]
    missed = [s.stats.missed for s in sessions]
    rendered = speak(on_time=True)
    assert [len(rendered[t]) for t in tokens] == [n, 0, 0]
    assert [s.stats.missed for s in sessions] == missed, "shed frames are not missed ones"
    # n/2 at half, n/2 more while the window that shed all of it was still at half, then all n
    assert [s.stats.shed for s in sessions] == [0, 2 * n, 2 * n]
    for _ in range(CALM_WINDOWS - 1):
        speak(on_time=True)
    assert [s.shed for s in sessions] == [FULL, HALF, NONE], "the last step taken, given back first"
    stats = msgspec.json.decode(live.handle(_call("session_stats", peers[2], session=tokens[2]), []))
    assert stats["shed"] == 2 * n + n * (CALM_WINDOWS - 1)
    assert live.metrics.session_frames.labels("shed")._value.get() == 2 * stats["shed"]
    assert live.metrics.sessions_shed._value.get() == 2
    live.handle(_call("session_close", peers[2], session=tokens[2]), [])
    clock.advance(2 * WINDOW_S)
    assert live.shedder.steps == [] and [s.shed for s in sessions[:2]] == [FULL, FULL]
    assert live.metrics.sessions_shed._value.get() == 0


def test_a_session_that_starts_to_speak_past_what_the_host_holds_is_shed_before_anything_is_late():
    """Where the host's costs are fitted (live/capacity.py), it knows how many sessions it holds speaking
    at once: one more starting to speak makes the newest speaking give up their speech at once, before
    any frame is late; the oldest keep every frame. With admission off (sessions.max_cpu_load 0) too."""
    from frontend.live.shedding import FULL, NONE
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, "max_cpu_load": 0,
                                        "max_queued_frames": 1000}})
    host, clock = RecordingHost(), VirtualClock()
    live = Live(host, config, Metrics(), clock=clock, cpu=lambda: {"frontend": 0.0, "cpu0": 0.0}, cores=2)
    peers = [Peer(f"s{i}") for i in range(3)]
    tokens = [_open(live, p) for p in peers]   # oldest first
    sessions = [live.table.get(t) for t in tokens]
    assert live.capacity.speakers_held(3) is None, "nothing fitted: nothing known to hold"
    # made-up fitted costs: 18 ms of cpu0 per speech frame, so its one core holds 2 speaking at 25 fps
    live.capacity.per_session, live.capacity.per_frame = {"frontend": 0.0, "cpu0": 0.0}, {"frontend": 0.0, "cpu0": 0.018}
    live.capacity.load = Load({"frontend": 0.1, "cpu0": 0.3}, 3)   # a host with room: a fit must not shed there
    assert live.capacity.speakers_held(3) is None
    live.capacity.load = Load({"frontend": 0.1, "cpu0": 0.9}, 3)   # busy (its core is)
    assert live.capacity.speakers_held(3) == 2
    for p, t in zip(peers, tokens):
        _audio(live, p, t, 4)
    assert [s.shed for s in sessions] == [FULL, FULL, NONE], "the third to start speaking is shed at once"
    clock.advance(1 / FPS)
    rendered = [token for r in host.of(Kind.COMPOSITE, SpeechBatch) for token, _, _ in r.work.targets]
    assert sorted(set(rendered)) == sorted(tokens[:2]) and len(rendered) == 8, "its speech is never rendered"
    assert all(s.stats.missed == 0 for s in sessions)


@pytest.fixture
def board(shm_name):
    """The sessions board of a host of two client-facing processes (shm/board.py): rows 0 and 1, and a
    column for one tenant with a session limit."""
    owner = Board.create(shm_name, 2, tenants=1)
    rows = [Board.attach(shm_name, i, 2) for i in (0, 1)]
    yield rows
    for b in rows:
        b.close()
    owner.close(unlink=True)


def test_the_sessions_of_every_client_facing_process_count_toward_max_sessions(board):
    """Two processes of one host, each its own Live: sessions.max_sessions holds for the host, not for each
    (each would let in max_sessions of its own); a session closed on one makes room on the other."""
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, "max_sessions": 3}})
    clock = VirtualClock()
    a, b = (Live(RecordingHost(), config, Metrics(), clock=clock, board=row) for row in board)
    pa = [Peer("a0"), Peer("a1")]
    tokens = [_open(a, p) for p in pa]
    _open(b, Peer("b0"))
    for live, name in ((a, "a2"), (b, "b1")):
        with pytest.raises(RequestError) as err:
            _open(live, Peer(name))
        assert err.value.code is ErrorCode.BUSY and "3 sessions are open on this host" in err.value.message
    a.handle(_call("session_close", pa[0], session=tokens[0]), [])
    _open(b, Peer("b2"))
    assert (len(a.table), len(b.table)) == (1, 2)
    # a process that starts again (its predecessor killed with its sessions) counts none of them
    board[0].close()
    board[0] = Board.attach(b.board.name, 0, 2)
    assert b._others().sessions == 0


def test_a_session_starting_to_speak_is_shed_past_the_speakers_the_host_holds_over_every_process(board):
    """Speakers held (live/capacity.py) are the host's: a process whose own sessions are few sheds its
    starting speaker when the other process's speakers fill the host already."""
    from frontend.live.shedding import FULL, NONE
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, "max_cpu_load": 0,
                                        "max_queued_frames": 1000}})
    clock = VirtualClock()
    a, b = (Live(RecordingHost(), config, Metrics(), clock=clock, cpu=lambda: {"frontend0": 0.0, "cpu0": 0.0},
                 cores=2, board=row) for row in board)
    for live in (a, b):   # made-up fitted costs, as the host's: its compositor's core holds 2 speaking
        live.capacity.per_session = {"frontend0": 0.0, "cpu0": 0.0}
        live.capacity.per_frame = {"frontend0": 0.0, "cpu0": 0.018}
        live.capacity.load = Load({"frontend0": 0.1, "cpu0": 0.9}, 3)
    pa = [Peer("a0"), Peer("a1")]
    ta = [_open(a, p) for p in pa]
    pb = Peer("b0")
    tb = _open(b, pb)
    for p, t in zip(pa, ta):
        _audio(a, p, t, 4)
    assert [a.table.get(t).shed for t in ta] == [FULL, FULL]
    _audio(b, pb, tb, 4)
    assert b.table.get(tb).shed == NONE, "two speak on the host already: the third is shed at once"


def test_a_tenant_holds_at_most_its_own_sessions_over_every_process(board):
    """frontend.curve.tenants.NAME.max_sessions: a tenant's clients get `busy` past its own limit, counted
    over the host's client-facing processes, while another tenant (and the host) still has room; a
    session of it that closes makes room for it again."""
    from frontend.server.calls import Tenant
    config = parse_config({"frontend": {"bind": ["tcp://127.0.0.1:5555"], "curve": {"secret_key": "s.key_secret", "tenants": {
        "acme": {"keys": ["acme.key"], "max_sessions": 2}, "other": {"keys": ["other.key"]}}}},
        "sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, "max_sessions": 10}})
    clock = VirtualClock()
    a, b = (Live(RecordingHost(), config, Metrics(), clock=clock, board=row) for row in board)

    def peer(name: str, tenant: str) -> Peer:
        p = Peer(name)
        p.tenant = Tenant(tenant, None)
        return p

    first = peer("a0", "acme")
    token = _open(a, first)
    _open(b, peer("b0", "acme"))
    for live, name in ((a, "a1"), (b, "b1")):
        with pytest.raises(RequestError) as err:
            _open(live, peer(name, "acme"))
        assert err.value.code is ErrorCode.BUSY and "tenant acme holds 2 live sessions" in err.value.message
    for live, name in ((a, "o0"), (b, "o1"), (a, "o2")):   # another tenant's are let in
        _open(live, peer(name, "other"))
    a.handle(_call("session_close", first, session=token), [])
    _open(b, peer("b2", "acme"))
    assert (len(a.table), len(b.table)) == (2, 3)


def test_chunks_of_one_utterance_play_back_to_back_as_speech():
    """An utterance streamed in chunks plays without a gap or an overlap: each chunk lands right after
    the one before, every frame goes out as its own speech frame, the last one says so, and the stats
    count them (with their latency)."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    one = _audio(live, owner, token, 3, utterance=1)
    two = _audio(live, owner, token, 4, utterance=1, last=True)
    first = one["first_frame"]
    assert two["first_frame"] == first + 3, "the second chunk plays right after the first"
    clock.advance(1 / FPS)
    for r in host.of(Kind.COMPOSITE, SpeechBatch):
        _composite(live, r, "speech")
    clock.advance((first + 10) / FPS + 0.2)
    frames = {h["index"]: (h, d[0]) for h, d in _frames(host, owner)}
    said = [frames[k] for k in range(first, first + 7)]
    assert [(h["kind"], image) for h, image in said] == [("speech", f"speech-{token}-{k}".encode())
                                                        for k in range(first, first + 7)]
    assert [h["last"] for h, _ in said] == [False] * 6 + [True] and {h["utterance"] for h, _ in said} == {1}
    stats = msgspec.json.decode(live.handle(_call("session_stats", owner, session=token), []))
    assert stats["frames_speech"] == 7 and stats["missed"] == 0 and stats["latency_ms_p50"] is not None, stats


def test_an_interrupt_mid_utterance_cuts_its_speech_at_the_next_frame_and_says_where_it_ended():
    """Barge-in while the utterance plays: none of its frames goes out after the interrupt (the very
    next one included), the reply counts those dropped, and the next frame, idle, tells the client
    that this utterance's playback ended there (utterance, last)."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    session = live.table.get(token)
    first = _audio(live, owner, token, 10, utterance=1)["first_frame"]
    clock.advance(1 / FPS)
    _composite(live, host.of(Kind.COMPOSITE, SpeechBatch)[0], "speech")
    clock.advance(session.due(first + 3) + 0.01 - clock.now())   # frames first .. first + 3 went out
    assert [h["kind"] for h, _ in _frames(host, owner)][first:] == ["speech"] * 4
    interrupted = msgspec.json.decode(live.handle(_call("session_interrupt", owner, session=token), []))
    assert interrupted["dropped"] == 6 and interrupted["utterance"] == 1
    clock.advance(12 / FPS)
    after = [h for h, _ in _frames(host, owner) if h["index"] >= first + 4]
    assert after and not [h for h in after if h["kind"] == "speech"], "the cut utterance still spoke"
    assert (after[0]["index"], after[0]["kind"], after[0]["utterance"], after[0]["last"]) == (first + 4, "idle", 1, True)
    assert [h["index"] for h, _ in _frames(host, owner) if h["last"]] == [first + 4], "its end said once"


def test_utterances_sent_without_ids_are_numbered_one_after_another():
    """A client that sends no utterance ids gets them counted for it: 1, then 2, in the audio replies,
    on the frames that carry each one's speech, and in the interrupt's reply."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    one = _audio(live, owner, token, 2, last=True)
    two = _audio(live, owner, token, 2, last=True)
    assert (one["utterance"], two["utterance"]) == (1, 2)
    clock.advance(1 / FPS)
    for r in host.of(Kind.COMPOSITE, SpeechBatch):
        assert [u for _, _, u in r.work.targets] == [1, 1, 2, 2]
        _composite(live, r, "speech")
    clock.advance((two["first_frame"] + 3) / FPS + 0.2)
    speech = [(h["index"], h["utterance"]) for h, _ in _frames(host, owner) if h["kind"] == "speech"]
    first = one["first_frame"]
    assert speech == [(first, 1), (first + 1, 1), (first + 2, 2), (first + 3, 2)]
    assert _audio(live, owner, token, 2)["utterance"] == 3
    interrupted = msgspec.json.decode(live.handle(_call("session_interrupt", owner, session=token), []))
    assert interrupted["utterance"] == 3 and interrupted["dropped"] == 2


def test_a_pcm_utterance_streamed_in_chunks_comes_back_with_every_sample_in_whole_frames():
    """pcm16 in two chunks (12,000 samples: 18.75 frames): each reply says the frame its chunk starts
    playing in and how many it spans, every frame carries exactly its 40 ms (zeros past the end), the
    samples come back in order, and the frame with the utterance's last samples is marked last."""
    from config.audio import speech
    live, host, clock = _live()
    peer = Peer("p")
    spec = SimpleNamespace(**{**vars(SPEC), "encoder": True})
    token = _open(live, peer, spec, audio="pcm16")
    pcm = speech(0.75, seed=2).tobytes()
    assert len(pcm) == 2 * 12000
    one = msgspec.json.decode(live.handle(_call("session_audio", peer, spec, session=token, utterance=1),
                                          [pcm[:16000]]))
    two = msgspec.json.decode(live.handle(_call("session_audio", peer, spec, session=token, utterance=1, last=True),
                                          [pcm[16000:]]))
    first = one["first_frame"]
    assert (one["frames"], two["first_frame"], two["frames"]) == (13, first + 12, 7)
    clock.advance(1 / FPS)
    for r in host.of(Kind.COMPOSITE, SpeechBatch):
        _composite(live, r, "speech")
    clock.advance((first + 25) / FPS + 0.2)
    frames = [(h, d) for h, d in _frames(host, peer) if first <= h["index"] < first + 19]
    assert [h["index"] for h, _ in frames] == list(range(first, first + 19))
    assert all(len(d[1]) == 2 * 640 for _, d in frames), "each frame carries 40 ms of audio"
    assert b"".join(d[1] for _, d in frames) == pcm + bytes(2 * 19 * 640 - len(pcm))
    assert [h["index"] for h, _ in _frames(host, peer) if h["last"]] == [first + 18]
    assert all(h["utterance"] == 1 for h, _ in frames)


def test_the_client_learns_where_an_utterance_ended_when_its_last_frame_is_missed_or_ends_late():
    """Every utterance's end reaches the client as a frame marked last: when its last speech frame
    failed (it goes out idle, missed, still marked), and when a pcm16 utterance's `last` comes after
    all of its audio has played (the next frame to go out carries it)."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    first = _audio(live, owner, token, 3, utterance=1, last=True)["first_frame"]
    clock.advance(1 / FPS)
    _failed(host.of(Kind.COMPOSITE, SpeechBatch)[0], "a worker died")
    clock.advance((first + 4) / FPS + 0.2)
    ended = [(h["index"], h["kind"], h["utterance"]) for h, _ in _frames(host, owner) if h["last"]]
    assert ended == [(first + 2, "idle", 1)]

    from config.audio import speech
    peer = Peer("p")
    spec = SimpleNamespace(**{**vars(SPEC), "encoder": True})
    token = _open(live, peer, spec, audio="pcm16")
    session = live.table.get(token)
    pcm = speech(0.5, seed=3).tobytes()
    live.handle(_call("session_audio", peer, spec, session=token, utterance=1), [pcm])
    clock.advance(1.5)   # all of its audio has played
    assert not [h for h, _ in _frames(host, peer) if h["last"]]
    next_index = session.next_index
    live.handle(_call("session_audio", peer, spec, session=token, utterance=1, last=True), [b""])
    clock.advance(2 / FPS)
    ended = [(h["index"], h["kind"], h["utterance"]) for h, _ in _frames(host, peer) if h["last"]]
    assert ended == [(next_index, "idle", 1)]


def test_frames_sent_late_after_a_stall_count_late_in_the_sessions_stats():
    """A frontend that stalls (its event loop held 200 ms) sends the frames due meanwhile late, all of
    them, in order: session_stats counts those more than 40 ms late and the worst lateness."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    clock.advance(0.5)
    stats = msgspec.json.decode(live.handle(_call("session_stats", owner, session=token), []))
    assert stats["late"] == 0 and stats["max_late_ms"] <= 4.0
    sent = len(_frames(host, owner))
    clock.t += 0.2   # no timer ran meanwhile
    clock.advance(0)
    indices = [h["index"] for h, _ in _frames(host, owner)]
    assert indices == list(range(len(indices))) and len(indices) - sent >= 4
    stats = msgspec.json.decode(live.handle(_call("session_stats", owner, session=token), []))
    assert stats["late"] >= 3 and 150 <= stats["max_late_ms"] <= 200, stats


def test_a_session_closed_while_its_speech_waits_for_a_batch_does_not_hold_up_the_others():
    """Speech frames wait a frame period to share a batch: a session that closes meanwhile takes its
    frames out of it, and the other session's frames are still submitted and go out as speech."""
    live, host, clock = _live()
    a, b = Peer("a"), Peer("b")
    ta, tb = _open(live, a), _open(live, b)
    _audio(live, a, ta, 3)
    first = _audio(live, b, tb, 3)["first_frame"]
    live.handle(_call("session_close", a, session=ta), [])
    clock.advance(1 / FPS)
    [r] = host.of(Kind.COMPOSITE, SpeechBatch)
    assert [(t, k) for t, k, _ in r.work.targets] == [(tb, first + i) for i in range(3)]
    _composite(live, r, "speech")
    clock.advance((first + 4) / FPS + 0.2)
    assert [h["index"] for h, _ in _frames(host, b) if h["kind"] == "speech"] == [first, first + 1, first + 2]


def test_a_features_utterances_frames_are_inferred_once_their_lookahead_rows_arrive():
    """features mode: frame j's window is rows j-8 .. j+7 of its own utterance (zeros outside it), so
    frame j is inferred once row j+7 has arrived, or at the utterance's end; the next utterance's first
    window sees zeros before its own rows, never the previous utterance's."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner, audio="features")

    def rows(n: int, value: float, **fields) -> dict:
        return msgspec.json.decode(live.handle(_call("session_audio", owner, session=token, **fields),
                                               [np.full((n, 512), value, np.float32).tobytes()]))

    def inferred() -> list[int]:
        clock.advance(1 / FPS)
        return [k for r in host.of(Kind.COMPOSITE, SpeechBatch) for _, k, _ in r.work.targets]

    first = rows(8, 1.0, utterance=1)["first_frame"]
    assert inferred() == [first], "frame 0 needs rows 0 .. 7: only it"
    rows(2, 1.0, utterance=1, last=True)
    assert inferred() == list(range(first, first + 10))
    batches = host.of(Kind.COMPOSITE, SpeechBatch)
    second = rows(10, 2.0, utterance=2, last=True)["first_frame"]
    clock.advance(12 / FPS)   # (its last frames lie beyond the horizon at first: live/speech.py)
    later = host.of(Kind.COMPOSITE, SpeechBatch)[len(batches):]
    assert [k for r in later for _, k, _ in r.work.targets] == list(range(second, second + 10))
    r = later[0]
    window = np.frombuffer(r.inputs.audio, "<f4").reshape(r.batch, 16, 512)[0]
    assert (window[:8] == 0).all() and (window[8:] == 2.0).all(), "its first window: zeros, then its own rows"


def test_an_interrupt_that_arrives_late_never_brings_back_an_utterance_cut_before():
    """Interrupts can cross on the wire: one up to utterance 5, then a stale one up to 2. Utterance 4's
    chunks arriving after them stay cut (its speech never rendered); 6's speak."""
    live, host, clock = _live()
    owner = Peer("owner")
    token = _open(live, owner)
    for upto in (5, 2):
        reply = msgspec.json.decode(live.handle(_call("session_interrupt", owner, session=token, utterance=upto), []))
        assert reply["utterance"] == 5
    _audio(live, owner, token, 4, utterance=4)
    _audio(live, owner, token, 4, utterance=6, last=True)
    clock.advance(1 / FPS)
    rendered = host.of(Kind.COMPOSITE, SpeechBatch)
    assert sum(len(r.work.targets) for r in rendered) == 4, "a cut utterance's speech was rendered"
    for r in rendered:
        _composite(live, r, "speech")
    clock.advance(1.0)
    spoken = {h["utterance"] for h, _ in _frames(host, owner) if h["kind"] == "speech"}
    assert spoken == {6}, spoken


def test_a_short_pcm_utterance_sent_whole_lands_as_soon_as_a_window_utterance_would():
    """A reply of a few hundred ms sent in one `last` chunk holds every sample its frames need: it lands
    at the session's lead, as feature windows sent at the same moment would, not PCM_LOOKAHEAD_SAMPLES
    (0.45 s) later as a stream's first chunk must; a first chunk that is not the last still waits."""
    from config.audio import speech
    spec = SimpleNamespace(**{**vars(SPEC), "encoder": True})
    firsts = {}
    for mode, last in (("window", True), ("pcm16", True), ("pcm16", False)):
        live, host, clock = _live()
        peer = Peer("p")
        token = _open(live, peer, spec, audio=mode)
        payload = (speech(0.3, seed=1).tobytes() if mode == "pcm16"
                   else np.zeros((7, 32, 16, 16), np.float32).tobytes())
        reply = msgspec.json.decode(live.handle(_call("session_audio", peer, spec, session=token, utterance=1,
                                                      last=last), [payload]))
        firsts[mode, last] = reply["first_frame"] - live.table.get(token).now_index(clock.now())
    assert firsts["pcm16", True] == firsts["window", True], firsts
    assert firsts["pcm16", False] > firsts["pcm16", True], firsts


def test_an_interrupt_takes_a_pcm_sessions_frames_waiting_for_a_batch_and_counts_only_speech():
    """PCM frames wait up to a frame period to share a request: an interrupt in that moment takes them
    too (none of them is inferred), and its reply's `dropped` counts the speech frames cut, never the
    tail frames that carry an utterance's samples past its last speech frame."""
    from config.audio import speech
    live, host, clock = _live()
    peer = Peer("p")
    spec = SimpleNamespace(**{**vars(SPEC), "encoder": True})
    token = _open(live, peer, spec, audio="pcm16")
    session = live.table.get(token)

    def interrupt() -> int:
        return msgspec.json.decode(live.handle(_call("session_interrupt", peer, spec, session=token), []))["dropped"]

    # a stream's first 0.6 s: the frames its samples make computable wait for a batch
    live.handle(_call("session_audio", peer, spec, session=token, utterance=1), [speech(0.6, seed=2).tobytes()])
    waiting = len(session.speech)
    assert waiting and not host.of(Kind.COMPOSITE, SpeechBatch), waiting
    assert interrupt() == waiting
    clock.advance(1.0)
    assert not host.of(Kind.COMPOSITE, SpeechBatch), "a cut utterance's frames were inferred"
    # a whole utterance (its frames asked for at once), cut before any plays: its speech frames counted
    live.handle(_call("session_audio", peer, spec, session=token, utterance=2, last=True),
                [speech(0.5, seed=3).tobytes()])
    spoken = sum(not f.tail for f in session.speech.values())
    assert 0 < spoken < len(session.speech), "no tail frame"
    assert interrupt() == spoken
