"""The floor under the frontend's CPU per frame sent: the messages an H.264 level makes the frontend
send and receive, through pyzmq alone, in a process that does nothing else with them.

A stand-in frontend (one thread, a `zmq.Poller` loop, libzmq's one I/O thread) paces `n` sessions at
25 fps on one frame grid (as the real pacer does: every session's frame is due at the same instants),
each frame a 3-part message to its own DEALER over TCP, sent back to back; the `speaking` sessions
also send an audio request every frame (an 8-KB window, as `bench sessions` does), answered with a
small reply, and each of their frames costs what it costs the real frontend on the inside: a share of
a batch's message to the inference side and back (10 frames a batch, the 110-KB face boxes coming
back), and a share of the tick's one encode request to a compositor, carrying its box out and its
access unit back, over IPC. A second process plays every client, a third every worker.

What it prints (`python -m bench transport`): the stand-in's CPU per frame sent, by thread: the
least the frontend could spend on these messages in Python with pyzmq, against which the real one's
figure (`bench sessions`) reads.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import tempfile
import time

import zmq

from bench.procstat import thread_cpu_s

FPS = 25.0
SPEAKING_SHARE = 0.27    # of a level's sessions, as `bench sessions` has them speak
SLACK_S = 0.004          # frames due this soon go in the same pass (as the real pacer)
BATCH = 10               # speech frames per inference batch
BOX_BYTES = 110_000      # a 270x270 face box in I420
AU_BYTES, IDLE_AU_BYTES = 6_000, 2_500
WINDOW_BYTES = 32 * 16 * 16 * 4
HEADER = b'{"op":"frame","session":"0123456789abcdef","index":123456,"pts_ms":4938240.0,"kind":"speech",' \
         b'"frame":17,"keyframe":false,"utterance":3,"last":false}'
AUDIO_HEADER = b'{"op":"session_audio","id":123456,"session":"0123456789abcdef","utterance":3,"last":false}'
REPLY = b'{"id":123456,"session":"0123456789abcdef","first_frame":123460,"frames":1,"utterance":3}'


def _frontend(to_worker: str, from_worker: str, n: int, speaking: int, seconds: float,
              warmup_s: float, box_bytes: int, out) -> None:
    ctx = zmq.Context(io_threads=1)
    router = ctx.socket(zmq.ROUTER)
    out.put(router.bind_to_random_port("tcp://127.0.0.1"))
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(to_worker)
    pull.bind(from_worker)
    peers: list[bytes] = []
    while len(peers) < n:   # each client says hello first: its routing id
        ident, *_ = router.recv_multipart()
        peers.append(ident)
    out.put("ready")
    idle_au, boxes, aus = bytes(IDLE_AU_BYTES), [], {}
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    start = time.monotonic() + 0.2
    due = [start] * n
    audio_in = 0
    sent = speech_sent = 0
    mark = start + warmup_s
    end = mark + seconds
    cpu0 = None
    while True:
        now = time.monotonic()
        if cpu0 is None and now >= mark:
            cpu0, sent, speech_sent = thread_cpu_s(os.getpid()), 0, 0
        if now >= end:
            break
        horizon = now + SLACK_S
        encodes = []
        for i in range(n):
            if due[i] > horizon:
                continue
            due[i] += 1 / FPS
            au = aus.pop(i, None) if i < speaking else None
            router.send(peers[i], zmq.SNDMORE | zmq.NOBLOCK)
            router.send(HEADER, zmq.SNDMORE | zmq.NOBLOCK)
            router.send(au if au is not None else idle_au, zmq.NOBLOCK, copy=False)
            sent += 1
            speech_sent += au is not None
            if i < speaking:   # the next frame's encode, with the box the batch brought back
                encodes.append((i, boxes.pop() if boxes else bytes(box_bytes)))
        if encodes:   # the tick's encodes in one request
            ids = b"".join(i.to_bytes(2, "little") for i, _ in encodes)
            push.send_multipart([b"encode", ids, *(box for _, box in encodes)], zmq.NOBLOCK, copy=False)
        timeout = math.ceil(max(min(due) - SLACK_S - time.monotonic(), 0) * 1000)
        for sock, _ in poller.poll(timeout):
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                if sock is router:   # an audio request: the reply; a batch's message every BATCH
                    router.send(parts[0], zmq.SNDMORE | zmq.NOBLOCK)
                    router.send(REPLY, zmq.NOBLOCK)
                    audio_in += 1
                    if audio_in % BATCH == 0:
                        push.send(b"infer", zmq.NOBLOCK)
                elif parts[0].bytes == b"boxes":   # a batch's boxes
                    boxes.extend(p.buffer for p in parts[1:])
                    boxes[:] = boxes[-4 * BATCH:]
                else:                               # a tick's access units
                    ids = parts[1].bytes
                    for j, au in enumerate(parts[2:]):
                        aus[int.from_bytes(ids[2 * j:2 * j + 2], "little")] = au.buffer
    cpu1 = thread_cpu_s(os.getpid())
    threads = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
    out.put({"frames": sent, "speech": speech_sent, "seconds": seconds, "threads": threads})
    ctx.destroy(linger=0)


def _clients(port: int, n: int, speaking: int, stop) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(b"hello")
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    window = bytes(WINDOW_BYTES)
    nxt, started = time.monotonic(), False   # audio once frames come (every client is known then)
    while not stop.is_set():
        now = time.monotonic()
        if now >= nxt and started:
            nxt += 1 / FPS
            for s in socks[:speaking]:
                s.send_multipart([AUDIO_HEADER, window], zmq.NOBLOCK)
        for s, _ in poller.poll(max(nxt - time.monotonic(), 0) * 1000):
            while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                s.recv_multipart(zmq.NOBLOCK, copy=False)
                started = True
        nxt = max(nxt, time.monotonic() - 1 / FPS) if not started else nxt
    ctx.destroy(linger=0)


def _worker(to_worker: str, from_worker: str, box_bytes: int, stop) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_worker)
    push.connect(from_worker)
    boxes, au = [bytes(box_bytes)] * BATCH, bytes(AU_BYTES)
    while not stop.is_set():
        if not pull.poll(100):
            continue
        parts = pull.recv_multipart(copy=False)
        if len(parts) == 1:
            push.send_multipart([b"boxes", *boxes], copy=False)
        else:
            push.send_multipart([b"aus", parts[1].bytes, *[au] * (len(parts[1].bytes) // 2)])
    ctx.destroy(linger=0)


def measure(n: int, speaking: int, seconds: float = 10.0, warmup_s: float = 2.0, box_bytes: int = BOX_BYTES) -> dict:
    """One level: the stand-in frontend's CPU per frame sent, by thread (us); `box_bytes`: the face box
    each speech frame brings back and sends on (BOX_BYTES; a few bytes: boxes that stay off the frontend)."""
    mpc = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lsync-transport-") as tmp:
        to_worker, from_worker = f"ipc://{tmp}/to", f"ipc://{tmp}/from"
        out, stop = mpc.Queue(), mpc.Event()
        front = mpc.Process(target=_frontend, args=(to_worker, from_worker, n, speaking, seconds, warmup_s, box_bytes, out))
        front.start()
        port = out.get(timeout=60)
        others = [mpc.Process(target=_clients, args=(port, n, speaking, stop)),
                  mpc.Process(target=_worker, args=(to_worker, from_worker, box_bytes, stop))]
        for p in others:
            p.start()
        try:
            if out.get(timeout=60) != "ready":
                raise RuntimeError("the stand-in frontend did not start")
            result = out.get(timeout=seconds + warmup_s + 60)
        finally:
            stop.set()
            front.join(10)
            for p in (front, *others):
                p.join(10)
                if p.is_alive():
                    p.kill()
    frames = max(result["frames"], 1)
    by_name: dict[str, float] = {}
    for name, cpu in result["threads"].items():   # (pyzmq's garbage collector runs a context of its own)
        by_name[name.rsplit("-", 1)[0]] = by_name.get(name.rsplit("-", 1)[0], 0.0) + cpu
    result["us_per_frame"] = {name: round(cpu / frames * 1e6, 1)
                              for name, cpu in sorted(by_name.items(), key=lambda kv: -kv[1]) if cpu > 0}
    result["us_per_frame_total"] = round(sum(result["threads"].values()) / frames * 1e6, 1)
    result.update(sessions=n, speaking=speaking, box_bytes=box_bytes)
    return result


def run(seconds: float = 10.0, levels=((40, 11), (40, 0))) -> dict:
    """Each level (sessions, of them speaking) with the boxes through the stand-in, and the speaking
    levels again with boxes of a few bytes (what keeping them off the frontend would leave)."""
    print("the frontend's messages alone (pyzmq, a stand-in that does nothing else), CPU per frame sent:")
    out = []
    for n, k in levels:
        for box_bytes in ((BOX_BYTES, 16) if k else (BOX_BYTES,)):
            out.append(measure(n, k, seconds, box_bytes=box_bytes))
            _print(out[-1])
    return {"levels": out}


def _print(lv: dict) -> None:
    threads = ", ".join(f"{name} {us}" for name, us in lv["us_per_frame"].items())
    boxes = "" if not lv["speaking"] else f", {lv['box_bytes']}-byte boxes"
    print(f"    {lv['sessions']} sessions, {lv['speaking']} speaking{boxes}: {lv['us_per_frame_total']} us a frame "
          f"({threads}); {lv['frames']} frames, {lv['speech']} of them speech, in {lv['seconds']:g} s")
