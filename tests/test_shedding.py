"""Shedding speech when the host is full (frontend/live/shedding.py): the rule on made-up windows, and
a session's timeline at each level. The same through the live service: tests/test_live.py."""

from __future__ import annotations

import numpy as np
import pytest

from frontend.live.shedding import CALM_WINDOWS, FULL, HALF, MIN_TIGHT_FRAMES, NONE, Meter, Shedder
from frontend.live.timeline import LiveSession


class Fake:
    def __init__(self, token: str):
        self.token, self.shed, self.meter, self.shed_whole = token, FULL, Meter(), False


def _window(shedder: Shedder, sessions, **counts) -> list[tuple[str, int]]:
    """One window in which the sessions named in `counts` had those meter counts, e.g. b=dict(speech=25):
    the (token, new level) of each change."""
    for s in sessions:
        for name, value in counts.get(s.token, {}).items():
            setattr(s.meter, name, value)
    changes = shedder.window(sessions)
    assert len({c.full for c in changes}) <= 1
    return [(c.token, c.level) for c in changes]


def test_a_missed_frame_sheds_the_newest_speaking_session_never_the_oldest():
    a, b, c = sessions = [Fake("a"), Fake("b"), Fake("c")]   # oldest first
    shedder = Shedder()
    speaking = dict(a=dict(speech=25, missed=1), b=dict(speech=25))   # c is silent: shedding it frees nothing
    assert _window(shedder, sessions, **speaking) == [("b", HALF)]
    assert all(s.meter == Meter() for s in sessions), "every meter starts again each window"
    assert _window(shedder, sessions, **speaking) == [], "the window after a step: speech in flight, not judged"
    assert _window(shedder, sessions, **speaking) == [("b", NONE)]
    _window(shedder, sessions, a=dict(speech=25))
    assert _window(shedder, sessions, a=dict(speech=25, missed=2), b=dict(missed=1)) == [], "b is shed all"
    assert _window(shedder, sessions, a=dict(speech=25, missed=2)) == [], "a, alone speaking, keeps its speech"
    assert _window(shedder, sessions, a=dict(speech=25), c=dict(speech=25, missed=1)) == [("c", HALF)]
    assert (a.shed, b.shed, c.shed) == (FULL, NONE, HALF)


def test_past_the_speakers_the_host_holds_the_newest_give_up_their_speech_before_it_is_late():
    """`crowd`: when one more session starts to speak than the host can hold speaking at once, the newest
    speaking go to NONE at once (not a window after their frames were late); never the oldest; and no
    step comes back while there is no room for it."""
    a, b, c, d = sessions = [Fake("a"), Fake("b"), Fake("c"), Fake("d")]   # oldest first
    shedder = Shedder()
    assert shedder.crowd([a, b, c], held=3) == []
    changes = shedder.crowd([a, b, c, d], held=2)
    assert [(ch.token, ch.level, ch.full) for ch in changes] == [("d", NONE, True), ("c", NONE, True)]
    assert shedder.crowd([a], held=0) == [], "the oldest speaking keeps its speech"
    for _ in range(CALM_WINDOWS + 2):   # calm, but the host holds no one more speaking
        assert shedder.window(sessions, room=0) == []
    back = [(ch.token, ch.level) for _ in range(4) for ch in shedder.window(sessions, room=1)]
    assert back == [("c", HALF), ("c", FULL), ("d", HALF), ("d", FULL)], "the last shed first, a step a window"
    whole = Fake("w")
    whole.shed_whole = True   # (h264) straight back to FULL: one step
    assert shedder.crowd([a, whole], held=1)[0].level == NONE and shedder.steps == ["w"]
    # the host's other client-facing processes have 2 speaking of the 3 it holds: one here keeps its
    # speech, and the oldest here is not spared while another process has one older
    others = Shedder()
    assert [ch.token for ch in others.crowd([a, b, c], held=3, others=2)] == ["c", "b"]
    assert [ch.token for ch in others.crowd([a], held=1, others=1)] == ["a"]


def test_as_many_sessions_step_down_as_the_share_of_speech_in_trouble():
    sessions = [Fake(f"s{i}") for i in range(10)]
    shedder = Shedder()
    counts = {f"s{i}": dict(speech=15, missed=10) for i in range(8)}   # 8 speaking, 40 % of speech missed
    assert _window(shedder, sessions, **counts) == [(f"s{i}", HALF) for i in (7, 6, 5, 4)]
    assert _window(shedder, sessions, **counts) == []
    assert _window(shedder, sessions, **counts) == [(f"s{i}", NONE) for i in (7, 6, 5, 4)]
    assert _window(shedder, sessions, **counts) == []
    assert _window(shedder, sessions, **counts) == [(f"s{i}", HALF) for i in (3, 2, 1)], "never s0"


def test_late_frames_and_a_share_of_tight_ones_are_pressure_a_few_tight_ones_are_not():
    shedder = Shedder()
    a, b, c = sessions = [Fake("a"), Fake("b"), Fake("c")]
    assert _window(shedder, sessions, a=dict(speech=100, tight=10), b=dict(speech=100, tight=10)) == [], "10 %"
    assert _window(shedder, sessions, a=dict(speech=MIN_TIGHT_FRAMES // 2, tight=MIN_TIGHT_FRAMES // 2),
                   b=dict(speech=MIN_TIGHT_FRAMES // 2 - 1)) == [], "too few frames to judge a share"
    assert _window(shedder, sessions, a=dict(speech=100, tight=21), b=dict(speech=100)) == [("b", HALF)]
    _window(shedder, sessions, a=dict(speech=25))
    assert _window(shedder, sessions, a=dict(speech=3, late=1), b=dict(speech=3), c=dict(speech=3)) == [("c", HALF)]
    _window(shedder, sessions, a=dict(speech=25))
    assert _window(shedder, sessions, a=dict(speech=3), b=dict(speech=3, late=1)) == [("b", NONE)], \
        "c spoke not in this window"


def test_calm_windows_give_the_steps_back_last_taken_first_one_a_window():
    shedder = Shedder()
    a, b, c = sessions = [Fake("a"), Fake("b"), Fake("c")]
    for _ in range(2):
        _window(shedder, sessions, a=dict(speech=25), c=dict(speech=25, missed=1))
        _window(shedder, sessions, a=dict(speech=25, tight=1))   # settling, and not calm
    _window(shedder, sessions, a=dict(speech=25), b=dict(speech=25, missed=1))
    assert (a.shed, b.shed, c.shed) == (FULL, HALF, NONE)
    given_back = [_window(shedder, sessions, a=dict(speech=25)) for _ in range(CALM_WINDOWS + 3)]
    assert given_back == [[]] * (CALM_WINDOWS - 1) + [[("b", FULL)], [("c", HALF)], [("c", FULL)], []]
    # a window with a few tight frames is neither calm nor pressure: the calm count starts again
    assert _window(shedder, sessions, a=dict(speech=25), b=dict(speech=25, missed=1)) == [("b", HALF)]
    for _ in range(CALM_WINDOWS - 1):
        assert _window(shedder, sessions, a=dict(speech=25)) == []
    assert _window(shedder, sessions, a=dict(speech=100, tight=1)) == []
    for _ in range(CALM_WINDOWS - 1):
        assert _window(shedder, sessions, a=dict(speech=25)) == []
    assert _window(shedder, sessions, a=dict(speech=25)) == [("b", FULL)]


def test_an_h264_session_has_no_half_step():
    a, b = sessions = [Fake("a"), Fake("b")]
    b.shed_whole = True
    shedder = Shedder()
    assert _window(shedder, sessions, a=dict(speech=25), b=dict(speech=25, missed=1)) == [("b", NONE)]
    given_back = [_window(shedder, sessions, a=dict(speech=25)) for _ in range(CALM_WINDOWS)]
    assert given_back[-1] == [("b", FULL)] and not any(given_back[:-1])


def test_a_closed_sessions_steps_go_with_it():
    a, b = [Fake("a"), Fake("b")]
    shedder = Shedder()
    _window(shedder, [a, b], a=dict(speech=25), b=dict(speech=25, missed=1))
    assert b.shed == HALF and shedder.steps == ["b"]
    for _ in range(CALM_WINDOWS):
        assert _window(shedder, [a], a=dict(speech=25)) == []
    assert shedder.steps == []


def _session(mode: str = "window") -> LiveSession:
    return LiveSession("t", "m", None, 25.0, t0=0.0, start_frame=0, n_backgrounds=8, order="loop", lead_frames=2,
                       audio_mode=mode, feature_shape=(16, 32))


@pytest.mark.parametrize("level", [HALF, NONE])
def test_a_shed_sessions_frames_repeat_or_go_out_idle_with_their_audio_never_missed(level):
    session = _session()
    session.shed = level
    first, ready = session.windows(np.arange(10, dtype=np.float32).reshape(10, 1), now=0.0, last=True)
    rendered = [k for frames, _ in ready for k in frames]
    if level == HALF:
        assert rendered == list(range(first, first + 10, 2))
        assert [w for _, windows in ready for w in windows.ravel()] == [0, 2, 4, 6, 8], "their own windows"
    else:
        assert rendered == []
    for k in rendered:
        session.ready(k, session.utterance_at(k), f"img-{k}".encode(), now=0.0)
    out = session.advance(session.due(first + 10))
    speech = {f.index: f for f in out if first <= f.index < first + 10}
    assert len(speech) == 10 and not any(f.missed for f in out)
    if level == HALF:
        assert [speech[k].image for k in range(first, first + 10)] == [
            f"img-{first + 2 * (i // 2)}".encode() for i in range(10)], "each frame between repeats the one before"
        assert all(f.kind == "speech" for f in speech.values())
    else:
        assert all(f.kind == "idle" and f.image is None for f in speech.values())
    assert speech[first + 9].last, "the utterance still ends where it ends"
    assert session.stats.missed == 0 and session.stats.shed == (5 if level == HALF else 10)
    assert session.meter.speech == (5 if level == HALF else 0) and session.meter.missed == 0


def test_a_shed_pcm_session_keeps_every_sample():
    session = _session("pcm16")
    session.shed = NONE
    pcm = (np.sin(np.arange(16000) / 7) * 8000).astype("<i2").tobytes()   # 1 s: 25 frames
    first, frames, ready = session.pcm(pcm, last=True, now=0.0)
    assert frames == 25 and ready == []
    out = session.advance(session.due(first + 30))
    audio = b"".join(f.audio for f in out if f.audio is not None)
    assert audio[:len(pcm)] == pcm and not any(f.missed for f in out)


def test_a_shed_features_session_whose_frame_went_out_before_its_rows_came():
    """features mode infers frame j once row j+7 is in: a frame already sent by then is not an error."""
    session = _session("features")
    session.shed = HALF
    rows = np.ones((4, 32), np.float32)
    first, ready = session.features(rows, last=False, now=0.0, audio_shape=(16, 32))
    assert ready == []   # rows 0-3 wait for the look-ahead
    session.advance(session.due(first + 1))   # frames first, first + 1 go out (missed) meanwhile
    _, ready = session.features(np.ones((8, 32), np.float32), last=True, now=session.due(first + 1),
                                audio_shape=(16, 32))
    rendered = [k for frames, _ in ready for k in frames]
    assert first + 2 in rendered and first + 3 not in rendered, "every other frame of those still to come"
