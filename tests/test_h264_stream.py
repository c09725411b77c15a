"""frontend/h264.py without processes: when a session encodes and when it sends its avatar's idle
loop, that every switch starts with an IDR, and that access units leave in order, when due."""

from __future__ import annotations

from frontend.live.h264_stream import H264Stream
from frontend.live.timeline import Outgoing

GOP, PERIOD = 4, 10
LOOP = {start: [f"loop{start + i}".encode() for i in range(min(GOP, PERIOD - start))] for start in range(0, PERIOD, GOP)}


def frame(k: int, kind: str = "idle") -> Outgoing:
    return Outgoing(k, kind, k % 5, b"box" if kind == "speech" else None, due=k * 0.04)


def decide(stream: H264Stream, k: int, kind: str = "idle", loop: bool = True):
    start, _ = stream.chunk_of(k)
    return stream.decide(frame(k, kind), LOOP[start] if loop else None)


def test_silence_joins_the_loop_only_at_a_chunk_start_and_speech_leaves_it_with_an_idr():
    stream = H264Stream(compositor=0, start_frame=1, period=PERIOD, chunk=GOP)
    first = decide(stream, 0)                  # position 1: not a chunk start, the encoder starts (IDR)
    assert first is not None and first.idr and first.box == b""
    assert not decide(stream, 1).idr           # position 2
    assert not decide(stream, 2).idr           # position 3
    assert decide(stream, 3) is None           # position 4: a chunk start, into the loop
    assert stream.units[3].au == b"loop4" and stream.units[3].keyframe
    assert decide(stream, 4) is None and stream.units[4].au == b"loop5" and not stream.units[4].keyframe
    speech = decide(stream, 5, "speech")
    assert speech.idr and speech.box == b"box", "the decoder's last picture was the loop's: an IDR"
    assert not decide(stream, 6, "speech").idr
    assert decide(stream, 7) is None and stream.units[7].keyframe        # position 8: a chunk start
    assert decide(stream, 8) is None and stream.units[8].au == b"loop9"
    assert decide(stream, 9) is None and stream.units[9].au == b"loop0"  # the loop wraps at a chunk start


def test_without_the_loop_every_frame_is_encoded_and_a_loss_forces_an_idr():
    stream = H264Stream(compositor=0, start_frame=0, period=PERIOD, chunk=GOP)
    assert decide(stream, 0, loop=False).idr
    assert [decide(stream, k, loop=False).idr for k in range(1, 6)] == [False] * 5
    stream.lost(5)
    assert decide(stream, 6, loop=False).idr, "after a lost frame the decoder needs an IDR"
    assert not decide(stream, 7).idr, "position 7 is inside a loop chunk: the encoder goes on"
    stream.lost(7)
    assert decide(stream, 8) is None and stream.units[8].keyframe, "a chunk start is an IDR: it settles the loss"


def test_units_leave_in_order_when_due_and_lost_ones_are_skipped():
    stream = H264Stream(compositor=0, start_frame=0, period=PERIOD, chunk=GOP)
    for k in range(4):
        decide(stream, k, loop=False)
    stream.encoded(0, b"a0")
    stream.encoded(2, b"a2")
    assert stream.sendable(now=-1.0) == [] and stream.waiting_due() == 0.0
    assert [u.au for u in stream.sendable(now=1.0)] == [b"a0"], "frame 2 waits for frame 1"
    assert stream.waiting_due() is None
    stream.encoded(3, b"a3")
    assert stream.sendable(now=0.1) == [], "frame 1 is due and not back: the rest wait"
    stream.lost(1)
    sent = stream.sendable(now=0.1)
    assert [(u.frame.index, u.lost, u.au) for u in sent] == [(1, True, None), (2, True, b"a2")], \
        "frame 2 refers to frame 1: skipped too"
    assert stream.sendable(now=0.1) == [], "frame 3 is not due yet"
    assert [u.lost for u in stream.sendable(now=0.2)] == [True], "nor is it an IDR"


def test_after_a_loss_nothing_goes_out_until_an_idr():
    stream = H264Stream(compositor=0, start_frame=0, period=PERIOD, chunk=GOP)
    for k in range(3):   # decided before the loss was known: P-frames referring to frame 0
        decide(stream, k, loop=False)
    stream.lost(0)
    stream.encoded(1, b"p1")
    stream.encoded(2, b"p2")
    idr = decide(stream, 3, loop=False)
    assert idr.idr
    stream.encoded(3, b"i3")
    sent = stream.sendable(now=1.0)
    assert [(u.frame.index, u.lost) for u in sent] == [(0, True), (1, True), (2, True), (3, False)]
    assert sent[-1].keyframe and not stream.broken
