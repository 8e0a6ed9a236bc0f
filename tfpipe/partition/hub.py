"""What tfpipe keeps of Keras' model zoos' habits: a keras_hub task's preprocessor in fit, and its sequence length.

A keras_hub task (``CausalLM``, ``TextClassifier``, ...) applies its
``preprocessor`` to the data inside its own ``fit``, ``evaluate`` and
``predict``: raw strings in, token ids out, batched by ``tf.data``. A
PipelineModel of the task does the same here, through the task's public
``preprocess_samples``; nothing here imports keras_hub.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat

STAND_IN_LENGTH = 128  # an unknown sequence length, for estimating costs, when the model gives no hint

Preprocess = Callable[..., Any]  # (x, y=None, sample_weight=None) -> x or (x, y[, sample_weight])


def preprocess_of(model: Any) -> Preprocess | None:
    """The task's ``preprocess_samples`` when it has a ``preprocessor`` (keras_hub tasks), else None."""
    if getattr(model, "preprocessor", None) is None:
        return None
    preprocess = getattr(model, "preprocess_samples", None)
    return preprocess if callable(preprocess) else None


TRACED = ("train_function", "test_function", "predict_function", "generate_function")  # Keras' and keras_hub's


def forget_traced(model: keras.Model) -> None:
    """Drop the step functions ``model`` and the models inside it traced before tfpipe moved their variables.

    A traced function holds the variables it read when it was traced; after the move it
    would read the old copies (``generate`` and ``predict`` of the task would not see training).
    """
    for layer in _compat.flatten_layers(model):
        for name in TRACED:
            if isinstance(layer, keras.Model) and getattr(layer, name, None) is not None:
                setattr(layer, name, None)


def stand_in_length(model: Any) -> int:
    """The length to estimate costs with where the model's inputs leave a dimension unknown.

    A keras_hub task's preprocessor pads to its ``sequence_length``; a backbone knows its
    ``max_sequence_length`` (the smaller of it and ``STAND_IN_LENGTH``); else ``STAND_IN_LENGTH``.
    """
    length = getattr(getattr(model, "preprocessor", None), "sequence_length", None)
    if isinstance(length, int) and length > 0:
        return length
    found = [
        getattr(layer, "max_sequence_length", None) for layer in [model, getattr(model, "backbone", None)] if layer
    ]
    known = [n for n in found if isinstance(n, int) and n > 0]
    return min(known + [STAND_IN_LENGTH]) if known else STAND_IN_LENGTH


def _dataset(x: Any, y: Any, sample_weight: Any, batch_size: int | None, what: str) -> tf.data.Dataset:
    """``x``, ``y`` and ``sample_weight`` batched as a dataset (as given when ``x`` already is one)."""
    if isinstance(x, tf.data.Dataset):
        given = {"y": y, "sample_weight": sample_weight, "batch_size": batch_size}
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(
                f"{what}: x is a tf.data.Dataset, so {', '.join(extra)} must be left out (the dataset holds them)."
            )
        return x
    if x is None:
        raise ValueError(f"{what}: x is None; give the raw samples the task's preprocessor takes.")
    data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
    data = keras.tree.map_structure(lambda a: a if isinstance(a, (tf.Tensor, tf.RaggedTensor)) else np.asarray(a), data)
    return tf.data.Dataset.from_tensor_slices(data).batch(batch_size or _compat.DEFAULT_BATCH_SIZE)


def _preprocessed(dataset: tf.data.Dataset, preprocess: Preprocess) -> tf.data.Dataset:
    return dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def _split(data: Any, fraction: float) -> tuple[Any, Any]:
    """The first ``1 - fraction`` of every array in ``data`` and the rest, as Keras' ``validation_split`` cuts."""
    leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
    n = len(leaves[0])
    at = int(math.floor(n * (1.0 - fraction)))
    if at in (0, n):
        raise ValueError(f"validation_split={fraction} leaves no samples on one side of {n}; use a split in (0, 1).")
    arrays = keras.tree.map_structure(lambda a: None if a is None else np.asarray(a), data, none_is_leaf=False)
    return (
        keras.tree.map_structure(lambda a: a[:at], arrays, none_is_leaf=False),
        keras.tree.map_structure(lambda a: a[at:], arrays, none_is_leaf=False),
    )


def for_fit(preprocess: Preprocess, x: Any, y: Any, batch_size: int | None, kwargs: dict[str, Any]) -> Any:
    """``fit``'s ``x`` as a preprocessed dataset, and its keyword arguments without what the dataset now holds.

    As a keras_hub task's own ``fit``: ``validation_split`` cuts the raw arrays (the last
    fraction), ``validation_data`` is preprocessed too, and arrays are batched in order.
    """
    kwargs = dict(kwargs)
    sample_weight = kwargs.pop("sample_weight", None)
    split = kwargs.pop("validation_split", None)
    if split and kwargs.get("validation_data") is None:
        if isinstance(x, tf.data.Dataset):
            raise ValueError("validation_split does not cut a tf.data.Dataset; pass validation_data instead.")
        (x, y, sample_weight), validation = _split((x, y, sample_weight), float(split))
        kwargs["validation_data"] = validation
    validation = kwargs.get("validation_data")
    if validation is not None:
        if not isinstance(validation, tf.data.Dataset):
            x_val, y_val, sample_weight_val = keras.utils.unpack_x_y_sample_weight(tuple(validation))
            validation = _dataset(x_val, y_val, sample_weight_val, batch_size, "fit")
        kwargs["validation_data"] = _preprocessed(validation, preprocess)
    return _preprocessed(_dataset(x, y, sample_weight, batch_size, "fit"), preprocess), kwargs


def for_evaluate(preprocess: Preprocess, x: Any, y: Any, batch_size: int | None, kwargs: dict[str, Any]) -> Any:
    """``evaluate``'s ``x`` as a preprocessed dataset, and its other keyword arguments."""
    kwargs = dict(kwargs)
    sample_weight = kwargs.pop("sample_weight", None)
    return _preprocessed(_dataset(x, y, sample_weight, batch_size, "evaluate"), preprocess), kwargs


def for_predict(preprocess: Preprocess, x: Any, batch_size: int | None) -> tf.data.Dataset:
    """``predict``'s ``x`` as a preprocessed dataset."""
    return _preprocessed(_dataset(x, None, None, batch_size, "predict"), preprocess)


def for_batch(preprocess: Preprocess, x: Any, y: Any = None, sample_weight: Any = None) -> tuple[Any, Any, Any]:
    """One batch preprocessed, for ``train_on_batch`` and its kind: (x, y, sample_weight) as tensors."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(preprocess(x, y, sample_weight))

    def tensors(a: Any) -> Any:
        return None if a is None else keras.tree.map_structure(tf.convert_to_tensor, a)

    return tensors(x), tensors(y), tensors(sample_weight)
