"""What PipelineModel saves beyond Keras' defaults: layer configs, seed states, layer copies."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

from tfpipe.sequence import copy_layer


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
