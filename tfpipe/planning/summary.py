"""PipelineModel.summary's table: each cell's device, layers, parameters, cost share and bytes handed on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tfpipe import balance as balance_lib
from tfpipe import cost as cost_lib
from tfpipe import schedule

COLUMNS = ("Cell", "Device", "Layers", "Params", "Cost", "Share", "Out bytes/sample")
WIDTHS = [4, 24, 0, 12, 20, 6, 16]  # 0: the layers column takes what the line length leaves


def print_summary(
    model: Any,
    line_length: int | None = None,
    print_fn: Callable[[str], None] | None = None,
    cuts: list[list[tuple[str, tuple, float]]] | None = None,
) -> None:
    """Print ``model``'s cells, its parameter counts and the predicted pipeline efficiency; ``cuts``: a Functional
    model's tensors crossing each cut (maker, shape, bytes a sample)."""
    print_fn = print_fn or print
    width = line_length or 120
    cost_name = model.cost if isinstance(model.cost, str) else "custom"
    try:
        estimate, problem = model.layer_costs(), None
    except ValueError as err:
        estimate, problem = None, str(err)
    balance = model.balance
    per_cell = balance_lib.cell_costs(estimate.costs, balance) if estimate and balance else None
    rows, widths = _table(model, estimate, per_cell, cost_name, width)

    def fmt(row: Sequence[Any]) -> str:
        return "  ".join(str(c)[:w].ljust(w) for c, w in zip(row, widths)).rstrip()

    k, m = model.num_partitions, model.num_micro_batches
    print_fn(
        f'PipelineModel "{model.name}": '
        + (f"{model.num_replicas} replicas x " if model.num_replicas > 1 else "")
        + f"{k} cells, balance={balance}, "
        f"num_micro_batches={m}, remat={model.remat!r}, schedule={schedule.label(model.schedule)} "
        f"(bubble {100 * schedule.predicted_bubble(model.schedule, k, m, model.num_devices):.1f}%)"
        + (f" over {model.num_devices} devices" if model.num_devices != k else "")
        + f", cost={cost_name!r}"
        + (", each cell compiled by XLA" if model.cells_jit_compile else "")
    )
    print_fn("=" * width)
    print_fn(fmt(rows[0]))
    print_fn("-" * width)
    if len(rows) == 1:
        print_fn(f"(the balance is decided at build, from cost={cost_name!r})")
    for row in rows[1:]:
        print_fn(fmt(row))
    print_fn("=" * width)
    for cut, tensors in enumerate(cuts or []):
        total = si(sum(b for _, _, b in tensors)) + "B"
        listed = ", ".join(f"{name} {list(shape[1:])} {si(b)}B" for name, shape, b in tensors)
        print_fn(f"Cut {cut}|{cut + 1}: {len(tensors)} tensors, {total}/sample: {listed}")
    if model.built:
        _print_params(model, print_fn)
    if per_cell is not None:
        _print_efficiency(model, per_cell, print_fn)
    elif problem:
        print_fn(f"Costs not estimated: {problem}")


def _table(
    model: Any, estimate: Any, per_cell: list[float] | None, cost_name: str, width: int
) -> tuple[list[Any], list[int]]:
    """The table's header and one row per cell, and the column widths that fit ``width``."""
    header = list(COLUMNS)
    header[4] = f"Cost ({cost_lib.UNITS.get(cost_name, 'cost')})"
    rows: list[Any] = [tuple(header)]
    balance = model.balance
    for cell in model.cells:
        k = cell.index
        params = f"{cell.count_params():,}" if model.built else "unbuilt"
        cost = share = out = "-"
        if per_cell is not None:
            total = sum(per_cell) or 1.0
            cost, share = si(per_cell[k]), f"{100.0 * per_cell[k] / total:.1f}%"
            if estimate.output_bytes:
                out = si(estimate.output_bytes[sum(balance[: k + 1]) - 1]) + "B"
        replicated = model.num_replicas > 1
        device = ", ".join(row[k] for row in model.devices) if replicated else cell.device  # replicas listed
        rows.append([str(k), device, cell.describe(), params, cost, share, out])
    widths = list(WIDTHS)
    widths[1] = max(widths[1], *(len(row[1]) for row in rows))
    widths[2] = max(12, width - sum(widths) - 2 * (len(widths) - 1))
    for row, cell in zip(rows[1:], model.cells):  # the layers, cut to their column with the count kept
        row[2] = cell.describe(widths[2])
    return rows, widths


def _print_params(model: Any, print_fn: Callable[[str], None]) -> None:
    """The tied weights and the parameter counts of a built model."""
    _print_tied(model.cells, print_fn)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    total = sum(int(np.prod(v.shape)) for v in model.weights)
    print_fn(f"Total params: {total:,}")
    print_fn(f"Trainable params: {trainable:,}")
    print_fn(f"Non-trainable params: {total - trainable:,}")


def _print_efficiency(model: Any, per_cell: list[float], print_fn: Callable[[str], None]) -> None:
    """The predicted pipeline efficiency (the schedule's bubble x the cells' evenness) and what would raise it."""
    k, m = model.num_partitions, model.num_micro_batches
    evenness = balance_lib.evenness(per_cell)
    if _own_bubble(model.schedule):  # the bubble is not GPipe's M/(M+K-1): say whose it is
        bubble_free = 1.0 - schedule.predicted_bubble(model.schedule, k, m, model.num_devices)
        print_fn(
            f"Predicted pipeline efficiency: {100 * bubble_free * evenness:.1f}% = 1 - bubble of "
            f"{schedule.label(model.schedule)} {100 * bubble_free:.1f}% (backward 2x forward, half of it W) x "
            f"mean/max cell cost {100 * evenness:.1f}%"
        )
    else:
        bubble_free = 1.0 - schedule.bubble_fraction(k, m)
        print_fn(
            f"Predicted pipeline efficiency: {100 * balance_lib.efficiency(per_cell, m):.1f}% "
            f"= M/(M+K-1) {100 * bubble_free:.1f}% x mean/max cell cost {100 * evenness:.1f}%"
        )
    for hint in _hints(model, per_cell):
        print_fn(hint)


def _own_bubble(name: str) -> bool:
    """Whether schedule ``name``'s bubble is not GPipe's (K-1)/(M+K-1): it splits backwards or shares devices."""
    return schedule.splits_backward(name) or schedule.shares_devices(name)


def _hints(model: Any, per_cell: list[float]) -> list[str]:
    """What would raise the predicted efficiency: more micro-batches than 1, a device per cell."""
    k, m = model.num_partitions, model.num_micro_batches
    hints = []
    if m == 1 and k > 1 and not schedule.is_written(model.schedule):  # a written one has its own M
        more = 4 * k
        if _own_bubble(model.schedule):
            bubble = schedule.predicted_bubble(model.schedule, k, more, model.num_devices)
            better = (1.0 - bubble) * balance_lib.evenness(per_cell)
        else:
            better = balance_lib.efficiency(per_cell, more)
        hints.append(
            f"  num_micro_batches=1 (the default) runs the cells one after another; "
            f"num_micro_batches={more} would predict {100 * better:.1f}%."
        )
    shared: dict[str, list[int]] = {}
    for cell in model.cells:
        shared.setdefault(cell.device, []).append(cell.index)
    for device, cells in shared.items():
        if len(cells) > 1:
            hints.append(
                f"  Cells {cells} share {device} and cannot run at the same time: the prediction assumes a device "
                "per cell."
            )
    return hints


def si(value: float) -> str:
    """A number with an SI prefix: 1234567 -> '1.23 M'."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g}"


def _print_tied(cells: Any, print_fn: Callable[[str], None]) -> None:
    """A line per cell that uses weights of an earlier cell (tied weights, counted in the first cell's Params)."""
    owner: dict[int, int] = {}
    for cell in cells:
        borrowed = [v for v in cell.weights if id(v) in cell.borrowed]
        for v in cell.weights:
            owner.setdefault(id(v), cell.index)
        if borrowed:
            listed = ", ".join(f"{v.path} of cell {owner[id(v)]}" for v in borrowed)
            print_fn(f"Tied weights: cell {cell.index} also uses {listed}")
