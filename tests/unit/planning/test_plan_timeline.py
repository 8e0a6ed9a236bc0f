"""The planner's predictions followed through the simulated schedule: one W over all micro-batches, and the peak of
devices that share one allocator."""

import dataclasses

import pytest

from tests.unit.planning.handmade import calibration, profile
from tfpipe import schedule as schedule_lib
from tfpipe.planning import predict
from tfpipe.planning.predict import Config


def _w_task(prof, config, batch, cell=0, cal=None):
    """The seconds of a cell's W task over every micro-batch, simulated."""
    found = predict.timeline(prof, cal or calibration(), batch, config)
    return next(end - start for task, start, end in found if task.kind == "W" and task.cell == cell)


def test_one_w_over_all_micro_batches_runs_at_the_whole_batch_s_speed():
    config = Config((2, 1), 1, 4, "never", "gpipe_batched_w")
    # times proportional to the rows: one W over 8 rows takes 4 micro-batches' W, half of each weighted backward
    linear = profile()
    assert _w_task(linear, config, 8) == pytest.approx(4 * 0.5 * (2.0 + 4.0) * 2 / 4)
    # the whole batch's backward measured at 1.5 x two rows' (not 4 x): W at the batch's speed
    fast = profile()
    fast.by_batch[8].backward_s[:] = [1.5 * x for x in fast.by_batch[2].backward_s]
    assert _w_task(fast, config, 8) == pytest.approx(0.5 * 1.5 * (2.0 + 4.0) * 2 / 4)
    cal = calibration()
    assert predict.step_seconds(fast, cal, 8, config).step_s < predict.step_seconds(linear, cal, 8, config).step_s
    # each B task is its backward less its W (plus the task's cost and its transfer)
    first = schedule_lib.Task("B", 0, 0)
    b0 = next(end - start for task, start, end in predict.timeline(fast, cal, 8, config) if task == first)
    moved = 50.0 * 2 / cal.bandwidth
    assert b0 == pytest.approx(0.5 * (2.0 + 4.0) * 2 / 4 + cal.task_s + moved)
    # a layer without trainable weights has no W: its whole backward is B
    none = profile(trainable=(0.0, 0.0, 30.0))
    assert _w_task(none, config, 8) == pytest.approx(0.0)
    # the replica's whole batch not profiled: M micro-batches' W
    short = profile(sizes=(1, 2, 4))
    assert _w_task(short, config, 8) == pytest.approx(4 * 0.5 * (2.0 + 4.0) * 2 / 4)


def test_one_w_over_all_micro_batches_first_copies_the_rows_it_joins():
    config = Config((2, 1), 1, 4, "never", "gpipe_batched_w")
    prof = profile()
    plain = _w_task(prof, config, 8)
    prof.joined_bytes = [3.0, 5.0, 7.0]  # per sample; cell 0 holds the first two layers
    assert _w_task(prof, config, 8) == pytest.approx(plain)  # no copy speed measured: no charge
    cal = dataclasses.replace(calibration(), copy_s_per_byte=0.001)
    # the replica's 8 rows of both layers, once
    assert _w_task(prof, config, 8, 0, cal) == pytest.approx(plain + (3.0 + 5.0) * 8 * 0.001)
    assert _w_task(prof, config, 8, 1, cal) == pytest.approx(_w_task(profile(), config, 8, 1) + 7.0 * 8 * 0.001)
    # a schedule that runs W per micro-batch joins nothing
    gpipe = Config((2, 1), 1, 4, "never", "gpipe")
    assert predict.step_seconds(prof, cal, 8, gpipe).step_s == pytest.approx(
        predict.step_seconds(profile(), calibration(), 8, gpipe).step_s
    )


def test_one_device_s_shared_peak_is_its_own_peak():
    prof = profile()
    for remat in ("never", "always"):
        config = Config((3,), 1, 4, remat, "gpipe")
        own = predict.peak_bytes(prof, 8, config, 2)[0]
        assert predict.shared_peak_bytes(prof, calibration(), 8, config, 2) == pytest.approx(own)


def test_devices_sharing_one_allocator_peak_together_only_where_the_schedule_holds_together():
    prof, slots = profile(), 2
    config = Config((2, 1), 1, 1, "never", "gpipe")  # F0 F1 B1 B0
    cell = [predict.cell_bytes(prof, 2, lo, hi, lo == 0, slots, 1) for lo, hi in predict.bounds((2, 1))]
    held = sum(c.static + c.cell_input + c.activations for c in cell)
    # B1 hands its input gradients over before its weights' part (inputs first): B0 starts while B1 still holds its
    # micro-batch and working set, and makes cell 0's gradients. The most is then everything, as the sum of peaks.
    assert cell[0].gradients == pytest.approx(sum(prof.trainable_bytes[:2]))  # one copy where the cells are inlined
    everything = held + sum(c.working for c in cell)
    assert predict.shared_peak_bytes(prof, calibration(), 2, config, slots) == pytest.approx(everything)
    assert sum(predict.peak_bytes(prof, 2, config, slots)) == pytest.approx(everything)
    # where B1 sends at its end (a step that calls its cells), B0 starts after cell 1 has let its micro-batch go
    called = dataclasses.replace(calibration(), noinline_tasks=1)
    cell = [predict.cell_bytes(prof, 2, lo, hi, lo == 0, slots, 1, inline=False) for lo, hi in predict.bounds((2, 1))]
    held = sum(c.static + c.cell_input + c.activations for c in cell)
    expected = max(
        held - cell[0].gradients + cell[1].working,
        held - cell[1].cell_input - cell[1].activations + cell[0].working,
    )
    assert predict.shared_peak_bytes(prof, called, 2, config, slots) == pytest.approx(expected)
    # 1F1B on four cells: cell i holds its most (K - i) at different moments; the sum of peaks overstates
    deep = profile(
        forward=(1.0,) * 4, backward=(2.0,) * 4, weights=(1.0,) * 4, trainable=(1.0,) * 4,
        outputs=(10.0,) * 4, held=(40.0,) * 4, working=(5.0,) * 4,
    )  # fmt: skip
    ones = Config((1, 1, 1, 1), 1, 8, "never", "1f1b")
    apart = sum(predict.peak_bytes(deep, 16, ones, slots))
    together = predict.shared_peak_bytes(deep, calibration(), 16, ones, slots)
    assert together < apart
    # GPipe holds every micro-batch on every cell at the end of its forwards: nearly the sum, less three working sets
    # and the gradients of cells 0-2 (64 tasks: not inlined, 1 + NOINLINE_GRADIENTS copies), made after that moment
    gpipe = Config((1, 1, 1, 1), 1, 8, "never", "gpipe")
    assert predict.shared_peak_bytes(deep, calibration(), 16, gpipe, slots) == pytest.approx(
        sum(predict.peak_bytes(deep, 16, gpipe, slots)) - 3 * 5.0 * 2 / 4 - 3 * (1.0 + predict.NOINLINE_GRADIENTS)
    )


@pytest.mark.parametrize("schedule", schedule_lib.SCHEDULES)
@pytest.mark.parametrize("remat", ["never", "always", "except_last"])
def test_the_shared_peak_is_at_most_the_sum_of_the_devices_peaks(schedule, remat):
    if schedule == "gpipe_batched_w" and remat != "never":
        pytest.skip("one W over all micro-batches keeps every micro-batch: it recomputes none")
    prof = profile()
    for replicas in (1, 2):
        config = Config((2, 1), replicas, 4, remat, schedule)
        together = predict.shared_peak_bytes(prof, calibration(), 16, config, 2)
        assert 0 < together <= sum(predict.peak_bytes(prof, 16, config, 2)) * (1 + 1e-9)
