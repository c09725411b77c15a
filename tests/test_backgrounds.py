"""A new avatar's backgrounds are decoded off the inference worker's main thread (gpu_actor/backgrounds.py):
while a frame of one avatar cannot be read yet, the requests of other avatars are served, and the one
waiting for it is served once it is in."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np

from config.assets import ModelPaths, load_assets
from gpu_actor.backgrounds import Backgrounds
from lipsync_client import AsyncClient
from shm.store import BackgroundStore, store_spec
from tests.conftest import TEST_PREFIX
from tests.helpers import base_config, make_avatar, run_server

AUDIO = np.zeros((1, 32, 16, 16), np.float32)


def test_a_frame_still_being_read_holds_up_no_other_avatars_requests(tmp_path):
    root = tmp_path / "models"
    make_avatar(root, "warm", seed=1)
    cold = make_avatar(root, "cold", seed=2)
    frame = cold / "frames" / "3.png"
    png = frame.read_bytes()
    frame.unlink()
    os.mkfifo(frame)   # whoever reads it waits until the test writes it: a slow disk, at its slowest
    made = os.stat(frame)
    opened = threading.Event()
    fifo = []

    def writer() -> None:   # open() returns once the server has opened the frame for reading
        fifo.append(open(frame, "wb"))
        opened.set()

    with run_server(tmp_path, base_config(root)) as srv:
        with srv.client(timeout_s=60) as c:
            for model in ("warm", "cold"):
                c.load(model)

        async def main():
            async with AsyncClient(srv.endpoint, timeout_s=120) as client:
                waiting = asyncio.create_task(client.composite("cold", AUDIO, start_frame=3))
                threading.Thread(target=writer, daemon=True).start()
                assert await asyncio.to_thread(opened.wait, 60), "the server never read the frame"
                # the frame is being read, and nothing comes: another avatar's requests are served meanwhile
                # (where the reading held the worker up, they would answer `timeout` after 20 s)
                served = [await client.composite("warm", AUDIO, start_frame=k, timeout_ms=20_000) for k in range(4)]
                assert not waiting.done()
                fifo[0].write(png)
                fifo[0].flush()
                # (writing stamps the file anew, and a frame file replaced under a server is another
                # version of the avatar: the time it was made is put back before the reader has it all)
                os.utime(frame, ns=(made.st_atime_ns, made.st_mtime_ns))
                fifo[0].close()
                return served, await waiting

        served, (header, frames) = asyncio.run(main())
        assert [len(f) for _, f in served] == [1] * 4
        assert len(frames) == 1 and frames[0][:2] == b"\xff\xd8", header   # a JPEG of the cold avatar's frame
        with srv.client() as c:
            # its crop came from the frame once written: the same request now gives the same image
            again, frames_again = c.composite("cold", AUDIO, start_frame=3)
        assert frames_again[0] == frames[0]


def test_a_frame_that_fails_to_decode_counts_as_ready_from_then_on_and_is_not_decoded_again(tmp_path):
    """The worker asks `ready` several times a loop (is anything runnable; which tasks make the step):
    once a frame's decode has failed, every ask says ready, so the task runs and its own read answers
    with the error; an ask never starts that decode again. A good frame is decoded once, then ready."""
    d = make_avatar(tmp_path, "x", n_frames=3)
    (d / "frames" / "1.png").write_bytes(b"\x89PNG but not really")
    assets = load_assets(ModelPaths("x", d / "model.onnx", d / "frames", d / "crop_rects.json"), (640, 480))
    store = BackgroundStore.create(store_spec(f"{TEST_PREFIX}-{os.getpid()}-0-{os.urandom(3).hex()}", str(tmp_path),
                                              8 << 20, 640, 480, "lru"))
    woken = threading.Semaphore(0)
    backgrounds = Backgrounds(store.spec, store, woken.release)
    try:
        for frame in (0, 1):
            assert not backgrounds.ready(assets, [frame])   # its decode starts
            assert woken.acquire(timeout=60), "the decode never ended"
            assert all(backgrounds.ready(assets, [frame]) for _ in range(5)), frame
        assert not woken.acquire(timeout=0.5), "an ask started a decode again"
        assert backgrounds.decoded == 1   # frame 0; frame 1 failed, once
    finally:
        backgrounds.close()
        store.close(unlink=True)
