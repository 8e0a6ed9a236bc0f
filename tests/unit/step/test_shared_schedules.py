"""Schedules with several cells per device: placement, each device's order, memory held and bubble, as data."""

import itertools

import pytest

from tfpipe import schedule
from tfpipe.schedule import Task

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
        if name in schedule.V_SCHEDULES and v != 2 or name == "dualpipev" and m < 2 * k - 1:
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


def test_dualpipev_fills_with_forwards_then_runs_a_forward_and_the_other_cell_s_whole_backward_in_turn():
    # K=2 devices, M=4: device 0 holds cells 0 and 3, device 1 cells 1 and 2
    orders = [[str(t) for t in order] for order in schedule.device_orders("dualpipev", 4, 4, 2)]
    assert orders[0][:3] == ["F(0,0)", "F(0,1)", "F(0,2)"]  # 2(K - 1 - d) forwards down, then one down and one up
    assert orders[0][3:6] == ["F(3,0)", "B(3,0)", "W(3,0)"]  # ... then a split backward up, its W, a forward up
    assert orders[1][:4] == ["F(1,0)", "F(2,0)", "F(1,1)", "F(2,1)"]  # the last device: down and up in turn
    # the steady phase on device 0 (M - 2K + 1 = 1 round): F down, whole B up, F up, whole B down
    assert orders[0][6:16] == ["F(3,1)", "F(0,3)", "B(3,1)", "W(3,1)", "F(3,2)", "B(0,0)", "W(0,0)", "B(3,2)",
                               "W(3,2)", "F(3,3)"]  # fmt: skip
    # the drain splits its later backwards: their W tasks come last, oldest first
    assert orders[1][-4:] == ["B(2,3)", "B(1,3)", "W(2,3)", "W(1,3)"]
    # with equal costs it takes ZB-V's time
    costs = ([1.0] * 4, [2.0] * 4)
    spans = [max(e for *_, e in schedule.simulate(4, 4, *costs, name, num_devices=2)) for name in schedule.V_SCHEDULES]
    assert spans[0] == spans[1]
    with pytest.raises(ValueError, match=r"schedule='dualpipev' needs at least 2K - 1 = 5 micro-batches on 3 devices"):
        schedule.device_orders("dualpipev", 6, 4, 3)


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
        ("dualpipev", 2, 8, [5, 5]),
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


def test_a_written_schedule_is_read_from_tfpipes_or_torchs_task_strings():
    ours = schedule.written([["F(0,0)", "F(0,1)", "B(0,0)", "B(0,1)"], ["F(1,0)", "B(1,0)", "F(1,1)", "B(1,1)"]])
    theirs = schedule.written([["0F0", "0F1", "0I0", "0B1"], ["1F0", "1B0", " 1F1 ", "1B1"]])  # I: a B
    assert ours == theirs == "F(0,0) F(0,1) B(0,0) B(0,1)\nF(1,0) B(1,0) F(1,1) B(1,1)"
    assert schedule.written("0F0,0F1,0I0,0B1\n1F0, 1B0, 1F1, 1B1") == ours  # torch's CSV: a row per rank
    assert schedule.check_name(ours) == ours and schedule.written(ours) == ours  # the text reads back as itself
    assert schedule.is_written(ours) and not schedule.is_written("zbv") and schedule.written_devices(ours) == 2
    assert schedule.placement(ours, 2, 2) == [0, 1] and not schedule.splits_backward(ours)
    assert schedule.device_orders(ours, 2, 2, 2)[1] == [
        Task("F", 1, 0),
        Task("B", 1, 0),
        Task("F", 1, 1),
        Task("B", 1, 1),
    ]
    assert schedule.label(ours) == "a written schedule on 2 devices"
    # torch's CSV text read as it is written, wherever a schedule is asked of
    csv = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1"
    assert schedule.placement(csv, 2, 2) == [0, 1] and schedule.splits_backward(csv)
    assert schedule.written_devices(csv) == 2 and schedule.check_written(csv, 2, 2) == csv
    assert schedule.device_orders(csv, 2, 2, 2)[0][2:4] == [Task("B", 0, 0), Task("W", 0, 0)]
    # The 1F1B order written out runs as 1F1B does.
    assert schedule.predicted_bubble(ours, 2, 2, 2) == pytest.approx(schedule.predicted_bubble("1f1b", 2, 2))


def test_a_written_schedule_of_two_cells_per_device_with_w_tasks_is_checked_whole():
    orders = schedule.device_orders("interleaved_zero_bubble", 4, 3, 2)
    text = schedule.written(orders)
    assert schedule.check_written(text, 4, 3) == text and schedule.splits_backward(text)
    assert schedule.placement(text, 4, 2) == [0, 1, 0, 1]
    assert schedule.steps(text, 4, 3, num_devices=2) == schedule.steps("interleaved_zero_bubble", 4, 3, num_devices=2)


@pytest.mark.parametrize(
    "orders,message",
    [
        ([["F(0,0)", "X(0,1)"]], r"device 0, task 1: 'X\(0,1\)' is not a task; write 'F\(cell,micro_batch\)'"),
        ([["F(0,0)", "B(0,0)"], ["F(1,0)", "B(1,0)", "F(0,1)"]], r"F\(0,1\) is on device 1, but cell 0's first task"),
        ([["F(0,0)", "F(0,0)"], ["F(1,0)"]], r"runs F\(0,0\) twice \(devices 0 and 0\)"),
        ([["F(0,0)", "F(0,1)", "B(0,0)", "B(0,1)"], ["F(1,0)", "B(1,0)", "F(1,1)"]], r"lacks B\(1,1\)\.$"),
        (
            [["F(0,0)", "F(0,1)", "B(0,0)", "W(0,0)", "B(0,1)"], ["F(1,0)", "B(1,0)", "F(1,1)", "B(1,1)"]],
            r"lacks W\(0,1\) \(its W tasks split the backward of every cell\)",
        ),
        (
            [["F(0,0)", "F(0,2)"], ["F(1,0)"]],
            r"F\(0,2\) \(device 0\) is out of range: the model has 2 cells \(0-1\) and "
            r"2 micro-batches",
        ),
        ([["F(0,0)", "F(0,1)", "B(0,1)", "B(0,0)"], ["F(1,1)", "B(1,1)", "F(1,0)", "B(1,0)"]], None),  # fine
        (
            [["F(0,0)", "B(0,0)", "F(0,1)", "B(0,1)"], ["F(1,1)", "B(1,1)", "F(1,0)", "B(1,0)"]],
            r"deadlock: B\(0,0\), F\(1,1\) each wait for another",
        ),
    ],
)
def test_a_written_schedule_that_is_not_whole_or_deadlocks_is_refused_naming_the_task(orders, message):
    if message is None:
        assert schedule.check_written(schedule.written(orders), 2, 2)
        return
    with pytest.raises(ValueError, match=message):
        schedule.check_written(schedule.written(orders), 2, 2)


def test_what_is_not_a_schedule_is_refused():
    with pytest.raises(TypeError, match=r"A written schedule is a list of each device's tasks"):
        schedule.written([["F(0,0)"], "F(1,0)"])
    with pytest.raises(ValueError, match="Unknown schedule='zb'; use one of .*, or write one as a list"):
        schedule.check_name("zb")
    with pytest.raises(ValueError, match=r"runs cells \[0, 1\] on 2 devices; the model has 3 cells \(0-2\) on 2"):
        schedule.placement(schedule.written([["F(0,0)"], ["F(1,0)"]]), 3, 2)
