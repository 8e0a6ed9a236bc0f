"""How many layers go into each cell: checking a given balance, or computing the best one from per-layer costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from tfpipe import cost as cost_lib
from tfpipe import schedule
from tfpipe._args import positive_int
from tfpipe.partition import functional
from tfpipe.partition.sequence import layer_list


def check(balance: Sequence[int], num_layers: int, unit: str = "layers") -> list[int]:
    """Validate a user's balance (layers per cell) against the number of layers (or other ``unit``s)."""
    if isinstance(balance, (str, bytes)) or not hasattr(balance, "__iter__"):
        raise TypeError(f"balance must be a list of ints (layers per cell), got {balance!r}.")
    balance = list(balance)
    if not balance:
        raise ValueError("balance is empty; give the number of layers of each cell, e.g. balance=[2, 2].")
    for b in balance:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"balance entries must be ints, got {b!r} in balance={balance}.")
        if b < 1:
            raise ValueError(f"Every cell needs at least one layer; balance={balance} has an entry {b} < 1.")
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance={balance} sums to {sum(balance)} but there are {num_layers} {unit}; "
            f"make the entries sum to {num_layers}."
        )
    return balance


def check_num_partitions(num_partitions: int, num_layers: int, unit: str = "layers") -> int:
    """Validate a number of cells K for ``num_layers`` layers (or other ``unit``s)."""
    num_partitions = positive_int("num_partitions", num_partitions)
    if num_partitions > num_layers:
        raise ValueError(
            f"num_partitions={num_partitions} is more than the {num_layers} {unit}; "
            f"use at most {num_layers} partitions."
        )
    return int(num_partitions)


def uniform(num_layers: int, num_partitions: int) -> list[int]:
    """Near-equal layer counts: K cells whose sizes differ by at most one, larger first."""
    check_num_partitions(num_partitions, num_layers)
    base, extra = divmod(num_layers, num_partitions)
    return [base + (1 if k < extra else 0) for k in range(num_partitions)]


def _check_costs(costs: Sequence[float], k: int, name: str = "costs") -> np.ndarray:
    values = np.asarray(list(costs), dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers, one per layer; got {list(costs)!r}.")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {float(values[bad[0]])}; every per-layer cost must be finite and >= 0.")
    k = positive_int("The number of cells", k)
    if k > values.size:
        raise ValueError(f"Cannot cut {values.size} layers into {k} non-empty cells; use at most {values.size} cells.")
    return values


def _fits(prefix: np.ndarray, limit: float, k: int) -> bool:
    """Whether the layers split into at most k contiguous cells each costing at most ``limit``."""
    n, start, cells = prefix.size - 1, 0, 0
    while start < n:
        end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
        while end > start and prefix[end] - prefix[start] > limit:
            end -= 1
        while end < n and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        if end == start:
            return False  # one layer alone exceeds the limit
        start, cells = end, cells + 1
        if cells > k:
            return False
    return True


def partition(costs: Sequence[float], k: int, boundary_bytes: Sequence[float] | None = None) -> list[int]:
    """The contiguous split of layers into k cells that minimizes the most expensive cell, exactly.

    Ties are broken by the smaller sum of squared deviations of the cell costs from
    their mean (GPipe's variance criterion), then by fewer bytes crossing cell
    boundaries, where ``boundary_bytes[i]`` is the size of layer i's output.
    """
    values = _check_costs(costs, k)
    n = values.size
    crossing = np.zeros(n + 1)
    if boundary_bytes is not None:
        crossing[1:] = _check_costs(boundary_bytes, 1, "boundary_bytes")
        if len(boundary_bytes) != n:
            raise ValueError(f"boundary_bytes has {len(boundary_bytes)} entries for {n} layers; give one per layer.")
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    # The optimal bottleneck is the cost of some contiguous run: binary search over those candidates.
    segment = prefix[None, :] - prefix[:, None]  # segment[s, e] = cost of layers s..e-1
    candidates = np.unique(segment[np.triu_indices(n + 1, 1)])
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(prefix, candidates[mid], k):
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo]

    # Among splits within the bottleneck: minimize the sum of squared cell costs (the mean is fixed),
    # then the bytes crossing boundaries. squares[k][e] covers the first e layers with k cells.
    cost_to = segment.T  # cost_to[e, s] = cost of layers s..e-1
    allowed = (np.tril(np.ones((n + 1, n + 1), bool), -1)) & (cost_to <= limit)
    squares = np.where(allowed[:, 0], cost_to[:, 0] ** 2, np.inf)
    moved = np.zeros(n + 1)
    choices = []
    for _ in range(1, k):
        total = np.where(allowed, squares[None, :] + cost_to**2, np.inf)
        best = total.min(axis=1)
        tied = total <= best[:, None] + 1e-12 * np.maximum(np.abs(best[:, None]), 1.0)
        traffic = np.where(tied, moved[None, :] + crossing[None, :], np.inf)
        choice = traffic.argmin(axis=1)
        rows = np.arange(n + 1)
        squares, moved = total[rows, choice], traffic[rows, choice]
        choices.append(choice)
    ends, end = [n], n
    for choice in reversed(choices):
        end = int(choice[end])
        ends.append(end)
    bounds = [0] + ends[::-1]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


Balance = Union[list[int], tuple[list[int], list[float]]]


def _by(kind: str, layers: Any, k: int, sample: Any, return_costs: bool, **options: Any) -> Balance:
    if functional.is_functional(layers):  # a balance of a Functional model counts its nodes
        batch = cost_lib.batch_size(sample) if sample is not None else None
        estimate = cost_lib.estimate_graph(functional.Graph(layers), kind, batch, **options)
    else:
        estimate = cost_lib.estimate(layers, sample, kind, **options)
    split = partition(estimate.costs, k, boundary_bytes=estimate.output_bytes)
    return (split, estimate.costs) if return_costs else split


def by_params(layers: Any, k: int, sample: Any = None, return_costs: bool = False) -> Balance:
    """Balance by parameter count; ``sample`` (a batch) is needed only when the layers are not built yet."""
    if sample is None and not functional.is_functional(layers):
        layers = layer_list(layers)
        unbuilt = [layer.name for layer in layers if not layer.built]
        if unbuilt:
            raise ValueError(
                f"Layers {unbuilt[:3]} are not built, so they have no parameters yet; pass sample= "
                "(a batch of inputs) to build copies of them."
            )
        seen: set[int] = set()  # a weight two layers use (tied) counts in the first
        costs = []
        for layer in layers:
            own = [v for v in layer.weights if id(v) not in seen]
            seen.update(id(v) for v in own)
            costs.append(float(sum(math.prod(v.shape) for v in own)))
        split = partition(costs, k)
        return (split, costs) if return_costs else split
    return _by("params", layers, k, sample, return_costs)


def by_flops(layers: Any, k: int, sample: Any, return_costs: bool = False) -> Balance:
    """Balance by forward FLOPs per sample, counted on copies of the layers fed with ``sample``."""
    return _by("flops", layers, k, sample, return_costs)


def by_time(
    layers: Any, k: int, sample: Any, return_costs: bool = False, device: str | None = None, repeats: int = 5
) -> Balance:
    """Balance by measured forward+backward time of each layer on ``sample`` (ideally one micro-batch)."""
    return _by("time", layers, k, sample, return_costs, device=device, repeats=repeats)


def by_memory(layers: Any, k: int, sample: Any, return_costs: bool = False, device: str | None = None) -> Balance:
    """Balance by measured peak memory of each layer's forward+backward on ``sample``, plus its weights.

    Needs an allocator that reports peaks: a GPU, or on a CPU ``TF_CPU_ALLOCATOR_USE_BFC=true``.
    """
    return _by("memory", layers, k, sample, return_costs, device=device)


def cell_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each cell for per-layer ``costs`` split as ``balance``."""
    bounds = np.cumsum([0] + list(balance))
    return [float(sum(costs[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def evenness(cells: Sequence[float]) -> float:
    """Mean cell cost over the most expensive cell's: 1.0 when the cells are perfectly balanced."""
    worst = max(cells)
    return (sum(cells) / len(cells)) / worst if worst > 0 else 1.0


def efficiency(cells: Sequence[float], num_micro_batches: int) -> float:
    """Predicted pipeline efficiency: GPipe's M / (M + K - 1), scaled by the cells' evenness."""
    return (1.0 - schedule.bubble_fraction(len(cells), num_micro_batches)) * evenness(cells)
