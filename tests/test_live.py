"""frontend/live/ on its own: session ops, speech batching and the pacer driven through the `Host`
interface, with no sockets, no processes and no viewer stack. The same paths run end to end over real
processes in test_sessions.py and test_h264.py; these pin down what live/ asks of its host."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from config import parse_config
from frontend import protocol as P
from frontend.core.request import Kind, RequestError
from frontend.core.scheduler import CompositorState
from frontend.live.service import Live, Pin, Speech
from frontend.metrics import Metrics
from shm.codes import ErrorCode, ProcState

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

    def of(self, kind, data_type=None) -> list:
        return [r for r in self.submitted if r.kind is kind and (data_type is None or isinstance(r.data, data_type))]


class Peer:
    """A connection, as the server's ReplyTo presents it to live/."""

    def __init__(self, name: str):
        self.peer, self.tenant, self.conn = (0, (name.encode(),)), None, (0, hash(name) % 1000)


def _call(op: str, peer: Peer, **fields):
    return SimpleNamespace(header=P.RequestHeader(op=P.Op(op), id=1, **fields), spec=SPEC, reply_to=peer)


def _live(**sessions) -> tuple[Live, RecordingHost]:
    config = parse_config({"sessions": {"start_delay_ms": 100, "latency_budget_ms": 280, **sessions}})
    host = RecordingHost()
    return Live(host, config, Metrics()), host


def _open(live: Live, peer: Peer, **fields) -> str:
    reply = msgspec.json.decode(live.handle(_call("session_open", peer, model="a", **fields), []))
    return reply["session"]


def _finish_idle_renders(live: Live, host: RecordingHost) -> None:
    """The compositors' answer to every idle render asked for: one encoded image per frame."""
    for r in host.of(Kind.RENDER):
        if not r.images:
            r.images = {0: [f"idle-{b}".encode() for b in r.data.frames]}
            live.done(r)


def test_open_pins_the_model_and_prefetches_idle_frames():
    async def run():
        live, host = _live()
        token = _open(live, Peer("owner"))
        pins = host.of(Kind.LOAD, Pin)
        assert len(pins) == 1 and pins[0].pin == 1 and pins[0].model == "a" and pins[0].data.token == token
        renders = host.of(Kind.RENDER)
        assert renders and sum(r.batch for r in renders) == len({b for r in renders for b in r.data.frames})
        pins[0].results = [SimpleNamespace(worker=0)]
        live.done(pins[0])
        assert live.table.get(token).pinned_worker == 0
        live.handle(_call("session_close", Peer("owner"), session=token), [])
        assert host.unpinned == [(0, "a")] and live.table.get(token) is None
    asyncio.run(run())


def test_speech_is_batched_across_sessions_then_paced_out_in_order():
    async def run():
        live, host = _live()
        owners = [Peer("p0"), Peer("p1")]
        tokens = [_open(live, p) for p in owners]
        _finish_idle_renders(live, host)
        firsts = []
        for token, peer in zip(tokens, owners):
            reply = live.handle(_call("session_audio", peer, session=token),
                                [np.ones((3, 32, 16, 16), np.float32).tobytes()])
            firsts.append(msgspec.json.decode(reply)["first_frame"])
        await asyncio.sleep(0.1)   # at most one frame period of waiting for others to share the batch
        speech = host.of(Kind.COMPOSITE, Speech)
        assert len(speech) == 1, "both sessions' frames share one request"
        r = speech[0]
        assert r.batch == 6 and r.inputs.layout == "windows" and r.inputs.window == (32, 16, 16)
        assert sorted(r.data.targets) == sorted((t, f + i) for t, f in zip(tokens, firsts) for i in range(3))
        assert len(r.inputs.audio) == 6 * 32 * 16 * 16 * 4
        r.images = {0: [f"speech-{t}-{k}".encode() for t, k in r.data.targets]}
        live.done(r)
        await asyncio.sleep((max(firsts) + 4) / FPS + 0.15)
        for token, peer in zip(tokens, owners):
            frames = [(h, d) for to, h, d in host.sent if to is peer and h.get("event") == "frame"]
            indices = [h["index"] for h, _ in frames]
            assert indices == list(range(len(indices))), "frames leave in order, none skipped"
            kinds = {h["index"]: (h["kind"], d[0]) for h, d in frames}
            first = firsts[tokens.index(token)]
            for k in range(first, first + 3):
                assert kinds[k] == ("speech", f"speech-{token}-{k}".encode()), kinds.get(k)
            assert all(kind == "idle" for i, (kind, _) in kinds.items() if not first <= i < first + 3)
        for token in tokens:
            live.handle(_call("session_close", owners[tokens.index(token)], session=token), [])
    asyncio.run(run())


def test_a_failed_speech_batch_goes_out_idle_and_counts_missed():
    async def run():
        live, host = _live()
        owner = Peer("owner")
        token = _open(live, owner)
        _finish_idle_renders(live, host)
        first = msgspec.json.decode(live.handle(_call("session_audio", owner, session=token),
                                                [np.ones((2, 32, 16, 16), np.float32).tobytes()]))["first_frame"]
        await asyncio.sleep(0.1)
        live.failed(host.of(Kind.COMPOSITE, Speech)[0], "a worker died")
        await asyncio.sleep((first + 3) / FPS + 0.15)
        stats = msgspec.json.decode(live.handle(_call("session_stats", owner, session=token), []))
        assert stats["missed"] == 2 and stats["frames_speech"] == 0, stats
    asyncio.run(run())


@pytest.mark.parametrize("op", ["session_audio", "session_interrupt", "session_keyframe", "session_stats",
                                "session_close"])
def test_another_connection_cannot_drive_a_session(op):
    async def run():
        live, _ = _live()
        token = _open(live, Peer("owner"))
        payload = [np.ones((1, 32, 16, 16), np.float32).tobytes()] if op == "session_audio" else []
        with pytest.raises(RequestError) as err:
            live.handle(_call(op, Peer("intruder"), session=token), payload)
        assert err.value.code is ErrorCode.BAD_REQUEST and "no open session" in err.value.message
        assert live.table.get(token) is not None
    asyncio.run(run())


def test_rates_a_stream_cannot_keep_are_refused():
    async def run():
        live, host = _live()
        with pytest.raises(RequestError) as err:
            _open(live, Peer("p"), fps=0.5)
        assert err.value.code is ErrorCode.BAD_REQUEST and "header.fps" in err.value.message
        assert not host.submitted and not len(live.table)
    asyncio.run(run())
