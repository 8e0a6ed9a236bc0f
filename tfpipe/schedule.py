"""The pipeline schedule as plain data: which task each device runs, in which order."""

from __future__ import annotations

import dataclasses
from typing import Sequence

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


def bubble_fraction(num_cells: int, num_micro_batches: int) -> float:
    """Share of each device's time spent idle in a GPipe step: (K-1) / (M+K-1)."""
    positive_int("num_cells", num_cells)
    positive_int("num_micro_batches", num_micro_batches)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def ideal_speedup(num_cells: int, num_micro_batches: int) -> float:
    """Speed-up over one device if cells are perfectly balanced: K*M / (M+K-1)."""
    return num_cells * (1.0 - bubble_fraction(num_cells, num_micro_batches))
