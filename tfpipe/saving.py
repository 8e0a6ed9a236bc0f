"""What PipelineModel saves beyond Keras' defaults (layer configs, seed states); conversion to and from Sequential."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfpipe.partition.sequence import copy_layer, layer_list


class SeedStates(keras.layers.Layer):
    """Saves and restores a model's seed-generator states, which Keras leaves out of saved weights.

    Without them a restored model draws other Dropout masks than the original
    would have; with them a resumed run repeats the uninterrupted one.
    """

    def __init__(self, states: Callable[[], list[keras.Variable]]):
        super().__init__(name="tfpipe_seed_states", trainable=False)
        self._states = states

    def save_own_variables(self, store: Any) -> None:
        """Store each seed state under its index."""
        for k, v in enumerate(self._states()):
            store[f"{k}"] = v

    def load_own_variables(self, store: Any) -> None:
        """Restore the seed states a file has; files saved without them leave them as they are."""
        keys = set(store.keys())
        for k, v in enumerate(self._states()):
            if f"{k}" in keys:
                v.assign(store[f"{k}"])


def layer_config(layer: keras.layers.Layer) -> dict[str, Any]:
    """A layer's serialization without its build config: loading must not build it before its cell
    places it (Keras would create its variables on the default device); the model's build does."""
    config = keras.saving.serialize_keras_object(layer)
    config.pop("build_config", None)
    return config


def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
    """An unbuilt copy of a layer, for converting between PipelineModel and keras.Sequential."""
    return copy_layer(layer, "to convert the model", "use copy=False to share the layers instead")


def copy_weights(source: Sequence[keras.layers.Layer], target: Sequence[keras.layers.Layer]) -> None:
    """Copy the weights of built layers into their built clones, layer by layer."""
    for a, b in zip(source, target):
        b.set_weights(a.get_weights())


def keep_off_xla(model: keras.Model, devices: Sequence[str]) -> None:
    """Turn XLA off for a Keras model that shares the cells' weights, when they live on several devices.

    XLA compiles a step for one device and cannot read a variable on another ("Trying to access
    resource ... located in device"), and Keras' default ``jit_compile="auto"`` enables XLA on
    every machine with a GPU: the user's own model would fail in ``predict`` once its weights moved.
    """
    if len(set(devices)) > 1:
        model.jit_compile = False


def from_sequential(cls: type, model: keras.Sequential, copy: bool, kwargs: dict[str, Any]) -> Any:
    """``cls(layers of model, **kwargs)``: with copies of the layers and their weights, or sharing them."""
    if not isinstance(model, keras.Sequential):
        raise TypeError(
            f"from_sequential takes a keras.Sequential, got {type(model).__name__}; "
            "for a list of layers use PipelineModel(layers, ...)."
        )
    if not copy:
        return cls(model, **kwargs)
    layers = layer_list(model)
    pipelined = cls([clone(layer) for layer in layers], **kwargs)
    if model.built and model.inputs:
        pipelined.build(model.inputs[0] if len(model.inputs) == 1 else model.inputs)
        copy_weights(layers, pipelined.pipeline_layers)
    return pipelined


def to_sequential(layers: Sequence[keras.layers.Layer], inputs: Any | None, name: str, copy: bool) -> keras.Sequential:
    """A keras.Sequential of ``layers`` (or of copies with their weights), built for ``inputs`` if given."""
    new = [clone(layer) for layer in layers] if copy else list(layers)
    if inputs is None:
        return keras.Sequential(new, name=name)
    if not isinstance(inputs, keras.KerasTensor):
        raise ValueError(
            "keras.Sequential takes a single input; this model was built for "
            f"{tf.nest.map_structure(lambda t: tuple(t.shape), inputs)}."
        )
    sequential = keras.Sequential([keras.Input(shape=inputs.shape[1:], dtype=inputs.dtype), *new], name=name)
    if copy:
        copy_weights(layers, new)
    return sequential
