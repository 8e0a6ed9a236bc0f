"""The step as two loops over GPipe's clock cycles, forward then backward: a graph that does not grow with M.

At clock cycle t, cell k runs micro-batch j = t - k (``schedule.gpipe``). Unrolled, a
step holds 2 K M cell calls; here it holds 2 K, inside two ``tf.while_loop``s of
M + K - 1 iterations whose iterations may overlap, so each cell runs as soon as its
input has arrived. At a cycle where a cell has no micro-batch (a bubble) a ``tf.cond``
skips it: an empty batch goes on, nothing is added. Every backward recomputes its
cell from the input stashed by the forward loop, so re-materialization is always on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe.distributed import devices
from tfpipe.partition.cell import Cell, add_dense
from tfpipe.step import state

# loss_grads(j, y_j) -> (micro-batch j's weighted loss, gradients of the scaled loss for the leaves of y_j)
LossGrads = Callable[[int, Any], tuple[tf.Tensor, list[tf.Tensor | None]]]


class Unsupported(Exception):
    """The pipeline cannot run as loops (a cell cannot be traced, or a tensor between cells has an unknown
    inner dimension); raised before any op is made, so the caller can unroll instead."""


@dataclasses.dataclass
class Looped:
    """What the loops produced, in the terms of ``pipeline.StepResult``."""

    outputs: list[Any]  # per micro-batch outputs of the last cell
    losses: list[tf.Tensor]  # per micro-batch weighted loss (training)
    added: list[tf.Tensor]  # per cell: add_loss and regularization terms, summed over micro-batches
    grads: list[list[Any]]  # per cell, aligned with its trainable variables
    new_state: dict  # (cell, j) -> the cell's non-trainable values after micro-batch j


def _floating(t: Any) -> bool:
    return t is not None and t.dtype.is_floating


def _unknown_batch(shape: tf.TensorShape) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(shape[1:])


def _empty(spec: tf.TensorSpec) -> tf.Tensor:
    """An empty batch of ``spec``, typed with an unknown batch size (so loop variables keep their type)."""
    zeros = tf.zeros([0] + spec.shape[1:].as_list(), spec.dtype)
    return tf.raw_ops.PlaceholderWithDefault(input=zeros, shape=_unknown_batch(spec.shape))


def _array(spec: tf.TensorSpec, size: int) -> tf.TensorArray:
    return tf.TensorArray(spec.dtype, size=size, element_shape=_unknown_batch(spec.shape), infer_shape=False)


def _rows(t: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """``t`` for a cycle with a micro-batch; its first zero rows (an empty batch) in a bubble."""
    return t[: tf.where(valid, tf.shape(t)[0], 0)]


def micro_batch_at(cycle: Any, cell: int) -> Any:
    """The micro-batch cell k runs at forward cycle t (GPipe's clock: ``schedule.gpipe``), valid or not.

    The backward loop's iteration s runs the forward cycle M + K - 2 - s again, in reverse.
    """
    return cycle - cell


class _Cycle:
    """Cell k at cycle t: its micro-batch j, whether there is one, j clipped into range, and j's share n_j/N."""

    def __init__(self, t: tf.Tensor, k: int, m: int, shares: tf.Tensor):
        self.j = micro_batch_at(t, k)
        self.valid = tf.logical_and(self.j >= 0, self.j < m)
        self.clipped = tf.clip_by_value(self.j, 0, m - 1)
        self.share = tf.where(self.valid, tf.gather(shares, self.clipped), 0.0)  # a bubble adds nothing


def run(
    cells: Sequence[Cell],
    weights: Sequence[tuple[list[tf.Tensor], list[tf.Tensor]]],
    inputs: Sequence[Any],
    training: bool,
    fractions: Sequence[Any] | None,
    loss_grads: LossGrads | None = None,
    loss_scale: Any = 1.0,
    first: int = 0,
) -> Looped:
    """Forward (and with ``loss_grads`` backward) of one step over the micro-batches ``inputs``.

    ``first`` is the global number of micro-batch 0 (a replica's first), from which seeds are drawn.
    """
    k_cells, m = len(cells), len(inputs)
    cycles = m + k_cells - 1
    backward = loss_grads is not None
    traces, structures = _trace_forward(cells, weights, inputs[0], training)
    with devices.scope(cells[0].device):
        shares = tf.stack([tf.cast(f, tf.float32) for f in (fractions or [1.0] * m)])
        sources = []
        for position, leaf in enumerate(tf.nest.flatten(inputs[0])):
            if leaf is None:
                continue
            array = _array(tf.TensorSpec(leaf.shape, leaf.dtype), m)
            for j, part in enumerate(inputs):
                array = array.write(j, tf.nest.flatten(part)[position])
            sources.append(array)
    specs = [_leaf_specs(s) for s in structures]  # specs[k]: cell k's input leaves; specs[K]: the outputs

    carries, stashes, states, added = [], [], [], []
    for k, cell in enumerate(cells):
        with devices.scope(cell.device):
            if k > 0:
                carries.append([_empty(s) for s in specs[k]])
            stashes.append([_array(s, cycles) for s in specs[k]] if backward else [])
            old = weights[k][1]
            states.append([_array(tf.TensorSpec(old[c].shape, old[c].dtype), cycles) for c in traces[k].changed])
            added.append(tf.constant(0.0))
    with devices.scope(cells[-1].device):
        outs = [_array(s, cycles) for s in specs[-1]]

    def forward_body(t, carries, stashes, states, outs, added):
        arrived = list(carries)  # what the cells sent in the previous cycle
        carries, stashes, states, added = list(carries), list(stashes), list(states), list(added)
        for k, cell in enumerate(cells):
            with devices.scope(cell.device):
                c = _Cycle(t, k, m, shares)
                leaves = [_rows(a.read(c.clipped), c.valid) for a in sources] if k == 0 else arrived[k - 1]
                if backward:
                    stashes[k] = [a.write(t, x) for a, x in zip(stashes[k], leaves)]
                x = tf.nest.pack_sequence_as(structures[k], _fill(structures[k], leaves))
                seeds = state.micro_batch_states(cell.non_trainable_variables, weights[k][1], c.clipped + first)
                y_leaves, changed, terms = _forward_or_bubble(traces[k], x, weights[k][0], seeds, c.valid, specs[k + 1])
                states[k] = [a.write(t, v) for a, v in zip(states[k], changed)]
                added[k] = added[k] + terms * c.share
                if k < k_cells - 1:
                    carries[k] = y_leaves
                else:
                    outs = [a.write(t, leaf) for a, leaf in zip(outs, y_leaves)]
        return t + 1, carries, stashes, states, outs, added

    _, _, stashes, states, outs, added = tf.while_loop(
        lambda t, *_: t < cycles,
        forward_body,
        (tf.constant(0), carries, stashes, states, outs, added),
        parallel_iterations=cycles,  # any cycle may start once its inputs exist: cell 0 runs ahead, as in GPipe
    )

    result = Looped(outputs=[], losses=[], added=list(added), grads=[], new_state={})
    with devices.scope(cells[-1].device):
        for j in range(m):
            flat = _fill(structures[-1], [a.read(j + k_cells - 1) for a in outs])
            result.outputs.append(tf.nest.pack_sequence_as(structures[-1], flat))
    for k, cell in enumerate(cells):
        with devices.scope(cell.device):
            for j in range(m):
                values = list(weights[k][1])
                for a, i in zip(states[k], traces[k].changed):
                    values[i] = a.read(j + k)
                result.new_state[(k, j)] = values
    if backward:
        _backward(cells, weights, traces, structures, specs, stashes, shares, loss_grads, loss_scale, result, first)
    return result


def _forward_or_bubble(trace, x, trainable, seeds, valid, out_specs):
    """The cell's forward at one cycle: (output leaves, changed state values, added losses); a bubble skips it.

    A bubble's outputs are empty batches, its state values the ones it was given, its added loss 0.
    """

    def forward():
        y, new_state, terms = trace.apply(x, trainable, seeds)
        return [leaf for leaf in tf.nest.flatten(y) if leaf is not None], [new_state[i] for i in trace.changed], terms

    def bubble():
        return [_empty(s) for s in out_specs], [tf.identity(seeds[i]) for i in trace.changed], tf.constant(0.0)

    return tf.cond(valid, forward, bubble)


def _fill(structure: Any, leaves: Sequence[tf.Tensor]) -> list[Any]:
    """The flat leaves of ``structure`` with its non-None leaves replaced, in order, by ``leaves``."""
    it = iter(leaves)
    return [None if leaf is None else next(it) for leaf in tf.nest.flatten(structure)]


def _leaf_specs(structure: Any) -> list[tf.TensorSpec]:
    return [leaf for leaf in tf.nest.flatten(structure) if leaf is not None]


def _trace_forward(cells, weights, first_input, training):
    """Each cell traced for a micro-batch of unknown size; the structures of specs between the cells."""
    structure = tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec(_unknown_batch(t.shape), t.dtype), first_input
    )
    traces, structures = [], [structure]
    for k, cell in enumerate(cells):
        trace = cell.traced(structure, weights[k][0], weights[k][1], training)
        if trace is None:
            raise Unsupported(f"cell {k} cannot be traced as a function")
        outputs = iter(trace.function.outputs)
        leaves = [None if leaf is None else next(outputs) for leaf in tf.nest.flatten(trace.y)]
        structure = tf.nest.pack_sequence_as(
            trace.y, [None if t is None else tf.TensorSpec(_unknown_batch(t.shape), t.dtype) for t in leaves]
        )
        unknown = [t for t in _leaf_specs(structure) if not t.shape[1:].is_fully_defined()]
        if unknown:  # a bubble passes on an empty batch, which needs every other dimension
            raise Unsupported(f"cell {k} outputs {unknown[0]}, whose inner dimensions are not all known")
        traces.append(trace)
        structures.append(structure)
    return traces, structures


def _backward(
    cells, weights, traces, structures, specs, stashes, shares, loss_grads, loss_scale, result, first
) -> None:
    """The losses, then the backward loop: each cell's VJP per cycle, its weight gradients summed as it goes."""
    k_cells, m = len(cells), len(result.outputs)
    cycles = m + k_cells - 1
    with devices.scope(cells[-1].device):
        wanted = [i for i, spec in enumerate(specs[-1]) if _floating(spec)]
        dys = [_array(specs[-1][i], m) for i in wanted]
        for j, y in enumerate(result.outputs):
            loss, grads = loss_grads(j, y)
            result.losses.append(loss)
            dys = [a.write(j, grads[i]) for a, i in zip(dys, wanted)]
    vjps = [_VJP(cell, weights[k], structures[k], specs[k + 1], k > 0) for k, cell in enumerate(cells)]
    dcarry, sums, sparse, scales = [], [], [], []
    for k, cell in enumerate(cells):
        with devices.scope(cell.device):
            dcarry.append([_empty(s) for s in specs[k + 1] if _floating(s)] if k < k_cells - 1 else [])
            sums.append([tf.zeros_like(w) for i, w in enumerate(weights[k][0]) if i not in vjps[k].sparse])
            sparse.append(
                [
                    (
                        _array(tf.TensorSpec([None, *w.shape[1:]], vjps[k].values_dtype[i]), cycles),
                        _array(tf.TensorSpec([None], vjps[k].index_dtype[i]), cycles),
                    )
                    for i, w in enumerate(weights[k][0])
                    if i in vjps[k].sparse
                ]
            )
            scales.append(tf.cast(loss_scale, tf.float32))

    def backward_body(s, dcarry, sums, sparse):
        t = cycles - 1 - s
        arrived = list(dcarry)  # what the cells sent back in the previous cycle
        dcarry, sums, sparse = list(dcarry), list(sums), list(sparse)
        for k in reversed(range(k_cells)):
            cell = cells[k]
            with devices.scope(cell.device):
                c = _Cycle(t, k, m, shares)
                dy = [_rows(a.read(c.clipped), c.valid) for a in dys] if k == k_cells - 1 else arrived[k]
                x = [a.read(t) for a in stashes[k]]
                seeds = state.micro_batch_states(cell.non_trainable_variables, weights[k][1], c.clipped + first)
                dx, sums[k], pieces = vjps[k](x, seeds, c.share, dy, scales[k], c.valid, sums[k])
                sparse[k] = [(v.write(t, a), i.write(t, b)) for (v, i), (a, b) in zip(sparse[k], pieces)]
                if k > 0:
                    dcarry[k - 1] = dx
        return s + 1, dcarry, sums, sparse

    _, _, sums, sparse = tf.while_loop(
        lambda s, *_: s < cycles,
        backward_body,
        (tf.constant(0), dcarry, sums, sparse),
        parallel_iterations=cycles,
    )
    for k, cell in enumerate(cells):
        with devices.scope(cell.device):
            dense, pieces = iter(sums[k]), iter(sparse[k])
            grads = []
            for i, w in enumerate(weights[k][0]):
                if i in vjps[k].sparse:
                    values, indices = next(pieces)
                    grads.append(tf.IndexedSlices(values.concat(), indices.concat(), tf.shape(w, out_type=tf.int64)))
                else:
                    grads.append(next(dense))
            if cell.has_regularizers and first == 0:  # once per step, outside the loops; replica 0 takes them
                penalty, extra = cell.regularization_gradients(weights[k][0], scales[k])
                grads = add_dense(grads, extra)
                result.added[k] = result.added[k] + penalty
            result.grads.append(grads)


class _VJP:
    """Cell k's backward at one cycle, one function traced once: recompute, VJP, add to the running sums."""

    def __init__(self, cell: Cell, weights, in_structure, out_specs, wants_dx: bool):
        self._cell = cell
        self._trainable, self._other = weights
        self._structure = in_structure
        in_specs = _leaf_specs(in_structure)
        self._dx = [i for i, s in enumerate(in_specs) if wants_dx and _floating(s)]
        self._dy = [i for i, s in enumerate(out_specs) if _floating(s)]
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
            self._body, autograph=False, experimental_attributes={"_noinline": True}
        ).get_concrete_function(*arg_specs)

    def _body(self, *flat):
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
                x = tf.nest.pack_sequence_as(self._structure, _fill(self._structure, x_leaves))
                y, _, terms = cell.run_inline(w, other, x, training=True)
                terms = terms * share
            y_leaves = [leaf for leaf in tf.nest.flatten(y) if leaf is not None]
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

    def __call__(self, x, seeds, share, dy, scale, valid, sums):
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
