"""Schedules with several cells per device: placement, each device's order, memory held and bubble, as data."""

import itertools

import pytest

from tfpipe.step import schedule
from tfpipe.step.schedule import Task

GRID = [(k, v, m) for k, v, m in itertools.product(range(1, 6), range(1, 4), range(1, 10))]


def test_placement_round_robin_v_and_one_cell_per_device():
    assert schedule.placement("interleaved_1f1b", 6, 3) == [0, 1, 2, 0, 1, 2]
    assert schedule.placement("looped_bfs", 4, 2) == [0, 1, 0, 1]
    assert schedule.placement("zbv", 6, 3) == [0, 1, 2, 2, 1, 0]  # cells d and 2K-1-d on device d
    assert schedule.placement("1f1b", 3, 3) == [0, 1, 2]
    assert schedule.shares_devices("zbv") and not schedule.shares_devices("zero_bubble")


@pytest.mark.parametrize(
    "name,n,k,message",
    [
        ("zbv", 6, 2, r"schedule='zbv' puts two cells on each device in a V: 2 devices take 4 cells, not 6"),
        ("interleaved_1f1b", 5, 2, r"5 cells do not divide over 2 devices; use a multiple of 2 cells"),
        ("1f1b", 4, 2, r"schedule='1f1b' puts one cell on each device: 4 cells need 4 devices, not 2"),
    ],
)
def test_a_placement_that_does_not_lay_out_is_refused_with_the_fix(name, n, k, message):
    with pytest.raises(ValueError, match=message):
        schedule.placement(name, n, k)


@pytest.mark.parametrize("name", schedule.SHARED_SCHEDULES)
def test_every_device_runs_every_task_of_its_cells_once_after_its_inputs(name):
    for k, v, m in GRID:
        if name == "zbv" and v != 2:
            continue
        n = k * v
        where = schedule.placement(name, n, k)
        orders = schedule.device_orders(name, n, m, k)
        kinds = "FBW" if schedule.splits_backward(name) else "FB"
        for d, order in enumerate(orders):
            mine = [Task(kind, c, j) for kind in kinds for c in range(n) if where[c] == d for j in range(m)]
            assert sorted(order, key=str) == sorted(mine, key=str), (name, k, v, m, d)
        merged = schedule.steps(name, n, m, num_devices=k)  # merge raises where the devices' orders deadlock
        pos = {t: i for i, t in enumerate(merged)}
        assert all(pos[dep] < pos[t] for t in merged for dep in schedule.depends_on(t, n))
        for d, order in enumerate(orders):
            assert [t for t in merged if where[t.cell] == d] == order


def test_interleaved_1f1b_is_megatrons_order():
    # K=2 devices, v=2, M=4: groups of K micro-batches; (v-1)K + 2(K-1-d) forwards ahead, then F and B in turn.
    orders = schedule.device_orders("interleaved_1f1b", 4, 4, 2)
    assert [str(t) for t in orders[0]] == [
        "F(0,0)", "F(0,1)", "F(2,0)", "F(2,1)",
        "F(0,2)", "B(2,0)", "F(0,3)", "B(2,1)", "F(2,2)", "B(0,0)", "F(2,3)", "B(0,1)",
        "B(2,2)", "B(2,3)", "B(0,2)", "B(0,3)",
    ]  # fmt: skip
    assert [str(t) for t in orders[1]][:6] == ["F(1,0)", "F(1,1)", "F(3,0)", "B(3,0)", "F(3,1)", "B(3,1)"]


def test_looped_bfs_runs_each_cell_breadth_first():
    orders = schedule.device_orders("looped_bfs", 4, 2, 2)
    assert [str(t) for t in orders[1]] == [
        "F(1,0)",
        "F(1,1)",
        "F(3,0)",
        "F(3,1)",
        "B(3,1)",
        "B(3,0)",
        "B(1,1)",
        "B(1,0)",
    ]


def test_interleaved_zero_bubble_runs_each_w_d_backwards_after_its_b_on_device_d():
    for d, order in enumerate(schedule.device_orders("interleaved_zero_bubble", 6, 6, 3)):
        b = [t for t in order if t.kind == "B"]
        for w in (t for t in order if t.kind == "W"):
            behind = sum(1 for t in b if order.index(t) < order.index(w)) - b.index(Task("B", w.cell, w.micro_batch))
            assert behind == min(d + 1, len(b) - b.index(Task("B", w.cell, w.micro_batch)))


@pytest.mark.parametrize(
    "name,k,m,held",
    [
        ("interleaved_1f1b", 2, 8, [5, 3]),  # micro-batches of a cell (half a device's layers) at once
        ("interleaved_1f1b", 4, 8, [11, 9, 7, 5]),
        ("looped_bfs", 2, 8, [16, 16]),  # GPipe's: every micro-batch of every cell
        ("zbv", 2, 8, [4, 4]),  # 1F1B's first device: K micro-batches of the device's layers
        ("zbv", 4, 8, [8, 8, 8, 8]),
    ],
)
def test_what_each_device_holds(name, k, m, held):
    n = 2 * k
    order = schedule.steps(name, n, m, num_devices=k)
    assert schedule.held_per_device(order, schedule.placement(name, n, k)) == held


def test_zbv_never_holds_more_than_1f1bs_memory():
    for k, _, m in GRID:
        order = schedule.steps("zbv", 2 * k, m, num_devices=k)
        assert max(schedule.held_per_device(order, schedule.placement("zbv", 2 * k, k))) <= 2 * k


@pytest.mark.parametrize("k,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_two_cells_per_device_shrink_the_bubble(k, m):
    # Equal cells, a backward twice the forward (W half of it): the idle share of each schedule on K devices.
    one = schedule.predicted_bubble("1f1b", k, m)
    interleaved = schedule.predicted_bubble("interleaved_1f1b", 2 * k, m, k)
    assert interleaved <= 0.7 * one
    assert schedule.predicted_bubble("looped_bfs", 2 * k, m, k) == pytest.approx(interleaved, abs=0.02)
    zb = schedule.predicted_bubble("zero_bubble", k, m)
    assert schedule.predicted_bubble("interleaved_zero_bubble", 2 * k, m, k) < zb
    assert schedule.predicted_bubble("zbv", 2 * k, m, k) < zb
    assert schedule.predicted_bubble("interleaved_1f1b", 4, 4, 2) == pytest.approx(2 / 18)  # (K-1)/(vM+K-1) x 2/2


def test_simulate_runs_one_task_at_a_time_on_each_device():
    timed = schedule.simulate(6, 4, [1, 2, 1, 1, 2, 1], [2, 3, 2, 2, 3, 2], "interleaved_1f1b", num_devices=3)
    where = schedule.placement("interleaved_1f1b", 6, 3)
    for d in range(3):
        spans = sorted((s, e) for t, s, e in timed if where[t.cell] == d)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))
    assert schedule.idle_fraction(timed, 3) < schedule.idle_fraction(
        schedule.simulate(3, 4, [3, 4, 2], [5, 6, 4], "1f1b"), 3
    )


def test_one_cell_orders_are_not_asked_of_a_shared_schedule():
    with pytest.raises(ValueError, match="orders the tasks of each device, not of each cell: use device_orders"):
        schedule.cell_orders("zbv", 4, 2)
