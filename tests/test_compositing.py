"""cpu_actor: SyncTalk_2D-exact pixels, the audio-only visual recipe, frame order, refused assets,
encoders, and the background store shared by processes."""

from __future__ import annotations

import multiprocessing as mp
import os

import cv2
import numpy as np
import pytest
import simplejpeg

from config.assets import AssetError, ModelPaths, frame_index, load_assets
from cpu_actor.composite import encode_image, mouth_to_uint8, paste
from gpu_actor.visual import build_visual
from shm.store import BackgroundStore, store_spec
from tests.conftest import TEST_PREFIX
from tests.helpers import make_avatar, mirror_index, reference_composite, reference_visual

W, H = 320, 240
RECTS = {
    "inside": [60, 40, 200, 190],
    "on the edge": [0, 0, 150, 130],
    "across the left/top edge": [-30, -20, 120, 110],
    "across the right/bottom edge": [250, 150, 400, 300],
    "thin": [100, 100, 107, 220],
}


@pytest.fixture(scope="module")
def avatar(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_avatar(root, "a", n_frames=len(RECTS), size=(W, H), rects=list(RECTS.values()))
    return load_assets(ModelPaths("a", root / "a" / "model.onnx", root / "a" / "frames", root / "a" / "crop_rects.json"), (4096, 4096))


@pytest.mark.parametrize("index, where", list(enumerate(RECTS)))
def test_composite_matches_the_three_steps_exactly(avatar, index, where):
    rng = np.random.default_rng(index)
    mouth = rng.random((3, 320, 320), dtype=np.float32)
    mouth[0, :8, :8] = [0.0, 1.0, 0.999999, 0.5, -0.2, 1.3, 0.00392, 0.00393]  # edges of the truncation
    background, crop = avatar.decode(index)
    out = paste(background.copy(), crop.copy(), mouth_to_uint8(mouth), avatar.rects[index])
    expected = reference_composite(cv2.imread(str(avatar.frame_files[index])), RECTS[where], mouth)
    np.testing.assert_array_equal(out, expected)
    assert out.shape == (H, W, 3)


def test_audio_only_visual_input_matches_the_recipe(avatar):
    crops = [avatar.decode(i)[1] for i in range(len(RECTS))]
    out = np.full((len(crops), 6, 320, 320), np.nan, np.float32)   # (a buffer is reused: every value is written)
    build_visual(crops, out)
    for i, rect in enumerate(RECTS.values()):
        np.testing.assert_array_equal(out[i], reference_visual(cv2.imread(str(avatar.frame_files[i])), rect))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_frame_order_mirror_and_loop(n):
    for k in range(4 * n + 3):
        assert frame_index(k, n, "mirror") == mirror_index(k, n)
        assert frame_index(k, n, "loop") == k % n
    assert [frame_index(k, 3) for k in range(8)] == [0, 1, 2, 2, 1, 0, 0, 1]


def test_encoders(avatar):
    image, _ = avatar.decode(0)
    png = encode_image(image, "png", 75)
    np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR), image)
    raw = encode_image(image, "raw", 75)
    np.testing.assert_array_equal(np.frombuffer(raw, np.uint8).reshape(H, W, 3), image)
    jpeg = encode_image(image, "jpeg", 90)
    decoded = simplejpeg.decode_jpeg(jpeg, colorspace="BGR")
    assert decoded.shape == image.shape and np.abs(decoded.astype(int) - image).mean() < 8
    assert len(encode_image(image, "jpeg", 10)) < len(jpeg)


# -- refused assets ---------------------------------------------------------------------------------

def _paths(d):
    return ModelPaths("x", d / "model.onnx", d / "frames", d / "crop_rects.json")


@pytest.mark.parametrize("rects, message", [
    ([[10, 10, 50, 50]] * 2, r"crop_rects.json: 2 rects for 3 frames .* index 2"),
    ([[10, 10, 50, 50], [40, 40, 40, 80], [10, 10, 50, 50]], r"crop_rects.json: index 1: empty box"),
    ([[10, 10, 50, 50], [10, 10, 50, 50], [400, 10, 500, 50]], r"crop_rects.json: index 2: box .* wholly outside"),
    ([[10, 10, 50, 50], [10, 10, 50], [10, 10, 50, 50]], r"crop_rects.json: index 1: expected a rect"),
])
def test_bad_rects_are_refused_naming_file_and_index(tmp_path, rects, message):
    d = make_avatar(tmp_path, "x", n_frames=3, rects=rects, rect_form="list")
    with pytest.raises(AssetError, match=message):
        load_assets(_paths(d), (4096, 4096))


def test_missing_frames_and_bad_files_are_refused(tmp_path):
    d = make_avatar(tmp_path, "x", n_frames=2)
    (d / "crop_rects.json").write_text("{not json")
    with pytest.raises(AssetError, match="crop_rects.json: not readable JSON"):
        load_assets(_paths(d), (4096, 4096))
    (d / "crop_rects.json").unlink()
    with pytest.raises(AssetError, match="crop rects file is missing"):
        load_assets(_paths(d), (4096, 4096))
    for f in (d / "frames").iterdir():
        f.unlink()
    with pytest.raises(AssetError, match=r"frames: no \*.png or \*.jpg"):
        load_assets(_paths(d), (4096, 4096))
    (d / "frames").rmdir()
    with pytest.raises(AssetError, match="frames directory is missing"):
        load_assets(_paths(d), (4096, 4096))


def test_frames_over_the_size_limit_and_indices_outside_the_frames_are_refused(tmp_path):
    """A first frame larger than compositing.max_frame_width x max_frame_height is refused naming the
    settings; a background index outside the avatar's frames (negative too) is refused naming the count."""
    d = make_avatar(tmp_path, "x", n_frames=3)   # 320x240 frames
    with pytest.raises(AssetError, match=r"frame is 320x240, more than .*max_frame_width.* \(300x240\)"):
        load_assets(_paths(d), (300, 240))
    assets = load_assets(_paths(d), (320, 240))
    assets.check_frames([0, 2])
    for bad in (3, -1):
        with pytest.raises(AssetError, match=rf"background frame {bad} does not exist: .* has 3 frames"):
            assets.check_frames([0, bad])


def test_replacing_a_frame_or_the_crop_boxes_in_place_makes_the_assets_a_new_version(tmp_path):
    """The shared store keys decoded frames by the files' version (AvatarAssets.store_id): a frame file
    rewritten in place (same name, inode and size) or new crop boxes give a new version, so no request
    meets the old decoded frames; the files as they were keep theirs."""
    import os
    d = make_avatar(tmp_path, "x", n_frames=3, rect_form="list")
    before = load_assets(_paths(d), (640, 480))
    assert load_assets(_paths(d), (640, 480)).store_id == before.store_id
    frame = before.frame_files[1]
    data = bytearray(frame.read_bytes())
    with open(frame, "r+b") as f:   # the same inode and size, other bytes, a later mtime
        f.write(bytes(data))
    st = frame.stat()
    os.utime(frame, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    after_frame = load_assets(_paths(d), (640, 480))
    assert after_frame.store_id != before.store_id
    rects = d / "crop_rects.json"
    st = rects.stat()
    rects.write_text(rects.read_text())   # (rewritten: its mtime moves)
    os.utime(rects, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    assert load_assets(_paths(d), (640, 480)).store_id not in (before.store_id, after_frame.store_id)


def test_frames_in_natural_name_order(tmp_path):
    d = make_avatar(tmp_path, "x", n_frames=12, rect_form="list")
    names = [p.name for p in load_assets(_paths(d), (4096, 4096)).frame_files]
    assert names == [f"{k}.png" for k in range(12)]


# -- the shared store -------------------------------------------------------------------------------

def _store(tmp_path, cache_bytes=16 * 1024 * 1024, eviction="lru"):
    spec = store_spec(f"{TEST_PREFIX}-{os.getpid()}-0-{os.urandom(3).hex()}", str(tmp_path), cache_bytes,
                      W, H, eviction)
    return BackgroundStore.create(spec)


def _fetch_in_process(spec, assets, frame, barrier, out_q):
    store = BackgroundStore.attach(spec)
    barrier.wait()
    background, crop, hit = store.fetch("a", frame, lambda: (__import__("time").sleep(0.3), assets.decode(frame))[1])
    out_q.put((background.tobytes(), crop.tobytes(), hit, os.getpid()))
    store.close()


def test_two_processes_share_one_decode(tmp_path, avatar):
    store = _store(tmp_path)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_process, args=(store.spec, avatar, 1, barrier, results)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert store.decodes == 1, "two concurrent misses on one frame must decode it once"
        assert sorted(g[2] for g in got) == [False, True]  # one decoded, the other read it from the store
        assert got[0][:2] == got[1][:2]
        background, crop = avatar.decode(1)
        assert got[0][0] == background.tobytes() and got[0][1] == crop.tobytes()
        # And this process reads the same bytes without decoding.
        _, crop3, hit = store.fetch("a", 1, lambda: pytest.fail("decoded again"))
        assert hit and crop3.tobytes() == crop.tobytes()
    finally:
        store.close(unlink=True)


def test_store_stays_under_cache_bytes_with_many_models(tmp_path, avatar):
    store = _store(tmp_path, cache_bytes=16 * 1024 * 1024)
    try:
        frame = avatar.decode(0)
        for m in range(25):
            for k in range(5):
                store.fetch(f"model{m}", k, lambda: frame)
                assert store.entries_used() <= store.spec.n_entries
                assert store.bytes_used() <= 16 * 1024 * 1024
        assert store.decodes == 125
        assert store.spec.n_entries * store.spec.entry_bytes <= 16 * 1024 * 1024
        assert len(store._hints) <= store.spec.n_entries   # where this process saw each frame: bounded too
        _, _, hit = store.fetch("model24", 4, lambda: frame)
        assert hit  # the most recent entry survived
        _, _, hit = store.fetch("model0", 0, lambda: frame)
        assert not hit  # the oldest was evicted
    finally:
        store.close(unlink=True)


def test_store_reads_what_another_process_put_where_a_frame_was(tmp_path, avatar):
    # Each process remembers where it found a frame; another may have evicted it since and put its
    # own frame there: that entry must be read as the other frame's, never as the one looked for.
    frame = avatar.decode(0)
    entry = store_spec("sizing", str(tmp_path), 1 << 30, W, H, "lru").entry_bytes
    store = _store(tmp_path, cache_bytes=2 * entry)
    other = BackgroundStore.attach(store.spec)
    marked = [(np.full_like(frame[0], v), np.full_like(frame[1], v)) for v in (1, 2, 3, 4)]
    try:
        assert store.spec.n_entries == 2
        for k in (0, 1):
            store.fetch("a", k, lambda: marked[k])
        for k in (0, 1):   # both entries evicted, and refilled with model b's frames
            other.fetch("b", k, lambda: marked[2 + k])
        background, crop, hit = store.fetch("a", 0, lambda: marked[0])
        assert not hit and background[0, 0, 0] == 1 and crop[0, 0, 0] == 1
        background, crop, hit = store.fetch("b", 1, lambda: pytest.fail("b's frame 1 is in the store"))
        assert hit and background[0, 0, 0] == 4 and crop[0, 0, 0] == 4
        assert store.entries_used() == 2
    finally:
        other.close()
        store.close(unlink=True)


def test_store_evicts_the_least_recently_used_or_the_least_used_as_compositing_eviction_says(tmp_path, avatar):
    """Two entries: a hit makes a frame the most recently used (lru) and counts a use (lfu); the third
    frame evicts the other one."""
    frame = avatar.decode(0)
    entry = store_spec("sizing", str(tmp_path), 1 << 30, W, H, "lru").entry_bytes
    for eviction, uses_of_0, kept in (("lru", 1, 0), ("lfu", 4, 0)):
        store = _store(tmp_path, cache_bytes=2 * entry, eviction=eviction)
        try:
            store.fetch("a", 0, lambda: frame)
            for _ in range(uses_of_0 - 1):
                store.fetch("a", 0, lambda: pytest.fail("frame 0 is in the store"))
            store.fetch("a", 1, lambda: frame)
            store.fetch("a", 1, lambda: pytest.fail("frame 1 is in the store"))
            if eviction == "lru":   # frame 0 read again: the most recent now
                store.fetch("a", 0, lambda: pytest.fail("frame 0 is in the store"))
            store.fetch("a", 2, lambda: frame)
            assert store.has("a", kept) and not store.has("a", 1 - kept), eviction
        finally:
            store.close(unlink=True)


def test_a_read_whose_entry_is_evicted_meanwhile_looks_again_and_never_returns_the_other_frame(tmp_path, avatar):
    """A process copies a frame out of its entry while another process evicts it and loads its own frame
    there: the copy is of the other frame, and the reader, seeing the entry's generation move, looks again
    and decodes its own."""
    frame = avatar.decode(0)
    entry = store_spec("sizing", str(tmp_path), 1 << 30, W, H, "lru").entry_bytes
    marked = [(np.full_like(frame[0], v), np.full_like(frame[1], v)) for v in (1, 2)]
    store = _store(tmp_path, cache_bytes=entry)
    other = BackgroundStore.attach(store.spec)
    copy = store._copy

    def copy_while_evicted(slot, want_background, out=None):
        store._copy = copy   # once
        other.fetch("b", 0, lambda: marked[1])   # the one entry goes to b's frame
        return copy(slot, want_background, out)
    try:
        store.fetch("a", 0, lambda: marked[0])
        store._copy = copy_while_evicted
        background, crop, hit = store.fetch("a", 0, lambda: marked[0])
        assert background[0, 0, 0] == 1 and crop[0, 0, 0] == 1 and not hit
    finally:
        other.close()
        store.close(unlink=True)


def _claim_and_die(spec, frame) -> None:
    store = BackgroundStore.attach(spec)
    store.fetch("a", frame, lambda: os._exit(0))   # dies holding the frame LOADING


def _claim_and_hang(spec, frame, claimed) -> None:
    import time
    store = BackgroundStore.attach(spec)
    store.fetch("a", frame, lambda: (claimed.set(), time.sleep(600)))


def test_a_frame_left_loading_by_a_dead_process_is_taken_over_and_a_live_ones_is_waited_for_until_the_timeout(
        tmp_path, avatar):
    store = _store(tmp_path)
    ctx = mp.get_context("spawn")
    try:
        dead = ctx.Process(target=_claim_and_die, args=(store.spec, 0))
        dead.start()
        dead.join(60)
        assert dead.exitcode == 0 and not store.has("a", 0)
        background, crop, hit = store.fetch("a", 0, lambda: avatar.decode(0), timeout_s=10)
        assert not hit and crop.tobytes() == avatar.decode(0)[1].tobytes()   # taken over, decoded here
        claimed = ctx.Event()
        hung = ctx.Process(target=_claim_and_hang, args=(store.spec, 1, claimed))
        hung.start()
        try:
            assert claimed.wait(60)
            with pytest.raises(Exception, match="frame 1 of model a stayed LOADING for 1s in another process"):
                store.fetch("a", 1, lambda: pytest.fail("a live process is decoding it"), timeout_s=1.0)
        finally:
            hung.kill()
            hung.join(30)
    finally:
        store.close(unlink=True)


def test_store_refuses_frames_larger_than_its_entries(tmp_path):
    store = _store(tmp_path)
    try:
        big = np.zeros((H + 1, W, 3), np.uint8)
        with pytest.raises(Exception, match="max_frame_width"):
            store.fetch("a", 0, lambda: (big, np.zeros((328, 328, 3), np.uint8)))
        # The failed claim does not poison the entry.
        _, _, hit = store.fetch("a", 0, lambda: (np.zeros((H, W, 3), np.uint8), np.zeros((328, 328, 3), np.uint8)))
        assert not hit
    finally:
        store.close(unlink=True)


@pytest.mark.parametrize("size, rows", [((1280, 720), (200, 470)), ((330, 250), (0, 37)), ((330, 250), (233, 250)),
                                        ((64, 64), (0, 64))])
def test_a_spliced_jpeg_is_the_whole_frame_encoded(size, rows):
    """Re-encoding only the MCU rows under the face box gives the very bytes of encoding the frame."""
    from cpu_actor.jpeg import RowSplicer, encode_jpeg
    rng = np.random.default_rng(sum(size) + rows[0])
    w, h = size
    background = cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (7, 7), 2)
    splicer = RowSplicer(1 << 20)
    for quality in (75, 90):
        splicer.remember(("bg", quality), background, quality)
        frame = background.copy()
        y1, y2 = rows
        frame[y1:y2, w // 4: w // 2] = rng.integers(0, 256, (y2 - y1, w // 2 - w // 4, 3), dtype=np.uint8)
        spliced = splicer.encode(("bg", quality), frame, y1, y2, quality)
        assert spliced == encode_jpeg(frame, quality)
        decoded = simplejpeg.decode_jpeg(spliced, colorspace="BGR")
        assert decoded.shape == (h, w, 3) and np.abs(decoded.astype(int) - frame).mean() < 20


def test_a_compositing_process_takes_a_live_frame_before_batch_work_queued_ahead_of_it():
    """A compositing process's queue: the task due soonest first (a live frame's due time, else the
    deadline), so a session's frame waits only for the task being run, not for a client's batch work
    that came first; among equal times in arrival order (a session's encodes stay in order); a restarted
    frontend's predecessor's tasks leave it, and no other's."""
    from cpu_actor.worker import DueQueue
    from shm.messages import CompositeTask, RenderIdle
    from shm.requests import first_id
    from shm.ring import TensorRef

    mouths = TensorRef("r", 0, 0, 0, "float32", (1, 3, 320, 320))

    def composite(req: int, deadline: float, due: float = 0.0) -> CompositeTask:
        return CompositeTask(req=req, model="m", worker=0, mouths=mouths, start=0, end=1, frames=[0], format="jpeg",
                             quality=80, deadline=deadline, due=due)

    old, new = first_id(1, 0), first_id(0, 0)
    batch = [composite(new + k, deadline=20.0 + k) for k in range(3)]   # (a client's: due in seconds)
    speech = [composite(new + 10, deadline=30.0, due=7.0), composite(new + 11, deadline=30.0, due=6.5)]
    idle = RenderIdle(req=new + 12, model="m", frames=[0], format="jpeg", quality=80, deadline=30.0, due=6.5)
    gone = composite(old + 1, deadline=1.0)
    queue = DueQueue()
    for task in [*batch, gone, *speech, idle]:
        queue.push(task)
    queue.drop_below(first_id(1, 5))   # frontend 1 restarted
    assert len(queue) == 6
    assert [queue.pop() for _ in range(6)] == [speech[1], idle, speech[0], *batch]
    late = [composite(new + 20, deadline=9.0), composite(new + 21, deadline=30.0, due=3.0)]
    for task in late:
        queue.push(task)
    assert [queue.pop() for _ in range(2)] == [late[1], late[0]]
