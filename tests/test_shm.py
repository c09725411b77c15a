"""Slot rings: unit tests, a multi-process stress test with a printed seed, and the sweep."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import numpy as np
import pytest
import zmq

from shm import RingError, RingFull, RingSpec, SlotRing, SlotState, StaleHandle, TensorRef, list_segments, sweep_dead_runs
from shm.segment import Segment
from tests.conftest import TEST_PREFIX


@pytest.fixture
def ring(shm_name):
    ring = SlotRing.create(RingSpec.for_bytes(shm_name, 3, 4 * 3 * 8 * 8))
    ring.become_writer()
    yield ring
    ring.close(unlink=True)


def test_round_trip_between_writer_and_attached_reader(ring):
    slot = ring.try_acquire(request_id=7)
    data = np.arange(3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)
    ring.writable(slot, 0, "float32", data.shape)[...] = data
    ref = ring.ref(slot, 0, "float32", data.shape)
    assert ring.state(slot) is SlotState.PUBLISHED

    reader = SlotRing.attach(ring.spec)
    try:
        out = reader.read(ref)
        np.testing.assert_array_equal(out, data)
        assert not out.flags.writeable
        reader.verify(ref)
        # Handles cross processes as msgpack: the round trip keeps every field.
        import msgspec
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=TensorRef) == ref
        del out
    finally:
        reader.close()


def test_wrap_around_reuses_slots_with_new_generations(ring):
    seen = {}
    for i in range(10):
        slot = ring.try_acquire(request_id=i + 1)
        assert slot is not None
        ring.writable(slot, 0, "int64", (1,))[0] = i
        ref = ring.ref(slot, 0, "int64", (1,))
        assert ring.read(ref)[0] == i
        assert ref.generation not in seen.get(slot, set())
        seen.setdefault(slot, set()).add(ref.generation)
        ring.release(slot)
    assert set(seen) == {0, 1, 2}
    assert ring.slots_in_use() == 0


def test_full_ring_times_out_with_error_naming_the_setting(ring):
    for i in range(3):
        assert ring.try_acquire(request_id=i + 1) is not None
    assert ring.try_acquire(request_id=99) is None
    waits = []
    t0 = time.monotonic()
    with pytest.raises(RingFull, match=r"shm\.slots"):
        ring.acquire(99, timeout_s=0.2, wait=lambda remaining: (waits.append(remaining), time.sleep(0.05)))
    assert waits and time.monotonic() - t0 >= 0.2


def test_acquire_succeeds_once_wait_releases_a_slot(ring):
    for i in range(3):
        ring.try_acquire(request_id=i + 1)
    slot = ring.acquire(42, timeout_s=5, wait=lambda _: ring.release_request(2))
    assert slot == 1 and ring.state(1) is SlotState.WRITING


def test_stale_generation_raises_and_never_returns_other_bytes(ring):
    slot = ring.try_acquire(request_id=1)
    ring.writable(slot, 0, "uint8", (4,))[...] = 1
    old = ring.ref(slot, 0, "uint8", (4,))
    ring.release_request(1)
    with pytest.raises(StaleHandle, match="released or reused"):
        ring.read(old)
    # The slot is reused by another request (after the ring wraps): the old handle still refuses.
    while (reused := ring.try_acquire(request_id=2)) != slot:
        ring.release(reused)
    ring.writable(slot, 0, "uint8", (4,))[...] = 2
    with pytest.raises(StaleHandle):
        ring.read(old)
    new = ring.ref(slot, 0, "uint8", (4,))
    assert list(ring.read(new)) == [2, 2, 2, 2]


def test_a_handle_of_another_ring_is_refused_naming_both(ring, shm_name):
    other = SlotRing.create(RingSpec.for_bytes(shm_name + "-other", 3, 64))
    try:
        other.become_writer()
        foreign = other.ref(other.try_acquire(request_id=1), 0, "uint8", (4,))
        ring.try_acquire(request_id=1)   # (the same slot and generation here)
        with pytest.raises(RingError, match=f"handle for ring {other.spec.name} used on ring {ring.spec.name}"):
            ring.read(foreign)
    finally:
        other.close(unlink=True)


def test_requests_that_came_and_went_leave_nothing_behind(ring):
    """A long-running writer serves millions of requests: each one's record goes with its last extent."""
    for req in range(1, 1000):
        slots = [ring.try_acquire(req) for _ in range(2)]
        ring.release(slots[0])
        if req % 2:
            ring.release(slots[1])
        else:
            ring.release_request(req)
    assert ring.slots_in_use() == 0 and not ring._by_request


def test_view_outside_slot_names_the_limit(ring):
    slot = ring.try_acquire(request_id=1)
    with pytest.raises(Exception, match="max_batch"):
        ring.writable(slot, 0, "float32", (ring.spec.slot_bytes // 4 + 1,))


def test_a_request_takes_adjacent_slots_as_one_extent_freed_together(shm_name):
    ring = SlotRing.create(RingSpec.in_pages(shm_name, 2, 3 * 4096, 4096))   # room for 2 requests of 3 slots
    ring.become_writer()
    reader = SlotRing.attach(ring.spec)
    try:
        assert ring.spec.n_slots == 6 and ring.slots_for(2 * 4096 + 1) == 3 and ring.slots_for(0) == 1
        small = [ring.try_acquire(request_id=i, count=1) for i in (1, 2)]
        big = ring.try_acquire(request_id=3, count=3)
        assert small == [0, 1] and big == 2
        data = np.arange(3 * 1024, dtype=np.float32)   # 12 KiB: past the first slot into the next two
        ring.writable(big, 0, "float32", data.shape)[...] = data
        ref = ring.ref(big, 0, "float32", data.shape)
        np.testing.assert_array_equal(reader.read(ref), data)
        assert [ring.state(s) for s in (2, 3, 4)] == [SlotState.PUBLISHED] * 3
        with pytest.raises(Exception, match="do not fit"):   # a writer stays inside its extent
            ring.writable(big, 0, "float32", (3 * 1024 + 1,))
        assert ring.try_acquire(request_id=4, count=2) is None   # slot 5 alone: an extent does not wrap
        assert ring.release_request(3) == 1 and ring.slots_in_use() == 2
        with pytest.raises(StaleHandle):
            reader.read(ref)
        assert (ring.try_acquire(request_id=8), ring.try_acquire(request_id=9)) == (5, 2)   # round-robin
        assert ring.try_acquire(request_id=5, count=2) == 3   # reuses slots 3-4, not the extent's first
        with pytest.raises(StaleHandle):
            reader.read(ref)
        for request in (1, 8, 9):
            ring.release_request(request)
        assert ring.try_acquire(request_id=6, count=2) is None   # free: 0, 2, 5, none adjacent
        ring.release_request(2)
        assert ring.try_acquire(request_id=6, count=3) == 0
        with pytest.raises(RingFull, match=r"7 slots asked for, the ring has 6"):
            ring.acquire(7, timeout_s=0, wait=lambda _: None, count=7)
    finally:
        reader.close()
        ring.close(unlink=True)


def test_restarted_writer_frees_slots_and_invalidates_handles(ring):
    slot = ring.try_acquire(request_id=5)
    ref = ring.ref(slot, 0, "uint8", (1,))
    successor = SlotRing.attach(ring.spec)
    try:
        successor.become_writer()
        with pytest.raises(StaleHandle):
            successor.read(ref)
        assert successor.slots_in_use() == 0
    finally:
        successor.close()


def test_a_restarted_peers_requests_are_freed_by_their_ids_and_no_others(ring):
    """ResetRequests: the slots of the requests below the new peer's first id go (but those a step still
    writes, `keep`); a slot the new peer's request holds stays held, and its handle stays good."""
    old, running, new = (ring.try_acquire(request_id=req) for req in (5, 6, 900))
    ref = ring.ref(new, 0, "uint8", (1,))
    assert ring.release_below(900, keep={6}) == 1
    assert [ring.state(s) for s in (old, running, new)] == [SlotState.FREE, SlotState.WRITING, SlotState.PUBLISHED]
    ring.verify(ref)
    assert ring.held(900) == new and ring.held(5) is None
    assert ring.release_below(900) == 1 and ring.slots_in_use() == 1


def test_a_restarted_owners_reset_reaches_its_predecessors_requests_and_no_other_owners(ring):
    """Request ids of two client-facing processes (owners 0 and 1, shm/requests.py): owner 1 restarts
    later than owner 0 started, so every id of owner 0 is below the new owner 1's first id; its reset
    frees its predecessor's slots and pins only, and the new process's first request is not taken
    for a dead one's."""
    from shm.requests import Floors, drop_owned_below, first_id, release_owned, same_owner_below
    zero, one = first_id(0, 1_000), first_id(1, 2_000)
    floor = first_id(1, 3_000)   # owner 1's successor
    zeros, ones = [ring.try_acquire(request_id=zero + k) for k in range(2)], [ring.try_acquire(request_id=one)]
    assert not same_owner_below(zero, floor) and same_owner_below(one, floor) and not same_owner_below(floor, floor)
    assert ring.release_below(floor) == 1
    assert [ring.state(s) for s in zeros + ones] == [SlotState.WRITING, SlotState.WRITING, SlotState.FREE]
    pins = {"a": [zero, one, zero + 1], "b": [one]}
    assert drop_owned_below(pins, floor) == 2 and pins == {"a": [zero, zero + 1]}
    release_owned(pins, "a", floor)   # (the new owner holds no pin of a: owner 0's stay)
    assert pins == {"a": [zero, zero + 1]}
    floors = Floors()
    floors.raise_to(floor)
    assert floors.gone(one) and not floors.gone(floor) and not floors.gone(zero) and not floors.gone(floor + 1)


def test_attacher_exit_does_not_unlink(shm_name):
    ring = SlotRing.create(RingSpec.for_bytes(shm_name, 1, 64))
    try:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_attach_and_exit, args=(ring.spec,))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert list_segments(shm_name) == [shm_name]
    finally:
        ring.close(unlink=True)
    assert list_segments(shm_name) == []


def _attach_and_exit(spec):
    SlotRing.attach(spec).close()


def test_sweep_unlinks_segments_of_dead_runs_only(shm_name):
    prefix = TEST_PREFIX
    dead = Segment(f"{prefix}-999999999-1-dead", 64, create=True)
    me = __import__("psutil").Process()
    alive = Segment(f"{prefix}-{me.pid}-{int(me.create_time()):x}-alive", 64, create=True)
    try:
        swept = sweep_dead_runs(prefix)
        assert swept == [dead.name]
        assert list_segments(alive.name) == [alive.name]
    finally:
        for seg in (dead, alive):
            seg.close()
            seg.unlink()


def _sweep_as(uid: int, prefix: str):
    os.setgid(uid)
    os.setuid(uid)
    return sweep_dead_runs(prefix)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as two users (another user's segment)")
def test_sweep_skips_segments_it_cannot_own():
    """Any local user can create a segment under our prefix; the sweep must not remove another user's
    segment, and must not fail when it may not remove one (it used to refuse start-up)."""
    nobody = 65534
    foreign = Segment(f"{TEST_PREFIX}-1-0-foreign", 64, create=True)   # pid 1 lives, with another start time
    try:
        os.chown(f"/dev/shm/{foreign.name}", nobody, nobody)
        assert foreign.name not in sweep_dead_runs(TEST_PREFIX)   # root could, but it is not ours
        os.chown(f"/dev/shm/{foreign.name}", 0, 0)
        with mp.get_context("fork").Pool(1) as pool:               # nobody may not remove root's segment
            assert pool.apply(_sweep_as, (nobody, TEST_PREFIX)) == []
        assert list_segments(foreign.name) == [foreign.name]
    finally:
        foreign.close()
        foreign.unlink()


# -- multi-process stress ---------------------------------------------------------------------

N_MESSAGES = 400


def _pattern(seed: int, i: int, shape) -> np.ndarray:
    return np.random.default_rng([seed, i]).integers(0, 2**31, size=shape, dtype=np.int64)


def _stress_writer(spec, seed, push_addrs, release_addr, result_q):
    """Writes N_MESSAGES tensors, drops some early (as a timeout would), counts releases."""
    rnd = random.Random(seed)
    ring = SlotRing.attach(spec)
    ring.become_writer()
    ctx = zmq.Context()
    pushes = []
    for addr in push_addrs:
        s = ctx.socket(zmq.PUSH)
        s.connect(addr)
        pushes.append(s)
    releases = ctx.socket(zmq.PULL)
    releases.bind(release_addr)

    def wait(remaining):
        if releases.poll(int(remaining * 1000) + 1):
            ring.release_request(int(releases.recv()))

    early = 0
    for i in range(1, N_MESSAGES + 1):
        shape = (rnd.randint(1, 64),)
        slot = ring.acquire(i, timeout_s=20, wait=wait)
        ring.writable(slot, 0, "int64", shape)[...] = _pattern(seed, i, shape)
        ref = ring.ref(slot, 0, "int64", shape)
        rnd.choice(pushes).send(__import__("msgspec").msgpack.encode([i, ref]))
        if rnd.random() < 0.1:  # the request "times out": its slot is freed under the reader
            ring.release_request(i)
            early += 1
    for s in pushes:
        s.send(b"stop")
    deadline = time.monotonic() + 20
    while ring.slots_in_use() and time.monotonic() < deadline:
        wait(0.1)
    result_q.put(("writer", early, ring.slots_in_use()))
    ring.close()
    ctx.destroy(linger=0)


def _stress_reader(spec, seed, pull_addr, release_addr, result_q):
    import msgspec
    rnd = random.Random(seed + 1)
    ring = SlotRing.attach(spec)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_addr)
    release = ctx.socket(zmq.PUSH)
    release.connect(release_addr)
    ok = stale = wrong = 0
    while (msg := pull.recv()) != b"stop":
        i, ref = msgspec.msgpack.decode(msg, type=tuple[int, TensorRef])
        try:
            got = ring.read(ref).copy()
            if rnd.random() < 0.2:
                time.sleep(0.001)
            ring.verify(ref)
        except StaleHandle:
            stale += 1
        else:
            if np.array_equal(got, _pattern(seed, i, ref.shape)):
                ok += 1
            else:
                wrong += 1
        release.send(str(i).encode())
    result_q.put(("reader", ok, stale, wrong))
    ring.close()
    ctx.destroy(linger=0)


def test_multiprocess_stress_never_returns_wrong_bytes(shm_name, tmp_path):
    seed = int(os.environ.get("STRESS_SEED", random.randrange(2**31)))
    print(f"stress seed: {seed} (rerun with STRESS_SEED={seed})")
    spec = RingSpec.for_bytes(shm_name, 4, 64 * 8)
    ring = SlotRing.create(spec)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    release_addr = f"ipc://{tmp_path}/release"
    reader_addrs = [f"ipc://{tmp_path}/reader{k}" for k in range(2)]
    procs = [ctx.Process(target=_stress_reader, args=(spec, seed, a, release_addr, results)) for a in reader_addrs]
    procs.append(ctx.Process(target=_stress_writer, args=(spec, seed, reader_addrs, release_addr, results)))
    try:
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        ring.close(unlink=True)
    writer = next(o for o in outcomes if o[0] == "writer")
    readers = [o for o in outcomes if o[0] == "reader"]
    assert writer[2] == 0, "slots left in use after every release came back"
    assert sum(r[3] for r in readers) == 0, f"a reader got another request's bytes (seed {seed})"
    assert sum(r[1] + r[2] for r in readers) == N_MESSAGES
    assert sum(r[1] for r in readers) >= N_MESSAGES - writer[1]


def test_the_host_board_forgets_a_dead_or_restarted_process_sessions_and_keeps_its_counts(shm_name):
    """Each client-facing process writes its row of the host's board (sessions, speaking, each limited
    tenant's sessions; speech frames and opens, cumulative); the others read their sum. A process that
    died (`vacate`) or restarted (attach to its row again) holds no sessions, speakers or tenants' sessions
    any more; what it counted stays counted."""
    from shm.board import OPENS, SESSIONS, SPEAKING, SPEECH_FRAMES, Board, HostCounts
    board = Board.create(shm_name, 2, tenants=1)
    rows = [Board.attach(shm_name, i, 2) for i in range(2)]
    try:
        for column, value in ((SESSIONS, 3), (SPEAKING, 2), (SPEECH_FRAMES, 50), (OPENS, 4)):
            rows[0].set(column, value)
        rows[0].set_tenants([3])
        rows[1].set(SESSIONS, 5)   # (its own: not among the others')
        assert rows[1].others() == HostCounts(3, 2, 50, 4, (3,)) and rows[0].others().sessions == 5
        board.vacate(0)
        assert rows[1].others() == HostCounts(0, 0, 50, 4, (0,))
        rows[0].set(SESSIONS, 1)
        rows[0].set(SPEAKING, 1)
        rows[0].set_tenants([1])
        rows[0].close()
        rows[0] = Board.attach(shm_name, 0, 2)   # its successor
        assert rows[1].others() == HostCounts(0, 0, 50, 4, (0,))
        for row, processes in ((2, 2), (0, 3)):
            with pytest.raises(ValueError, match=f"has no row {row} of {processes}"):
                Board.attach(shm_name, row, processes)
    finally:
        for row in rows:
            row.close()
        board.close(unlink=True)
