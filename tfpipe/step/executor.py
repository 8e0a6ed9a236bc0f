"""What runs a pipeline's steps: the ``Executor`` interface PipelineModel calls, and the ``StepResult`` it gets.

Three executors implement it: ``unrolled.Pipeline`` (every task a call in one graph, chained in the
schedule's order; the one a PipelineModel holds, which hands its steps to the loops where asked and
able), ``looped.Looped`` (two loops over GPipe's clock cycles) and ``replicated.Replicated`` (R
pipelines side by side, as one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import keras
import tensorflow as tf

from tfpipe.distributed import devices
from tfpipe.partition.cell import Cell
from tfpipe.step.loss import LossFn
from tfpipe.step.sums import sum_on_devices, tied_gradients


@dataclasses.dataclass
class StepResult:
    """What one pipelined step produced."""

    outputs: list[Any]  # per micro-batch outputs of the last cell
    loss: tf.Tensor | None = None  # total (unscaled) loss of the mini-batch
    # Forward only: the layers' add_loss terms (activity regularizers), each micro-batch's weighted by its share.
    added_loss: tf.Tensor | None = None
    gradients: list[tf.Tensor] = dataclasses.field(default_factory=list)  # aligned with ``variables``
    variables: list[keras.Variable] = dataclasses.field(default_factory=list)
    state_updates: list[tuple[keras.Variable, tf.Tensor]] = dataclasses.field(default_factory=list)
    # Unmerged, for a caller that merges several pipelines' (replicas'): each cell's values as read at the
    # step's start, (trainable, non-trainable), and its non-trainable values after each micro-batch.
    weights: list[tuple[list[tf.Tensor], list[tf.Tensor]]] = dataclasses.field(default_factory=list)
    new_states: list[list[list[tf.Tensor]]] = dataclasses.field(default_factory=list)


@runtime_checkable
class Executor(Protocol):
    """What PipelineModel calls on the object that runs its steps (``tfpipe/model.py``)."""

    if TYPE_CHECKING:
        # Read-only to a type checker, as Replicated derives them; plain attributes at run time, as Pipeline and
        # Looped set them (a property here would refuse that) and isinstance checks them.
        @property
        def cells(self) -> list[Cell]:
            """The cells that own the variables, in pipeline order."""

        @property
        def num_micro_batches(self) -> int:
            """M, the micro-batches of one pipeline (of each replica's)."""

        @property
        def micro_batches_per_step(self) -> int:
            """The pieces a step's batch is split into: M, or R x M for R replicas."""

        @property
        def unroll(self) -> bool:
            """Whether a step is an unrolled graph of tasks (False: loops over clock cycles)."""

    else:
        cells: list[Cell]  # the cells that own the variables, in pipeline order
        num_micro_batches: int  # M, the micro-batches of one pipeline (of each replica's)
        micro_batches_per_step: int  # the pieces a step's batch is split into: M, or R x M for R replicas
        unroll: bool  # whether a step is an unrolled graph of tasks (False: loops over clock cycles)

    def prepare(self) -> None:
        """Eagerly, before a step is traced: learn what the step needs (explicit transfers between processes)."""

    def forward(
        self, inputs: Sequence[Any], training: bool = False, fractions: Sequence[tf.Tensor] | None = None
    ) -> StepResult:
        """Forward only over the micro-batches ``inputs``; training mode also merges state updates."""

    def train(
        self,
        inputs: Sequence[Any],
        loss_fn: LossFn,
        fractions: Sequence[tf.Tensor],
        loss_scale: tf.Tensor | float = 1.0,
    ) -> StepResult:
        """Forward and backward of one step: summed gradients, the loss and merged state updates."""


def step_result(
    cells: Sequence[Cell],
    num_micro_batches: int,
    outputs: Sequence[Any],
    losses: Sequence[tf.Tensor] | None,
    added: Sequence[tf.Tensor],
    grads: Sequence[Any],
    new_state: dict,
    weights: Sequence[tuple[list[tf.Tensor], list[tf.Tensor]]],
    fractions: Sequence[Any] | None,
) -> StepResult:
    """A pipeline's step result: the loss from the micro-batches' ``losses`` (None: forward only) and ``added``
    terms, gradients per variable (``grads`` per cell), merged state updates (given the ``fractions``).

    ``new_state[(i, j)]`` is cell i's non-trainable values after micro-batch j; ``weights`` what each cell read.
    """
    m = num_micro_batches
    result = StepResult(outputs=list(outputs), weights=list(weights))
    result.new_states = [[new_state[(i, j)] for j in range(m)] for i in range(len(cells))]
    if losses is None:
        result.added_loss = sum_on_devices(added) if added else None
    else:
        result.loss = sum_on_devices(list(losses) + list(added))
        result.variables, result.gradients = tied_gradients(cells, grads)
    if fractions is not None:
        for i, cell in enumerate(cells):
            with devices.scope(cell.device):
                result.state_updates.extend(
                    cell.merger.merge(cell.non_trainable_variables, weights[i][1], result.new_states[i], fractions)
                )
    return result
