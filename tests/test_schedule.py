"""The schedule is plain data: GPipe clock cycles, per-device order, bubble arithmetic."""

import pytest

from tfpipe import schedule
from tfpipe.schedule import Task


def test_forward_cycles_are_diagonals():
    cycles = schedule.gpipe(3, 2, backward=False)
    assert [[str(t) for t in c] for c in cycles] == [
        ["F(0,0)"], ["F(0,1)", "F(1,0)"], ["F(1,1)", "F(2,0)"], ["F(2,1)"]]


def test_backward_mirrors_forward():
    cycles = schedule.gpipe(2, 3)
    backward = [[str(t) for t in c] for c in cycles[4:]]
    assert backward == [["B(1,2)"], ["B(1,1)", "B(0,2)"], ["B(1,0)", "B(0,1)"], ["B(0,0)"]]


@pytest.mark.parametrize("k,m", [(1, 1), (2, 4), (4, 3), (5, 8)])
def test_every_task_once_and_dependencies_first(k, m):
    order = schedule.flatten(schedule.gpipe(k, m))
    assert sorted(order, key=str) == sorted(
        [Task(kind, i, j) for kind in "FB" for i in range(k) for j in range(m)], key=str)
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
        "F(0,0)", "F(0,1)", "F(1,0)", "F(1,1)", "B(1,1)", "B(0,1)", "B(1,0)", "B(0,0)"]


def test_bubble_and_ideal_speedup():
    assert schedule.bubble_fraction(1, 8) == 0.0
    assert schedule.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert schedule.ideal_speedup(4, 32) == pytest.approx(4 * 32 / 35)


@pytest.mark.parametrize("k,m", [(0, 1), (1, 0), (2.0, 1), (True, 2)])
def test_bad_sizes(k, m):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        schedule.gpipe(k, m)
