"""The unrolled graph of one step: forward and backward tasks in schedule order, chained per device.

TensorFlow runs any op whose inputs are ready; the only way to make a device
run its tasks in the schedule's order is to give each task a control
dependency on the previous task of the same device. Each task is also a name
scope ``F_i_j`` / ``B_i_j`` so that the order can be read back from the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import keras
import tensorflow as tf

from tfpipe import checkpoint, schedule, state
from tfpipe.stage import Cell

LossFn = Callable[[int, Any], tf.Tensor]


TASK_START = "task_start"


def task_scope_name(task: schedule.Task) -> str:
    """The name scope of a task's ops in the graph."""
    return f"{task.kind}_{task.cell}_{task.micro_batch}"


@dataclasses.dataclass
class StepResult:
    """What one pipelined step produced."""

    outputs: list[Any]  # per micro-batch outputs of the last cell
    loss: Optional[tf.Tensor] = None  # total (unscaled) loss of the mini-batch
    gradients: list[tf.Tensor] = dataclasses.field(default_factory=list)  # aligned with ``variables``
    variables: list[keras.Variable] = dataclasses.field(default_factory=list)
    state_updates: list[tuple[keras.Variable, tf.Tensor]] = dataclasses.field(default_factory=list)


def _flat(x: Any) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(x) if t is not None]


class _Chain:
    """Control-dependency chains, one per device, plus the device scope of each task."""

    def __init__(self, cells: Sequence[Cell]):
        self._cells = cells
        self._last: dict[str, list[tf.Tensor]] = {}

    @contextlib.contextmanager
    def task(self, task: schedule.Task, extra_deps: Sequence[tf.Tensor] = ()) -> Iterator[list[tf.Tensor]]:
        """Open the task's device, name and control scope; the caller appends the task's results."""
        device = self._cells[task.cell].device
        produced: list[tf.Tensor] = []
        deps = [t for t in list(self._last.get(device, [])) + list(extra_deps) if t is not None]
        with tf.device(device), tf.name_scope(task_scope_name(task)), tf.control_dependencies(deps):
            # Marks where the task's ops begin in the graph; tape gradients are named
            # after their forward ops, so names alone cannot attribute them to a task.
            tf.no_op(name=TASK_START)
            yield produced
        if produced:
            self._last[device] = produced


class Pipeline:
    """Runs cells over micro-batches in GPipe order, with explicit per-task backward."""

    def __init__(self, cells: Sequence[Cell], num_micro_batches: int, remat: str):
        self.cells = list(cells)
        self.num_micro_batches = num_micro_batches
        self.remat = checkpoint.check_mode(remat)

    def _schedule(self, backward: bool) -> list[schedule.Task]:
        return schedule.flatten(schedule.gpipe(len(self.cells), self.num_micro_batches, backward=backward))

    def forward(self, inputs: Sequence[Any], training: bool = False,
                fractions: Optional[Sequence[tf.Tensor]] = None) -> StepResult:
        """Forward-only pass over the micro-batches ``inputs``; training mode also merges state updates."""
        return self._run(inputs, training=training, loss_fn=None, fractions=fractions)

    def train(self, inputs: Sequence[Any], loss_fn: LossFn, fractions: Sequence[tf.Tensor],
              loss_scale: tf.Tensor | float = 1.0) -> StepResult:
        """Forward and backward of one step: summed gradients, loss and merged state updates.

        ``loss_fn(j, y_j)`` is micro-batch j's share of the mini-batch loss (already
        weighted); ``loss_scale`` multiplies every loss before differentiation
        (mixed-precision loss scaling) and is not part of the reported loss.
        """
        return self._run(inputs, training=True, loss_fn=loss_fn, fractions=fractions, loss_scale=loss_scale)

    def _run(self, inputs, training, loss_fn, fractions, loss_scale=1.0) -> StepResult:
        cells, m = self.cells, self.num_micro_batches
        k_cells = len(cells)
        backward = loss_fn is not None
        chain = _Chain(cells)
        weights = [cell.read() for cell in cells]  # once per step, on each cell's device
        acts: dict[tuple[int, int], Any] = {}  # (cell, j) -> cell output
        records: dict[tuple[int, int], checkpoint.Checkpoint] = {}
        new_state: dict[tuple[int, int], list[tf.Tensor]] = {}
        losses: dict[int, tf.Tensor] = {}
        dys: dict[tuple[int, int], list[tf.Tensor]] = {}
        grads: list[Optional[list[tf.Tensor]]] = [None] * k_cells
        added: list[tf.Tensor] = []

        for task in self._schedule(backward):
            i, j = task.cell, task.micro_batch
            cell = cells[i]
            trainable, other = weights[i]
            if task.kind == "F":
                x = inputs[j] if i == 0 else acts[(i - 1, j)]
                with chain.task(task) as produced:
                    x = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), x)
                    seeds = [state.micro_batch_seed(s, j) if state.is_seed_state(v) else s
                             for v, s in zip(cell.non_trainable_variables, other)] if training else other
                    with_reg = backward and j == 0

                    share = fractions[j] if fractions is not None else 1.0

                    def fn(x_in, *w, cell=cell, seeds=seeds, with_reg=with_reg, share=share):
                        y, ns, extra = cell(list(w), seeds, x_in, training=training)
                        extra = extra * share  # add_loss terms are batch means, as Keras normalizes them
                        if with_reg:
                            extra = extra + cell.regularization_loss(list(w))
                        return y, ns, extra

                    if backward:
                        rec = checkpoint.Checkpoint(
                            lambda *src, fn=fn, x=x: fn(tf.nest.pack_sequence_as(x, _unflat(x, src)), *src[len(_flat(x)):]),
                            _flat(x) + list(trainable),
                            recompute=checkpoint.recomputes(self.remat, j, m),
                            constant=len(_flat(x)) if i == 0 else 0)
                        records[(i, j)] = rec
                        y, ns, extra = rec.outputs
                    else:
                        y, ns, extra = fn(x, *trainable)
                    acts[(i, j)] = y
                    new_state[(i, j)] = ns
                    added.append(extra)
                    produced.extend(_flat(y) + [extra])
                    if backward and i == k_cells - 1:
                        ys = _flat(y)
                        floating = [t for t in ys if t.dtype.is_floating]
                        with tf.GradientTape(watch_accessed_variables=False) as tape:
                            tape.watch(floating)
                            loss_j = tf.cast(loss_fn(j, y), tf.float32)
                            scaled = loss_j * loss_scale
                        dy = iter(tape.gradient(scaled, floating,
                                                unconnected_gradients=tf.UnconnectedGradients.ZERO))
                        dys[(i, j)] = [next(dy) if t.dtype.is_floating else None for t in ys]
                        losses[j] = loss_j
                        produced.append(loss_j)
            else:
                rec = records.pop((i, j))
                dy = dys.pop((i, j))
                with chain.task(task, extra_deps=[g for g in dy if g is not None]) as produced:
                    scale = tf.cast(loss_scale, tf.float32)
                    src_grads = rec.vjp(lambda out: _flat(out[0]) + [out[2]], list(dy) + [scale])
                    n_x = len(src_grads) - len(trainable)
                    dx, dw = src_grads[:n_x], src_grads[n_x:]
                    if i > 0:
                        dys[(i - 1, j)] = dx
                    grads[i] = dw if grads[i] is None else [_add(a, b) for a, b in zip(grads[i], dw)]
                    produced.extend([g for g in dx if g is not None] + grads[i])

        result = StepResult(outputs=[acts[(k_cells - 1, j)] for j in range(m)])
        if backward:
            result.loss = tf.add_n([losses[j] for j in range(m)] + added)
            for cell, g in zip(cells, grads):
                result.variables.extend(cell.trainable_variables)
                result.gradients.extend(g or [])
        if training:
            for i, cell in enumerate(cells):
                with tf.device(cell.device):
                    result.state_updates.extend(cell.merger.merge(
                        cell.non_trainable_variables, weights[i][1],
                        [new_state[(i, j)] for j in range(m)], fractions))
        return result


def _add(a: Any, b: Any) -> Any:
    """Sum two gradients; sparse ones (embeddings) stay sparse by concatenating their slices."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _unflat(structure: Any, sources: Sequence[tf.Tensor]) -> list[Any]:
    """Put the first sources back in the places of the non-None leaves of ``structure``."""
    it = iter(sources)
    return [None if leaf is None else next(it) for leaf in tf.nest.flatten(structure)]
