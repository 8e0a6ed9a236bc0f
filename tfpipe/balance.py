"""How many layers go into each cell: checking a given balance and computing one."""

from __future__ import annotations

from typing import Sequence


def check(balance: Sequence[int], num_layers: int) -> list[int]:
    """Validate a user's balance (layers per cell) against the number of layers."""
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
            f"balance={balance} sums to {sum(balance)} but there are {num_layers} layers; "
            f"make the entries sum to {num_layers}."
        )
    return balance


def uniform(num_layers: int, num_partitions: int) -> list[int]:
    """Near-equal layer counts: K cells whose sizes differ by at most one, larger first."""
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions!r}.")
    if num_partitions > num_layers:
        raise ValueError(
            f"num_partitions={num_partitions} is more than the {num_layers} layers; "
            f"use at most {num_layers} partitions."
        )
    base, extra = divmod(num_layers, num_partitions)
    return [base + (1 if k < extra else 0) for k in range(num_partitions)]
