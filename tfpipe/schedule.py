"""The pipeline schedule as plain data: which task each device runs, in which order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfpipe._args import positive_int


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work: the forward ("F") or backward ("B") of one cell on one micro-batch."""

    kind: str
    cell: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}({self.cell},{self.micro_batch})"


def gpipe(num_cells: int, num_micro_batches: int, backward: bool = True) -> list[list[Task]]:
    """GPipe's clock cycles: each cycle lists the tasks that may run at the same time.

    Forward: at cycle k, cell i runs micro-batch k - i. Backward mirrors it: cell
    K-1 starts with micro-batch M-1, and cell i runs B(i, j) at backward cycle
    (K-1-i) + (M-1-j).
    """
    positive_int("num_cells", num_cells)
    positive_int("num_micro_batches", num_micro_batches)
    k_cells, m = num_cells, num_micro_batches
    cycles = []
    for clock in range(m + k_cells - 1):
        cycles.append([Task("F", i, clock - i) for i in range(k_cells) if 0 <= clock - i < m])
    if backward:
        for clock in range(m + k_cells - 1):
            tasks = []
            for i in reversed(range(k_cells)):
                j = (m - 1) - (clock - (k_cells - 1 - i))
                if 0 <= j < m:
                    tasks.append(Task("B", i, j))
            cycles.append(tasks)
    return cycles


def flatten(cycles: Sequence[Sequence[Task]]) -> list[Task]:
    """All tasks in clock-cycle order; every task comes after the tasks it depends on."""
    return [task for cycle in cycles for task in cycle]


def device_order(cycles: Sequence[Sequence[Task]], cell_devices: Sequence[str]) -> dict[str, list[Task]]:
    """For each device, its tasks in the order the device must run them (clock cycle, then cell)."""
    order: dict[str, list[Task]] = {}
    for cycle in cycles:
        for task in sorted(cycle, key=lambda t: t.cell):
            order.setdefault(cell_devices[task.cell], []).append(task)
    return order


def simulate(
    num_cells: int, num_micro_batches: int, f_cost: Sequence[float], b_cost: Sequence[float]
) -> list[tuple[Task, float, float]]:
    """(task, start, end) of every GPipe task, cell i on its own device taking f_cost[i] per F and b_cost[i] per B.

    Tasks come in clock-cycle order. A task starts when its device has finished the
    task before it and its inputs exist: F(i, j) after F(i-1, j); B(i, j) after
    F(i, j) and B(i+1, j). Transfers take no time.
    """
    positive_int("num_cells", num_cells)
    f_cost, b_cost = _costs("f_cost", f_cost, num_cells), _costs("b_cost", b_cost, num_cells)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * num_cells
    out = []
    for task in flatten(gpipe(num_cells, num_micro_batches)):
        i, j = task.cell, task.micro_batch
        if task.kind == "F":
            ready = done.get(("F", i - 1, j), 0.0)
        else:
            ready = max(done[("F", i, j)], done.get(("B", i + 1, j), 0.0))
        start = max(free[i], ready)
        end = start + (f_cost[i] if task.kind == "F" else b_cost[i])
        done[(task.kind, i, j)] = free[i] = end
        out.append((task, start, end))
    return out


def _costs(name: str, costs: Sequence[float], num_cells: int) -> list[float]:
    """``costs`` as floats if it holds one duration >= 0 per cell, else a ValueError naming it."""
    try:
        values = [float(c) for c in costs]
    except (TypeError, ValueError):
        values = []
    if len(values) != num_cells or any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be a list of {num_cells} durations >= 0, one per cell, got {costs!r}.")
    return values


def bubble_fraction(num_cells: int, num_micro_batches: int) -> float:
    """Share of each device's time spent idle in a GPipe step: (K-1) / (M+K-1)."""
    positive_int("num_cells", num_cells)
    positive_int("num_micro_batches", num_micro_batches)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def ideal_speedup(num_cells: int, num_micro_batches: int) -> float:
    """Speed-up over one device if cells are perfectly balanced: K*M / (M+K-1)."""
    return num_cells * (1.0 - bubble_fraction(num_cells, num_micro_batches))
