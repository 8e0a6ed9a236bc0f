"""Data-parallel replicas of a pipeline: R copies of the K cells, each on its share of the batch, one step.

Every variable exists once, on its cell's device in replica 0. Replica r > 0 runs
the same layers on its own devices: each step it reads the weights once (one copy
per cell and step crosses to its device) and hands back the sum of its weight
gradients, which is added to the others' on replica 0's device before the one
optimizer step. So the replicas cannot drift apart: there is nothing to keep in
sync, and a checkpoint is the same for any R. The bytes moved are an all-reduce's
(the weights out, the gradients in).

The batch is split into R x M micro-batches as for one pipeline with R x M: replica
r takes micro-batches rM .. rM + M - 1, numbered so for seeds and the loss; each
BatchNorm moving statistic is merged from all R x M micro-batches' statistics, so
a step of R replicas is a step of one pipeline over R x M micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.backward.gradients import sum_gradients
from tfpipe.distributed import devices
from tfpipe.partition.cell import Cell, owned
from tfpipe.step.executor import Executor, StepResult
from tfpipe.step.loss import LossFn
from tfpipe.step.unrolled import Pipeline


def replica_cells(cells: Sequence[Cell], replica_devices: Sequence[str]) -> list[Cell]:
    """Cells running the same layers (the same variables) as ``cells`` on other devices."""
    return [Cell(c.index, c.layers, d, program=c.program) for c, d in zip(cells, replica_devices)]


class Replicated(Executor):
    """R pipelines over the same layers, run side by side on slices of every batch, as one pipeline."""

    def __init__(self, pipelines: Sequence[Pipeline]):
        if len(pipelines) < 2:
            raise ValueError(f"Replicated needs at least 2 pipelines, got {len(pipelines)}.")
        self.pipelines = list(pipelines)

    @property
    def cells(self) -> list[Cell]:
        """Replica 0's cells, which own the variables."""
        return self.pipelines[0].cells

    @property
    def num_replicas(self) -> int:
        """R."""
        return len(self.pipelines)

    @property
    def num_micro_batches(self) -> int:
        """M, each replica's micro-batches."""
        return self.pipelines[0].num_micro_batches

    @property
    def micro_batches_per_step(self) -> int:
        """All replicas' micro-batches together: R x M."""
        return sum(p.num_micro_batches for p in self.pipelines)

    @property
    def unroll(self) -> bool:
        """Whether the replicas' steps are unrolled graphs of tasks (see ``Pipeline``)."""
        return all(p.unroll for p in self.pipelines)

    def prepare(self) -> None:
        """Learn each replica's explicit transfers between processes (see ``Pipeline.prepare``)."""
        for pipeline in self.pipelines:
            pipeline.prepare()

    def forward(
        self, inputs: Sequence[Any], training: bool = False, fractions: Sequence[tf.Tensor] | None = None
    ) -> StepResult:
        """Forward over the R x M micro-batches ``inputs``, replica r on its M; training merges state updates."""
        results = [
            p.forward(part, training, shares, first, merge=False)
            for p, part, shares, first in self._slices(inputs, fractions)
        ]
        return self._combine(results, fractions if training else None)

    def train(
        self,
        inputs: Sequence[Any],
        loss_fn: LossFn,
        fractions: Sequence[tf.Tensor],
        loss_scale: tf.Tensor | float = 1.0,
    ) -> StepResult:
        """Forward and backward of one step over R x M micro-batches; gradients summed on replica 0's devices."""
        results = [
            p.train(part, loss_fn, shares, loss_scale, first, merge=False)
            for p, part, shares, first in self._slices(inputs, fractions)
        ]
        return self._combine(results, fractions)

    def _slices(self, inputs: Sequence[Any], fractions: Sequence[Any] | None):
        if len(inputs) != self.micro_batches_per_step:
            raise ValueError(f"{len(inputs)} micro-batches for replicas that take {self.micro_batches_per_step}.")
        first = 0
        for pipeline in self.pipelines:
            end = first + pipeline.num_micro_batches
            yield pipeline, inputs[first:end], None if fractions is None else fractions[first:end], first
            first = end

    def _combine(self, results: Sequence[StepResult], fractions: Sequence[Any] | None) -> StepResult:
        """One step's result from the replicas': outputs in order, losses and gradients summed, state merged."""
        primary = results[0]
        combined = StepResult(outputs=[y for r in results for y in r.outputs], variables=list(primary.variables))
        if primary.added_loss is not None:
            with devices.scope(self.cells[-1].device):
                combined.added_loss = tf.add_n([r.added_loss for r in results])
        if primary.loss is not None:
            with devices.scope(self.cells[-1].device):
                combined.loss = tf.add_n([r.loss for r in results])
            for n, (_, first) in enumerate(owned(self.cells)):
                with devices.scope(self.cells[first].device):
                    combined.gradients.append(sum_gradients([r.gradients[n] for r in results]))
        if fractions is not None:
            for i, cell in enumerate(self.cells):
                old = primary.weights[i][1]
                # A replica's unchanged value is its own copy of the read: the merge knows it by identity.
                news = [[_as(old, r.weights[i][1], new) for new in r.new_states[i]] for r in results]
                with devices.scope(cell.device):
                    merged = cell.merger.merge(cell.non_trainable_variables, old, sum(news, []), fractions)
                combined.state_updates.extend(merged)
        return combined


def _as(old: Sequence[tf.Tensor], own_old: Sequence[tf.Tensor], new: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``new`` with each value that is still the replica's own read replaced by replica 0's."""
    return [o if n is own else n for o, own, n in zip(old, own_old, new)]
