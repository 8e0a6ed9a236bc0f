"""One W over all micro-batches: whether a cell's weight-gradient part may run on their concatenation, and running it.

A cell's W (``tfpipe.backward.split_vjp``) computes its weight gradients from tensors its forward and
B leave it. Fed those tensors of all M micro-batches concatenated along the batch axis,
W gives the sum of its M results, one product over the mini-batch instead of M small
ones (on one CPU thread, M small products cost more than one over all the rows:
docs/benchmarks.md#overhead-per-task), if every op of W works example by example, or
sums over the examples, or is linear in such a sum.
``BatchedW`` checks that op by op on W traced with the rows of all micro-batches, each
tensor labelled by where it holds the examples (``tfpipe.backward.batched_w_ops``).
Anything else (batch statistics, an op it does not know) makes W run once per micro-batch.
What works example by example (in a first cell, with no input gradient to take, the whole
chain of activation gradients) runs in each micro-batch's B, so that only the sums wait
for the last micro-batch; so do plain sums over the examples (bias gradients), which gain
nothing from more rows: W adds up each B's partial sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.backward.batched_w_ops import BATCHED, COLUMNS, CONST, SHAPE, SHAPE_OPS, SUMMED, Unbatchable, fail, label_op
from tfpipe.backward.split_vjp import SplitVJP, ancestors

__all__ = ["BatchedW", "Unbatchable"]

_PARTIAL_SUMS = ("Sum", "BiasAddGrad")  # sums over examples that each B takes of its own micro-batch


class BatchedW:
    """A cell's W cut in two: what works example by example, which each B runs on its micro-batch, and the sums
    over examples, which run once on the rows of all micro-batches (a W task over all of them).
    """

    def __init__(self, smalls: Sequence[SplitVJP], big: SplitVJP, shared: set[str]):
        """``smalls[j]``: micro-batch j's split VJP (one object where shapes agree); ``big``: the cell traced with
        the rows of all of them; ``shared``: the names of inputs that are the same tensor in every micro-batch.

        Raises ``Unbatchable`` naming what keeps W from running once.
        """
        self._big = big
        self._key = object()  # the parts cut for this W, cached in the split VJPs under it
        labels = _labels(smalls, big, shared)
        inside = big.ops("weights")
        self._added, self._sliced, rows = _check_results(big, labels, {t.name for op in inside for t in op.outputs})
        graph = big.graph
        results = [graph.get_tensor_by_name(n).op for n in big.dw if n not in rows]
        # A plain sum over the examples gains nothing from more rows, and concatenating its input costs a copy:
        # each B sums its own micro-batch, and W adds up those partial sums.
        partial = {op for op in inside if op.type in _PARTIAL_SUMS and labels.get(op.inputs[0].name) == BATCHED}
        partial = {op for op in partial if labels.get(op.outputs[0].name) == SUMMED}
        stop = lambda op: op in partial or _per_example(op, labels)  # noqa: E731
        self._sums = _closure([op for op in results if op in inside], inside, stop=stop)
        read = {t.name: t for op in self._sums for t in op.inputs if t.op not in self._sums and t.op.type != "Const"}
        self._batched = [n for n in read if labels.get(n) == BATCHED]
        self._shared = [n for n in read if labels.get(n) == CONST]
        self._partial = [n for n in read if read[n].op in partial]
        self._partial += [n for n in big.dw if graph.get_tensor_by_name(n).op in partial and n not in self._partial]
        read.update((n, graph.get_tensor_by_name(n)) for n in self._partial)
        odd = [n for n in read if n not in self._batched + self._shared + self._partial]
        if odd:
            raise Unbatchable(f"the sums of W read {odd[0]}, which is {labels.get(odd[0])}")
        frontier = [read[n].op for n in self._batched + self._partial] + [graph.get_tensor_by_name(n).op for n in rows]
        self._examples = {op.name for op in _closure(frontier, inside)}
        self._wanted = list(read) + rows  # what each B hands over of its micro-batch
        self._sliced += rows  # a sparse gradient's rows, made example by example: concatenated
        _check_traced_alike(smalls, self._examples, self._wanted)

    def joined_bytes(self) -> int:
        """The bytes ``run`` concatenates at the rows ``big`` was traced with (what each B hands W, joined)."""
        graph = self._big.graph
        tensors = [graph.get_tensor_by_name(name) for name in self._batched + self._sliced]
        return sum(t.shape.num_elements() * t.dtype.size for t in tensors if t.shape.is_fully_defined())

    def inputs_part(self, small: SplitVJP) -> Any:
        """B of one micro-batch (``small``'s): its input gradients and the per-example part of W."""
        graph = small.graph
        ops = small.ops("inputs") | {graph.get_operation_by_name(name) for name in self._examples}
        return small.cut(("inputs", self._key), "inputs", ops, small.dx + self._wanted)

    def run(self, envs: Sequence[dict[str, tf.Tensor]]) -> list[Any]:
        """The weight gradients summed over the micro-batches ``envs`` (each after its B): W's sums, once."""
        env = {name: tf.concat([e[name] for e in envs], 0) for name in self._batched}
        env.update((name, envs[0][name]) for name in self._shared)
        env.update((name, tf.add_n([e[name] for e in envs])) for name in self._partial)
        self._big.cut(("weights", self._key), "weights", self._sums, self._big.dw)(env)
        env.update((name, tf.add_n([e[name] for e in envs])) for name in self._added)
        env.update((name, tf.concat([e[name] for e in envs], 0)) for name in self._sliced)
        for name in self._big.dw:
            if name not in env:
                env[name] = envs[0][name]  # the dense shape of a sparse gradient made before W
        return self._big.weight_gradients(env)


def _per_example(op: tf.Operation, labels: dict[str, str]) -> bool:
    """Whether every output of ``op`` is made example by example (a ShapeN of a weight too is not)."""
    return bool(op.outputs) and all(labels.get(t.name) in (BATCHED, COLUMNS, SHAPE) for t in op.outputs)


def _closure(ops: Sequence[tf.Operation], within: set[tf.Operation], stop=lambda op: False) -> set[tf.Operation]:
    """``ops`` and what they read from ``within``, transitively, not going past an op where ``stop`` says so."""
    seen: set[tf.Operation] = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in seen or op not in within or stop(op):
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return seen


def _check_traced_alike(smalls: Sequence[SplitVJP], ops: set[str], tensors: Sequence[str]) -> None:
    """Raise ``Unbatchable`` unless every micro-batch's graph has the ops each B runs for W and the tensors it hands
    over: TensorFlow traces some gradients without a sum over a dimension of 1, as in a micro-batch of one row."""
    for small in smalls:
        names = {op.name for op in small.graph.get_operations()}
        missing = sorted(ops - names) + [t for t in tensors if t.split(":")[0] not in names]
        if missing:
            shape = small.graph.get_tensor_by_name(small.inputs[0]).shape if small.inputs else "unknown"
            raise Unbatchable(
                f"a micro-batch shaped {shape} was traced without {missing[0]}, which W runs example by example"
            )


def _labels(smalls: Sequence[SplitVJP], big: SplitVJP, shared: set[str]) -> dict[str, str]:
    """The label of every tensor W reads or makes, by name (in ``big``'s graph, which names them as ``smalls``')."""
    whole = big.part("weights", recompute=False)
    for small in smalls:
        part = small.part("weights", recompute=False)
        if part.feeds != whole.feeds or part.fetches != whole.fetches or small.dw != big.dw:
            raise Unbatchable("the cell traced with the rows of all micro-batches reads or makes other tensors in W")
    graph_b = big.graph
    first = graph_b.get_tensor_by_name(big.inputs[0]).shape if big.inputs else None
    examples = first[0] if first is not None and first.rank else None  # the first source's rows: one per example
    labels: dict[str, str] = {}
    for name in whole.feeds:
        fed = [s.graph.get_tensor_by_name(name) for s in smalls]
        labels[name] = _feed_label(fed, graph_b.get_tensor_by_name(name), shared)
    inside = big.ops("weights")
    for op in graph_b.get_operations():  # creation order: every op after its inputs
        if op in inside:
            read = [labels.get(t.name, CONST if t.op.type == "Const" else None) for t in op.inputs]
            ins = [label for label in read if label is not None]
            if len(ins) < len(read):
                raise Unbatchable(f"W's op {op.name} reads a tensor W is not fed")
            if op.type == "ShapeN":  # one shape per input: each its own label
                shapes = [SHAPE if label == BATCHED else CONST if label in (CONST, SUMMED) else None for label in ins]
                outs = [label for label in shapes if label is not None]
                if len(outs) < len(shapes):
                    raise fail(op, ins)
            else:
                outs = [label_op(op, ins, examples)] * len(op.outputs)
            labels.update((t.name, out) for t, out in zip(op.outputs, outs))
    return labels


def _feed_label(smalls: Sequence[tf.Tensor], big: tf.Tensor, shared: set[str]) -> str:
    """CONST for a tensor the same in every micro-batch, BATCHED for one with the examples on axis 0.

    ``smalls`` is the tensor in each micro-batch's graph, ``big`` in the graph of all their rows.
    """
    small = smalls[0]
    if small.op.type in SHAPE_OPS + ("Size", "Rank"):
        index = small.value_index if small.op.type == "ShapeN" else 0
        measured = [t.op.inputs[index].shape for t in smalls] + [big.op.inputs[index].shape]
        if measured[0].is_fully_defined() and all(shape == measured[0] for shape in measured):
            return CONST
        raise Unbatchable(f"W reads {small.name}, the shape of a tensor that grows with the batch")
    same_shape = all(t.shape == big.shape for t in smalls)  # else its shape grows with the batch
    if same_shape and (small.name in shared or _made_from(small, shared)):
        return CONST
    rank, rows = small.shape.rank, [t.shape[0] if t.shape.rank else None for t in smalls]
    trailing = rank and big.shape.rank == rank and all(t.shape[1:] == big.shape[1:] for t in smalls)
    known = [r for r in rows if r is not None]
    if trailing and (
        (None in rows and big.shape[0] is None) or (len(known) == len(rows) and big.shape[0] == sum(known))
    ):
        return BATCHED
    raise Unbatchable(
        f"W reads {small.name} {small.shape}, which is neither example by example nor the same in every micro-batch"
    )


def _made_from(tensor: tf.Tensor, inputs: set[str]) -> bool:
    """Whether ``tensor`` depends on no graph input but ``inputs`` (weights make the same copy in each micro-batch)."""
    return all(op.type != "Placeholder" or op.outputs[0].name in inputs for op in ancestors([tensor]))


def _check_results(big: SplitVJP, labels: dict[str, str], inside: set[str]) -> tuple[list[str], ...]:
    """Check that W's weight gradients are sums over the examples (or zeros), and sort out the rest.

    Returns the names of dense gradients and of sparse gradients' (values, indices) that B
    computed, each micro-batch its own (added up, and concatenated, instead), and of the
    (values, indices) that W makes example by example (concatenated).
    """
    added, sliced, rows = [], [], []
    names = iter(big.dw)
    for k in range(len(big.dw) - 2 * len(big.sparse)):
        group = [next(names) for _ in range(3 if k in big.sparse else 1)]
        if not any(name in inside for name in group):
            (sliced.extend(group[:2]) if k in big.sparse else added.extend(group))
            continue
        if k in big.sparse:
            values, indices, shape = (labels.get(name) for name in group)
            if shape not in (CONST, None) or (values, indices) not in ((BATCHED, BATCHED), (SUMMED, CONST)):
                raise Unbatchable(f"the sparse weight gradient {group[0]} is not made row by row")
            if values == BATCHED:  # slices of rows: their concatenation is their sum
                rows += group[:2]
            continue  # else the same slices every time (positions), their values summed
        label = labels.get(group[0])
        if label == SUMMED or label == CONST and _zeros(big.graph.get_tensor_by_name(group[0])):
            continue
        raise Unbatchable(f"the weight gradient {group[0]} is {label}, not a sum over the examples")
    return added, sliced, rows


def _zeros(tensor: tf.Tensor) -> bool:
    """Whether ``tensor`` is zeros (an unconnected weight's gradient), whatever the batch."""
    if tensor.op.type == "ZerosLike":
        return True
    value = tf.get_static_value(tensor)
    return value is not None and not value.any()
