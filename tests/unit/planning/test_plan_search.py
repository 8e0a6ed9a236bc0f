"""The planner's time model and search by hand: a hand-made profile and calibration, predicted by hand."""

import dataclasses
import re

import keras
import pytest

from tests.unit.planning.handmade import DEVICES, calibration, memory_bound_profile, profile
from tfpipe import planner
from tfpipe.backward.remat import REMAT_MODES
from tfpipe.planner import probe_fits
from tfpipe.planning import plans, predict, search
from tfpipe.planning.predict import Config
from tfpipe.schedule import SCHEDULES


def test_one_cell_runs_every_task_one_after_another():
    prof, cal = profile(), calibration()
    # M=1: the whole batch of 4; F then B, each a task; nothing moves between devices
    config = Config((3,), 1, 1, "never", "gpipe")
    p = predict.step_seconds(prof, cal, 4, config)
    pipeline = (1 + 2 + 3) + (2 + 4 + 6) + 2 * 0.1
    update = (10 + 20 + 30) * 0.01
    assert p.pipeline_s == pytest.approx(pipeline)
    assert p.update_s == pytest.approx(update)
    assert p.fixed_s == pytest.approx(0.25)
    assert p.step_s == pytest.approx(pipeline + update + 0.25)
    # M=2 on a batch of 8: two micro-batches of 4, each F and B in turn
    p = predict.step_seconds(prof, cal, 8, Config((3,), 1, 2, "never", "gpipe"))
    assert p.step_s == pytest.approx(2 * ((1 + 2 + 3) + (2 + 4 + 6) + 2 * 0.1) + update + 0.25)


def test_one_cell_with_remat_always_recomputes_its_forward_in_each_backward():
    prof, cal = profile(), calibration()
    never = predict.step_seconds(prof, cal, 8, Config((3,), 1, 2, "never", "gpipe"))
    always = predict.step_seconds(prof, cal, 8, Config((3,), 1, 2, "always", "gpipe"))
    # each B first recomputes the cell's layers' forward: no second task cost, no second transfer
    assert always.step_s - never.step_s == pytest.approx(2 * (1 + 2 + 3))
    # a recomputation fitted at half a forward at K=1 (Profile.recompute_ratios) costs half; K=2's ratio is K=2's
    prof.recompute_ratios = {1: 0.5, 2: 0.25}
    halved = predict.step_seconds(prof, cal, 8, Config((3,), 1, 2, "always", "gpipe"))
    assert halved.step_s - never.step_s == pytest.approx(0.5 * 2 * (1 + 2 + 3))
    assert [prof.recompute_ratio(k) for k in (1, 2, 3, 4)] == [0.5, 0.25, 0.25, 0.25]
    prof.recompute_ratios = {1: 0.7, 4: 0.1}  # probed at K=1 and K=devices: linear between them
    assert [prof.recompute_ratio(k) for k in (1, 2, 3, 4, 5)] == pytest.approx([0.7, 0.5, 0.3, 0.1, 0.1])
    prof.recompute_ratios = {1: 0.5, 2: 0.25}
    assert profile().recompute_ratio(2) == 1.0  # not probed: a forward


def test_cells_cut_over_devices_run_at_the_fitted_split_speed_and_one_cell_as_measured():
    prof, cal = profile(), calibration()
    faster = dataclasses.replace(cal, split_speed=2.0)
    one, two = Config((3,), 1, 1, "never", "gpipe"), Config((1, 2), 1, 1, "never", "gpipe")
    assert predict.step_seconds(prof, faster, 4, one).step_s == predict.step_seconds(prof, cal, 4, one).step_s
    # K=2, M=1: F0 F1 B1 one after another, each layer's time halved; B0 (2) runs within B1's weights' part (5):
    # B1 sends its input gradients first
    halved = predict.step_seconds(prof, cal, 4, two).step_s - predict.step_seconds(prof, faster, 4, two).step_s
    assert halved == pytest.approx((1 + 2 + 3 + 4 + 6) / 2)
    # the planner fits it (and the recomputation ratio) by bisection on the prediction
    took = predict.step_seconds(prof, dataclasses.replace(cal, split_speed=1.7), 4, two).step_s
    fitted = probe_fits.fit(
        lambda x: predict.step_seconds(prof, probe_fits.at_speed(cal, x), 4, two).step_s, took, 3.0, 1.0
    )
    assert fitted == pytest.approx(1.7, rel=1e-4)
    assert probe_fits.fit(lambda x: x, 5.0, 3.0, 1.0) == 3.0 and probe_fits.fit(lambda x: x, 0.5, 3.0, 1.0) == 1.0


def test_two_gpipe_cells_follow_the_clock_cycles_by_hand():
    prof, cal = profile(), calibration(parallelism=1.5)
    config = Config((1, 2), 1, 2, "never", "gpipe")  # batch 8, M=2: micro-batches of 4
    moved = 100.0 * 4 / 4000.0  # layer 0's output, 4 samples, to the next device: 0.1 s (and its gradient back)
    f0 = 1 + 0.1
    f1 = (2 + 3) + 0.1 + moved
    b0 = 2 + 0.1 + moved
    b1 = (4 + 6) + 0.1
    # cell 0: F00 [0, f0], F01 [f0, 2 f0]; cell 1: F10 [f0, f0+f1], F11 [f0+f1, f0+2 f1] (f1 > f0);
    # B11 [f0+2 f1, f0+2 f1+b1], B10 then; each hands its input gradients over half its time before its end (inputs
    # first), and cell 0's B01 and B00 then take b0 < b1/2: cell 1's B10 ends the step at f0+2f1+2b1
    assert b0 < b1 / 2
    span = f0 + 2 * f1 + 2 * b1
    work = 2 * (f0 + f1 + b0 + b1)
    assert work / 1.5 < span  # the parallelism does not bind here
    p = predict.step_seconds(prof, cal, 8, config)
    update = max(10.0, 50.0, 60.0 / 1.5) * 0.01  # each device its own cell's weights: the larger, 50 bytes
    assert p.pipeline_s == pytest.approx(span)
    assert p.update_s == pytest.approx(update)
    assert p.step_s == pytest.approx(span + update + 0.25)
    # Two logical devices on one core: the work cannot overlap, and the step is all of it
    shared = predict.step_seconds(prof, calibration(parallelism=1.0), 8, config)
    assert shared.pipeline_s == pytest.approx(work)
    assert shared.update_s == pytest.approx(60 * 0.01)


def test_replicas_of_one_cell_share_the_devices_by_the_replicas_parallelism_and_pipelines_by_the_other():
    prof = profile()
    replicas = Config((3,), 2, 1, "never", "gpipe")  # batch 8: 4 rows a replica, its F and B one after another
    one = (1 + 2 + 3) + (2 + 4 + 6) + 2 * 0.1
    measured = dataclasses.replace(calibration(parallelism=2.0), replica_parallelism=1.25)
    assert predict.step_seconds(prof, calibration(parallelism=2.0), 8, replicas).pipeline_s == pytest.approx(one)
    assert predict.step_seconds(prof, measured, 8, replicas).pipeline_s == pytest.approx(2 * one / 1.25)
    # a pipeline, and replicas of a pipeline (micro-batch tasks, as the pipeline probe ran): the pipeline's
    for shape in (Config((1, 2), 1, 2, "never", "gpipe"), Config((1, 2), 2, 2, "never", "gpipe")):
        slow = dataclasses.replace(calibration(parallelism=1.0), replica_parallelism=2.0)
        assert predict.step_seconds(prof, slow, 16, shape).pipeline_s == pytest.approx(
            predict.step_seconds(prof, calibration(parallelism=1.0), 16, shape).pipeline_s
        )
        assert slow.parallelism_of(shape.num_replicas, shape.num_partitions) == 1.0


@pytest.mark.parametrize("shape", [Config((1, 2), 1, 4, "never", "gpipe"), Config((3,), 2, 1, "never", "gpipe")])
@pytest.mark.parametrize("parallelism", [1.0, 1.1])
def test_parallelism_found_from_a_measured_step_is_the_one_that_predicts_it(shape, parallelism):
    prof = profile()
    shared = dataclasses.replace(calibration(parallelism=parallelism), replica_parallelism=parallelism)
    took = predict.step_seconds(prof, shared, 16, shape).step_s
    # fitted on the whole step, the optimizer's update (which the devices also share) included
    assert probe_fits.parallelism(prof, calibration(), 16, shape, took) == pytest.approx(parallelism, rel=1e-4)
    # a step as fast as the devices side by side, or faster, is all of them
    every = dataclasses.replace(calibration(parallelism=2.0), replica_parallelism=2.0)
    free = predict.step_seconds(prof, every, 16, shape)
    assert probe_fits.parallelism(prof, calibration(), 16, shape, 0.9 * free.step_s) == 2.0


def space(**kwargs):
    """Two devices, M in (1, 2), GPipe and remat never unless told otherwise; no replicas."""
    return search.Space(
        num_devices=2,
        micro_batches=kwargs.get("micro_batches", (1, 2)),
        schedules=kwargs.get("schedules", ("gpipe",)),
        remats=kwargs.get("remats", ("never",)),
        replicas=kwargs.get("replicas", False),
    )


def test_search_picks_the_fastest_and_sorts_what_does_not_fit_last():
    # steps that call their cells (a backward sends its input gradients at its end): K=1 M=2 and K=2 M=1 tie
    prof, cal = profile(), dataclasses.replace(calibration(), noinline_tasks=1)
    found = search.run(prof, cal, 8, space(), None, 2)
    shapes = sorted((c.config.num_partitions, c.config.num_micro_batches) for c in found)
    assert shapes == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(c.fits for c in found)
    times = [round(c.prediction.step_s, 9) for c in found]
    assert times == sorted(times)  # ties (here K=1 M=2 and K=2 M=1) go to fewer devices
    assert [c.config.num_partitions for c in found if times.count(round(c.prediction.step_s, 9)) > 1] == [1, 2]
    for c in found:  # each prediction is step_seconds' own
        again = predict.step_seconds(prof, cal, 8, c.config)
        assert c.prediction.step_s == pytest.approx(again.step_s)

    # A budget under the fastest configuration's peak: the fastest of those that fit comes first
    both = space(remats=("never", "always"))
    fastest = search.run(prof, cal, 8, both, None, 2)[0]
    assert fastest.config == found[0].config  # recomputing is slower, never faster
    budget = max(fastest.prediction.peak_bytes) - 1
    tight = search.run(prof, cal, 8, both, budget, 2)
    fits = [c.fits for c in tight]
    assert fits[0] and fits == sorted(fits, reverse=True)  # every fitting one before every other
    assert any(not f for f in fits)
    fitting = [c for c in tight if c.fits]
    assert all(max(c.prediction.peak_bytes) <= budget for c in fitting)
    assert all(max(c.prediction.peak_bytes) > budget for c in tight if not c.fits)
    assert tight[0].prediction.step_s == pytest.approx(min(c.prediction.step_s for c in fitting))
    assert tight[0].config != fastest.config


def test_search_skips_what_cannot_run():
    prof, cal = profile(), calibration()
    found = search.run(prof, cal, 8, space(schedules=("gpipe", "gpipe_batched_w"), remats=("never", "always")), None, 2)
    configs = [c.config for c in found]
    # batched W holds every activation until W: never with recomputation; one cell: GPipe's order only
    assert not any(c.schedule == "gpipe_batched_w" and c.remat != "never" for c in configs)
    assert not any(c.num_partitions == 1 and c.schedule != "gpipe" for c in configs)
    assert len(configs) == len(set(configs))


def test_search_takes_the_memory_cut_when_the_time_even_cut_overflows():
    prof, cal = memory_bound_profile(), calibration()
    found = search.run(prof, cal, 8, space(micro_batches=(2,)), 1000.0, 2)
    two = next(c for c in found if c.config.num_partitions == 2)
    assert two.memory_cut and two.fits and two.config.balance == (3, 1)
    one = next(c for c in found if c.config.num_partitions == 1)
    assert not one.fits  # both heavy layers on one device
    assert found[0] is two


def test_from_candidates_names_the_smallest_budget_that_would_fit():
    prof, cal = profile(), calibration()
    found = search.run(prof, cal, 8, space(), 1.0, 2)
    assert not any(c.fits for c in found)
    smallest = min(found, key=lambda c: max(c.prediction.peak_bytes))
    message = (
        f"No configuration fits memory_budget=1 B on every device: the smallest predicted peak is "
        f"{plans.gib(max(smallest.prediction.peak_bytes))}, with {smallest.config.describe()}"
    )
    with pytest.raises(plans.NothingFits, match=re.escape(message)) as raised:
        plans.from_candidates(found, DEVICES, 8, 1.0, prof, cal, 2, {DEVICES[0]: 3 * 2**20, DEVICES[1]: 2**20})
    error = raised.value
    assert isinstance(error, ValueError) and error.smallest_budget == max(smallest.prediction.peak_bytes)
    assert error.profile is prof and error.calibration is cal and error.config == smallest.config
    assert str(error).endswith(f"plans again without measuring. Planning itself held at most 3 MiB on {DEVICES[0]}.")
    # planned from a reused profile, nothing measured: nothing held, nothing said of it
    with pytest.raises(plans.NothingFits, match=r"plans again without measuring\.$"):
        plans.from_candidates(found, DEVICES, 8, 1.0, prof, cal, 2, dict.fromkeys(DEVICES, 0.0))
    with pytest.raises(ValueError, match="No configuration to plan"):
        plans.from_candidates([], DEVICES, 8, None, prof, cal, 2)


def test_from_candidates_makes_the_plan_of_the_first():
    prof, cal = profile(), calibration()
    found = search.run(prof, cal, 8, space(replicas=True), None, 2)
    plan = plans.from_candidates(found, DEVICES, 8, None, prof, cal, 2)
    best = found[0].config
    assert (plan.num_partitions, plan.num_replicas, plan.num_micro_batches) == (
        best.num_partitions,
        best.num_replicas,
        best.num_micro_batches,
    )
    assert plan.balance == list(best.balance) and plan.num_layers == 3
    assert plan.step_seconds == found[0].prediction.step_s
    args = plan.pipeline_arguments()
    assert args["balance"] == list(best.balance) and args["remat"] == best.remat
    assert sorted(plan.device_peaks) == sorted(DEVICES[: best.num_partitions * best.num_replicas])


@pytest.mark.parametrize(
    "value, expected",
    [("12GiB", 12 * 2**30), ("512MB", 512e6), ("1e9", 1e9), ("1.5 kib", 1536.0), (1e9, 1e9), (4096, 4096.0)],
)
def test_parse_bytes(value, expected):
    assert plans.parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["abc", -1, 0, True, "", "12 GB of RAM", None, [1]])
def test_parse_bytes_rejects_what_is_not_a_positive_size(value):
    with pytest.raises(ValueError, match=r"memory_budget must be a number of bytes > 0"):
        plans.parse_bytes(value)


def test_optimizer_slots():
    assert planner.optimizer_slots("adam") == 2
    assert planner.optimizer_slots("Adam") == 2
    assert planner.optimizer_slots("sgd") == 0
    assert planner.optimizer_slots(keras.optimizers.SGD()) == 0
    assert planner.optimizer_slots(keras.optimizers.SGD(momentum=0.9)) == 1
    assert planner.optimizer_slots(keras.optimizers.AdamW()) == 2
    with pytest.raises(ValueError, match="Unknown optimizer 'nope'"):
        planner.optimizer_slots("nope")
    with pytest.raises(TypeError, match="optimizer must be a name"):
        planner.optimizer_slots(3)


def test_summary_prints_the_choice_and_why_the_runners_up_lost():
    prof, cal = profile(), calibration()
    every = search.run(prof, cal, 8, space(), None, 2)
    budget = sorted(max(c.prediction.peak_bytes) for c in every)[1]  # the two smallest fit, the others do not
    found = search.run(prof, cal, 8, space(), budget, 2)
    assert [c.fits for c in found].count(True) == 2
    plan = plans.from_candidates(found, DEVICES, 8, budget, prof, cal, 2)
    lines = []
    plan.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert lines[0] == f"tfpipe plan for a batch of 8 over 3 layers, memory budget {plans.gib(budget)} per device:"
    assert f"  chosen: {found[0].config.describe()}" in lines
    assert f"predicted step: {found[0].prediction.step_s * 1e3:.1f} ms" in text
    assert "step costs (by hand): 100.00 ms a task, 250.00 ms a step, 0.00 GiB/s between devices" in text
    assert "runners-up (3 other configurations tried):" in text
    runners = [line for line in lines if line.startswith("    K=")]
    assert len(runners) == 3
    assert re.search(r"K=\d.*: \+\d+% slower \(\d+\.\d ms\), peak ", runners[0]), runners
    assert sum("does not fit: predicted peak" in line for line in runners) == 2, runners
    assert f"> budget {plans.gib(budget)}" in runners[-1]


def test_runners_up_leave_out_configurations_predicted_like_one_already_shown():
    prof, cal = profile(), calibration()
    # at M=1 every schedule and remat mode runs alike: twelve candidates, few distinct outcomes
    found = search.run(prof, cal, 8, space(micro_batches=(1,), schedules=SCHEDULES, remats=REMAT_MODES), None, 2)
    plan = plans.from_candidates(found, DEVICES, 8, None, prof, cal, 2)
    shown = [plans._outcome(c) for c, _ in plan.runners_up(count=20)]
    assert len(shown) == len(set(shown)) and plans._outcome(found[0]) not in shown
    every = {plans._outcome(c) for c in found}
    assert len(shown) == len(every) - 1 < len(found) - 1  # each distinct outcome once, and some were ties


def test_summary_says_when_transfers_were_too_fast_to_time():
    # two logical GPUs of one card copied 16 MiB within a call's noise: no bandwidth, not 15,625,000 GiB/s
    prof, cal = profile(), calibration(bandwidth=float("inf"))
    found = search.run(prof, cal, 8, space(), None, 2)
    lines = []
    plans.from_candidates(found, DEVICES, 8, None, prof, cal, 2).summary(print_fn=lines.append)
    assert ", transfers between devices too fast to time, parallelism 1.50 devices" in "\n".join(lines)
