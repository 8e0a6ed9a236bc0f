"""Gradient values: which tensors (or specs) take a gradient, and the sum of two gradients, dense or sparse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def differentiable(t: Any) -> bool:
    """Whether ``t`` (a tensor or spec) takes a gradient: one of a floating dtype."""
    return t is not None and t.dtype.is_floating


def sum_gradients(grads: Sequence[Any]) -> Any:
    """The sum of one variable's gradients; None where none flows.

    Slices (an embedding's) stay slices, their rows concatenated, unless one of the gradients is dense:
    Keras' optimizers update only a slice's rows (an embedding's moments decay only where the batch has
    tokens), so densifying them would change Adam's step. An embedding's rows and a dense gradient of
    the same table (tied to an output projection) add densely.
    """
    present = [g for g in grads if g is not None]
    if len(present) <= 1:
        return present[0] if present else None
    if all(isinstance(g, tf.IndexedSlices) for g in present):
        indices = [tf.cast(g.indices, tf.int64) for g in present]  # one dtype, whatever each slice's
        shape = next((g.dense_shape for g in present if g.dense_shape is not None), None)
        return tf.IndexedSlices(tf.concat([g.values for g in present], 0), tf.concat(indices, 0), shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in present])


def add_each(grads: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
    """Each gradient of ``grads`` plus its ``extra`` (``sum_gradients`` of the pair)."""
    return [sum_gradients([g, e]) for g, e in zip(grads, extra, strict=True)]
