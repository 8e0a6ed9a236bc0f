"""The planner's last step by hand: which candidates it times, and that the fastest measured is chosen."""

import dataclasses
import time

import pytest

from tests.unit.planning.handmade import DEVICES, calibration, profile
from tfpipe import planner
from tfpipe.planner import calibration as calibration_lib
from tfpipe.planner import probe_fits
from tfpipe.planning import plans, predict, search
from tfpipe.planning.predict import Config, Prediction


def candidate(k, r, m, schedule, predicted, fits=True, remat="never"):
    """A candidate predicted to take ``predicted`` seconds, with a peak of 1 byte per device."""
    balance = (3,) if k == 1 else (2, 1)
    prediction = Prediction(step_s=predicted, pipeline_s=predicted, update_s=0.0, fixed_s=0.0, peak_bytes=[1.0] * k * r)
    return search.Candidate(Config(balance, r, m, remat, schedule), prediction, fits)


def test_the_shortlist_takes_one_per_shape_near_the_fastest_and_only_what_fits():
    found = [
        candidate(2, 1, 8, "gpipe", 1.00),
        candidate(2, 1, 4, "gpipe", 1.01),  # the same shape as the first: tells nothing new
        candidate(1, 2, 2, "gpipe", 1.05),
        candidate(2, 1, 8, "zero_bubble", 1.10, fits=False),  # does not fit
        candidate(2, 1, 8, "1f1b", 1.20),
        candidate(1, 1, 1, "gpipe", 1.30),  # beyond the band (25% over the fastest)
    ]
    listed = search.shortlist(found, 5)
    assert [c.config.schedule for c in listed] == ["gpipe", "gpipe", "1f1b"]
    assert [c.config.num_replicas for c in listed] == [1, 2, 1]
    assert search.shortlist(found, 2) == listed[:2]


def test_at_one_micro_batch_the_schedules_are_one_shape():
    # M=1 runs F then B on each cell whatever the schedule: timing it under three names would time it thrice
    found = [candidate(2, 1, 1, s, 1.0) for s in ("gpipe", "1f1b", "gpipe_batched_w", "zero_bubble")]
    found += [candidate(2, 1, 2, "1f1b", 1.05), candidate(2, 1, 4, "gpipe", 1.06)]
    listed = search.shortlist(found, 3)
    assert [(c.config.num_micro_batches, c.config.schedule) for c in listed] == [
        (1, "gpipe"),
        (2, "1f1b"),
        (4, "gpipe"),
    ]


def test_only_what_is_predicted_with_headroom_under_the_budget_is_timed():
    # predicted peaks within 15% of measured: one predicted at 0.9 of the budget may hold more than it when run
    found = [candidate(2, 1, 8, "gpipe", 1.00), candidate(1, 2, 2, "gpipe", 1.05), candidate(2, 1, 8, "1f1b", 1.10)]
    found[0] = dataclasses.replace(found[0], prediction=dataclasses.replace(found[0].prediction, peak_bytes=[90.0] * 2))
    assert [c.config.schedule for c in search.shortlist(found, 3)] == ["gpipe", "gpipe", "1f1b"]
    listed = search.shortlist(found, 3, budget=100.0)
    assert [(c.config.num_replicas, c.config.schedule) for c in listed] == [(2, "gpipe"), (1, "1f1b")]
    assert search.shortlist(found, 3, budget=90.0 / search.TIMED_HEADROOM) == search.shortlist(found, 3)


def test_the_fastest_measured_is_chosen_and_the_rest_keep_their_predicted_order():
    found = [candidate(2, 1, 8, "gpipe", 1.00), candidate(1, 2, 2, "gpipe", 1.05), candidate(2, 1, 8, "1f1b", 1.10)]
    found += [candidate(1, 2, 4, "gpipe", 1.06), candidate(1, 1, 1, "gpipe", 2.0)]
    measured = {"gpipe": 1.30, "1f1b": 1.12}  # GPipe K=2 ran slower than predicted, 1F1B as predicted
    timed = []

    def time_step(config):
        timed.append(config)
        return (1.20 if config.num_replicas == 2 else measured[config.schedule]), None

    ordered = search.by_measured(found, 3, time_step)
    assert len(timed) == 3
    assert [(c.config.schedule, c.config.num_replicas) for c in ordered[:3]] == [
        ("1f1b", 1),
        ("gpipe", 2),
        ("gpipe", 1),
    ]
    assert [c.measured_s for c in ordered] == [1.12, 1.20, 1.30, None, None]
    plan = plans.from_candidates(ordered, DEVICES, 8, None, profile(), calibration(), 2)
    assert plan.schedule == "1f1b" and plan.measured_seconds == 1.12 and plan.step_seconds == 1.10
    lines = []
    plan.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "measured step: 1120.0 ms, the fastest of 3 configurations timed on the devices" in text
    assert "+7% slower measured (1200.0 ms; predicted 1050.0 ms)" in text  # the replicas, measured against the chosen
    assert "+82% slower (2000.0 ms)" in text  # not timed: against the chosen's prediction
    # predicted faster than the chosen but not timed: another configuration of its shape was, and lost
    assert "predicted 4% faster (1060.0 ms), not timed: the timed configuration of its K, R and schedule ran" in text


def test_a_configuration_that_runs_out_of_memory_when_timed_goes_last_and_says_so():
    found = [candidate(2, 1, 8, "gpipe", 1.00), candidate(2, 1, 8, "1f1b", 1.05)]
    ordered = search.by_measured(found, 3, lambda config: (float("inf") if config.schedule == "gpipe" else 1.0, None))
    assert [c.config.schedule for c in ordered] == ["1f1b", "gpipe"]
    plan = plans.from_candidates(ordered, DEVICES, 8, None, profile(), calibration(), 2)
    assert "ran out of memory when timed on the devices" in plans._why_lost(ordered[1], ordered[0], None)
    assert plan.measured_seconds == 1.0
    # none could be timed: the predicted order stays
    assert search.by_measured(found, 3, lambda config: (float("inf"), None)) == found


def test_a_configuration_over_the_budget_when_timed_goes_last_and_says_so():
    # workers' and GPUs' allocators are read when timing: the fastest ran over the budget the prediction said it fits
    found = [candidate(2, 1, 2, "zero_bubble", 1.00), candidate(2, 1, 4, "1f1b", 1.05)]
    peaks = {"zero_bubble": 105.0, "1f1b": 90.0}
    ordered = search.by_measured(found, 3, lambda config: (1.0, peaks[config.schedule]), budget=100.0)
    assert [(c.config.schedule, c.measured_peak) for c in ordered] == [("1f1b", 90.0), ("zero_bubble", 105.0)]
    assert "its peak when timed, 105 B, is over the budget" in plans._why_lost(ordered[1], ordered[0], 100.0)
    # without a budget, or where no allocator was read (peak None), only the time counts
    assert (
        search.by_measured(found, 3, lambda config: (1.0, peaks[config.schedule]))[0].config.schedule == "zero_bubble"
    )
    # every timed one over the budget: the predicted order stays
    assert search.by_measured(found, 3, lambda config: (1.0, 200.0), budget=100.0) == found


def test_with_one_worth_timing_nothing_is_timed():
    found = [candidate(2, 1, 8, "gpipe", 1.0), candidate(1, 1, 1, "gpipe", 3.0)]
    assert search.by_measured(found, 3, lambda config: pytest.fail("timed")) == found
    assert search.by_measured(found, 0, lambda config: pytest.fail("timed")) == found


@pytest.mark.parametrize("verify", [-1, 1.5, True, "3"])
def test_verify_must_be_a_count(verify):
    with pytest.raises(ValueError, match=f"verify={verify!r}: give how many configurations to time, or 0"):
        planner.verified([], [], None, 8, DEVICES, "sgd", verify)


def test_only_configurations_predicted_to_fit_are_timed_and_one_that_ran_over_goes_last():
    # a probe keeps to the budget (on a GPU, its memory): the fastest predicted, 5% over the budget, is not run
    fast = candidate(2, 1, 4, "gpipe_batched_w", 1.00, fits=False)
    fast.prediction.peak_bytes = [105.0, 80.0]
    found = [candidate(2, 1, 1, "zero_bubble", 1.10), candidate(1, 1, 1, "gpipe", 1.20), fast]
    timed = []

    def time_step(config):
        timed.append(config.schedule)
        return {"zero_bubble": 1.10, "gpipe": 1.0}[config.schedule], (120.0 if config.schedule == "gpipe" else 90.0)

    ordered = search.by_measured(found, 3, time_step, budget=100.0)
    assert timed == ["zero_bubble", "gpipe"]
    # gpipe ran faster but over the budget: last among the timed, the fitting one chosen
    assert [c.config.schedule for c in ordered] == ["zero_bubble", "gpipe", "gpipe_batched_w"]
    assert ordered[1].measured_peak == 120.0 and ordered[2].measured_s is None
    assert "its peak when timed, 120 B, is over the budget" in plans._why_lost(ordered[1], ordered[0], 100.0)
    assert plans._why_lost(ordered[2], ordered[0], 100.0) == "does not fit: predicted peak 105 B > budget 100 B"


def test_without_the_bfc_allocator_no_peak_of_logical_cpus_is_read(monkeypatch):
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    assert not calibration_lib.peaks_readable(["/CPU:0", "/CPU:1"])


def test_probes_compared_with_one_another_are_timed_in_rounds_in_turn(monkeypatch):
    # a slow spell (x3) during the first probe's first round: the median over rounds is the machine's usual speed
    calls = []

    def step_times(model, data, steps):
        calls.append(model)
        return [{"a": 1.0, "b": 2.0}[model]] * steps

    monkeypatch.setattr(calibration_lib, "step_times", step_times)
    probes = {8: calibration_lib.Probe(3.0, None), 32: calibration_lib.Probe(2.0, None)}
    kept = {8: ["a", None, [3.0] * 4], 32: ["b", None, [2.0] * 4]}
    timed = calibration_lib.in_rounds(probes, kept, 4)
    assert calls == ["a", "b"] * (calibration_lib.ROUNDS - 1)
    assert {b: p.seconds for b, p in timed.items()} == {8: 1.0, 32: 2.0}


def test_recomputation_is_fitted_per_k_to_what_it_adds_to_a_step():
    # per K, a step recomputing every micro-batch and the same step recomputing none, timed by hand: the fitted ratio
    # predicts what recomputing adds, whatever the steps' level (a fast spell of the machine falls on both)
    seconds = {1: (24.0, 30.0), 2: (13.0, 18.0), 4: (10.0, 12.0)}
    prof = profile(**{k: (v,) * 4 for k, v in dict(forward=1.0, backward=2.0, trainable=0.0, held=1.0).items()})
    cal = calibration(parallelism=4.0)
    shapes = {k: probe_fits.probe_shape(prof, 4, 8, k) for k in seconds}
    assert [shapes[k].cut for k in (1, 2, 4)] == [(4,), (2, 2), (1, 1, 1, 1)]
    ratios = probe_fits.recompute_ratios(prof, cal, 8, shapes, seconds)
    assert sorted(ratios) == [1, 2, 4]
    for k, ratio in ratios.items():
        shape = shapes[k]
        never = predict.step_seconds(prof, cal, 8, Config(shape.cut, 1, shape.m, "never", "gpipe")).step_s
        fitted = dataclasses.replace(prof, recompute_ratios={k: ratio})
        always = predict.step_seconds(fitted, cal, 8, Config(shape.cut, 1, shape.m, "always", "gpipe")).step_s
        assert always - never == pytest.approx(seconds[k][1] - seconds[k][0], rel=1e-3) and 0.1 < ratio < 1.5


def test_the_calibration_moves_16_mib_or_an_eighth_of_the_budget():
    assert calibration_lib.probe_size(None) == calibration_lib.PROBE_SIZE == 16 * 2**20
    assert calibration_lib.probe_size(2**30) == 16 * 2**20
    assert calibration_lib.probe_size(40 * 2**20) == 4 * 2**20  # an eighth is 5 MiB: the power of two below
    assert calibration_lib.probe_size(2**20) == 2**20  # never less: a smaller copy times too little to tell


def test_the_calibration_times_a_step_that_calls_its_cells_only_where_the_search_reaches_one(monkeypatch):
    from tfpipe.step.unrolled import NOINLINE_TASKS

    probed: list[int] = []

    def probe(layers, balance, devices, m, *args, **kwargs):
        probed.append(m)
        return calibration_lib.Probe(0.001 + 0.0001 * 2 * len(devices) * m, None)

    monkeypatch.setattr(calibration_lib, "_CALIBRATIONS", {})
    monkeypatch.setattr(calibration_lib, "_probe", probe)
    monkeypatch.setattr(calibration_lib, "in_rounds", lambda probes, kept, steps: probes)
    for name in ("_bandwidth", "_update_seconds_per_byte", "_copy_seconds_per_byte"):
        monkeypatch.setattr(calibration_lib, name, lambda *args: 1e-9)
    devices = ["/CPU:0", "/CPU:1"]
    fewer = calibration_lib.calibrate(devices, "sgd", most_tasks=NOINLINE_TASKS - 1)
    assert fewer.noinline_task_s is None and fewer.noinline_tasks == NOINLINE_TASKS
    assert max(probed) * 2 * len(devices) < NOINLINE_TASKS  # every step it timed inlines its cells
    probed.clear()
    reaching = calibration_lib.calibrate(devices, "sgd", most_tasks=NOINLINE_TASKS)  # not the cached one above
    assert max(probed) * 2 * len(devices) >= NOINLINE_TASKS
    assert reaching.noinline_task_s is not None and reaching.noinline_task_s > 0


def test_the_shortlist_is_timed_one_at_a_time_while_max_seconds_leaves_time_for_one_more(monkeypatch):
    from tfpipe.planning import progress as progress_lib

    clock = [0.0]
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    built_as = set()

    def configured_step(layers, sample, batch_size, config, devices, optimizer, repeated_layers="-"):
        built_as.add(repeated_layers)
        clock[0] += 50.0  # each configuration 50 s to trace, warm up and time
        return calibration_lib.Probe({"zero_bubble": 1.0, "gpipe": 0.8, "1f1b": 0.5}[config.schedule], None)

    monkeypatch.setattr(calibration_lib, "configured_step", configured_step)
    found = [
        candidate(2, 1, 4, "zero_bubble", 1.00),
        candidate(1, 1, 1, "gpipe", 1.05),
        candidate(2, 1, 4, "1f1b", 1.10),
    ]
    progress = progress_lib.Progress(0, max_seconds=120.0)
    not_run: list[str] = []
    ordered = planner.verified(found, [], None, 8, DEVICES, "sgd", 3, None, progress, not_run, "call")
    assert built_as == {"call"}  # timed as the planned model will train
    # at 100 s, one more at 50 s a configuration does not fit the 20 s left: two timed, the faster of them first
    assert [c.config.schedule for c in ordered] == ["gpipe", "zero_bubble", "1f1b"]
    assert [c.measured_s for c in ordered] == [0.8, 1.0, None]
    assert not_run == ["1 of the shortlist not timed: no time left"]
    not_run.clear()  # nothing timed: nothing said of the budget, without one or with one
    planner.verified(found, [], None, 8, DEVICES, "sgd", 0, None, None, not_run)
    planner.verified(found, [], None, 8, DEVICES, "sgd", 0, 1e6, None, not_run)
    assert not_run == []
    # under a budget the fastest predicted, too near it to run, is not timed, and the summary says so
    found[0] = dataclasses.replace(
        found[0], prediction=dataclasses.replace(found[0].prediction, peak_bytes=[0.9e6] * 2)
    )
    not_run.clear()
    ordered = planner.verified(found, [], None, 8, DEVICES, "sgd", 3, 1e6, None, not_run)
    assert [c.config.schedule for c in ordered] == ["1f1b", "gpipe", "zero_bubble"]
    assert not_run == [
        "K=2, M=4, remat='never', schedule='zero_bubble', balance=[2, 1] not timed: predicted to peak at 879 KiB, "
        "within 13% of the budget"
    ]


def test_a_shortlisted_configuration_predicted_past_the_bound_is_not_timed_the_first_included(monkeypatch):
    from tfpipe.planning import progress as progress_lib

    clock = [0.0]
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    timed = []

    def configured_step(layers, sample, batch_size, config, devices, optimizer, repeated_layers="-"):
        timed.append(config.num_micro_batches)
        clock[0] += 10.0
        return calibration_lib.Probe(1.0, None)

    monkeypatch.setattr(calibration_lib, "configured_step", configured_step)
    monkeypatch.setattr(probe_fits, "STEPS", 0)  # the tracing alone is predicted
    monkeypatch.setattr(calibration_lib, "PROBE_WARM_SECONDS", 0.0)
    measured = profile(sizes=(1, 2, 4, 8))
    measured.trace_s = [
        0.0,
        0.0,
        10.0,
    ]  # 10 s of tracing alone: traced in 3 x 10 + 0.25 x (10 x 2 x 1.5) ** 1.45 s at M=2, recomputing
    found = [candidate(2, 1, 2, "gpipe", 1.0, remat="always"), candidate(1, 1, 1, "gpipe", 1.1)]
    shape = probe_fits.shape_of(found[0].config, 8)
    assert shape == probe_fits.Shape(4, 2, (2, 1), "always")
    predicted = probe_fits.build_seconds(measured, shape)
    assert predicted == pytest.approx(
        30.0 + 0.25 * 30.0**1.45 + 2 * 2 * 18.0
    )  # and two steps of 2 micro-batches of 4 rows (18 s each)
    not_run: list[str] = []
    progress = progress_lib.Progress(0, max_seconds=predicted - 1.0)
    ordered = planner.verified(found, [], None, 8, DEVICES, "sgd", 2, None, progress, not_run, measured=measured)
    assert timed == [] and [c.measured_s for c in ordered] == [None, None]
    assert not_run == ["2 of the shortlist not timed: no time left; chosen by prediction alone"]


def test_the_summary_says_when_planning_went_past_its_bound_and_its_longest_part():
    plan = plans.from_candidates([candidate(2, 1, 8, "gpipe", 0.5)], DEVICES, 8, None, profile(), calibration(), 2)
    plan.planning_seconds, plan.planning_bound = 99.0, 60.0
    plan.planning_phases = {"measuring the 2 devices": 3.0, "measuring each of the 18 layers alone": 82.0}
    assert plan.planning()[0] == (
        "planning: 99 s, 198 steps of the chosen (past max_seconds=60; the longest part, measuring each of the 18 "
        "layers alone: 82 s)"
    )
    plan.planning_bound = 100.0  # within it: nothing more said
    assert plan.planning()[0] == "planning: 99 s, 198 steps of the chosen"


def test_out_of_time_the_batched_w_schedule_leaves_the_search_rather_than_be_read(monkeypatch):
    import types

    from tfpipe.planner import choose
    from tfpipe.planning import progress as progress_lib

    read = []
    monkeypatch.setattr(choose.joined, "bytes_per_sample", lambda *args: read.append(1) or [1.0, 1.0, 1.0])
    clock = [0.0]
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])
    progress = progress_lib.Progress(0, max_seconds=10.0)
    clock[0] = 11.0  # past the bound
    request = types.SimpleNamespace(space=search.Space(2, schedules=("gpipe", "gpipe_batched_w")), layers=[], data=None)
    request.devices = DEVICES
    measured = profile()
    measured.trace_s = [1.5, 2.0, 1.5]
    choose._joined(request, measured, progress)
    assert read == [] and request.space.schedules == ("gpipe",) and measured.joined_bytes == []
    assert measured.not_run == [
        "gpipe_batched_w not searched: reading what one W over all micro-batches joins (each kind of layer traced "
        "once) is predicted to take up to 5 s, 0 s left within max_seconds"
    ]
    # within the bound, but the layers' tracing summed is past what is left: not read either
    clock[0] = 6.0
    request.space = search.Space(2, schedules=("gpipe", "gpipe_batched_w"))
    choose._joined(request, measured, progress)
    assert read == [] and request.space.schedules == ("gpipe",) and "4 s left" in measured.not_run[-1]
    # where it is all the search has, it is read whatever the time; within the time, read
    request.space = search.Space(2, schedules=("gpipe_batched_w",))
    choose._joined(request, profile(), progress)
    clock[0] = 0.0
    request.space = search.Space(2, schedules=("gpipe", "gpipe_batched_w"))
    measured = profile()
    choose._joined(request, measured, progress)
    assert read == [1, 1] and measured.joined_bytes == [1.0, 1.0, 1.0] and measured.not_run == []


def test_a_shortlisted_step_that_a_probe_trained_takes_its_times_and_is_not_built_again(monkeypatch):
    built = []

    def configured_step(layers, sample, batch_size, config, devices, optimizer, repeated_layers="-"):
        built.append(config)
        return calibration_lib.Probe(0.9, None)

    monkeypatch.setattr(calibration_lib, "configured_step", configured_step)
    # probes: K=1 at M=1 on the whole batch of 8, two replicas of 4 rows at M=1; one of 4 rows x M=1 is no batch's step
    shapes = [probe_fits.Shape(8, 1, (3,)), probe_fits.Shape(4, 1, (3,), replicas=2), probe_fits.Shape(4, 1, (3,))]
    assert [probe_fits.config_of(s, 8) for s in shapes] == [
        Config((3,), 1, 1, "never", "gpipe"),
        Config((3,), 2, 1, "never", "gpipe"),
        None,
    ]
    measured = profile()
    measured.steps[(8, Config((3,), 1, 1, "never", "gpipe"))] = (0.7, 5.0)
    measured.steps[(8, Config((3,), 2, 1, "never", "gpipe"))] = (0.8, None)
    found = [
        candidate(2, 1, 4, "gpipe", 1.00),
        candidate(1, 1, 1, "gpipe", 1.05, remat="except_last"),  # at M=1 recomputing nothing: the probe's step
        candidate(1, 2, 1, "gpipe", 1.06),
    ]
    not_run: list[str] = []
    ordered = planner.verified(found, [], None, 8, DEVICES, "sgd", 3, None, None, not_run, "inline", measured)
    assert built == [found[0].config]  # the other two were trained by probes
    assert [(c.config.num_partitions, c.config.num_replicas, c.measured_s) for c in ordered] == [
        (1, 1, 0.7),
        (1, 2, 0.8),
        (2, 1, 0.9),
    ]
    # another batch size, or a profile reused for another plan: built again
    built.clear()
    planner.verified(found, [], None, 16, DEVICES, "sgd", 3, None, None, not_run, "inline", measured)
    assert len(built) == 3
    assert planner.reused(measured, [None] * len(measured.weight_bytes)).steps == {}


def test_the_auto_bound_tightens_to_what_the_fitted_predictions_give_and_never_grows(capsys):
    from types import SimpleNamespace

    from tfpipe.planner import choose
    from tfpipe.planning import progress as progress_lib

    def candidate(step_s, fits=True):
        return SimpleNamespace(prediction=SimpleNamespace(step_s=step_s), fits=fits)

    # the layers alone predicted 549 ms (a 110 s bound); whole steps fitted say 300 ms, and a faster one over the
    # budget does not count
    progress = progress_lib.Progress(1, max_seconds=110.0)
    choose._tightened(progress, [candidate(0.2, fits=False), candidate(0.3), candidate(0.4)])
    assert progress.max_seconds == pytest.approx(60.0)
    assert (
        "planning within 60 s (200 steps of 300.0 ms, the fastest the whole steps predict)" in capsys.readouterr().out
    )
    # never longer than the first bound, never under AUTO_MIN_SECONDS
    choose._tightened(progress, [candidate(0.5)])
    assert progress.max_seconds == pytest.approx(60.0)
    choose._tightened(progress, [candidate(0.01)])
    assert progress.max_seconds == pytest.approx(choose.AUTO_MIN_SECONDS)
    # none fits: the fastest of all is the bound's step
    unfitted = progress_lib.Progress(0, max_seconds=110.0)
    choose._tightened(unfitted, [candidate(0.25, fits=False)])
    assert unfitted.max_seconds == pytest.approx(50.0)
    # a profile reused: no bound was set, none is set now
    reused = progress_lib.Progress(0)
    choose._tightened(reused, [candidate(0.3)])
    assert reused.max_seconds is None
