"""Where each cell's inputs come from when tensors skip cells: a producer cell (or the model's inputs) and position."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MODEL_INPUT = -1  # the producer of a model input


@dataclasses.dataclass(frozen=True)
class Routes:
    """The tensors between cells of a graph: every cell's inputs and the model's outputs, by producer.

    A cell's input and output are tuples of tensors; a source ``(p, pos)`` is leaf
    ``pos`` of cell p's output, or with ``p == MODEL_INPUT`` of the flattened model input.
    """

    feeds: list[list[tuple[int, int]]]  # per cell: the source of each input leaf (model inputs first)
    results: list[tuple[int, int]]  # the source of each leaf of the model's outputs
    flatten_inputs: Callable[[Any], list[Any]]  # a batch shaped as the model's input -> its leaves
    pack_outputs: Callable[[list[Any]], Any]  # the output leaves -> the model's output structure

    def constants(self, cell: int) -> int:
        """How many leading inputs of ``cell`` are model inputs (they need no gradient)."""
        return sum(1 for p, _ in self.feeds[cell] if p == MODEL_INPUT)

    def readers(self, producer: int) -> dict[int, list[int]]:
        """Cells that read ``producer``'s outputs -> the positions each reads; the outputs count for the last cell."""
        found: dict[int, set[int]] = {}
        last = len(self.feeds) - 1
        for consumer, sources in [*enumerate(self.feeds), (last, self.results)]:
            for p, pos in sources:
                if p == producer:
                    found.setdefault(consumer, set()).add(pos)
        return {c: sorted(positions) for c, positions in found.items()}
