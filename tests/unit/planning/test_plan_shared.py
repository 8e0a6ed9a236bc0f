"""The planner with several cells per device (interleaved, looped BFS, ZB-V): each device's time and bytes, by hand."""

import dataclasses

import pytest

from tests.unit.planning.handmade import DEVICES, calibration, profile
from tfpipe import schedule as schedule_lib
from tfpipe.planning import plans, predict, search
from tfpipe.planning.predict import Config


def four_layers():
    """Four layers of equal time, each a different size: where a cell's bytes land shows in its device's peak."""
    return profile(
        forward=(1.0, 1.0, 1.0, 1.0),
        backward=(2.0, 2.0, 2.0, 2.0),
        weights=(10.0, 20.0, 30.0, 40.0),
        trainable=(10.0, 20.0, 30.0, 40.0),
        outputs=(4.0, 4.0, 4.0, 4.0),
        held=(8.0, 16.0, 24.0, 32.0),
        working=(1.0, 9.0, 3.0, 5.0),
    )


@pytest.mark.parametrize("schedule, where", [("interleaved_1f1b", [0, 1, 0, 1]), ("zbv", [0, 1, 1, 0])])
def test_a_device_holds_the_state_and_activations_of_every_cell_on_it_and_one_backward_s_working_set(schedule, where):
    prof, m, slots = four_layers(), 4, 2
    config = Config((1, 1, 1, 1), 1, m, "never", schedule, cells_per_device=2)
    assert (config.num_partitions, config.num_devices, config.placement()) == (4, 2, where)
    assert config.describe().startswith("K=4 on 2 devices, M=4")
    peaks = predict.peak_bytes(prof, 8, config, slots)
    assert len(peaks) == 2  # one per device, not per cell
    in_flight, kept, ratio = predict.holding(prof, 2, 4, m, schedule, "never", num_devices=2)
    parts = [predict.cell_bytes(prof, 2, i, i + 1, i == 0, slots, m, ratio) for i in range(4)]
    for device in (0, 1):
        mine = [c for c in range(4) if where[c] == device]
        held = sum(parts[c].static + in_flight[c] * parts[c].cell_input + kept[c] * parts[c].activations for c in mine)
        assert peaks[device] == pytest.approx(held + max(parts[c].working for c in mine))


def test_cells_sharing_a_device_run_one_at_a_time_and_interleaving_shrinks_the_bubble():
    prof, cal = four_layers(), calibration(parallelism=2.0)
    shared = Config((1, 1, 1, 1), 1, 4, "never", "interleaved_1f1b", cells_per_device=2)
    simulated = predict.timeline(prof, cal, 8, shared)
    for device in (0, 1):
        spans = sorted((start, end) for task, start, end in simulated if shared.placement()[task.cell] == device)
        assert all(end <= next_start + 1e-9 for (_, end), (next_start, _) in zip(spans, spans[1:]))
    # the same layers as two cells, one a device, under 1F1B: the same work, a longer step (bubble (K-1)/(M+K-1)
    # against (K-1)/(vM+K-1))
    one_each = Config((2, 2), 1, 4, "never", "1f1b")
    interleaved = predict.step_seconds(prof, cal, 8, shared)
    plain = predict.step_seconds(prof, cal, 8, one_each)
    assert interleaved.pipeline_s < plain.pipeline_s
    # each device updates the weights of both its cells: (10 + 30) and (20 + 40) bytes, the larger sets the time
    assert interleaved.update_s == pytest.approx((20 + 40) * 0.01)


def test_a_v_s_turn_moves_nothing_between_devices():
    prof, cal = four_layers(), calibration(bandwidth=1.0)  # slow transfers: a boundary of 2 rows x 4 bytes takes 8 s

    def forward_seconds(schedule):
        config = Config((1, 1, 1, 1), 1, 1, "never", schedule, cells_per_device=2)
        return [end - start for task, start, end in predict.timeline(prof, cal, 2, config) if task.kind == "F"]

    # a forward task is its cell's 0.5 s at 2 rows, the task's 0.1 s, and what it receives from another device
    assert forward_seconds("interleaved_zero_bubble") == pytest.approx([0.6, 8.6, 8.6, 8.6])
    assert forward_seconds("zbv") == pytest.approx([0.6, 8.6, 0.6, 8.6])  # cells 1 and 2 share device 1


def test_the_search_tries_v_cells_on_each_device_where_every_cell_keeps_a_layer():
    prof, cal = four_layers(), calibration()
    space = search.Space(num_devices=2, micro_batches=(2,), remats=("never",), replicas=False)
    found = search.run(prof, cal, 8, space, None, 2)
    shared = {(c.config.schedule, c.config.cells_per_device, c.config.num_devices) for c in found}
    shared = {s for s in shared if s[1] > 1}
    assert search.most_tasks(8, 4, space) == 2 * 4 * 2  # 4 cells of 2 micro-batches
    # v=2 on two devices: 4 cells of one layer each; v=4 would leave cells empty; DualPipeV needs M >= 3
    assert shared == {(name, 2, 2) for name in schedule_lib.SHARED_SCHEDULES if name != "dualpipev"}
    space = dataclasses.replace(space, micro_batches=(2, 4))
    assert {
        c.config.num_micro_batches for c in search.run(prof, cal, 8, space, None, 2) if c.config.schedule == "dualpipev"
    } == {4}
    assert all(c.config.balance == (1, 1, 1, 1) for c in found if c.config.cells_per_device > 1)
    only_v = search.Space(num_devices=2, micro_batches=(2,), schedules=("interleaved_1f1b",), cells_per_device=(4,))
    assert search.run(prof, cal, 8, only_v, None, 2) == []  # 8 cells of 4 layers: none


def test_a_plan_of_several_cells_a_device_names_its_devices_once():
    prof, cal = four_layers(), calibration()
    space = search.Space(num_devices=2, micro_batches=(2,), schedules=("zbv",), replicas=False)
    found = search.run(prof, cal, 8, space, None, 2)
    plan = plans.from_candidates(found, DEVICES, 8, None, prof, cal, 2)
    assert (plan.num_partitions, plan.devices, plan.schedule) == (4, DEVICES, "zbv")
    assert plan.pipeline_arguments()["balance"] == [1, 1, 1, 1]
    assert sorted(plan.device_peaks) == DEVICES


def test_a_split_backward_where_cells_are_not_inlined_holds_halfway_between_the_two_shares():
    prof = dataclasses.replace(four_layers(), held_ratios={True: ([2], [0.5]), False: ([2], [1.0])})
    # 2 K M = 64 tasks: the cells are called, not inlined; a split backward's share is the mean of the two
    assert predict.held_share(prof, 2, False, "zbv") == pytest.approx(0.75)
    assert predict.held_share(prof, 2, False, "zero_bubble") == pytest.approx(0.75)
    assert predict.held_share(prof, 2, False, "interleaved_1f1b") == pytest.approx(1.0)  # one VJP call keeps it all
    assert predict.held_share(prof, 2, True, "zbv") == pytest.approx(0.5)  # inlined: what the backward reads
    for schedule, share in (("zbv", 0.75), ("interleaved_1f1b", 1.0)):
        assert predict.holding(prof, 2, 4, 8, schedule, "never", num_devices=2)[2] == pytest.approx(share)
    cal, zbv = calibration(), Config((1, 1, 1, 1), 1, 8, "never", "zbv", cells_per_device=2)
    kept_whole = dataclasses.replace(prof, held_ratios={True: ([2], [1.0]), False: ([2], [1.0])})
    # less held than at a called cell's whole share, as measured
    assert predict.shared_peak_bytes(prof, cal, 16, zbv, 2) < predict.shared_peak_bytes(kept_whole, cal, 16, zbv, 2)


def test_a_cell_s_gradients_are_held_from_its_first_backward_and_their_call_copies_while_one_runs():
    prof, cal, slots = four_layers(), calibration(), 2
    config = Config((1, 1, 1, 1), 1, 8, "never", "looped_bfs", cells_per_device=2)  # 64 tasks: not inlined
    simulated = predict.timeline(prof, cal, 16, config)
    first = predict.first_backwards(simulated)
    assert sorted(first, key=first.get) == [3, 2, 1, 0]  # looped BFS: every backward of cell 3, then cell 2's, ...
    part = predict.cell_bytes(prof, 2, 3, 4, False, slots, 8, inline=False)
    assert part.gradients == pytest.approx((1 + predict.NOINLINE_GRADIENTS) * 40.0)
    assert part.called == pytest.approx(predict.NOINLINE_GRADIENTS * 40.0)  # in and out of a call, while it runs
    assert predict.cell_bytes(prof, 2, 3, 4, False, slots, 8).called == 0.0  # inlined: no call to copy into
    # heavier weights on the cells whose backwards come last raise the peak by less than all their gradients: they
    # are made after the other cells' activations are let go
    heavy = dataclasses.replace(
        prof, trainable_bytes=[110.0, 120.0, 30.0, 40.0], weight_bytes=[110.0, 120.0, 30.0, 40.0]
    )
    grown = predict.shared_peak_bytes(heavy, cal, 16, config, slots) - predict.shared_peak_bytes(
        prof, cal, 16, config, slots
    )
    assert grown < (1 + slots + 1 + predict.NOINLINE_GRADIENTS) * 200.0
