"""Barge-in never replays cut speech: after an interruption no sample of the interrupted utterance and
no speech image of it comes out, whatever was in flight (the TTS's late audio, chunks on the socket,
batches being inferred, frames on their way back), through the real Pipecat service, the LiveKit
generator and the bare protocol, against a real server.

Every utterance here has samples of its own (the same voice at a different gain), and every sample the
server sends back is a sample it was sent, unchanged: an output chunk is traced to its utterance by
looking its bytes up."""

from __future__ import annotations

import asyncio
import json
import random

import cv2
import numpy as np
import pytest
import zmq

from tests.voice import face_avatar, tts_speech, warm_server

pytestmark = pytest.mark.slow
N_FRAMES = 6
SEED = 2025
LOUD = 64          # a chunk quieter than this could be anyone's (pauses): not traced


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return face_avatar(tmp_path_factory, N_FRAMES)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with warm_server(models, tmp_path_factory, latency_budget_ms=280, start_delay_ms=200) as srv:
        yield srv


@pytest.fixture(scope="module")
def backgrounds(models):
    return [cv2.imread(str(models / "face" / "frames" / f"{k}.png")) for k in range(N_FRAMES)]


def utterances(rate: int, n: int, rng: random.Random) -> list[np.ndarray]:
    """n utterances of 0.5-1.6 s, each with samples of its own (its own gain on a slice of the voice)."""
    voice = tts_speech(rate).astype(np.float64)
    out = []
    for u in range(n):
        size = int(rng.uniform(0.5, 1.6) * rate)
        start = rng.randrange(0, len(voice) - size)
        out.append(np.round(voice[start:start + size] * (0.3 + 0.045 * u)).astype("<i2"))
    return out


def owner(chunk: bytes, pcms: list[np.ndarray]) -> list[int]:
    """The utterances whose samples this output chunk carries (its loud part looked up in each)."""
    samples = np.frombuffer(chunk, "<i2")
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > LOUD)
    if len(loud) < 8:
        return []
    piece = samples[loud[0]:loud[-1] + 1].tobytes()
    found = []
    for u, pcm in enumerate(pcms):
        at = pcm.tobytes().find(piece)
        while at >= 0 and at % 2:
            at = pcm.tobytes().find(piece, at + 1)
        if at >= 0:
            found.append(u)
    return found


# -- Pipecat ---------------------------------------------------------------------------------------

pipecat = pytest.importorskip("pipecat", reason="the pipecat extra: pip install -e .[pipecat]")


def pipecat_script(rate: int, pcms: list[np.ndarray], rng: random.Random) -> tuple[list, list[str]]:
    """What a TTS pushes at 4x real time, with an interruption in each utterance but the last: mid-way
    (chunks in flight), after its last chunk (speech still queued at the server), or after its stop
    (while it plays); then, as a TTS's socket may still deliver them, 0-3 of the cut chunks."""
    from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame
    from pipecat.tests.utils import SleepFrame
    chunk = rate // 50
    frames: list = [SleepFrame(0.3)]
    where = []
    for u, pcm in enumerate(pcms):
        context = f"tts-{u}"
        chunks = [pcm[i:i + chunk].tobytes() for i in range(0, len(pcm), chunk)]
        last = u == len(pcms) - 1
        kind = "whole" if last else rng.choice(["mid", "mid", "pushed", "playing"])
        cut_at = rng.randrange(1, len(chunks)) if kind == "mid" else len(chunks)
        frames.append(TTSStartedFrame(context_id=context))
        for i, c in enumerate(chunks[:cut_at]):
            frames.append(TTSAudioRawFrame(audio=c, sample_rate=rate, num_channels=1, context_id=context))
            if i % 4 == 3:
                frames.append(SleepFrame(0.02))          # 4 chunks of 20 ms each 20 ms: 4x real time
        if kind in ("whole", "playing"):
            frames.append(TTSStoppedFrame(context_id=context))
        if last:
            frames.append(SleepFrame(len(pcm) / rate + 2.0))
            break
        frames.append(SleepFrame(rng.uniform(0.0, 0.6)))
        frames.append(InterruptionFrame())
        where.append(kind)
        if kind != "playing":   # the TTS's late audio: with its context, or (some TTSs) none
            for c in chunks[cut_at:cut_at + rng.randint(0, 3)]:
                frames.append(TTSAudioRawFrame(audio=c, sample_rate=rate, num_channels=1,
                                               context_id=context if rng.random() < 0.5 else None))
        frames.append(SleepFrame(rng.uniform(0.05, 0.5)))
    return frames, where


@pytest.mark.parametrize("rate,cuts", [(16000, 13), (22050, 13), (24000, 12), (48000, 12)])
def test_pipecat_barge_in_never_replays_cut_speech(server, backgrounds, rate, cuts):
    from pipecat.frames.frames import (
        ErrorFrame,
        InterruptionFrame,
        OutputImageRawFrame,
        TTSAudioRawFrame,
    )
    from pipecat.pipeline.task import PipelineParams
    from pipecat.tests.utils import run_test

    from lipsync_client.pipecat import LipsyncVideoService
    rng = random.Random(SEED + rate)
    pcms = utterances(rate, cuts + 1, rng)
    script, where = pipecat_script(rate, pcms, rng)
    print(f"seed {SEED + rate}: {rate} Hz, interruptions {where}")
    service = LipsyncVideoService(model="face", endpoint=server.endpoint)
    down, up = asyncio.run(run_test(service, frames_to_send=script, start_timeout=30,
                                    pipeline_params=PipelineParams(audio_out_sample_rate=rate)))
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    own = {cv2.cvtColor(bg, cv2.COLOR_BGR2RGB).tobytes() for bg in backgrounds}
    cuts_at = [i for i, f in enumerate(down) if isinstance(f, InterruptionFrame)]
    assert len(cuts_at) == cuts
    replayed, cut_speech_images = [], 0
    for j, at in enumerate(cuts_at):
        cut = pcms[:j + 1]
        for i in range(at + 1, len(down)):
            f = down[i]
            if isinstance(f, TTSAudioRawFrame) and owner(f.audio, cut):
                replayed.append((j, i, owner(f.audio, cut)))
            if isinstance(f, OutputImageRawFrame) and f.image not in own:
                # a speech image after the interruption: the next utterance's, with its own audio after it
                audio = down[i + 1] if i + 1 < len(down) else None
                if not isinstance(audio, TTSAudioRawFrame) or owner(audio.audio, cut):
                    cut_speech_images += 1
    assert not replayed, f"samples of an interrupted utterance came out after its interruption: {replayed[:5]}"
    assert cut_speech_images == 0
    # the last utterance, never interrupted, plays whole: every one of its samples, in order
    out = np.frombuffer(b"".join(f.audio for f in down[cuts_at[-1]:] if isinstance(f, TTSAudioRawFrame)), "<i2")
    last = pcms[-1]
    start = out.tobytes().find(last[:rate // 10].tobytes())
    assert start >= 0 and start % 2 == 0, "the utterance after the last interruption did not play"
    np.testing.assert_array_equal(out[start // 2:start // 2 + len(last)], last)


# -- LiveKit ---------------------------------------------------------------------------------------

def test_livekit_clear_buffer_drops_what_the_runner_had_in_hand_and_reports_what_played(server):
    """The agent's audio output (start_in_process's) and the runner's two tasks as AvatarRunner runs
    them: a frame the runner had taken before clear_buffer and pushes after it is not said; the
    playback position reported at the clear is the audio the generator yielded, a prefix of the cut
    utterance; the next segment plays whole."""
    pytest.importorskip("livekit.agents", reason="the livekit extra: pip install -e .[livekit]")
    from livekit import rtc
    from livekit.agents.voice.avatar import AudioSegmentEnd

    from lipsync_client.livekit import ClearCountingAudioOutput, LipsyncVideoGenerator
    rate = 24000
    chunk = rate // 50
    rng = random.Random(SEED)
    first, second = utterances(rate, 2, rng)
    first = np.concatenate([first, first])   # long enough to be cut mid-way

    def frames_of(pcm):
        return [rtc.AudioFrame(pcm[i:i + chunk].tobytes(), rate, 1, len(pcm[i:i + chunk]))
                for i in range(0, len(pcm), chunk)]

    async def main():
        generator = LipsyncVideoGenerator(server.endpoint, "face", sample_rate=rate)
        await generator.start()
        agent = ClearCountingAudioOutput(sample_rate=rate)
        generator.follow(agent)
        reader = agent.__aiter__()               # the channel AvatarRunner._read_audio iterates
        yielded: list = []
        reports: list = []
        position = 0.0
        in_hand: asyncio.Queue = asyncio.Queue()

        async def forward():                     # AvatarRunner._forward_video's bookkeeping
            nonlocal position
            async for item in generator:
                yielded.append(item)
                if isinstance(item, rtc.AudioFrame):
                    position += item.duration
                elif isinstance(item, AudioSegmentEnd):
                    reports.append(("finished", position))
                    position = 0.0

        async def on_clear():                    # AvatarRunner._on_clear_buffer, in a task as it does
            nonlocal position
            await generator.clear_buffer()
            reports.append(("interrupted", position, len(yielded)))
            position = 0.0

        agent.on("clear_buffer", lambda: asyncio.ensure_future(on_clear()))
        forwarding = asyncio.create_task(forward())
        try:
            for frame in frames_of(first):
                await agent.capture_frame(frame)
                await generator.push_audio(await reader.__anext__())   # AvatarRunner._read_audio
            # let it play a while, then the runner takes one more frame of it ... and the agent clears
            while sum(isinstance(f, rtc.AudioFrame) for f in yielded) < 20:
                await asyncio.sleep(0.04)
            await agent.capture_frame(frames_of(first)[0])
            in_hand.put_nowait(await reader.__anext__())
            agent.clear_buffer()
            cleared_at = len(yielded)
            while not [r for r in reports if r[0] == "interrupted"]:   # the runner's clear task runs first
                await asyncio.sleep(0.01)
            await generator.push_audio(in_hand.get_nowait())    # ... then it pushes what it had in hand
            for _ in range(20):
                await asyncio.sleep(0.04)
            for frame in frames_of(second):
                await agent.capture_frame(frame)
                await generator.push_audio(await reader.__anext__())
            agent.flush()
            await generator.push_audio(await reader.__anext__())
            while not any(r[0] == "finished" for r in reports):
                await asyncio.sleep(0.04)
            return yielded, reports, cleared_at
        finally:
            forwarding.cancel()
            await generator.aclose()

    yielded, reports, cleared_at = asyncio.run(asyncio.wait_for(main(), 120))
    audio = [(i, np.frombuffer(bytes(f.data), "<i2")) for i, f in enumerate(yielded) if isinstance(f, rtc.AudioFrame)]
    before = np.concatenate([a for i, a in audio if i < cleared_at])
    np.testing.assert_array_equal(before, first[:len(before)])          # what played: the start of it
    after = [a.tobytes() for i, a in audio if i >= cleared_at]
    assert not [a for a in after if owner(a, [first])], "the cut utterance was heard after clear_buffer"
    interrupted = [r for r in reports if r[0] == "interrupted"]
    assert len(interrupted) == 1
    assert interrupted[0][1] == pytest.approx(len(before) / rate, abs=1e-6), (interrupted, len(before) / rate)
    heard = np.frombuffer(b"".join(after), "<i2")
    np.testing.assert_array_equal(heard[:len(second)], second)          # the next segment, whole
    assert [r for r in reports if r[0] == "finished"][0][1] == pytest.approx(len(heard) / rate, abs=1e-6)


# -- the protocol ----------------------------------------------------------------------------------

@pytest.mark.parametrize("audio", ["window", "pcm16"])
def test_chunks_sent_before_an_interrupt_and_arriving_after_it_are_never_rendered(server, audio):
    """Any ZeroMQ client, pipelining: utterance 1 is sent, interrupted, and more of it arrives after the
    interrupt (it was in the client's queue); then utterance 2. No frame of utterance 1 comes after
    the interrupt's reply but the one marking where it was cut; utterance 2 plays."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    ids = iter(range(1, 1000))

    def send(op, payload=(), **fields):
        rid = next(ids)
        sock.send_multipart([b"", json.dumps({"op": op, "id": rid, **fields}).encode(), *payload])
        return rid

    def chunk(u: int) -> bytes:
        if audio == "pcm16":
            return (tts_speech(16000, seconds=0.5) // (u + 1)).astype("<i2").tobytes()
        return np.full((10, 32, 16, 16), 0.1 * u, np.float32).tobytes()

    replies, frames = {}, []
    cut = None

    def cut_answered() -> bool:
        return cut is not None and cut in replies

    def pump(until, timeout_s=30.0):
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        import time
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            if poller.poll(100):
                msg = sock.recv_multipart()[1:]
                header = json.loads(msg[0])
                if header.get("event") == "frame":
                    frames.append((cut_answered(), header))
                else:
                    replies[header.get("id")] = header

    try:
        open_id = send("session_open", model="face", audio=audio, format="jpeg")
        pump(lambda: open_id in replies)
        token = replies[open_id]["session"]
        first = [send("session_audio", [chunk(1)], session=token, utterance=1) for _ in range(3)]
        cut = send("session_interrupt", session=token, utterance=1)
        late = [send("session_audio", [chunk(1)], session=token, utterance=1) for _ in range(2)]
        second = send("session_audio", [chunk(2)], session=token, utterance=2, last=True)
        pump(lambda: second in replies)
        assert all(replies[r]["ok"] for r in first + late + [cut, second]), replies
        assert all(replies[r]["retired"] and replies[r]["frames"] == 0 for r in late)
        assert replies[cut]["utterance"] == 1 and replies[second]["utterance"] == 2
        pump(lambda: any(h.get("utterance") == 2 and h.get("last") for _, h in frames))
        after = [h for answered, h in frames if answered]   # read after the interrupt's reply
        assert not [h for h in after if h.get("utterance") == 1 and h["kind"] == "speech"], after[:5]
        assert [h for h in after if h.get("utterance") == 2 and h["kind"] == "speech"]
        close = send("session_close", session=token)
        pump(lambda: close in replies)
    finally:
        sock.close(linger=0)
