"""Per-device memory as a stated constraint: each cell's state against its device's budget, before training.

What a cell's device holds in every training step, whatever the schedule: the weights its layers read (a tied
weight on every device that reads it), one gradient per trainable weight it computes, and the optimizer's slots
of the weights it owns. That much is known exactly from the shapes; the activations come on top and depend on
M, ``remat`` and the schedule (``tfpipe.plan`` predicts them from measurements). So a configuration whose state
alone exceeds a device's budget cannot train there: ``check`` refuses it before anything is traced, naming the
device, its budget, what the cell needs, and the smallest K (cut by state) or budget that would hold the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from tfpipe import balance as balance_lib
from tfpipe import schedule as schedule_lib
from tfpipe.planning.plans import gib, parse_bytes
from tfpipe.planning.predict import SLOTS
from tfpipe.planning.units import variable_bytes


@dataclasses.dataclass(frozen=True)
class CellState:
    """The bytes one cell's device holds all step long: its weights, their gradients, the optimizer's slots."""

    device: str
    weights: float
    gradients: float
    slots: float
    cells: tuple[int, ...] = ()  # the cells it sums, where several share the device (``per_device``)

    @property
    def total(self) -> float:
        """All of it."""
        return self.weights + self.gradients + self.slots


def per_device(states: Sequence[CellState]) -> tuple[list[CellState], list[int]]:
    """One state per device, summing the cells that share it (several cells per device), and the first cell of each."""
    merged: dict[str, CellState] = {}
    first: dict[str, int] = {}
    for i, state in enumerate(states):
        had = merged.get(state.device)
        first.setdefault(state.device, i)
        merged[state.device] = CellState(
            state.device,
            state.weights + (had.weights if had else 0.0),
            state.gradients + (had.gradients if had else 0.0),
            state.slots + (had.slots if had else 0.0),
            (had.cells if had else ()) + (i,),
        )
    return list(merged.values()), list(first.values())


def budgets(memory_budget: Any, devices: Sequence[str]) -> list[float]:
    """One budget in bytes per device: one value for all, a sequence of one per cell, or a dict by device string."""
    if isinstance(memory_budget, Mapping):
        unknown = [d for d in memory_budget if d not in devices]
        missing = [d for d in devices if d not in memory_budget]
        if unknown or missing:
            raise ValueError(
                f"memory_budget names devices {unknown or 'as given'} and leaves out {missing or 'none'}; give one "
                f"budget for each of the cells' devices {list(devices)}, or one value for all."
            )
        return [parse_bytes(memory_budget[d], f"memory_budget[{d!r}]") for d in devices]
    if isinstance(memory_budget, (list, tuple)):
        if len(memory_budget) != len(devices):
            raise ValueError(
                f"memory_budget has {len(memory_budget)} entries for {len(devices)} cells' devices {list(devices)}; "
                "give one per cell, or one value for all."
            )
        return [parse_bytes(b, f"memory_budget[{i}]") for i, b in enumerate(memory_budget)]
    return [parse_bytes(memory_budget)] * len(devices)


def optimizer_name(optimizer: Any) -> str:
    """The key of ``predict.SLOTS`` for ``optimizer`` (a name or a Keras optimizer): SGD with momentum apart."""
    if isinstance(optimizer, str):
        return optimizer.lower()
    if isinstance(optimizer, keras.optimizers.Optimizer):
        name = type(optimizer).__name__.lower()
        momentum = float(getattr(optimizer, "momentum", 0.0) or 0.0)
        return "sgd_momentum" if name == "sgd" and momentum > 0 else name
    raise TypeError(f"optimizer must be a name such as 'adam' or a keras.optimizers.Optimizer, got {optimizer!r}.")


def slots_of(optimizer: Any) -> tuple[str, int]:
    """The optimizer's name and slots per trainable weight (``predict.SLOTS``; an unknown one counts none, so that a
    refusal never rests on a guess); None (not compiled yet): "no optimizer", 0."""
    if optimizer is None:
        return "no optimizer", 0
    name = optimizer_name(optimizer)
    return name, SLOTS.get(name, 0)


def cell_state(
    device: str, weights: Sequence[keras.Variable], trainable: Sequence[keras.Variable], borrowed: set[int], slots: int
) -> CellState:
    """What a cell on ``device`` holds: ``weights`` it reads, gradients of its ``trainable`` weights, and ``slots``
    per trainable weight it owns (not in ``borrowed``: a tied weight's slots live with its owner)."""
    trained = sum(variable_bytes(v) for v in trainable)
    owned = sum(variable_bytes(v) for v in trainable if id(v) not in borrowed)
    return CellState(device, sum(variable_bytes(v) for v in weights), trained, slots * owned)


def unit_states(units: Sequence[Sequence[keras.Variable]], slots: int) -> list[float]:
    """Per unit (a layer, or a Functional model's node), the state it adds where it is the first to hold a weight."""
    seen: set[int] = set()
    out = []
    for variables in units:
        fresh = [v for v in variables if id(v) not in seen]
        seen.update(id(v) for v in fresh)
        out.append(sum(variable_bytes(v) * (1 + (1 + slots) * v.trainable) for v in fresh))
    return out


def smallest_cut(unit_bytes: Sequence[float], budget: float) -> tuple[int, list[int]] | None:
    """The fewest cells whose best cut by state keeps every cell's state within ``budget``, and that cut; None if
    even one unit per cell does not. Bisected: the best cut's largest cell never grows with more cells."""

    def cut_within(k: int) -> list[int] | None:
        cut = balance_lib.partition(unit_bytes, k)
        return cut if max(_cell_bytes(unit_bytes, cut)) <= budget else None

    if max(unit_bytes) > budget:
        return None
    low, high = 1, len(unit_bytes)  # within at ``high``: one unit per cell
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if cut_within(middle) is not None else (middle + 1, high)
    return low, balance_lib.partition(unit_bytes, low)


def smallest_shared_cut(unit_bytes: Sequence[float], budget: float, per_device: int) -> tuple[int, list[int]] | None:
    """Where each device holds ``per_device`` cells: the fewest devices whose cut by state into ``per_device`` cells
    each keeps every device's cells within ``budget``, laid out round robin or as a V (the larger of the two), and
    that cut; None if no number of devices up to one unit per cell does."""
    layouts = ["interleaved_1f1b"] + (["zbv"] if per_device == 2 else [])  # round robin; a V holds two a device
    for devices in range(1, len(unit_bytes) // per_device + 1):
        cut = balance_lib.partition(unit_bytes, per_device * devices)
        cells = _cell_bytes(unit_bytes, cut)
        for layout in layouts:
            held = [0.0] * devices
            for cell, device in enumerate(schedule_lib.placement(layout, len(cells), devices)):
                held[device] += cells[cell]
            if max(held) > budget:
                break
        else:
            return devices, cut
    return None


def _cell_bytes(unit_bytes: Sequence[float], cut: Sequence[int]) -> list[float]:
    """Each cell's bytes under ``cut`` (units per cell)."""
    starts = [sum(cut[:i]) for i in range(len(cut) + 1)]
    return [sum(unit_bytes[a:b]) for a, b in zip(starts, starts[1:])]


def check(states: Sequence[CellState], limits: Sequence[float], unit_bytes: Sequence[float], optimizer: str) -> None:
    """Raise a ValueError for the first cell whose state exceeds its device's budget (``budget``'s docstring); a
    state that sums several cells of one device (``per_device``) names them all."""
    for i, (state, limit) in enumerate(zip(states, limits)):
        if state.total <= limit:
            continue
        worst = max(s.total for s in states)
        fewest = _fewest(states, unit_bytes, min(limits))
        parts = [f"weights {gib(state.weights)}", f"their gradients {gib(state.gradients)}"]
        parts += [f"{optimizer}'s slots {gib(state.slots)}"] if state.slots else []
        fewer = ", or an optimizer with fewer slots" if state.slots else ""
        raise ValueError(
            f"{_which(i, state)} on {state.device} need{'' if len(state.cells) > 1 else 's'} at least "
            f"{gib(state.total, up=True)} for {'their' if len(state.cells) > 1 else 'its'} state "
            f"({', '.join(parts)}), over that device's memory_budget of {gib(limit)}; activations come on top. "
            f"{fewest}; or give each device a budget of at least {gib(worst, up=True)}{fewer}."
        )


def _fewest(states: Sequence[CellState], unit_bytes: Sequence[float], budget: float) -> str:
    """What would hold the state within ``budget``: the fewest cells cut by state, or where devices hold several
    cells each, the fewest devices of that many cells."""
    shared = max(len(s.cells) for s in states)
    if shared > 1:
        found = smallest_shared_cut(unit_bytes, budget, shared)
        if found:
            return (
                f"{found[0]} devices of {shared} cells each, cut by state (balance={found[1]}), would hold it within "
                f"{gib(budget)} a device"
            )
        if max(unit_bytes) <= budget:
            return f"no number of devices of {shared} cells each holds it within {gib(budget)}: fewer cells a device"
    else:
        found = smallest_cut(unit_bytes, budget)
        if found:
            return f"K={found[0]} cells cut by state (balance={found[1]}) would hold it within {gib(budget)} each"
    return f"no cut holds it within {gib(budget)}: one unit alone needs {gib(max(unit_bytes), up=True)}"


def _which(i: int, state: CellState) -> str:
    """ "Cell i" (its own index where ``per_device`` made it), or "Cells 0 and 2" for cells sharing a device."""
    if len(state.cells) <= 1:
        return f"Cell {state.cells[0] if state.cells else i}"
    return f"Cells {', '.join(map(str, state.cells[:-1]))} and {state.cells[-1]}"
