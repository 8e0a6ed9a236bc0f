"""How a PipelineModel is saved, loaded and converted to and from keras.Sequential (or back to its Functional model).

Beyond Keras' defaults it saves layer configs without their build config and the seed generators' states.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import keras
import tensorflow as tf

from tfpipe import schedule as schedule_lib
from tfpipe.distributed import devices as devices_lib
from tfpipe.partition.sequence import copy_layer, layer_list

_Model = TypeVar("_Model", bound=keras.Model)  # the PipelineModel class from_config is called on


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


def model_config(model: Any, source: keras.Model | None, memory_budget: Any) -> dict[str, Any]:
    """A PipelineModel's config: its layers (or ``source``, the Functional model it was made from), the split
    (balance once known, else K and the cost), devices, M, remat, unroll, schedule and a budget for all devices.

    A callable ``cost`` cannot be saved; its balance is, so a loaded model is split the same way.
    """
    config: dict[str, Any] = {
        "name": model.name,
        "trainable": model.trainable,
        "dtype": keras.dtype_policies.serialize(model.dtype_policy),
        "devices": model.devices,
        "num_micro_batches": model.num_micro_batches,
        "remat": model.remat,
        "unroll": model.unroll,
        "schedule": model.schedule,
        "repeated_layers": model.repeated_layers,
        "cost": model.cost if isinstance(model.cost, str) else "flops",
    }
    if source is not None:
        config["model"] = keras.saving.serialize_keras_object(source)
    else:
        config["layers"] = [layer_config(layer) for layer in model.pipeline_layers]
    if model.balance is not None:
        config["balance"] = model.balance
    else:
        config["num_partitions"] = model.num_partitions
    if isinstance(memory_budget, (int, float, str)):  # one for all devices; per device, its devices may change
        config["memory_budget"] = memory_budget
    return config


def model_from_config(cls: Callable[..., _Model], config: dict[str, Any], custom_objects: Any = None) -> _Model:
    """``cls`` made from ``model_config``'s config; saved devices this machine lacks are replaced by its own (with a
    warning)."""
    config = dict(config)
    if "model" in config:  # a Functional model
        layers = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects=custom_objects)
    else:
        layers = [keras.saving.deserialize_keras_object(c, custom_objects=custom_objects) for c in config.pop("layers")]
    if config.get("plan") == "auto":  # saved before its first fit planned it: planned by the next
        saved = config.pop("devices")
        return cls(layers, devices=None if saved is None else devices_lib.restore(saved, len(saved))[0], **config)
    num_cells = len(config["balance"]) if config.get("balance") else config["num_partitions"]
    devices: list[str] | list[list[str]] | None
    devices, why = devices_lib.restore(config.pop("devices"), num_cells)
    if why and schedule_lib.shares_devices(config.get("schedule", "gpipe")):
        devices = None  # the schedule lays the cells over this machine's devices its own way
        placer = schedule_lib.label(schedule_lib.check_name(config["schedule"]))
        why = why.split("; ")[0] + f"; the cells go to this machine's devices as schedule {placer} places them"
    if why:
        warnings.warn(f"Loading PipelineModel {config.get('name')!r}: {why}.", stacklevel=3)
    return cls(layers, devices=devices, **config)
