"""The planner's pieces without measuring anything: a hand-made profile and calibration, predicted by hand."""

import dataclasses
import re

import keras
import pytest

from tfpipe import planner
from tfpipe.backward.remat import REMAT_MODES
from tfpipe.planning import balance as balance_lib
from tfpipe.planning import plans, predict, search
from tfpipe.planning.predict import Calibration, Config
from tfpipe.planning.profile import LayerCosts, Profile
from tfpipe.step import schedule as schedule_lib
from tfpipe.step.schedule import SCHEDULES

DEVICES = ["/CPU:0", "/CPU:1"]


def calibration(parallelism=1.5, bandwidth=4000.0):
    """A hand-made calibration: 0.1 s a task, 0.25 s a step, 0.01 s of update per byte of weights."""
    return Calibration(
        task_s=0.1,
        step_s=0.25,
        bandwidth=bandwidth,
        parallelism=parallelism,
        update_s_per_byte=0.01,
        source="by hand",
    )


def profile(
    forward=(1.0, 2.0, 3.0),
    backward=(2.0, 4.0, 6.0),
    weights=(10.0, 20.0, 30.0),
    trainable=(10.0, 20.0, 30.0),
    outputs=(100.0, 50.0, 10.0),
    held=(40.0, 30.0, 20.0),
    working=(5.0, 7.0, 3.0),
    input_bytes=8.0,
    sizes=(1, 2, 4, 8),
):
    """A hand-made profile whose per-layer seconds and held bytes scale with the micro-batch size (given at 4)."""
    by_batch = {
        b: LayerCosts(
            [f * b / 4 for f in forward],
            [x * b / 4 for x in backward],
            [h * b / 4 for h in held],
            [w * b / 4 for w in working],
        )
        for b in sizes
    }
    return Profile(
        "/CPU:0", list(weights), list(trainable), input_bytes, list(outputs), by_batch, "held bytes given by hand"
    )


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


def test_two_gpipe_cells_follow_the_clock_cycles_by_hand():
    prof, cal = profile(), calibration(parallelism=1.5)
    config = Config((1, 2), 1, 2, "never", "gpipe")  # batch 8, M=2: micro-batches of 4
    moved = 100.0 * 4 / 4000.0  # layer 0's output, 4 samples, to the next device: 0.1 s (and its gradient back)
    f0 = 1 + 0.1
    f1 = (2 + 3) + 0.1 + moved
    b0 = 2 + 0.1 + moved
    b1 = (4 + 6) + 0.1
    # cell 0: F00 [0, f0], F01 [f0, 2 f0]; cell 1: F10 [f0, f0+f1], F11 [f0+f1, f0+2 f1] (f1 > f0);
    # B11 [f0+2 f1, f0+2 f1+b1], B10 then; cell 0: B01 after B11, B00 after B10 (b1 > b0): ends f0+2f1+2b1+b0
    span = f0 + 2 * f1 + 2 * b1 + b0
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


def test_replicas_share_the_devices_by_the_replicas_parallelism_and_pipelines_by_the_other():
    prof = profile()
    replicas = Config((3,), 2, 1, "never", "gpipe")  # batch 8: 4 rows a replica, its F and B one after another
    one = (1 + 2 + 3) + (2 + 4 + 6) + 2 * 0.1
    measured = dataclasses.replace(calibration(parallelism=2.0), replica_parallelism=1.25)
    assert predict.step_seconds(prof, calibration(parallelism=2.0), 8, replicas).pipeline_s == pytest.approx(one)
    assert predict.step_seconds(prof, measured, 8, replicas).pipeline_s == pytest.approx(2 * one / 1.25)
    pipeline = Config((1, 2), 1, 2, "never", "gpipe")
    assert predict.step_seconds(prof, measured, 8, pipeline).pipeline_s == pytest.approx(
        predict.step_seconds(prof, calibration(parallelism=2.0), 8, pipeline).pipeline_s
    )


@pytest.mark.parametrize("shape", [Config((1, 2), 1, 4, "never", "gpipe"), Config((3,), 2, 1, "never", "gpipe")])
@pytest.mark.parametrize("parallelism", [1.0, 1.1])
def test_parallelism_found_from_a_measured_step_is_the_one_that_predicts_it(shape, parallelism):
    prof = profile()
    shared = dataclasses.replace(calibration(parallelism=parallelism), replica_parallelism=parallelism)
    took = predict.step_seconds(prof, shared, 16, shape).step_s
    # within 1%: the optimizer's update, which the devices also share, is taken as predicted for free devices
    assert planner._parallelism(prof, calibration(), 16, shape, took) == pytest.approx(parallelism, rel=0.01)
    # a step as fast as the devices side by side, or faster, is all of them
    every = dataclasses.replace(calibration(parallelism=2.0), replica_parallelism=2.0)
    free = predict.step_seconds(prof, every, 16, shape)
    assert planner._parallelism(prof, calibration(), 16, shape, 0.9 * free.step_s) == 2.0


def test_peak_bytes_of_one_cell_with_remat_never_and_always_by_hand():
    prof = profile()
    b, m, slots = 2, 4, 2  # batch 8 in 4 micro-batches of 2
    static = (10 + 20 + 30) + (1 + slots) * (10 + 20 + 30)  # weights, gradients, Adam's two slots
    activations = (40 + 30 + 20) * b / 4  # one micro-batch's held bytes at size 2
    working = max(5, 7, 3) * b / 4  # the largest backward's working set
    batch = 2 * m * b * 8.0  # the first cell holds the batch
    inputs = b * 8.0  # one micro-batch's input to the cell
    never = predict.peak_bytes(prof, 8, Config((3,), 1, m, "never", "gpipe"), slots)
    always = predict.peak_bytes(prof, 8, Config((3,), 1, m, "always", "gpipe"), slots)
    # GPipe on one cell runs every forward before the first backward: all 4 micro-batches are in flight
    assert never == [pytest.approx(static + m * inputs + m * activations + working + batch)]
    assert always == [pytest.approx(static + m * inputs + activations + working + batch)]
    assert never[0] - always[0] == pytest.approx((m - 1) * activations)


@pytest.mark.parametrize(
    "schedule, remat, expected",
    [
        ("gpipe", "never", [4, 4]),  # every micro-batch's activations until the backward
        ("gpipe", "always", [1, 1]),  # one recomputed at a time
        ("gpipe", "except_last", [1, 1]),  # the last is kept, and its backward runs first, before any recompute
        ("1f1b", "never", [2, 1]),  # K - i in flight
        ("1f1b", "except_last", [2, 1]),  # cell 0: the last kept while an earlier one is recomputed
        ("zero_bubble", "always", [1, 2]),  # recomputed at B, held until W, which the last cell defers past a B
        ("gpipe_batched_w", "never", [4, 4]),
    ],
)
def test_activations_held_at_once_follow_the_schedule_and_remat(schedule, remat, expected):
    order = schedule_lib.steps(schedule, 2, 4)
    assert predict.activations_at_once(order, 2, remat, 4) == expected


def test_held_ratios_scale_the_activations_by_whether_the_step_inlines_its_cells():
    prof = profile()
    # what steps held against the layers' bytes: measured at sizes 1 and 4 inlined, at 2 not inlined
    prof.held_ratios = {True: ([1, 4], [0.4, 0.6]), False: ([2], [1.1])}
    assert prof.held_ratio(2, True) == pytest.approx(0.5)  # halfway in log2(size)
    assert (prof.held_ratio(8, True), prof.held_ratio(8, False)) == (pytest.approx(0.6), pytest.approx(1.1))
    b, m, slots = 2, 4, 2
    ones = profile()  # the same profile, no ratios: the layers' bytes as measured
    activations = (40 + 30 + 20) * b / 4
    inlined = predict.peak_bytes(prof, 8, Config((3,), 1, m, "never", "gpipe"), slots)
    plain = predict.peak_bytes(ones, 8, Config((3,), 1, m, "never", "gpipe"), slots)
    assert plain[0] - inlined[0] == pytest.approx(m * activations * (1 - 0.5))
    # from NOINLINE_TASKS tasks (2 K M) on, the step calls its cells without inlining them: the other ratio
    m = predict.NOINLINE_TASKS // 2
    assert not predict.inlined(1, m) and predict.inlined(1, m - 1)
    big = Config((3,), 1, m, "never", "gpipe")
    b = predict.micro_batch_size(8 * m, big)
    apart = predict.peak_bytes(prof, 8 * m, big, slots)[0] - predict.peak_bytes(ones, 8 * m, big, slots)[0]
    assert apart == pytest.approx(m * (40 + 30 + 20) * b / 4 * (1.1 - 1))


def test_a_step_that_does_not_inline_its_cells_pays_its_own_task_cost_and_more_gradient_copies():
    prof, slots = profile(), 2
    m = predict.NOINLINE_TASKS // 2  # one cell: 2 x 1 x M tasks, the first M not inlined
    called, inlined = Config((3,), 1, m, "never", "gpipe"), Config((3,), 1, m - 1, "never", "gpipe")
    # measured apart: 0.3 s a task where cells are called, 0.1 where inlined; each of the 2 M tasks pays it
    cal = dataclasses.replace(calibration(), noinline_task_s=0.3)
    assert cal.task_seconds(True) == 0.1 and cal.task_seconds(False) == 0.3
    for config in (called, inlined):
        batch = 4 * config.num_micro_batches
        extra = (
            predict.step_seconds(prof, cal, batch, config).step_s
            - predict.step_seconds(prof, calibration(), batch, config).step_s
        )
        assert extra == pytest.approx(0.2 * 2 * config.num_micro_batches if config is called else 0.0)
    # not measured apart (no probe past the threshold): the inlined cost
    assert calibration().task_seconds(False) == 0.1
    # the running gradient sums in and out of each call: NOINLINE_GRADIENTS more copies of the trainable bytes
    args = (prof, 4, 0, 3, True, 1, 1, slots, m)
    gap = predict.cell_peak(*args, 1.0, False) - predict.cell_peak(*args, 1.0, True)
    assert gap == pytest.approx(predict.NOINLINE_GRADIENTS * (10 + 20 + 30))


def test_peak_bytes_count_the_optimizer_slots_on_the_first_replica_only():
    prof = profile()
    two = predict.peak_bytes(prof, 8, Config((3,), 2, 1, "never", "gpipe"), 2)
    assert len(two) == 2
    assert two[0] - two[1] == pytest.approx(2 * (10 + 20 + 30))


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
    prof, cal = profile(), calibration()
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


def memory_bound_profile():
    """Four layers of equal time; the last two hold 600 bytes of weights each, the first two none."""
    return profile(
        forward=(1.0, 1.0, 1.0, 1.0),
        backward=(2.0, 2.0, 2.0, 2.0),
        weights=(0.0, 0.0, 600.0, 600.0),
        trainable=(0.0, 0.0, 0.0, 0.0),
        outputs=(1.0, 1.0, 1.0, 1.0),
        held=(1.0, 1.0, 1.0, 1.0),
        working=(1.0, 1.0, 1.0, 1.0),
        input_bytes=1.0,
    )


def test_memory_balance_moves_layers_off_the_device_that_overflows():
    prof = memory_bound_profile()
    b, k, m = 4, 2, 2  # batch 8, M=2
    times = [f + x for f, x in zip(prof.costs(b).forward_s, prof.costs(b).backward_s)]
    even = balance_lib.partition(times, k, boundary_bytes=prof.output_bytes)
    assert even == [2, 2]
    budget = 1000.0
    even_peaks = predict.peak_bytes(prof, 8, Config(tuple(even), 1, m, "never", "gpipe"), 2)
    assert max(even_peaks) > budget  # the time-even cut puts both heavy layers on the last device
    cut = search.memory_balance(prof, times, b, k, m, "never", "gpipe", 2, budget)
    assert cut is not None and cut != even and sum(cut) == 4
    assert cut == [3, 1]  # the least largest time among the cuts that fit
    assert all(peak <= budget for peak in predict.peak_bytes(prof, 8, Config(tuple(cut), 1, m, "never", "gpipe"), 2))
    # no budget: nothing to fit; a budget no cut fits: None
    assert search.memory_balance(prof, times, b, k, m, "never", "gpipe", 2, None) is None
    assert search.memory_balance(prof, times, b, k, m, "never", "gpipe", 2, 500.0) is None


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
    with pytest.raises(ValueError, match=re.escape(message)):
        plans.from_candidates(found, DEVICES, 8, 1.0, prof, cal, 2)
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
    assert "step costs (by hand): 100.00 ms a task, 250.00 ms a step" in text
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
