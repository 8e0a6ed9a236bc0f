"""Gradient values: which tensors (or specs) take a gradient, and the sum of two gradients, dense or sparse."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def differentiable(t: Any) -> bool:
    """Whether ``t`` (a tensor or spec) takes a gradient: one of a floating dtype."""
    return t is not None and t.dtype.is_floating


def add(a: Any, b: Any) -> Any:
    """Sum two gradients; sparse ones (embeddings) stay sparse by concatenating their slices."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
