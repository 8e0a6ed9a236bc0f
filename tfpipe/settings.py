"""A PipelineModel's settings: the constructor's arguments checked, or taken from a plan, as one ``Settings``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tfpipe import balance as balance_lib
from tfpipe import cost as cost_lib
from tfpipe import schedule as schedule_lib
from tfpipe._args import positive_int
from tfpipe.backward import remat as remat_lib
from tfpipe.distributed import devices as devices_lib
from tfpipe.partition import functional
from tfpipe.planning.plans import Plan
from tfpipe.step.unrolled import check_remat, check_unroll

# PipelineModel's defaults for the settings a plan chooses (its signature keeps them: tests/unit/test_settings.py)
PLANNED_DEFAULTS: dict[str, Any] = {
    "balance": None,
    "num_partitions": None,
    "num_micro_batches": 1,
    "remat": "except_last",
    "schedule": "gpipe",
}


class Settings(NamedTuple):
    """The constructor's arguments, checked: the split asked for, M, how steps are built, the devices."""

    cell_sizes: list[int] | None  # the balance given; None when num_partitions asks for a split by cost
    num_cells: int
    cost: cost_lib.Cost
    num_micro_batches: int
    remat: str
    unroll: bool
    schedule: str
    replica_devices: list[list[str]]  # one device per cell, per replica
    num_devices: int  # K, the devices the schedule lays the cells over (the number of cells unless it shares them)


def check(
    layers: Any,
    graph: functional.Graph | None,
    units: int,
    balance: Sequence[int] | None,
    num_partitions: int | None,
    cost: cost_lib.Cost,
    devices: Any,
    num_micro_batches: int,
    remat: str,
    unroll: bool,
    schedule: Any,
) -> Settings:
    """PipelineModel's arguments checked (``units``: layers, or a Functional model's nodes), with errors that
    say what to pass instead."""
    if (balance is None) == (num_partitions is None):
        raise ValueError(
            "Give exactly one of balance=[layers per cell] or num_partitions=K; got "
            f"balance={balance!r}, num_partitions={num_partitions!r}."
        )
    cost = cost_lib.check_kind(cost)
    if cost == "memory":
        raise ValueError(
            "cost='memory' needs a measurement outside the training graph; compute "
            "balance=tfpipe.balance.by_memory(layers, K, sample) first and pass it as balance=."
        )
    unit = "layers" if graph is None else f"nodes (layer and keras.ops calls) in {layers.name!r}"
    if graph is not None and graph.whole:
        unit += f" ({graph.whole_note()})"
    cell_sizes = balance_lib.check(balance, units, unit) if balance is not None else None
    if cell_sizes:
        num_cells = len(cell_sizes)
    else:
        assert num_partitions is not None  # given where balance is not (checked above)
        num_cells = balance_lib.check_num_partitions(num_partitions, units, unit)
    m = positive_int("num_micro_batches", num_micro_batches, "Use 1 to disable micro-batching.")
    remat = remat_lib.check_mode(remat)
    schedule = schedule_lib.check_name(schedule)
    if schedule_lib.is_written(schedule):
        schedule_lib.check_written(schedule, num_cells, m)
    check_remat(remat, schedule)
    unroll = check_unroll(unroll, remat, schedule)
    replica_devices, num_devices = placed(devices, num_cells, schedule)
    schedule_lib.check_micro_batches(schedule, m, num_devices)  # DualPipeV's phases need 2K - 1
    return Settings(cell_sizes, num_cells, cost, m, remat, unroll, schedule, replica_devices, num_devices)


def placed(devices: Any, num_cells: int, schedule: str) -> tuple[list[list[str]], int]:
    """Each replica's cell devices, and K, the devices the schedule lays the cells over.

    A schedule of one cell per device takes one device per cell (``devices_lib.resolve_replicas``). One of
    ``SHARED_SCHEDULES`` takes the K devices (or one per cell, laid out as it places them; None: the machine's,
    K = N/2 for a V) and puts its cells on them (``schedule.placement``).
    """
    if not schedule_lib.shares_devices(schedule):
        return devices_lib.resolve_replicas(devices, num_cells), num_cells
    rows = [list(row) for row in devices] if devices_lib.is_replicated(devices) else [devices]
    ks = {_shared_k(row, num_cells, schedule) for row in rows}
    if len(ks) > 1:
        raise ValueError(f"Every replica's devices must number the same K, got {sorted(ks)} in devices={devices!r}.")
    k = ks.pop()
    where = schedule_lib.placement(schedule, num_cells, k)  # checks that N cells lay out over K devices
    slot_rows = [row[:k] if row is not None and len(row) != num_cells else _slots(row, where, k) for row in rows]
    resolved = devices_lib.resolve_replicas(slot_rows if len(rows) > 1 else slot_rows[0], k)
    return [[row[where[c]] for c in range(num_cells)] for row in resolved], k


def _shared_k(row: Any, num_cells: int, schedule: str) -> int:
    """K for one replica's ``devices`` under a schedule that shares devices."""
    if schedule_lib.is_written(schedule):
        return schedule_lib.written_devices(schedule)
    if row is None:
        found = len(devices_lib.available())
        return num_cells // 2 if schedule in schedule_lib.V_SCHEDULES or num_cells % found else found
    if isinstance(row, str) or not hasattr(row, "__iter__"):
        raise TypeError(f"devices must be a list of device strings, got {row!r}.")
    if len(row) != num_cells:
        return len(row)
    return num_cells // 2 if schedule in schedule_lib.V_SCHEDULES else len(dict.fromkeys(row))


def _slots(row: list[str] | None, where: list[int], k: int) -> list[str] | None:
    """The K devices of a list of one device per cell, which must follow ``where``; None stays None."""
    if row is None:
        return None
    slots = [row[where.index(d)] for d in range(k)]
    if any(row[c] != slots[d] for c, d in enumerate(where)):
        raise ValueError(
            f"devices={row!r} gives one device per cell, which the schedule must place as {where} (the device of "
            f"each cell): give the {k} devices instead, e.g. devices={slots!r}."
        )
    return slots


def from_plan(plan: Any, units: int, given: dict[str, Any]) -> dict[str, Any]:
    """PipelineModel's arguments from ``plan`` (a ``tfpipe.plan`` result), checked against those given beside it.

    ``given`` holds balance, num_partitions, devices, num_micro_batches, remat and schedule as passed:
    the first three must be left out, the others left at their defaults or equal to the plan's.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f'plan must be what tfpipe.plan(...) returns, or "auto", got {plan!r:.80}.')
    if plan.num_layers != units:
        raise ValueError(
            f"The plan was made for {plan.num_layers} layers but this model has {units}; plan this model's layers."
        )
    clashes = [name for name in ("balance", "num_partitions", "devices") if given[name] is not None]
    planned = plan.pipeline_arguments()
    clashes += [n for n, d in PLANNED_DEFAULTS.items() if d is not None and given[n] != d and given[n] != planned[n]]
    if clashes:
        raise ValueError(
            f"plan= sets {', '.join(clashes)}; leave {'it' if len(clashes) == 1 else 'them'} out, or drop plan= and "
            "give every setting yourself."
        )
    return planned
