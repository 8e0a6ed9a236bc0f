"""The schedule is plain data: GPipe clock cycles, per-device order, bubble arithmetic."""

import pytest

from tfpipe import schedule
from tfpipe.schedule import Task


def test_forward_cycles_are_diagonals():
    cycles = schedule.gpipe(3, 2, backward=False)
    assert [[str(t) for t in c] for c in cycles] == [["F(0,0)"], ["F(0,1)", "F(1,0)"], ["F(1,1)", "F(2,0)"], ["F(2,1)"]]


def test_backward_mirrors_forward():
    cycles = schedule.gpipe(2, 3)
    backward = [[str(t) for t in c] for c in cycles[4:]]
    assert backward == [["B(1,2)"], ["B(1,1)", "B(0,2)"], ["B(1,0)", "B(0,1)"], ["B(0,0)"]]


@pytest.mark.parametrize("k,m", [(1, 1), (2, 4), (4, 3), (5, 8)])
def test_every_task_once_and_dependencies_first(k, m):
    order = schedule.flatten(schedule.gpipe(k, m))
    assert sorted(order, key=str) == sorted(
        [Task(kind, i, j) for kind in "FB" for i in range(k) for j in range(m)], key=str
    )
    pos = {t: n for n, t in enumerate(order)}
    for i in range(k):
        for j in range(m):
            if i > 0:
                assert pos[Task("F", i - 1, j)] < pos[Task("F", i, j)]
                assert pos[Task("B", i, j)] < pos[Task("B", i - 1, j)]
            assert pos[Task("F", k - 1, j)] < pos[Task("B", k - 1, j)]


def test_device_order_per_device_and_shared_device():
    cycles = schedule.gpipe(2, 2)
    order = schedule.device_order(cycles, ["/GPU:0", "/GPU:1"])
    assert [str(t) for t in order["/GPU:0"]] == ["F(0,0)", "F(0,1)", "B(0,1)", "B(0,0)"]
    assert [str(t) for t in order["/GPU:1"]] == ["F(1,0)", "F(1,1)", "B(1,1)", "B(1,0)"]
    shared = schedule.device_order(cycles, ["/CPU:0", "/CPU:0"])
    assert [str(t) for t in shared["/CPU:0"]] == [
        "F(0,0)",
        "F(0,1)",
        "F(1,0)",
        "F(1,1)",
        "B(1,1)",
        "B(0,1)",
        "B(1,0)",
        "B(0,0)",
    ]


def test_bubble_and_ideal_speedup():
    assert schedule.bubble_fraction(1, 8) == 0.0
    assert schedule.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert schedule.ideal_speedup(4, 32) == pytest.approx(4 * 32 / 35)


@pytest.mark.parametrize("k,m", [(0, 1), (1, 0), (2.0, 1), (True, 2)])
def test_bad_sizes(k, m):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        schedule.gpipe(k, m)


@pytest.mark.parametrize("k,m,f,b", [(1, 1, 1.0, 2.0), (2, 4, 1.0, 2.0), (4, 3, 0.5, 1.5), (5, 8, 2.0, 2.0)])
def test_simulated_equal_costs_take_m_plus_k_minus_1_cycles_and_idle_the_bubble(k, m, f, b):
    timed = schedule.simulate(k, m, [f] * k, [b] * k)
    assert [task for task, _, _ in timed] == schedule.flatten(schedule.gpipe(k, m))
    makespan = max(end for _, _, end in timed)
    assert makespan == pytest.approx((m + k - 1) * (f + b))
    for i in range(k):
        busy = sum(end - start for task, start, end in timed if task.cell == i)
        assert busy == pytest.approx(m * (f + b))
        assert 1 - busy / makespan == pytest.approx(schedule.bubble_fraction(k, m))


def test_simulated_uneven_cells_wait_for_inputs_and_for_their_device():
    timed = schedule.simulate(2, 2, [1, 2], [2, 4])
    assert [(str(task), start, end) for task, start, end in timed] == [
        ("F(0,0)", 0, 1),
        ("F(0,1)", 1, 2),
        ("F(1,0)", 1, 3),
        ("F(1,1)", 3, 5),  # F(1,1) waits for cell 1
        ("B(1,1)", 5, 9),
        ("B(1,0)", 9, 13),
        ("B(0,1)", 9, 11),
        ("B(0,0)", 13, 15),
    ]  # B(0,0) waits for B(1,0)


def test_a_crossing_delays_only_the_tasks_that_read_another_devices_result():
    timed = schedule.simulate(2, 2, [1, 2], [2, 4], crossing=0.5)
    assert [(str(task), start, end) for task, start, end in timed] == [
        ("F(0,0)", 0, 1),
        ("F(0,1)", 1, 2),
        ("F(1,0)", 1.5, 3.5),  # F(0,0)'s result crosses
        ("F(1,1)", 3.5, 5.5),  # its own device is later than F(0,1)'s crossing
        ("B(1,1)", 5.5, 9.5),  # reads F(1,1) on its own device: no crossing
        ("B(1,0)", 9.5, 13.5),
        ("B(0,1)", 10, 12),  # B(1,1)'s result crosses
        ("B(0,0)", 14, 16),
    ]
    # two cells on one device: nothing crosses
    one = schedule.simulate(2, 2, [1, 2], [2, 4], "interleaved_1f1b", num_devices=1, crossing=0.5)
    assert max(end for _, _, end in one) == 18
    with pytest.raises(ValueError, match=r"crossing must be a duration >= 0 .*, got -1"):
        schedule.simulate(2, 2, [1, 2], [2, 4], crossing=-1)


def test_a_whole_backward_sending_its_inputs_first_hands_them_over_before_its_weights():
    timed = schedule.simulate(2, 2, [1, 2], [2, 4], w_cost=[1, 3], inputs_first=True)
    assert [(str(task), start, end) for task, start, end in timed] == [
        ("F(0,0)", 0, 1),
        ("F(0,1)", 1, 2),
        ("F(1,0)", 1, 3),
        ("F(1,1)", 3, 5),
        ("B(1,1)", 5, 9),  # its input gradients at 6, its weights' to 9
        ("B(1,0)", 9, 13),
        ("B(0,1)", 6, 8),
        ("B(0,0)", 10, 12),  # cell 0 sends nothing back: its device free at 12, not 15
    ]
    # where the cells share a device nothing is sent, and a split schedule's B is already only the inputs' part
    one = schedule.simulate(2, 2, [1, 2], [2, 4], "interleaved_1f1b", num_devices=1, inputs_first=True)
    assert max(end for _, _, end in one) == 18
    split = schedule.simulate(2, 2, [1, 2], [2, 4], "zero_bubble", inputs_first=True)
    assert split == schedule.simulate(2, 2, [1, 2], [2, 4], "zero_bubble")


def test_simulated_tasks_respect_every_dependency():
    timed = {task: (start, end) for task, start, end in schedule.simulate(3, 4, [1, 3, 2], [2, 1, 5])}
    for task, (start, end) in timed.items():
        i, j = task.cell, task.micro_batch
        deps = [Task("F", i - 1, j)] if task.kind == "F" else [Task("F", i, j), Task("B", i + 1, j)]
        assert all(timed[d][1] <= start for d in deps if d in timed), task
        assert end - start == ([1, 3, 2][i] if task.kind == "F" else [2, 1, 5][i])
    for i in range(3):  # one task at a time per device
        spans = sorted(span for task, span in timed.items() if task.cell == i)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize(
    "f,b,name",
    [
        ([1.0], [1.0, 1.0], "f_cost"),
        ([1.0, 1.0], [1.0, -1.0], "b_cost"),
        ([1.0, "x"], [1.0, 1.0], "f_cost"),
        (1.0, [1.0, 1.0], "f_cost"),
        ([1.0, float("nan")], [1.0, 1.0], "f_cost"),
    ],
)
def test_simulate_refuses_costs_that_are_not_one_duration_per_cell(f, b, name):
    with pytest.raises(ValueError, match=rf"{name} must be a list of 2 durations >= 0, one per cell"):
        schedule.simulate(2, 3, f, b)


def test_a_recomputing_backward_starts_with_a_forward_once_its_gradient_is_there():
    timed = schedule.simulate(2, 2, [1, 1], [2, 2], r_cost=[0.5, 1], recomputed=[0])
    assert [(str(task), start, end) for task, start, end in timed] == [
        ("F(0,0)", 0, 1),
        ("F(0,1)", 1, 2),
        ("F(1,0)", 1, 2),
        ("F(1,1)", 2, 3),
        ("B(1,1)", 3, 5),  # the last micro-batch keeps its activations
        ("B(1,0)", 5, 8),  # 1 to recompute, 2 to differentiate
        ("B(0,1)", 5, 7),
        ("B(0,0)", 8, 10.5),  # waits for B(1,0), then recomputes for 0.5
    ]
    default = schedule.simulate(2, 2, [1, 3], [2, 2], recomputed=[0, 1])  # a recomputation costs a forward
    assert [end - start for task, start, end in default if task.kind == "B"] == [5, 5, 3, 3]


def test_allowed_speedup_is_the_ideal_without_recomputation_and_less_with_it():
    for name in ("gpipe", "1f1b"):
        for k, m in [(1, 1), (2, 8), (4, 32)]:
            assert schedule.allowed_speedup(name, k, m) == pytest.approx(schedule.ideal_speedup(k, m))
    # One device recomputing all but the last micro-batch: 3 units per micro-batch, 1 more for seven of eight.
    assert schedule.allowed_speedup("gpipe", 1, 8, range(7)) == pytest.approx(24 / 31)
    # K=2, M=8, except_last: 9 forward cycles, then cell 1's 2 + 7 x 3, then cell 0's last 3: 35 against 48.
    assert schedule.allowed_speedup("gpipe", 2, 8, range(7)) == pytest.approx(48 / 35)
    assert schedule.allowed_speedup("gpipe", 2, 8, range(8)) == pytest.approx(4 / 3)
    assert schedule.allowed_speedup("zero_bubble", 2, 8) > schedule.ideal_speedup(2, 8)


@pytest.mark.parametrize("recomputed", [[8], [-1], [0.5]])
def test_simulate_refuses_micro_batches_it_does_not_have(recomputed):
    with pytest.raises(ValueError, match=r"recomputed holds .*: it lists micro-batch indices from 0 to 7"):
        schedule.simulate(2, 8, [1, 1], [2, 2], recomputed=recomputed)


def test_simulate_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_micro_batches must be an integer >= 1"):
        schedule.simulate(2, 0, [1, 1], [1, 1])
    with pytest.raises(ValueError, match="num_cells must be an integer >= 1"):
        schedule.simulate(0, 2, [], [])


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (2, 4), (4, 3), (4, 6), (3, 8)])
def test_every_schedule_runs_every_task_once_after_its_inputs(name, k, m):
    order = schedule.steps(name, k, m)
    kinds = "FBW" if schedule.splits_backward(name) else "FB"
    once = schedule.batches_weights(name)  # one W per cell, over all micro-batches
    expected = [
        Task(kind, i, j) for kind in kinds.replace("W", "" if once else "W") for i in range(k) for j in range(m)
    ]
    expected += [Task("W", i, schedule.ALL) for i in range(k)] if once else []
    assert sorted(order, key=str) == sorted(expected, key=str)
    pos = {t: n for n, t in enumerate(order)}
    for i in range(k):
        for j in range(m):
            assert pos[Task("F", i, j)] < pos[Task("B", i, j)]
            if "W" in kinds:
                assert pos[Task("B", i, j)] < pos[Task("W", i, schedule.ALL if once else j)]
            if i > 0:
                assert pos[Task("F", i - 1, j)] < pos[Task("F", i, j)]
                assert pos[Task("B", i, j)] < pos[Task("B", i - 1, j)]
    for i, cell_order in enumerate(schedule.cell_orders(name, k, m)):  # each cell keeps its own order
        assert [t for t in order if t.cell == i] == cell_order


def test_1f1b_alternates_after_its_warm_up_and_holds_at_most_k_minus_i_micro_batches():
    orders = schedule.cell_orders("1f1b", 3, 5)
    assert [str(t) for t in orders[0]] == [
        "F(0,0)", "F(0,1)", "F(0,2)", "B(0,0)", "F(0,3)", "B(0,1)", "F(0,4)", "B(0,2)", "B(0,3)", "B(0,4)",
    ]  # fmt: skip
    assert [str(t) for t in orders[2]][:4] == ["F(2,0)", "B(2,0)", "F(2,1)", "B(2,1)"]
    assert schedule.in_flight(schedule.steps("1f1b", 3, 5), 3) == [3, 2, 1]
    assert schedule.in_flight(schedule.steps("gpipe", 3, 5), 3) == [5, 5, 5]
    assert schedule.in_flight(schedule.steps("1f1b", 4, 2), 4) == [2, 2, 2, 1]  # M < K


def test_1f1b_has_gpipes_bubble():
    for k, m in [(2, 4), (4, 8)]:
        ends = [max(e for _, _, e in schedule.simulate(k, m, [1.0] * k, [2.0] * k, name)) for name in ("gpipe", "1f1b")]
        assert ends == [3.0 * (m + k - 1)] * 2


def test_zero_bubble_defers_i_weight_gradients_on_cell_i():
    orders = schedule.cell_orders("zero_bubble", 3, 5)
    assert [str(t) for t in orders[0]] == [
        "F(0,0)", "F(0,1)", "F(0,2)", "B(0,0)", "W(0,0)", "F(0,3)", "B(0,1)", "W(0,1)", "F(0,4)",
        "B(0,2)", "W(0,2)", "B(0,3)", "W(0,3)", "B(0,4)", "W(0,4)",
    ]  # fmt: skip
    assert [str(t) for t in orders[2]] == [
        "F(2,0)", "B(2,0)", "F(2,1)", "B(2,1)", "F(2,2)", "B(2,2)", "W(2,0)", "F(2,3)", "B(2,3)", "W(2,1)",
        "F(2,4)", "B(2,4)", "W(2,2)", "W(2,3)", "W(2,4)",
    ]  # fmt: skip
    # Activations live until W: every cell holds K micro-batches, 1F1B's peak (its first cell's).
    assert schedule.in_flight(schedule.steps("zero_bubble", 3, 5), 3) == [3, 3, 3]
    assert schedule.in_flight(schedule.steps("zero_bubble", 4, 2), 4) == [2, 2, 2, 2]  # M < K


@pytest.mark.parametrize("k,m", [(2, 8), (4, 8), (4, 16), (3, 5)])
def test_zero_bubble_has_the_papers_bubble(k, m):
    # Qi et al. 2024: 1F1B idles (K-1)(F+B+W) per device, ZB-H1 (K-1)(F+B-W), for M >= K.
    f, b, w = 1.0, 1.2, 0.8  # b: the input-gradient part of the backward; w: the weights'
    spans = {
        name: max(e for _, _, e in schedule.simulate(k, m, [f] * k, [b + w] * k, name, w_cost=[w] * k))
        for name in ("1f1b", "zero_bubble")
    }
    assert spans["1f1b"] == pytest.approx(m * (f + b + w) + (k - 1) * (f + b + w))
    assert spans["zero_bubble"] == pytest.approx(m * (f + b + w) + (k - 1) * (f + b - w))
    sim = schedule.simulate(k, m, [f] * k, [b + w] * k, "zero_bubble", w_cost=[w] * k)
    assert schedule.idle_fraction(sim, k) == pytest.approx((k - 1) * (f + b - w) / spans["zero_bubble"])


def test_batched_w_runs_each_cells_w_once_after_its_last_backward():
    orders = schedule.cell_orders("gpipe_batched_w", 2, 3)
    assert [str(t) for t in orders[1]] == ["F(1,0)", "F(1,1)", "F(1,2)", "B(1,2)", "B(1,1)", "B(1,0)", "W(1,all)"]
    assert schedule.depends_on(Task("W", 1, schedule.ALL), 2) == [Task("B", 1, 0)]
    # Every micro-batch is held until the W over all of them.
    assert schedule.in_flight(schedule.steps("gpipe_batched_w", 2, 3), 2) == [3, 3]
    timed = {str(t): (s, e) for t, s, e in schedule.simulate(2, 3, [1, 1], [2, 2], "gpipe_batched_w", w_cost=[1, 1])}
    assert timed["W(1,all)"] == (7.0, 10.0)  # after B(1,0) at 6-7, M W's long
    # Cell 1's W fills the time it would wait for cell 0: one F shorter than GPipe's 3(M+K-1)F = 12.
    assert timed["W(0,all)"] == (8.0, 11.0)
    assert schedule.allowed_speedup("gpipe_batched_w", 2, 8) > schedule.ideal_speedup(2, 8)


def test_simulate_refuses_a_weight_cost_above_the_backward():
    with pytest.raises(ValueError, match=r"w_cost \[1.0, 3.0\] is part of b_cost \[2.0, 2.0\]"):
        schedule.simulate(2, 2, [1, 1], [2, 2], "zero_bubble", w_cost=[1, 3])


def test_an_order_that_deadlocks_is_refused_naming_the_tasks():
    orders = [[Task("F", 0, 0), Task("B", 0, 0)], [Task("B", 1, 0), Task("F", 1, 0)]]
    with pytest.raises(ValueError, match=r"deadlock: B\(0,0\), B\(1,0\)"):
        schedule.merge(orders)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="Unknown schedule='pipedream'; use one of 'gpipe', '1f1b'"):
        schedule.steps("pipedream", 2, 2)
