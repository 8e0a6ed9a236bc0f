"""Split nested batches into micro-batches, merge them back, and weight their losses exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ContextManager, Union

import tensorflow as tf

from tfpipe.leaves import flat

Size = Union[int, tf.Tensor]
SHORT_BATCH = "tfpipe: a training batch is smaller than"  # the in-graph check's message starts so


def split_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
    """Sizes of M micro-batches of a batch of N: they differ by at most one, larger first."""
    if batch_size < num_micro_batches:
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into num_micro_batches="
            f"{num_micro_batches} micro-batches; use a batch size of at least "
            f"{num_micro_batches} or lower num_micro_batches."
        )
    base, extra = divmod(batch_size, num_micro_batches)
    return [base + (1 if j < extra else 0) for j in range(num_micro_batches)]


def batch_size(structure: Any) -> Size:
    """The batch size N of a nested batch: a Python int when static, else a scalar tensor."""
    leaves = flat(structure)
    if not leaves:
        raise ValueError("The batch holds no tensors; cannot split it into micro-batches.")
    first = tf.convert_to_tensor(leaves[0])
    if first.shape.rank == 0:
        raise ValueError(f"Batch tensors need a batch dimension; got a scalar {first!r}.")
    static = first.shape[0]
    return int(static) if static is not None else tf.shape(first)[0]


def _dynamic_sizes(n: tf.Tensor, m: int) -> tf.Tensor:
    base, extra = n // m, n % m
    return base + tf.cast(tf.range(m) < extra, n.dtype)


def sizes(structure: Any, num_micro_batches: int, allow_empty: bool = False) -> list[Size]:
    """Micro-batch sizes for a nested batch; static ints when N is static.

    With ``allow_empty`` (inference), N < M gives empty micro-batches instead of an error.
    """
    n = batch_size(structure)
    m = num_micro_batches
    if isinstance(n, int):
        if n < m and allow_empty:
            return [1 if j < n else 0 for j in range(m)]
        return split_sizes(n, m)
    if not allow_empty:
        check = tf.debugging.assert_greater_equal(
            n,
            m,
            message=f"{SHORT_BATCH} num_micro_batches={m}; "
            "use a larger batch size or drop the remainder (e.g. dataset.batch(..., drop_remainder=True))",
        )
        with tf.control_dependencies([check]):
            n = tf.identity(n)
    dynamic = _dynamic_sizes(n, m)
    return [dynamic[j] for j in range(m)]


def split(structure: Any, micro_sizes: Sequence[Size]) -> list[Any]:
    """Split every tensor of a nested batch along axis 0 into micro-batches of the given sizes.

    ``None`` leaves (no targets, no sample weights) stay ``None`` in every micro-batch.
    """
    m = len(micro_sizes)
    if structure is None:
        return [None] * m
    # (no annotation on size_arg: AutoGraph, converting a step that calls this, cannot handle one)
    if all(isinstance(s, int) for s in micro_sizes):
        size_arg = list(micro_sizes)
    else:
        size_arg = tf.stack([tf.cast(s, tf.int32) for s in micro_sizes])

    def split_leaf(leaf):
        if leaf is None:
            return [None] * m
        if m == 1:
            return [leaf]
        return tf.split(leaf, size_arg, axis=0, num=m)

    flat = [split_leaf(leaf) for leaf in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [parts[j] for parts in flat]) for j in range(m)]


def merge(parts: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs back into one batch, leaf by leaf."""
    if len(parts) == 1:
        return parts[0]
    flat = [tf.nest.flatten(p) for p in parts]
    merged = [None if leaves[0] is None else tf.concat(list(leaves), axis=0) for leaves in zip(*flat)]
    return tf.nest.pack_sequence_as(parts[0], merged)


def fractions(micro_sizes: Sequence[Size]) -> list[tf.Tensor]:
    """Each micro-batch's share n_j / N of the samples, as float32 scalars."""
    total = tf.cast(tf.add_n([tf.cast(s, tf.float32) for s in micro_sizes]), tf.float32)
    return [tf.cast(s, tf.float32) / total for s in micro_sizes]


def loss_weights(reduction: str, micro_sizes: Sequence[Size], sample_weight_parts: Sequence[Any]) -> list[tf.Tensor]:
    """Weights w_j such that sum_j w_j * loss(micro-batch j) equals the loss of the whole batch.

    ``reduction`` is the Keras loss reduction: "sum" adds micro-batch losses as they are;
    "sum_over_batch_size"/"mean" divide by the element count, so w_j = n_j / N;
    "mean_with_sample_weight" divides by the sum of sample weights, so w_j = S_j / S.
    """
    if reduction == "sum":
        return [tf.constant(1.0)] * len(micro_sizes)
    if reduction in ("sum_over_batch_size", "mean"):
        return fractions(micro_sizes)
    if reduction == "mean_with_sample_weight":
        if sample_weight_parts[0] is None:
            return fractions(micro_sizes)
        sums = [tf.add_n([tf.reduce_sum(tf.cast(w, tf.float32)) for w in flat(p)]) for p in sample_weight_parts]
        total = tf.add_n(sums)
        return [tf.math.divide_no_nan(s, total) for s in sums]
    raise ValueError(
        f"tfpipe cannot split a loss with reduction={reduction!r} into micro-batches exactly; "
        "use reduction 'sum_over_batch_size' (the Keras default), 'sum', 'mean' or 'mean_with_sample_weight'."
    )


def unfoldable(values: Sequence[Any], within: ContextManager | None = None) -> list[tf.Tensor]:
    """The same scalars as float32, hidden from Grappler's constant folding, read ``within`` a device scope.

    The gradient reaching a cell's added losses is loss scale x the micro-batch's share; folded
    into a distinct constant per micro-batch, it made Grappler's function optimizer specialize
    (copy and re-optimize) the cell's backward function once per task: most of the first step
    at K=2, M=32. The same holds for the inputs of the traced loss (its weight, the loss scale).
    A PlaceholderWithDefault is never folded, and costs one op per step. Read within a device's
    scope, the scalars cross to it as one vector and are unstacked there: one transfer, not one each.
    """
    stacked = tf.stack([tf.cast(v, tf.float32) for v in values])
    with within if within is not None else contextlib.nullcontext():
        return tf.unstack(tf.raw_ops.PlaceholderWithDefault(input=stacked, shape=stacked.shape))
