"""Planning's progress lines: a phase's start, its steps with the time left at its pace, its end; none at verbose=0."""

import pytest

from tfpipe.planning import progress as progress_lib


def _clocked(monkeypatch, start: float = 0.0) -> tuple[list[str], list[float]]:
    """The lines said and the clock (set by hand) of the progress made after this."""
    said: list[str] = []
    clock = [start]
    monkeypatch.setattr(progress_lib.messages, "say", said.append)
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    return said, clock


def _run(monkeypatch, verbose: int) -> list[str]:
    said, clock = _clocked(monkeypatch, 100.0)
    progress = progress_lib.Progress(verbose)
    clock[0] += 3
    progress.phase("measuring each of the 4 layers alone", 4)
    for name in ("a", "b", "c", "d"):
        clock[0] += 10  # each step 10 s: a line every time (EVERY_S is 5 s)
        progress.step(name)
    progress.phase("predicting every configuration")
    clock[0] += 200
    progress.end()
    return said


def test_each_phase_says_its_steps_the_time_left_and_how_long_it_took(monkeypatch):
    assert _run(monkeypatch, 1) == [
        "tfpipe.plan: measuring each of the 4 layers alone (0 of 4), 3 s in",
        "tfpipe.plan: measuring each of the 4 layers alone: 1 of 4 (a), about 30 s left in it",
        "tfpipe.plan: measuring each of the 4 layers alone: 2 of 4 (b), about 20 s left in it",
        "tfpipe.plan: measuring each of the 4 layers alone: 3 of 4 (c), about 10 s left in it",
        "tfpipe.plan: measuring each of the 4 layers alone: 4 of 4 (d)",
        "tfpipe.plan: measuring each of the 4 layers alone: done in 40 s",
        "tfpipe.plan: predicting every configuration, 43 s in",
        "tfpipe.plan: predicting every configuration: done in 3.3 min",
    ]


def test_verbose_0_says_nothing(monkeypatch):
    assert _run(monkeypatch, 0) == []


def test_steps_closer_than_the_interval_are_not_each_said(monkeypatch):
    said, clock = _clocked(monkeypatch)
    progress = progress_lib.Progress()
    progress.phase("timing", 10)
    for _ in range(10):
        clock[0] += 1.0  # a step a second: a line every 5 s, and the last
        progress.step()
    steps = [line for line in said if " of 10" in line and "(0 of 10)" not in line]
    assert steps == [
        "tfpipe.plan: timing: 5 of 10, about 5 s left in it",
        "tfpipe.plan: timing: 10 of 10",
    ]


def test_the_time_left_goes_by_the_pace_of_the_last_steps(monkeypatch):
    said, clock = _clocked(monkeypatch)
    progress = progress_lib.Progress()
    progress.phase("measuring each of the 100 layers alone", 100)
    for step in range(32):  # two of a kind measured (60 s each), the rest given their times (0.5 s each)
        clock[0] += 60.0 if step < 2 else 0.5
        progress.step()
    # the phase's pace (4.2 s a step) would say 4.8 min; the last ten steps' says 34 s
    assert said[-1] == "tfpipe.plan: measuring each of the 100 layers alone: 32 of 100, about 34 s left in it"


def test_a_time_bound_affords_probes_at_the_pace_of_those_built_with_the_shortlist_kept(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    unbounded = progress_lib.Progress(0)
    assert unbounded.affords(1000) and unbounded.time_left() == float("inf")
    progress = progress_lib.Progress(0, max_seconds=100.0)
    progress.reserve = 2  # the shortlist: two configurations timed after the probes
    clock[0] = 20.0
    assert progress.affords(1)  # no pace yet: the first is built while there is time at all
    progress.probe_took(10.0)
    progress.probe_took(20.0)  # 15 s a probe
    assert progress.time_left() == 80.0
    assert progress.affords(3)  # (3 + 2) x 15 = 75 <= 80
    assert not progress.affords(3, also=10.0)  # and 10 s of rounds: 85 > 80
    assert not progress.affords(4)
    clock[0] = 101.0
    progress.probe_took(0.0)
    assert not progress.affords(0) and progress.time_left() == -1.0


def test_a_prediction_scaled_by_how_far_the_probes_built_were_from_theirs(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    progress = progress_lib.Progress(0, max_seconds=100.0)
    progress.reserve = 2
    # the first probe: built where predicted to end within the bound, the shortlist's reserve not kept back
    assert progress.probe_seconds() is None and progress.probe_seconds(30.0) == 30.0
    assert progress.affords(1, predicted=100.0) and not progress.affords(1, predicted=101.0)
    assert not progress.affords(1, also=1.0, predicted=100.0)
    progress.probe_took(20.0, predicted=10.0)  # twice its prediction
    progress.probe_took(30.0, predicted=10.0)  # three times: the median 2.5
    progress.probe_took(5.0)  # without a prediction: the pace only (55 / 3 s)
    assert progress.probe_seconds(4.0) == pytest.approx(10.0) and progress.probe_seconds() == pytest.approx(55 / 3)
    clock[0] = 20.0  # 80 s left: 2 x 55/3 kept for the shortlist, 43.3 s for the probes
    assert progress.affords(4, predicted=4.0) and not progress.affords(5, predicted=4.0)
    assert not progress.affords(3)  # at the pace: 5 x 18.3 = 91.7 > 80


def test_every_step_calls_on_step_also_when_silent(monkeypatch):
    called = []
    progress = progress_lib.Progress(0, on_step=lambda: called.append(1))
    progress.phase("probes", 2)
    progress.step()
    progress.step()
    assert called == [1, 1]
