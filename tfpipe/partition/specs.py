"""Input specs: symbolic inputs from shapes or tensors, their JSON form, and generated samples shaped like them."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

ESTIMATION_BATCH = 8  # samples per estimation batch when the model's batch size is not known


def is_shape(s: Any) -> bool:
    """Whether ``s`` is one shape (a tuple, list or TensorShape of ints and Nones), not a structure of them."""
    return isinstance(s, (tuple, list, tf.TensorShape)) and all(
        d is None or isinstance(d, (int, np.integer)) for d in s
    )


def symbolic(input_shape: Any, keep_batch: bool = False) -> Any:
    """Symbolic inputs (KerasTensors) from shapes, as Keras passes them to ``build``, or from tensors.

    A tensor's batch dimension becomes None unless ``keep_batch``.
    """
    if isinstance(input_shape, (tf.Tensor, np.ndarray, keras.KerasTensor)):
        dtype = keras.backend.standardize_dtype(input_shape.dtype)
        batch = input_shape.shape[0] if keep_batch else None
        return keras.KerasTensor((batch,) + tuple(input_shape.shape[1:]), dtype=dtype)
    if is_shape(input_shape):
        return keras.KerasTensor(tuple(input_shape))
    if isinstance(input_shape, dict):
        return {k: symbolic(v, keep_batch) for k, v in input_shape.items()}
    return type(input_shape)(symbolic(s, keep_batch) for s in input_shape)


def detached(spec: Any) -> Any:
    """``spec`` with each KerasTensor made again without its history: a symbolic call's outputs keep the layer that
    made them, and through its inputs every layer before, alive (with their weights)."""

    def fresh(t: Any) -> Any:
        if isinstance(t, keras.KerasTensor):
            return keras.KerasTensor(t.shape, dtype=t.dtype, sparse=t.sparse, ragged=t.ragged)
        return t

    return tf.nest.map_structure(fresh, spec)


def first_batch_dim(input_shape: Any) -> int | None:
    """The batch dimension of the first input of a shape, tensor or structure of them (None if unknown)."""
    if is_shape(input_shape):
        return input_shape[0] if len(input_shape) else None
    if hasattr(input_shape, "shape"):
        return input_shape.shape[0] if len(input_shape.shape) else None
    leaves = list(input_shape.values()) if isinstance(input_shape, dict) else list(input_shape)
    return first_batch_dim(leaves[0]) if leaves else None


def filled(shape: Any, length: int | None) -> tuple:
    """``shape`` (batch dimension included) with every unknown dimension after the batch taken as ``length``."""
    return tuple(shape[:1]) + tuple(length if d is None and length else d for d in shape[1:])


def estimation_sample(spec: Any, batch: int | None, num_micro_batches: int, length: int | None = None) -> Any:
    """Generated data shaped like one micro-batch of a batch of ``batch`` inputs (or of ESTIMATION_BATCH).

    Unknown dimensions after the batch (a sequence length) are taken as ``length`` when it is given.
    """
    n = -(-int(batch) // num_micro_batches) if batch else ESTIMATION_BATCH
    rng = np.random.default_rng(0)

    def make(spec: keras.KerasTensor) -> np.ndarray:
        shape = filled((n,) + tuple(spec.shape[1:]), length)
        if any(d is None for d in shape):
            raise ValueError(
                f"Estimating layer costs needs the input's full shape but one sample is {tuple(spec.shape[1:])}; "
                "build the model with a full shape, e.g. model.build((None, 128)), or pass balance=[...]."
            )
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if "float" in dtype:
            return rng.standard_normal(shape).astype(dtype if dtype != "bfloat16" else "float32")
        return np.zeros(shape, dtype if dtype != "string" else object)

    return tf.nest.map_structure(make, spec)


def to_config(spec: Any) -> Any:
    """Symbolic inputs as JSON-able data: each leaf becomes {"shape": [...], "dtype": ...}."""
    if isinstance(spec, keras.KerasTensor):
        return {"shape": list(spec.shape), "dtype": keras.backend.standardize_dtype(spec.dtype)}
    if isinstance(spec, dict):
        return {"dict": {k: to_config(v) for k, v in spec.items()}}
    return {"sequence": [to_config(v) for v in spec]}


def from_config(config: dict[str, Any]) -> Any:
    """Inverse of ``to_config`` (sequences come back as tuples)."""
    if "dict" in config:
        return {k: from_config(v) for k, v in config["dict"].items()}
    if "sequence" in config:
        return tuple(from_config(v) for v in config["sequence"])
    return keras.KerasTensor(tuple(config["shape"]), dtype=config["dtype"])
