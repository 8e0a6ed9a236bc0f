"""The planner's memory model by hand: peaks per schedule and remat, held ratios, inlining, the memory cut."""

import dataclasses

import numpy as np
import pytest

from tests.unit.planning.handmade import calibration, memory_bound_profile, profile
from tfpipe import balance as balance_lib
from tfpipe import schedule as schedule_lib
from tfpipe.planning import predict, search, units
from tfpipe.planning.predict import Config


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


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("1f1b", [1.5, 1.0]),  # cell 0: the last kept from its forward, one recomputed in its backward call
        ("gpipe", [1.0, 1.0]),  # the last kept, its backward first: no recomputation while it is held
        ("zero_bubble", [2.0, 2.0]),  # the last kept, and one recomputed at B handed to its W: both held in full
    ],
)
def test_a_micro_batch_recomputed_within_its_backward_call_holds_what_that_call_frees_as_it_goes(schedule, expected):
    order = schedule_lib.steps(schedule, 2, 4)
    assert predict.activations_at_once(order, 2, "except_last", 4, recomputing=0.5) == expected
    # a step that does not inline its cells keeps a forward call's every intermediate (ratio 1.2 here), while the
    # backward call that recomputes holds what an inlined step holds (0.6): except_last on 1F1B counts one of each
    prof = profile()
    prof.held_ratios = {True: ([1, 8], [0.6, 0.6]), False: ([1, 8], [1.2, 1.2])}
    m = predict.NOINLINE_TASKS // 4  # two cells: 2 K M tasks, not inlined
    config = Config((2, 1), 1, m, "except_last", "1f1b")
    in_flight, kept, ratio = predict.holding(prof, 2, 2, m, "1f1b", "except_last")
    assert (in_flight, kept, ratio) == ([2, 1], [1.5, 1.0], 1.2)
    activations = (40 + 30) * 2 / 4  # cell 0's layers at micro-batch size 2
    never = Config((2, 1), 1, m, "never", "1f1b")
    held_two = predict.peak_bytes(prof, 2 * m, never, 2)[0] - predict.peak_bytes(prof, 2 * m, config, 2)[0]
    assert held_two == pytest.approx((2 - 1.5) * 1.2 * activations)


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
    # cells in other processes are inlined up to twice as many tasks: the inlined ratio again
    later = 2 * predict.NOINLINE_TASKS
    assert predict.inlined(1, m, later) and not predict.inlined(1, later // 2, later)
    assert predict.peak_bytes(prof, 8 * m, big, slots, later)[0] < predict.peak_bytes(prof, 8 * m, big, slots)[0]


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


def _random_profile(layers, seed):
    """A profile of ``layers`` random layers at size 4, the last reading the first's weights (a tied embedding)."""
    rng = np.random.default_rng(seed)
    values = lambda low, high: tuple(float(v) for v in rng.integers(low, high, layers))  # noqa: E731
    prof = profile(
        forward=values(1, 9), backward=values(1, 9), weights=values(0, 900), trainable=values(0, 900),
        outputs=values(1, 60), held=values(1, 60), working=values(1, 30), sizes=(4,),
    )  # fmt: skip
    prof.tied = [units.Tied(0, layers - 1, 120.0, 100.0), units.Tied(0, layers - 2, 120.0, 100.0)]
    return prof


def _memory_balance_one_cell_at_a_time(prof, times, b, k, m, remat, schedule, slots, budget):
    """The dynamic program with each cell's peak from ``predict.cell_peak``: what the table must agree with."""
    held_at_once, kept, ratio = predict.holding(prof, b, k, m, schedule, remat)
    summed, inline = predict.holds_running_sums(m, schedule, False), predict.inlined(k, m)
    n, prefix = len(times), np.concatenate([[0.0], np.cumsum(times)])
    best, choice = np.full((k + 1, n + 1), np.inf), np.zeros((k + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, k + 1):
        for hi in range(c, n - (k - c) + 1):
            for lo in range(c - 1, hi):
                value = max(best[c - 1, lo], prefix[hi] - prefix[lo])
                if np.isfinite(best[c - 1, lo]) and value < best[c, hi]:
                    args = (held_at_once[c - 1], kept[c - 1], slots, m, ratio, inline, summed)
                    if predict.cell_peak(prof, b, lo, hi, c == 1, *args) <= budget:
                        best[c, hi], choice[c, hi] = value, lo
    if not np.isfinite(best[k, n]):
        return None
    cut, hi = [], n
    for c in range(k, 0, -1):
        cut.append(hi - int(choice[c, hi]))
        hi = int(choice[c, hi])
    return cut[::-1]


@pytest.mark.parametrize("first, inline, summed", [(True, True, False), (False, True, True), (False, False, False)])
def test_the_cell_bytes_table_holds_every_cells_bytes(first, inline, summed):
    prof = _random_profile(9, seed=1)
    table = predict.cell_bytes_table(prof, 4, first, 2, 8, 0.7, inline, summed)
    for lo in range(9):
        for hi in range(lo + 1, 10):
            one = predict.cell_bytes(prof, 4, lo, hi, first, 2, 8, 0.7, inline, summed)
            got = (table.static[lo, hi], table.cell_input[lo, 0], table.activations[lo, hi], table.working[lo, hi])
            assert got == pytest.approx((one.static, one.cell_input, one.activations, one.working), rel=1e-12)
            peak = predict.cell_peak(prof, 4, lo, hi, first, 3, 1.5, 2, 8, 0.7, inline, summed)
            assert table.peaks(3, 1.5)[lo, hi] == pytest.approx(peak, rel=1e-12)
    assert np.isinf(table.peaks(3, 1.5)[np.tril_indices(10)]).all()  # no cell where hi <= lo


@pytest.mark.parametrize("seed", range(6))
def test_memory_balance_cuts_as_a_scan_of_one_cell_at_a_time_does(seed):
    prof = _random_profile(14, seed)
    times = [f + x for f, x in zip(prof.costs(4).forward_s, prof.costs(4).backward_s)]
    schedule, remat = [("gpipe", "never"), ("1f1b", "always"), ("zero_bubble", "except_last")][seed % 3]
    k = 2 + seed % 3
    even = balance_lib.partition(times, k, boundary_bytes=prof.output_bytes)
    top = max(predict.peak_bytes(prof, 16, Config(tuple(even), 1, 4, remat, schedule), 2))
    found = []
    for budget in (0.7 * top, 0.85 * top, top):  # none fits, a cut off the time-even one, the time-even one
        expected = _memory_balance_one_cell_at_a_time(prof, times, 4, k, 4, remat, schedule, 2, budget)
        found.append(search.memory_balance(prof, times, 4, k, 4, remat, schedule, 2, budget))
        assert found[-1] == expected
    assert found[0] is None and found[-1] == even
    if seed in (0, 5):
        assert found[1] not in (None, even)  # memory binds: the table's cut is not the time-even one


def test_across_processes_the_first_replica_holds_the_others_gradients_as_copies():
    # measured on two workers (12 x Dense(512), two replicas): the first held one more copy of the weights
    prof = profile()
    config = Config((2, 1), 3, 1, "never", "gpipe")
    local = predict.peak_bytes(prof, 12, config, 2)
    remote = predict.peak_bytes(prof, 12, config, 2, across_processes=True)
    assert [a - b for a, b in zip(remote, local)] == pytest.approx([2 * (10 + 20), 2 * 30, 0, 0, 0, 0])
    one = Config((2, 1), 1, 1, "never", "gpipe")
    assert predict.peak_bytes(prof, 4, one, 2, across_processes=True) == predict.peak_bytes(prof, 4, one, 2)


@pytest.mark.parametrize(
    "schedule, m, summed",
    [
        ("gpipe", 4, True),
        ("1f1b", 4, True),
        ("zero_bubble", 4, True),
        ("gpipe", 1, False),
        ("gpipe_batched_w", 4, False),
    ],
)
def test_across_processes_a_cell_summing_micro_batches_gradients_holds_part_of_another_copy(schedule, m, summed):
    # measured on two workers (12 x Dense(512) cut 6-6, M > 1): each cell held 0.56-1.36 more copies of its gradients
    # than at M=1 with the same activations; the grids on logical devices of one process showed no such copy
    prof = profile()
    config = Config((2, 1), 1, m, "never", schedule)
    local = predict.peak_bytes(prof, 8, config, 2)
    remote = predict.peak_bytes(prof, 8, config, 2, across_processes=True)
    extra = predict.RUNNING_SUM if summed else 0.0
    assert predict.RUNNING_SUM > 0
    assert [a - b for a, b in zip(remote, local)] == pytest.approx([extra * (10 + 20), extra * 30])
