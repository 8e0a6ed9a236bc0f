"""The pipeline schedule as plain data: which task each device runs, in which order.

Two schedules, both one synchronous step with the same bubble (K-1)/(M+K-1):

- ``"gpipe"``: every cell runs all its forwards, then all its backwards (last
  micro-batch first); a cell holds the activations of all M micro-batches.
- ``"1f1b"`` (PipeDream-flush, Narayanan et al. 2021): cell i runs min(K-i, M)
  forwards, then alternates one backward and one forward, then drains its
  backwards (first micro-batch first); a cell holds at most K-i micro-batches.
"""

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


SCHEDULES = ("gpipe", "1f1b")


def check_name(name: str) -> str:
    """Validate a schedule name."""
    if name not in SCHEDULES:
        raise ValueError(f"Unknown schedule={name!r}; use one of {', '.join(repr(s) for s in SCHEDULES)}.")
    return name


def cell_orders(name: str, num_cells: int, num_micro_batches: int) -> list[list[Task]]:
    """Each cell's forward and backward tasks in the order the schedule ``name`` runs them."""
    check_name(name)
    k_cells = positive_int("num_cells", num_cells)
    m = positive_int("num_micro_batches", num_micro_batches)
    orders = []
    for i in range(k_cells):
        forwards = [Task("F", i, j) for j in range(m)]
        if name == "gpipe":
            orders.append(forwards + [Task("B", i, j) for j in reversed(range(m))])
            continue
        warm = min(k_cells - i, m)
        order = forwards[:warm]
        for j in range(m - warm):
            order += [Task("B", i, j), forwards[warm + j]]
        orders.append(order + [Task("B", i, j) for j in range(m - warm, m)])
    return orders


def steps(name: str, num_cells: int, num_micro_batches: int, backward: bool = True) -> list[Task]:
    """Every task of a step in an order that keeps each cell's order and puts each task after its inputs.

    GPipe's is its clock-cycle order (``flatten(gpipe(...))``); forward-only steps run GPipe's
    forward whatever ``name``. Other schedules are merged from ``cell_orders``, one task per cell
    in turn whenever its inputs exist.
    """
    check_name(name)
    if name == "gpipe" or not backward:
        return flatten(gpipe(num_cells, num_micro_batches, backward=backward))
    return merge(cell_orders(name, num_cells, num_micro_batches))


def merge(orders: Sequence[Sequence[Task]]) -> list[Task]:
    """One order of all tasks that keeps each cell's ``orders[i]`` and the data dependencies.

    F(i, j) needs F(i-1, j); B(i, j) needs F(i, j) and B(i+1, j). A ValueError names the
    tasks that wait on each other if the cells' orders cannot all be kept (a deadlock).
    """
    k_cells = len(orders)
    done: set[Task] = set()
    position, merged = [0] * k_cells, []
    while any(position[i] < len(orders[i]) for i in range(k_cells)):
        moved = False
        for i in range(k_cells):
            if position[i] < len(orders[i]) and _ready(orders[i][position[i]], done, k_cells):
                task = orders[i][position[i]]
                done.add(task)
                merged.append(task)
                position[i] += 1
                moved = True
        if not moved:
            waiting = [str(orders[i][position[i]]) for i in range(k_cells) if position[i] < len(orders[i])]
            raise ValueError(f"The cells' task orders deadlock: {', '.join(waiting)} each wait for another.")
    return merged


def _ready(task: Task, done: set[Task], num_cells: int) -> bool:
    i, j = task.cell, task.micro_batch
    if task.kind == "F":
        return i == 0 or Task("F", i - 1, j) in done
    return Task("F", i, j) in done and (i == num_cells - 1 or Task("B", i + 1, j) in done)


def in_flight(order: Sequence[Task], num_cells: int) -> list[int]:
    """Per cell, the most micro-batches whose forward has run and backward has not: activations held at once."""
    held, peak = [0] * num_cells, [0] * num_cells
    for task in order:
        held[task.cell] += 1 if task.kind == "F" else -1
        peak[task.cell] = max(peak[task.cell], held[task.cell])
    return peak


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
    num_cells: int,
    num_micro_batches: int,
    f_cost: Sequence[float],
    b_cost: Sequence[float],
    name: str = "gpipe",
) -> list[tuple[Task, float, float]]:
    """(task, start, end) of every task of schedule ``name``, cell i on its own device taking f_cost[i] per F
    and b_cost[i] per B.

    Tasks come in the order of ``steps``. A task starts when its device has finished the
    task before it and its inputs exist: F(i, j) after F(i-1, j); B(i, j) after
    F(i, j) and B(i+1, j). Transfers take no time.
    """
    positive_int("num_cells", num_cells)
    f_cost, b_cost = _costs("f_cost", f_cost, num_cells), _costs("b_cost", b_cost, num_cells)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * num_cells
    out = []
    for task in steps(name, num_cells, num_micro_batches):
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
