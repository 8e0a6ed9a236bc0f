"""What both loops of the looped step share: the step's plan, GPipe's clock cycles, arrays over them, bubbles.

At clock cycle t, cell k runs micro-batch j = t - k (``schedule.gpipe``); at a cycle where it has
none (a bubble) an empty batch goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.partition import state
from tfpipe.partition.cell import Cell


@dataclasses.dataclass
class LoopTraces:
    """A step's loops before any of their ops: the weights read for it and each cell traced for its inputs."""

    weights: list[tuple[list[tf.Tensor], list[tf.Tensor]]]  # per cell, (trainable, non-trainable)
    traces: list[Any]  # per cell: its forward traced for a micro-batch of unknown size
    structures: list[Any]  # specs of cell k's inputs at k, of the model's outputs at K


@dataclasses.dataclass
class LoopOutputs:
    """What the loops produced, in the terms of ``executor.StepResult``."""

    outputs: list[Any]  # per micro-batch outputs of the last cell
    losses: list[tf.Tensor]  # per micro-batch weighted loss (training)
    added: list[tf.Tensor]  # per cell: add_loss and regularization terms, summed over micro-batches
    grads: list[list[Any]]  # per cell, aligned with its trainable variables
    new_state: dict  # (cell, j) -> the cell's non-trainable values after micro-batch j


def unknown_batch(shape: tf.TensorShape) -> tf.TensorShape:
    """``shape`` with an unknown batch size: a micro-batch's, or a bubble's empty batch."""
    return tf.TensorShape([None]).concatenate(shape[1:])


def empty(spec: tf.TensorSpec) -> tf.Tensor:
    """An empty batch of ``spec``, typed with an unknown batch size (so loop variables keep their type)."""
    zeros = tf.zeros([0] + spec.shape[1:].as_list(), spec.dtype)
    return tf.raw_ops.PlaceholderWithDefault(input=zeros, shape=unknown_batch(spec.shape))


def array(spec: tf.TensorSpec, size: int) -> tf.TensorArray:
    """An array of ``size`` batches like ``spec``, each of its own batch size."""
    return tf.TensorArray(spec.dtype, size=size, element_shape=unknown_batch(spec.shape), infer_shape=False)


def rows(t: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """``t`` for a cycle with a micro-batch; its first zero rows (an empty batch) in a bubble."""
    return t[: tf.where(valid, tf.shape(t)[0], 0)]


def micro_batch_at(cycle: Any, cell: int) -> Any:
    """The micro-batch cell k runs at forward cycle t (GPipe's clock: ``schedule.gpipe``), valid or not.

    The backward loop's iteration s runs the forward cycle M + K - 2 - s again, in reverse.
    """
    return cycle - cell


class Cycle:
    """Cell k at cycle t: its micro-batch j, whether there is one, j clipped into range, and j's share n_j/N."""

    def __init__(self, t: tf.Tensor, k: int, m: int, shares: tf.Tensor):
        self.j = micro_batch_at(t, k)
        self.valid = tf.logical_and(self.j >= 0, self.j < m)
        self.clipped = tf.clip_by_value(self.j, 0, m - 1)
        self.share = tf.where(self.valid, tf.gather(shares, self.clipped), 0.0)  # a bubble adds nothing


@dataclasses.dataclass
class Loops:
    """What both loops of one step read."""

    cells: Sequence[Cell]
    plan: LoopTraces
    specs: list[list[tf.TensorSpec]]  # specs[k]: cell k's input leaves; specs[K]: the outputs
    shares: tf.Tensor  # each micro-batch's share n_j/N, on cell 0's device
    m: int  # micro-batches
    first: int  # the global number of micro-batch 0 (a replica's first), from which seeds are drawn

    @property
    def cycles(self) -> int:
        """Clock cycles, M + K - 1: iterations of each loop."""
        return self.m + len(self.cells) - 1

    def seeds(self, k: int, c: Cycle) -> list[tf.Tensor]:
        """Cell k's non-trainable values for its micro-batch at cycle ``c``, with that micro-batch's seeds."""
        cell_states = self.cells[k].non_trainable_variables
        return state.micro_batch_states(cell_states, self.plan.weights[k][1], c.clipped + self.first)
