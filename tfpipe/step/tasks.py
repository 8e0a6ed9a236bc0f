"""The bodies of an unrolled step's tasks: F runs a cell (on the last also the loss), B its VJP, W its weights'.

A forward records a ``backward.remat.Checkpoint`` (kept or to recompute, by ``remat``); its
backward is one VJP, or with a split schedule ("zero_bubble") the input gradients at B and the
weights' at W, which "gpipe_batched_w" takes once over all micro-batches (``backward.batched_w``).
A whole backward whose input gradients go to another device is cut the same way and runs both parts,
the input gradients first (``Tasks._inputs_first``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import schedule
from tfpipe.backward import remat as remat_lib
from tfpipe.backward.gradients import add_each
from tfpipe.distributed import devices
from tfpipe.leaves import fill, flat
from tfpipe.partition import state
from tfpipe.partition.cell import Cell
from tfpipe.step import loss
from tfpipe.step.chain import Chain, task_end
from tfpipe.step.handoff import Handoff
from tfpipe.step.wiring import Wiring


def differentiated(out: Any) -> list[tf.Tensor]:
    """What a cell's backward differentiates of its (outputs, new state, added losses): outputs and added losses."""
    return flat(out[0]) + [out[2]]


class Tasks:
    """F, B and W of the cells, built into a step's graph one task at a time (``run``)."""

    def __init__(self, cells: Sequence[Cell], wiring: Wiring, schedule_name: str, remat: str, num_micro_batches: int):
        self.cells, self.wiring = cells, wiring
        self.schedule, self.remat, self.num_micro_batches = schedule_name, remat, num_micro_batches
        self._unbatched: set[int] = set()  # cells told that their W does not batch (warned once)

    def run(self, task: schedule.Task, step: Handoff, chain: Chain) -> None:
        """Build ``task`` into the step."""
        if task.kind == "F":
            self.forward(task, step, chain)
        elif task.kind == "B":
            self.backward(task, step, chain)
        else:
            self.weight(task, step, chain)

    def forward(self, task: schedule.Task, step: Handoff, chain: Chain) -> None:
        """F(i, j): run cell i on micro-batch j; on the last cell also the loss and its gradient."""
        i, j = task.cell, task.micro_batch
        cell, (trainable, other) = self.cells[i], step.weights[i]
        backward = step.loss_fn is not None
        x = self.wiring.input_of(i, j, step)
        with chain.task(task) as produced:
            x = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), x)  # arrive on this device
            training = step.training
            seeds = state.micro_batch_states(cell.non_trainable_variables, other, step.first + j) if training else other
            extras = list(seeds) + list(self._added_weights(cell, j, step))
            fn = self._cell_function(cell, len(trainable), training, backward)
            if backward:
                y, new_state, added = self._checkpoint(task, fn, x, trainable, extras, step)
            else:
                y, new_state, added = fn(x, *trainable, *extras)
            step.acts[(i, j)], step.new_state[(i, j)] = y, new_state
            step.added.append(added)
            produced.extend(flat(y) + [added])
            produced.extend(self.wiring.send(task, y, step))
            if i == len(self.cells) - 1:
                leaves, step.outputs[j] = self.wiring.model_outputs(j, y, step)
                if backward:
                    produced.append(self._loss(i, j, step.outputs[j], leaves, step))

    @staticmethod
    def _added_weights(cell: Cell, j: int, step: Handoff) -> tuple[Any, Any]:
        """What micro-batch j's added losses are weighted by: (its share of the batch, the weight of penalties)."""
        if step.shares:
            # Penalties count in the step's first micro-batch: a replica's other than replica 0's do not.
            reg_weight = step.reg_weights[cell.device][0 if step.first + j == 0 else 1]
            share = step.shares[cell.device][j]
        else:  # forward only: plain numbers, no ops
            share = step.fractions[j] if step.fractions is not None else 1.0
            reg_weight = 0.0
        return share, reg_weight

    def _cell_function(self, cell: Cell, n_w: int, training: bool, backward: bool) -> Callable[..., Any]:
        """The cell as fn(x, *trainable, *seeds, share, penalty weight, forward=) -> (outputs, new state, added losses);
        ``forward`` says which forward it is (``remat.RECORDED`` and the rest), as a ``Checkpoint`` runs it."""
        # Weight regularizers count once per step: in micro-batch 0's task, or after the cell's one W
        # under gpipe_batched_w, whose W batches only what is the same function in every micro-batch.
        regularized = backward and cell.has_regularizers and self.schedule != "gpipe_batched_w"

        def fn(x_in, *rest, forward=remat_lib.RECORDED):
            w, s, (share_, reg_weight_) = rest[:n_w], rest[n_w:-2], rest[-2:]
            y, new_state, added = cell.run_traced(list(w), list(s), x_in, training=training, forward=forward)
            added = added * share_  # add_loss terms are batch means, as Keras normalizes them
            if regularized:
                added = added + reg_weight_ * cell.regularization_loss(list(w))
            return y, new_state, added

        return fn

    def _checkpoint(self, task: schedule.Task, fn: Callable[..., Any], x: Any, trainable, extras, step: Handoff):
        """F(i, j) recorded for its backward (kept, or to recompute): the cell's (outputs, new state, added losses)."""
        i, j = task.cell, task.micro_batch
        cell = self.cells[i]
        flat_x = flat(x)
        n_x = len(flat_x)
        record = remat_lib.Checkpoint(
            lambda *src, forward: fn(tf.nest.pack_sequence_as(x, fill(x, src)), *src[n_x:], forward=forward),
            flat_x + list(trainable),
            recompute=remat_lib.recomputes(self.remat, j, self.num_micro_batches),
            constant=self.wiring.constants(i, n_x),
            extras=extras,
            traced=cell.vjps if cell.traceable else None,
            key=repr(tf.nest.map_structure(lambda t: t is None, x)),
            split=(len(trainable), differentiated) if self._cut(i) else None,
        )
        step.records[(i, j)] = record
        return record.outputs

    def _loss(self, i: int, j: int, y: Any, leaves: list[tf.Tensor], step: Handoff) -> tf.Tensor:
        """Micro-batch j's weighted loss of the model's outputs ``y`` and its gradient for the tensors ``leaves``."""
        assert step.loss_fn is not None  # a step with a backward has a loss
        step.losses[j], grads = loss.on_cell(step.loss_fn, j, y, step.loss_scale, leaves, self.cells[i])
        self.wiring.loss_gradients(i, j, grads, step)
        return step.losses[j]

    def backward(self, task: schedule.Task, step: Handoff, chain: Chain) -> None:
        """B(i, j): the VJP of cell i on micro-batch j (recomputing it if so recorded); sum weight gradients."""
        i, j = task.cell, task.micro_batch
        record = step.records.pop((i, j))
        dy = self.wiring.output_gradients(i, j, step)
        with chain.task(task, extra_deps=flat(dy)) as produced:
            dy = self.wiring.summed(dy)
            # Through identities made here: a tape's gradient ops (a kept forward's backward) take no control
            # dependencies, so without them the backward ran as soon as its gradients arrived, out of turn.
            grads_out = [None if g is None else tf.identity(g) for g in dy] + [step.scales[i]]
            dx = self._vjp(task, record, grads_out, step, produced)
            produced.extend([g for g in dx if g is not None])
            self.wiring.pass_back(task, dx, step, produced)
            if self._inputs_first(record):  # the weights' part after the input gradients have left
                with tf.control_dependencies(task_end(produced)):
                    step.grads[i] = record.weight_vjp(step.running(i))
                produced.extend(step.grads[i])

    def _vjp(self, task: schedule.Task, record: remat_lib.Checkpoint, grads_out, step: Handoff, produced) -> list:
        """B(i, j)'s input gradients; the weights' are added to their sums here, or left to W(i, j) or W(i, all)."""
        i, j = task.cell, task.micro_batch
        n_w = len(step.weights[i][0])
        batched = self._batched_weights(record, task, step) if schedule.batches_weights(self.schedule) else None
        if batched is not None:  # W(i, all) takes the weights' gradients of every micro-batch at once
            dx = record.input_vjp(grads_out, batched)[: len(record.sources) - n_w]
            step.records[(i, j)] = record
            produced.extend(record.computed)
        elif schedule.splits_backward(self.schedule) or self._inputs_first(record):
            dx = record.input_vjp(grads_out)[: len(record.sources) - n_w]
            if schedule.batches_weights(self.schedule):  # this cell's W does not batch: it runs here
                step.grads[i] = record.weight_vjp(step.running(i))
                produced.extend(step.grads[i])
            elif not self._inputs_first(record):  # W(i, j) takes the weights' gradients later
                step.records[(i, j)] = record
            produced.extend(record.computed)
        else:
            grads = record.vjp(differentiated, grads_out, accumulate=step.running(i))
            dx, step.grads[i] = grads[: len(grads) - n_w], grads[len(grads) - n_w :]
            produced.extend(step.grads[i])
        return dx

    def _cut(self, i: int) -> bool:
        """Whether cell i's backward is cut in B and W: under a split schedule, and where its input gradients go to
        another device in a step that inlines its cells (``_inputs_first``; a called cell's forward would hold
        less than the planner counts for a whole backward, where the bubble is small anyway: from 64 tasks, 128
        with cells in other processes)."""
        cell = self.cells[i]
        sends = i > 0 and self.cells[i - 1].device != cell.device
        return schedule.splits_backward(self.schedule) or (sends and cell.traceable and not cell.noinline)

    def _inputs_first(self, record: remat_lib.Checkpoint) -> bool:
        """Whether a whole backward runs cut (``_cut``): its input gradients first, sent, then its weights'.

        The device that waits for them gets them about half a backward sooner (a Dense layer's input gradient is
        one of its two MatMuls); with ops of both parts ready together, a one-thread worker ran them mixed and sent
        at the end. On two workers GPipe's step 0.90x, 1F1B's 0.93x, interleaved 1F1B's 0.96x at M=4
        (docs/benchmarks.md#schedules).
        """
        return record.cut and not schedule.splits_backward(self.schedule)

    def weight(self, task: schedule.Task, step: Handoff, chain: Chain) -> None:
        """W(i, j) (zero bubble): cell i's weight gradients on micro-batch j, added to their running sums.

        W(i, all) ("gpipe_batched_w") computes them over every micro-batch at once.
        """
        i, j = task.cell, task.micro_batch
        if j == schedule.ALL:
            batched = step.batched.get(i)
            if batched is None:  # every B took its micro-batch's weight gradients
                return
            records = [step.records.pop((i, k)) for k in range(self.num_micro_batches)]
            with chain.task(task) as produced:
                step.grads[i] = remat_lib.batched_weight_vjp(records, batched)
                produced.extend(step.grads[i])
            return
        record = step.records.pop((i, j))
        with chain.task(task) as produced:
            step.grads[i] = record.weight_vjp(step.running(i))
            produced.extend(step.grads[i])

    def _batched_weights(self, record: remat_lib.Checkpoint, task: schedule.Task, step: Handoff) -> Any:
        """Cell i's W cut to run once over all micro-batches (``backward.batched_w``), made at its first B (``task``,
        whose ``record`` is out of ``step.records``); None where it cannot (a warning says why, once per cell) or
        there is nothing to batch."""
        i = task.cell
        if i not in step.batched:
            # In GPipe's order every forward of the cell ran before its first B.
            records = [record if k == task.micro_batch else step.records[(i, k)] for k in range(self.num_micro_batches)]
            # The last differentiated output is the added losses, whose gradient is the loss scale, step.scales[i].
            n_out = len(differentiated(record.outputs))
            cut = remat_lib.batch_weights(records, [False] * (n_out - 1) + [True])
            if isinstance(cut, str):
                if i not in self._unbatched:
                    self._unbatched.add(i)
                    warnings.warn(
                        f"schedule='gpipe_batched_w': cell {i} computes its weight gradients once per micro-batch, "
                        f"as exact but not faster, because {cut}.",
                        stacklevel=6,  # Pipeline.train's frame: _vjp, backward, run, Pipeline._run, train
                    )
                cut = None
            step.batched[i] = cut
        return step.batched[i]

    def penalties(self, step: Handoff) -> None:
        """ "gpipe_batched_w": each cell's weight penalties and their gradients, added once after its W."""
        for i, cell in enumerate(self.cells):
            if cell.has_regularizers:
                with devices.scope(cell.device):
                    penalty, extra = cell.regularization_gradients(step.weights[i][0], step.scales[i])
                    step.grads[i] = add_each(step.running(i), extra)
                    step.added.append(penalty)
