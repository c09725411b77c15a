"""When a host is full (frontend/live/capacity.py), on made-up loads and the test's own clock: a session is
refused `busy` before one more would push the processes past their share of the cores, or one
single-threaded process past its core; a burst on an idle host is let in a few at a time until measured."""

from __future__ import annotations

import pytest

from frontend.live.capacity import RAMP, SAMPLE_S, Capacity, Load, ProcessCpu, host_cores, speaking_at_once


class Host:
    """Processes whose CPU grows by a given cost per session per second, on a clock the test moves."""

    def __init__(self, capacity: Capacity, per_session: dict, base: dict):
        self.capacity, self.per_session, self.base = capacity, per_session, base
        self.now, self.cpu = 0.0, {name: 0.0 for name in per_session}

    def run(self, sessions: int, seconds: float) -> None:
        steps = round(seconds / 0.5)
        for _ in range(steps):
            self.now += 0.5
            for name in self.cpu:
                self.cpu[name] += 0.5 * (self.base[name] + self.per_session[name] * sessions)
            self.capacity.sample(self.now, self.cpu, sessions)

    def fill(self, limit: int = 1000) -> int:
        """Open sessions one at a time, each after the window has measured the last: how many are let in."""
        sessions = 0
        while sessions < limit and self.capacity.refuse(self.now, sessions) is None:
            sessions += 1
            self.run(sessions, 2.0)
        return sessions


def test_the_cores_set_the_limit_at_max_load():
    # 3 % of a core per session in the frontend, 2 % in each of two compositors: 7 % of a core each
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9)
    host = Host(cap, {"frontend": 0.03, "cpu0": 0.02, "cpu1": 0.02}, {"frontend": 0.01, "cpu0": 0.0, "cpu1": 0.0})
    host.run(0, 2.0)
    admitted = host.fill()
    # (0.01 + 0.07 n) <= 1.5  ->  n <= 21
    assert admitted == 21
    busy = cap.refuse(host.now, admitted)
    assert busy is not None and "cores" in busy.message and busy.retry_after_s > 0


def test_one_saturating_process_sets_the_limit_before_the_cores_do():
    # the frontend takes 8 % of its core per session; the machine as a whole would hold more
    cap = Capacity(cores=8, max_load=0.75, max_process_load=0.9)
    host = Host(cap, {"frontend": 0.08, "cpu0": 0.01}, {"frontend": 0.0, "cpu0": 0.0})
    admitted = host.fill()
    assert admitted == 11   # 0.08 n <= 0.9
    assert "frontend" in cap.refuse(host.now, admitted).message


def test_a_process_that_may_use_many_cores_is_held_to_the_total_only():
    cap = Capacity(cores=8, max_load=0.75, max_process_load=0.9, single_threaded=lambda name: name != "gpu0")
    host = Host(cap, {"frontend": 0.01, "gpu0": 0.2}, {"frontend": 0.0, "gpu0": 0.0})
    assert host.fill() == 28   # 0.21 n <= 6, though gpu0 alone passes one core at 5 sessions


def test_a_burst_on_an_idle_host_is_let_in_a_few_per_window_until_measured():
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9)
    host = Host(cap, {"frontend": 0.035}, {"frontend": 0.0})
    host.run(0, 2.0)
    ramp = 2 * RAMP   # per core
    admitted = [cap.refuse(host.now, n) is None for n in range(40)]
    assert sum(admitted) == ramp
    busy = cap.refuse(host.now, ramp)
    assert "measured" in busy.message and busy.retry_after_s == cap.window_s
    host.run(ramp, 2.0)          # now their cost is known: 3.5 % each
    # the burst's rest fits by the measured cost, all at once: 0.035 n <= 0.9 (the frontend's core)
    extra = 0
    while cap.refuse(host.now, ramp + extra) is None:
        extra += 1
    assert ramp + extra == 25


def test_the_ramp_is_shared_by_the_hosts_client_facing_processes():
    """Each of a host's client-facing processes lets in its share of the unmeasured ramp: together they
    let in what one process would."""
    caps = [Capacity(cores=2, max_load=0.75, max_process_load=0.9, processes=3) for _ in range(3)]
    admitted = 0
    for n in range(40):   # opens arriving at the three in turn, each counting the host's sessions
        admitted += caps[n % 3].refuse(0.0, admitted) is None
    assert admitted == 3 * round(2 * RAMP / 3)


def test_sessions_that_close_make_room_at_once():
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9)
    host = Host(cap, {"frontend": 0.05, "cpu0": 0.05}, {"frontend": 0.0, "cpu0": 0.0})
    full = host.fill()
    assert cap.refuse(host.now, full) is not None
    assert cap.refuse(host.now, full - 2) is None   # two closed since the window's measurement


def test_a_restarted_process_does_not_count_its_new_clock_as_load():
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9)
    host = Host(cap, {"frontend": 0.05, "cpu0": 0.05}, {"frontend": 0.0, "cpu0": 0.0})
    host.run(4, 4.0)   # (the window's first sample has more CPU time than the new process's first)
    host.cpu["cpu0"] = 0.0        # the compositor was restarted: its CPU time starts again
    host.run(4, 0.5)
    assert cap.load.by_process["cpu0"] == 0.0 and cap.refuse(host.now, 4) is None


def test_the_hosts_own_processes_are_read():
    import os
    cpu = ProcessCpu()
    cpu.track("me", os.getpid())
    cpu.track("gone", 2 ** 22 + 12345)      # no such process: left out
    sum(i * i for i in range(200_000))
    assert set(cpu.read()) == {"me"} and cpu.read()["me"] > 0
    assert 0 < host_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("quota, cores", [("max 100000", None), ("50000 100000", 0.5), ("garbage", None)])
def test_a_containers_cpu_quota_caps_the_cores(quota, cores, tmp_path):
    import os
    (tmp_path / "cpu.max").write_text(quota)
    assert host_cores(str(tmp_path / "cpu.max")) == (cores or len(os.sched_getaffinity(0)))


def test_sessions_silent_when_one_more_opens_still_count_as_speaking_their_share():
    """A window of silent sessions makes a session look cheap. The fitted costs (one per open session,
    one per speech frame) say what they cost when they speak: the host admits by that, at
    sessions.speaking_share, not by a quiet moment."""
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9, speaking_share=0.5, fps=25)
    per_session, per_frame = 0.002, 0.004   # cores per open session; core-seconds per speech frame
    now, cpu, speech = 0.0, {"frontend": 0.0, "cpu0": 0.0}, 0.0

    def run(sessions: int, duty: float, seconds: float) -> None:
        nonlocal now, speech
        for _ in range(round(seconds / 0.5)):
            now += 0.5
            frames = sessions * 25 * duty * 0.5
            speech += frames
            cpu["frontend"] += 0.5 * sessions * per_session + 0.2 * frames * per_frame
            cpu["cpu0"] += 0.8 * frames * per_frame
            cap.sample(now, cpu, sessions, int(speech))

    run(10, 0.0, 2.0)
    assert cap.per_session is None, "no speech seen: nothing to fit"
    for duty in (0.1, 0.4, 0.2, 0.3) * 3:   # 10 sessions speaking now more, now less
        run(10, duty, 2.0)
    assert sum(cap.per_frame.values()) == pytest.approx(per_frame, rel=0.05)
    assert sum(cap.per_session.values()) == pytest.approx(per_session, rel=0.05)
    run(10, 0.0, 2.0)   # all silent now: by this window alone a session costs 0.002 cores
    # speaking half the time, a session takes 0.04 of cpu0's core: 0.04 n <= 0.9 -> n <= 22
    refused_at = next(n for n in range(10, 400) if cap.refuse(now, n) is not None)
    assert refused_at == 22
    busy = cap.refuse(now, refused_at)
    assert "cpu0" in busy.message and "speaking 50%" in busy.message and "sessions.speaking_share" in busy.message
    # the same host judged by its last quiet window alone lets in far more
    quiet = Capacity(cores=2, max_load=0.75, max_process_load=0.9)
    for n, t in ((10, 0.5), (10, 1.0), (10, 1.5), (10, 2.0)):
        quiet.sample(t, {"frontend": t * n * per_session, "cpu0": 0.0}, n)
    assert quiet.refuse(2.0, 300) is None


def test_speaking_at_once_is_the_binomial_upper_quantile():
    assert speaking_at_once(40, 0.27, 0.01) == 18   # P(X > 18) = 0.44 %, P(X > 17) = 1.09 % for X ~ B(40, 0.27)
    assert speaking_at_once(40, 0.0, 0.01) == 0 and speaking_at_once(40, 1.0, 0.01) == 40
    assert speaking_at_once(0, 0.5, 0.01) == 0
    assert speaking_at_once(5000, 0.27, 0.01) > 5000 * 0.27   # no underflow on a large host
    assert speaking_at_once(40, 0.27, 0.02) == 17   # P(X > 17) = 1.09 % <= 2 %


def test_a_host_full_when_sessions_speak_together_refuses_before_the_average_says_so():
    """Sessions speak when their users' conversations have them speak: sometimes many at once. With
    sessions.burst_share, the number speaking at once that is passed only that share of the time must
    fit under max_burst_load of the cores, which refuses sooner than the average (max_cpu_load) does."""
    def filled(burst_share: float) -> tuple[int, Capacity]:
        cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9, speaking_share=0.27, fps=25,
                       burst_share=burst_share, max_burst_load=0.9)
        cap.per_session = {"frontend": 0.001, "cpu0": 0.0, "cpu1": 0.0}
        cap.per_frame = {"frontend": 0.0004, "cpu0": 0.0018, "cpu1": 0.0018}   # 4 ms of CPU per speech frame
        idle = {"frontend": 0.0, "cpu0": 0.0, "cpu1": 0.0}
        cap.load, cap.cost = Load(idle, 1.0), Load({**idle, "frontend": 0.001}, 1.0)
        return next(n for n in range(1, 500) if cap.refuse(0.0, n - 1) is not None) - 1, cap

    average, _ = filled(0.0)
    assert average == 53   # (0.001 + 0.004 x 25 x 0.27) n <= 0.75 x 2
    bursts, cap = filled(0.01)
    # k(n) speaking at once: 0.001 n + 0.1 k <= 1.8, k = speaking_at_once(n, 0.27, 0.01)
    assert bursts == max(n for n in range(1, 100) if 0.001 * n + 0.1 * speaking_at_once(n, 0.27, 0.01) <= 1.8)
    assert bursts < average
    busy = cap.refuse(0.0, bursts)
    assert "sessions.burst_share" in busy.message and "sessions.max_burst_load" in busy.message


class ChurningHost:
    """A host on the test's clock, in STEP_S steps, sampled every SAMPLE_S as the frontend samples it: a
    base load, a steady cost per session held, and for each open a moment of CPU (its model warmed up,
    its first idle frames rendered: `warm_up` core-seconds over WARM_UP_S) before it is held."""

    STEP_S, WARM_UP_S = 0.05, 0.1

    def __init__(self, capacity: Capacity, base: dict, held: dict, warm_up: dict):
        self.capacity, self.base, self.held, self.warm_up = capacity, base, held, warm_up
        self.cpu = {name: 0.0 for name in base}
        self.ticks, self.sessions, self.opened = 0, 0, 0

    @property
    def now(self) -> float:
        return self.ticks * self.STEP_S

    def run(self, seconds: float, warming: int = 0) -> None:
        for _ in range(round(seconds / self.STEP_S)):
            self.ticks += 1
            for name in self.cpu:
                self.cpu[name] += self.STEP_S * (self.base[name] + self.held[name] * self.sessions
                                                 + warming * self.warm_up[name] / self.WARM_UP_S)
            if self.ticks % round(SAMPLE_S / self.STEP_S) == 0:
                self.capacity.sample(self.now, self.cpu, self.sessions, speech_frames=0, opened=self.opened)

    def open(self):
        """A session_open: refused (the Busy), or warmed up and held (None)."""
        busy = self.capacity.refuse(self.now, self.sessions)
        if busy is None:
            self.opened += 1
            self.run(self.WARM_UP_S, warming=1)
            self.sessions += 1
        return busy

    def churn(self, opens: int) -> None:
        """Sessions opened and closed in a row, each held a moment."""
        for _ in range(opens):
            assert self.open() is None
            self.run(0.1)
            self.sessions -= 1
            self.run(0.05)

    def fill(self, limit: int, patience_s: float = 30.0) -> tuple[int, list]:
        """Open sessions one after another up to `limit` open, waiting as a refusal says (for `patience_s`
        in all): the sessions open, and the refusals with the sessions open when each came."""
        refusals, deadline = [], self.now + patience_s
        while self.sessions < limit and self.now < deadline:
            sessions, busy = self.sessions, self.open()
            if busy is not None:
                refusals.append((sessions, busy))
                self.run(busy.retry_after_s)
        return self.sessions, refusals


IDLE = {"frontend": 0.004, "cpu0": 0.002, "cpu1": 0.002, "gpu0": 0.0}      # cores a held idle session costs
WARM_UP = {"frontend": 0.01, "cpu0": 0.02, "cpu1": 0.02, "gpu0": 0.03}     # core-seconds an open costs
BASE = {"frontend": 0.02, "cpu0": 0.0, "cpu1": 0.0, "gpu0": 0.0}


def churned(held: dict, quiet_s: float) -> ChurningHost:
    """A host with one session open (for `quiet_s` alone), then 200 sessions opened and closed in a row."""
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9,
                   single_threaded=lambda name: not name.startswith("gpu"))
    host = ChurningHost(cap, BASE, held, WARM_UP)
    assert host.open() is None
    host.run(quiet_s)
    host.churn(200)
    return host


def test_opens_and_closes_in_a_row_do_not_count_as_the_cost_of_a_session_held():
    """An open costs CPU for a moment (warm-up renders), a held idle session little: after 200 opens and
    closes, the cost a session held is admitted by is the one session held through them (its idle share
    and the base load), not the churn's load over it, and an open's warm-up is fitted apart. So 25 idle
    sessions (0.22 cores in all with the base load) are let in one after another on 2 cores at max_load
    0.75, each while the measured load plus one session's steady cost stays under it."""
    host = churned(IDLE, quiet_s=10.0)
    cap = host.capacity
    assert cap.load.total > 0.3, "the churn's opens are in the measured load"
    assert cap.cost.total == pytest.approx(sum(BASE.values()) + sum(IDLE.values()), rel=0.1), \
        f"the churn's {cap.load.total:.2f} cores over {cap.load.sessions:.1f} sessions taken for a held one's cost"
    # (the frontend's base load, which the fit has no term for, is shared out between its session and open costs)
    assert cap.per_open is not None, "the opens not fitted apart from the sessions held"
    assert {name: cost for name, cost in cap.per_open.items() if not BASE[name]} == \
        pytest.approx({name: cost for name, cost in WARM_UP.items() if not BASE[name]}, rel=0.05)
    opened, refusals = host.fill(25)
    assert (opened, refusals) == (25, [])


def test_churn_on_a_host_never_measured_without_opens_is_let_in_at_the_ramps_pace_not_refused_as_full():
    """The session held opened as the churn began: every window so far had opens in it, so what a
    session held costs is not known apart from them. Not `busy` naming the cores (they are far from
    full): let in at the ramp's pace, as on a fresh host, and all 25 open. The ramp's pace: a session is
    let in while fewer than RAMP a core of those let in over the last window are still open, so the
    churn's sessions, closed again, take none of it, and it refuses once with that many open; the window
    waited out has no opens in it and measures what they cost, and the rest are let in by it."""
    host = churned(IDLE, quiet_s=0.0)
    assert host.capacity.cost is None and host.sessions == 1
    ramp = max(round(RAMP * host.capacity.cores), 1)
    assert ramp < 25
    opened, refusals = host.fill(25)
    assert opened == 25
    assert all("measured" in busy.message for _, busy in refusals), refusals
    assert [sessions for sessions, _ in refusals] == [ramp], refusals


def test_after_churn_a_host_whose_sessions_really_cost_is_still_refused_at_its_cores():
    """The same churn, with held sessions costing 0.08 cores each: (0.02 + 0.08 n) <= 1.5 holds 18, and
    the 19th is refused naming the cores, however long it waits."""
    held = {"frontend": 0.02, "cpu0": 0.03, "cpu1": 0.03, "gpu0": 0.0}
    host = churned(held, quiet_s=10.0)
    opened, refusals = host.fill(25)
    assert opened == 18
    assert refusals and "cores" in refusals[-1][1].message and "sessions.max_cpu_load" in refusals[-1][1].message


def test_opens_are_fitted_apart_from_sessions_and_speech():
    """Sessions opened and closed among 10 held ones, speaking now more, now less: the fit tells a
    session held, a speech frame and an open apart, so churn does not raise what speaking sessions are
    admitted by (per_session) either."""
    cap = Capacity(cores=2, max_load=0.75, max_process_load=0.9, speaking_share=0.5, fps=25)
    per_session, per_frame, per_open = 0.002, 0.004, 0.05
    now, cpu, speech, opened = 0.0, {"frontend": 0.0, "cpu0": 0.0}, 0.0, 0
    for duty, opens in zip((0.1, 0.4, 0.2, 0.3) * 4, (0, 1, 0, 2, 1, 0, 2, 1) * 2):   # opens each 0.5 s
        for _ in range(4):   # 2 s at each
            now += 0.5
            frames = 10 * 25 * duty * 0.5
            speech, opened = speech + frames, opened + opens
            cpu["frontend"] += 0.5 * 10 * per_session + 0.2 * frames * per_frame + opens * per_open
            cpu["cpu0"] += 0.8 * frames * per_frame
            cap.sample(now, cpu, 10, int(speech), opened)
    assert sum(cap.per_session.values()) == pytest.approx(per_session, rel=0.1)
    assert sum(cap.per_frame.values()) == pytest.approx(per_frame, rel=0.05)
    assert sum(cap.per_open.values()) == pytest.approx(per_open, rel=0.1)


def test_a_gpu_hosts_sessions_are_held_within_the_frames_per_second_its_workers_measured():
    """The GPU workers' inference is not in the host's CPU: a cheap host with a full card refuses by what
    the card runs (measured at load, sent with the model's ModelEvent), before speech is missed."""
    cap = Capacity(cores=16, max_load=0.75, max_process_load=0.9, speaking_share=0.5, fps=25.0)
    host = Host(cap, {"frontend": 0.001, "cpu0": 0.001}, {"frontend": 0.0, "cpu0": 0.0})
    host.run(0, 2.0)
    assert host.fill(limit=200) == 200            # no device measured: the cores alone, and they have room
    cap.device(0, 600.0)
    cap.device(0, 400.0)                          # the worker's latest figure holds (a second avatar loaded)
    # 0.5 x 25 frames/s a session <= 0.75 x 400  ->  24 sessions
    assert cap.refuse(host.now, 23) is None
    busy = cap.refuse(host.now, 24)
    assert busy is not None and "400 frames/s" in busy.message and "sessions.max_cpu_load" in busy.message
    cap.device(1, 400.0)                          # a second GPU worker doubles it
    assert cap.refuse(host.now, 47) is None and cap.refuse(host.now, 48) is not None
    cap.device(0, 800.0)                          # ... and it rises again (the N-model form is ready)
    assert cap.refuse(host.now, 71) is None and cap.refuse(host.now, 72) is not None
    cap.device(0, 0.0)                            # its last model unloaded: nothing measured, the figure holds
    assert cap.refuse(host.now, 71) is None and cap.refuse(host.now, 72) is not None


def test_the_gpu_limit_holds_bursts_of_speech_too():
    cap = Capacity(cores=16, max_load=0.75, max_process_load=0.9, speaking_share=0.27, fps=25.0,
                   burst_share=0.01, max_burst_load=0.9)
    cap.device(0, 1000.0)
    n = next(n for n in range(1, 1000) if cap.refuse(0.0, n - 1) is not None)
    k = speaking_at_once(n, 0.27, 0.01)
    assert k * 25 > 0.9 * 1000 >= speaking_at_once(n - 1, 0.27, 0.01) * 25   # the burst, not the average, binds
    assert n * 0.27 * 25 <= 0.75 * 1000
    assert "speak at once" in cap.refuse(0.0, n - 1).message


def test_a_burst_that_one_single_threaded_process_could_not_run_is_refused_though_the_cores_have_room():
    """16 cores, but 10 ms of one compositing process's core per speech frame: it runs 4 speaking at once.
    Sessions are let in while the number speaking at once that is passed only sessions.burst_share of the
    time fits in that core, the rest refused naming the process."""
    cap = Capacity(cores=16, max_load=0.75, max_process_load=0.9, speaking_share=0.27, fps=25, burst_share=0.01,
                   max_burst_load=0.9)
    cap.per_session, cap.per_frame = {"frontend": 0.0, "cpu0": 0.0}, {"frontend": 0.0, "cpu0": 0.01}
    idle = {"frontend": 0.0, "cpu0": 0.0}
    cap.load, cap.cost = Load(idle, 1.0), Load({**idle, "frontend": 0.001}, 1.0)
    let_in = next(n for n in range(1, 500) if cap.refuse(0.0, n - 1) is not None) - 1
    assert let_in == max(n for n in range(1, 100) if 25 * 0.01 * speaking_at_once(n, 0.27, 0.01) <= 1.0)
    busy = cap.refuse(0.0, let_in)
    assert "cpu0 would need" in busy.message and "its one core" in busy.message, busy.message


def test_the_speakers_a_host_holds_are_bounded_by_its_cores_as_well_as_by_each_process():
    """speakers_held (what shedding holds speaking at once): 12 ms of CPU per speech frame over two processes
    (0.3 of a core per speaker at 25 fps) on one core at max_burst_load 0.9: 3, though each process alone
    would run 6."""
    cap = Capacity(cores=1, max_load=0.75, max_process_load=0.9, speaking_share=0.27, fps=25, max_burst_load=0.9)
    cap.per_session, cap.per_frame = {"cpu0": 0.0, "cpu1": 0.0}, {"cpu0": 0.006, "cpu1": 0.006}
    cap.load = Load({"cpu0": 0.45, "cpu1": 0.45}, 10)   # busy
    assert cap.speakers_held(10) == 3
