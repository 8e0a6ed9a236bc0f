"""A layer sequence: checking what the user hands in as the layers of a pipeline, and copying layers."""

from __future__ import annotations

from typing import Any

import keras

from tfpipe.partition import functional


def layer_list(layers: Any) -> list[keras.layers.Layer]:
    """The layers of a list, a ``keras.Sequential`` or a Functional model (in node order), each a distinct layer."""
    if isinstance(layers, keras.Sequential):
        layers = layers.layers
    elif functional.is_functional(layers):
        layers = functional.Graph(layers).layers
    elif isinstance(layers, keras.layers.Layer):
        raise TypeError(
            f"layers must be a list of Keras layers or a keras.Sequential, got the single layer {layers.name!r}; "
            "wrap it in a list."
        )
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of Keras layers or a keras.Sequential, got {type(layers).__name__}.")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; give at least one Keras layer.")
    seen: dict[int, int] = {}
    for k, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"layers[{k}] is a {type(layer).__name__} ({layer!r:.60}), not a keras.layers.Layer; "
                "wrap functions in keras.layers.Lambda or a Layer subclass."
            )
        if id(layer) in seen:
            raise ValueError(
                f"Layer {layer.name!r} appears twice in layers (positions {seen[id(layer)]} and {k}); a layer object "
                "can sit in only one place of the pipeline. Create a separate layer for each position."
            )
        seen[id(layer)] = k
    return layers


def copy_layer(layer: keras.layers.Layer, purpose: str, alternative: str) -> keras.layers.Layer:
    """An unbuilt copy of a layer made from its config (same name, so saved weights still match it).

    ``purpose`` and ``alternative`` complete the error message: "Cannot copy layer
    ... {purpose}" and "..., or {alternative}".
    """
    try:
        return type(layer).from_config(layer.get_config())
    except Exception as err:  # noqa: BLE001 - report whatever stops the copy, with the fix
        raise ValueError(
            f"Cannot copy layer {layer.name!r} ({type(layer).__name__}) {purpose}: {type(err).__name__}: {err}. "
            f"Give the layer a get_config() that returns its constructor arguments, or {alternative}."
        ) from None
