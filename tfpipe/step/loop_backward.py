"""The looped step's backward loop: the losses, then each cell's VJP per clock cycle, in reverse.

Every backward recomputes its cell from the input the forward loop stashed (``CycleVJP``: one
function per cell, traced once), and adds its weight gradients to running sums as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat, leaves
from tfpipe.backward.gradients import add_each, differentiable
from tfpipe.distributed import devices
from tfpipe.partition.cell import Cell
from tfpipe.step.loop_cycles import Cycle, LoopOutputs, Loops, array, empty, rows

# loss_grads(j, y_j) -> (micro-batch j's weighted loss, gradients of the scaled loss for the leaves of y_j)
LossGrads = Callable[[int, Any], tuple[tf.Tensor, list[tf.Tensor | None]]]


def backward(loops: Loops, stashes: list, loss_grads: LossGrads, loss_scale: Any, result: LoopOutputs) -> None:
    """The losses, then the backward loop: each cell's VJP per cycle, its weight gradients summed as it goes."""
    dys = _loss_gradients(loops, loss_grads, result)
    weights, structures, specs = loops.plan.weights, loops.plan.structures, loops.specs
    vjps = [CycleVJP(cell, weights[k], structures[k], specs[k + 1], k > 0) for k, cell in enumerate(loops.cells)]
    dcarry, sums, sparse, scales = _backward_variables(loops, vjps, loss_scale)
    sums, sparse = _backward_loop(loops, vjps, dys, stashes, scales, (dcarry, sums, sparse))
    _weight_gradients(loops, vjps, sums, sparse, scales, result)


def _loss_gradients(loops: Loops, loss_grads: LossGrads, result: LoopOutputs) -> list[tf.TensorArray]:
    """Each micro-batch's loss (into ``result``) and its gradients for the floating outputs, in arrays by j."""
    with devices.scope(loops.cells[-1].device):
        wanted = [i for i, spec in enumerate(loops.specs[-1]) if differentiable(spec)]
        dys = [array(loops.specs[-1][i], loops.m) for i in wanted]
        for j, y in enumerate(result.outputs):
            loss_value, grads = loss_grads(j, y)
            result.losses.append(loss_value)
            dys = [a.write(j, grads[i]) for a, i in zip(dys, wanted)]
    return dys


def _backward_variables(loops: Loops, vjps: list[CycleVJP], loss_scale: Any) -> tuple[list, list, list, list]:
    """The backward loop's variables at its start: (what each cell sends back, dense weight gradient sums,
    arrays of sparse ones' pieces), and each cell's loss scale."""
    dcarry, sums, sparse, scales = [], [], [], []
    for k, cell in enumerate(loops.cells):
        trainable, vjp = loops.plan.weights[k][0], vjps[k]
        with devices.scope(cell.device):
            last = k == len(loops.cells) - 1
            dcarry.append([] if last else [empty(s) for s in loops.specs[k + 1] if differentiable(s)])
            sums.append([tf.zeros_like(w) for i, w in enumerate(trainable) if i not in vjp.sparse])
            sparse.append(
                [
                    (
                        array(tf.TensorSpec([None, *w.shape[1:]], vjp.values_dtype[i]), loops.cycles),
                        array(tf.TensorSpec([None], vjp.index_dtype[i]), loops.cycles),
                    )
                    for i, w in enumerate(trainable)
                    if i in vjp.sparse
                ]
            )
            scales.append(tf.cast(loss_scale, tf.float32))
    return dcarry, sums, sparse, scales


def _backward_loop(loops: Loops, vjps: list[CycleVJP], dys, stashes, scales, variables) -> tuple[list, list]:
    """The backward loop over the cycles, in reverse: each cell's dense weight gradient sums and sparse pieces."""
    cells, k_cells, m, cycles = loops.cells, len(loops.cells), loops.m, loops.cycles

    def backward_body(s, dcarry, sums, sparse):
        t = cycles - 1 - s
        arrived = list(dcarry)  # what the cells sent back in the previous cycle
        dcarry, sums, sparse = list(dcarry), list(sums), list(sparse)
        for k in reversed(range(k_cells)):
            with devices.scope(cells[k].device):
                c = Cycle(t, k, m, loops.shares)
                dy = [rows(a.read(c.clipped), c.valid) for a in dys] if k == k_cells - 1 else arrived[k]
                x = [a.read(t) for a in stashes[k]]
                dx, sums[k], pieces = vjps[k](x, loops.seeds(k, c), c.share, dy, scales[k], c.valid, sums[k])
                sparse[k] = [(v.write(t, a), i.write(t, b)) for (v, i), (a, b) in zip(sparse[k], pieces)]
                if k > 0:
                    dcarry[k - 1] = dx
        return s + 1, dcarry, sums, sparse

    _, _, sums, sparse = tf.while_loop(
        lambda s, *_: s < cycles,
        backward_body,
        (tf.constant(0), *variables),
        parallel_iterations=cycles,
    )
    return sums, sparse


def _weight_gradients(loops: Loops, vjps: list[CycleVJP], sums, sparse, scales, result: LoopOutputs) -> None:
    """Each cell's weight gradients into ``result``: dense sums, sparse pieces as slices, and the penalties'."""
    for k, cell in enumerate(loops.cells):
        trainable = loops.plan.weights[k][0]
        with devices.scope(cell.device):
            dense, pieces = iter(sums[k]), iter(sparse[k])
            grads = []
            for i, w in enumerate(trainable):
                if i in vjps[k].sparse:
                    values, indices = next(pieces)
                    grads.append(tf.IndexedSlices(values.concat(), indices.concat(), tf.shape(w, out_type=tf.int64)))
                else:
                    grads.append(next(dense))
            if cell.has_regularizers and loops.first == 0:  # once per step, outside the loops; replica 0 takes them
                penalty, extra = cell.regularization_gradients(trainable, scales[k])
                grads = add_each(grads, extra)
                result.added[k] = result.added[k] + penalty
            result.grads.append(grads)


class CycleVJP:
    """Cell k's backward at one cycle, one function traced once: recompute, VJP, add to the running sums."""

    def __init__(
        self,
        cell: Cell,
        weights: tuple[list[tf.Tensor], list[tf.Tensor]],
        in_structure: Any,
        out_specs: Sequence[tf.TensorSpec],
        wants_dx: bool,
    ):
        self._cell = cell
        self._trainable, self._other = weights
        self._structure = in_structure
        in_specs = leaves.flat(in_structure)
        self._dx = [i for i, s in enumerate(in_specs) if wants_dx and differentiable(s)]
        self._dy = [i for i, s in enumerate(out_specs) if differentiable(s)]
        self.sparse: set[int] = set()
        self.values_dtype: dict[int, tf.DType] = {}
        self.index_dtype: dict[int, tf.DType] = {}
        w = self._trainable
        sum_specs = [tf.TensorSpec([None] * v.shape.rank, v.dtype) for v in w]
        arg_specs = (
            list(in_specs)
            + [tf.TensorSpec(v.shape, v.dtype) for v in w]
            + [tf.TensorSpec(v.shape, v.dtype) for v in self._other]
            + [tf.TensorSpec([], tf.float32)]
            + [out_specs[i] for i in self._dy]
            + [tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.bool)]
            + sum_specs
        )
        self._n_x = len(in_specs)
        self._function = tf.function(
            self._body, autograph=False, experimental_attributes=_compat.noinline()
        ).get_concrete_function(*arg_specs)

    def _body(self, *flat: tf.Tensor) -> list[tf.Tensor]:  # named flat: the traced function's argument names
        n_x, n_w, n_s, n_y = self._n_x, len(self._trainable), len(self._other), len(self._dy)
        x_leaves = list(flat[:n_x])
        w = list(flat[n_x : n_x + n_w])
        other = list(flat[n_x + n_w : n_x + n_w + n_s])
        share = flat[n_x + n_w + n_s]
        dy = list(flat[n_x + n_w + n_s + 1 : n_x + n_w + n_s + 1 + n_y])
        scale, valid = flat[n_x + n_w + n_s + 1 + n_y : n_x + n_w + n_s + 3 + n_y]
        sums = list(flat[n_x + n_w + n_s + 3 + n_y :])
        cell = self._cell

        def compute() -> list[tf.Tensor]:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch([x_leaves[i] for i in self._dx] + w)
                x = tf.nest.pack_sequence_as(self._structure, leaves.fill(self._structure, x_leaves))
                y, _, terms = cell.run_inline(w, other, x, training=True)
                terms = terms * share
            y_leaves = leaves.flat(y)
            grads = tape.gradient(
                [y_leaves[i] for i in self._dy] + [terms],
                [x_leaves[i] for i in self._dx] + w,
                output_gradients=dy + [scale],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            out = list(grads[: len(self._dx)])
            for i, g in enumerate(grads[len(self._dx) :]):
                if isinstance(g, tf.IndexedSlices):  # embeddings: the slices leave the loop in arrays
                    self.sparse.add(i)
                    self.values_dtype[i], self.index_dtype[i] = g.values.dtype, g.indices.dtype
                    out += [g.values, g.indices]
                else:
                    total = sums[i] + g
                    total.set_shape(w[i].shape)
                    out.append(total)
            return out

        def bubble() -> list[tf.Tensor]:  # nothing to add (its empty batch may even hold NaN statistics)
            out = [tf.zeros_like(x_leaves[i]) for i in self._dx]
            for i, v in enumerate(w):
                if i in self.sparse:
                    out += [tf.zeros([0, *v.shape[1:]], self.values_dtype[i]), tf.zeros([0], self.index_dtype[i])]
                else:
                    same = tf.identity(sums[i])
                    same.set_shape(v.shape)
                    out.append(same)
            return out

        with cell.vjps.tracing():
            return tf.cond(valid, compute, bubble)  # traced in this order: bubble knows the sparse gradients

    def __call__(self, x: list, seeds: list, share: Any, dy: list, scale: Any, valid: Any, sums: list) -> tuple:
        """(input gradients, new running sums, (values, indices) of each sparse gradient)."""
        running, dense = [], iter(sums)
        for i, w in enumerate(self._trainable):
            if i in self.sparse:  # unused: the slices leave the loop in arrays
                running.append(self._cell.vjps.placeholder(w))
            else:
                running.append(next(dense))
        outputs = iter(self._function(*x, *self._trainable, *seeds, share, *dy, scale, valid, *running))
        dx = [next(outputs) for _ in self._dx]
        new_sums, pieces = [], []
        for i in range(len(self._trainable)):
            if i in self.sparse:
                pieces.append((next(outputs), next(outputs)))
            else:
                new_sums.append(next(outputs))
        return dx, new_sums, pieces
