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
from tfpipe.partition import functional, specs
from tfpipe.partition import state as state_lib
from tfpipe.partition.sequence import copy_layer, layer_list

_Model = TypeVar("_Model", bound="Saving")  # the PipelineModel class a classmethod is called on


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


class Saving(keras.Model):
    """PipelineModel's saving, loading and conversion methods.

    A base class of ``PipelineModel`` alone: it reads the settings and layers that the model's constructor sets.
    """

    _graph: functional.Graph | None
    _inputs: Any
    _cost: Any
    _m: int
    _remat: str
    _unroll: bool
    _schedule: str
    _num_cells: int
    _devices: list[str]
    pipeline_layers: list[keras.layers.Layer]

    def get_config(self) -> dict[str, Any]:
        """The layers, the split (balance once known, else K and the cost), devices, M and remat.

        A callable ``cost`` cannot be saved; its balance is, so a loaded model is split the same way.
        """
        config: dict[str, Any] = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
            "devices": self.devices,
            "num_micro_batches": self._m,
            "remat": self._remat,
            "unroll": self._unroll,
            "schedule": self._schedule,
            "cost": self._cost if isinstance(self._cost, str) else "flops",
        }
        if self._graph is not None:
            config["model"] = keras.saving.serialize_keras_object(self._graph.model)
        else:
            config["layers"] = [layer_config(layer) for layer in self.pipeline_layers]
        if self.balance is not None:
            config["balance"] = self.balance
        else:
            config["num_partitions"] = self._num_cells
        if isinstance(getattr(self, "_memory_budget", None), (int, float, str)):  # per device: its devices may change
            config["memory_budget"] = self._memory_budget
        return config

    @classmethod
    def from_config(cls: type[_Model], config: dict[str, Any], custom_objects: Any = None) -> _Model:
        """A model from ``get_config``; saved devices this machine lacks are replaced by its own (with a warning)."""
        config = dict(config)
        if "model" in config:  # a Functional model
            layers = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects=custom_objects)
        else:
            layers = [
                keras.saving.deserialize_keras_object(c, custom_objects=custom_objects) for c in config.pop("layers")
            ]
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
            warnings.warn(f"Loading PipelineModel {config.get('name')!r}: {why}.", stacklevel=2)
        return cls(layers, devices=devices, **config)

    def get_build_config(self) -> dict[str, Any] | None:
        """The shapes and dtypes of the inputs the model was built for."""
        return {"inputs": specs.to_config(self._inputs)} if self._inputs is not None else None

    def build_from_config(self, config: dict[str, Any] | None) -> None:
        """Build for the inputs recorded by ``get_build_config`` (loading then finds every variable)."""
        if config and "inputs" in config:
            self.build(specs.from_config(config["inputs"]))

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile as saved, creating the optimizer's variables on their devices so that its state loads."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def _tfpipe_seed_states(self) -> SeedStates:
        # Keras saves every KerasSaveable attribute of a model, so this one puts the seed
        # states in their own group (a keras.Sequential loading the file ignores it). Set
        # without Keras' attribute tracking, so that it is not one of the model's layers.
        if "_seed_saver" not in self.__dict__:
            states = SeedStates(lambda: state_lib.seed_states(self.pipeline_layers))
            object.__setattr__(self, "_seed_saver", states)
        return self.__dict__["_seed_saver"]

    @classmethod
    def from_sequential(cls: type[_Model], model: keras.Sequential, *, copy: bool = True, **kwargs: Any) -> _Model:
        """A PipelineModel of a Sequential's layers; ``kwargs`` as for the constructor.

        ``copy=True`` (default) clones the layers and copies their weights, so the new
        variables are created on the cells' devices and the Sequential is left alone.
        ``copy=False`` shares the layer objects, and with them the variables, wherever
        they already are.
        """
        return from_sequential(cls, model, copy, kwargs)

    def to_sequential(self, *, copy: bool = False) -> keras.Sequential:
        """The same layers as a plain ``keras.Sequential`` (for serving or export), built if this model is.

        ``copy=False`` (default) shares the layers and weights: training one trains the
        other. ``copy=True`` clones the layers and copies the current weights.
        """
        if self._graph is not None:
            raise TypeError(
                f"PipelineModel {self.name!r} was made from the Functional model {self._graph.model.name!r}; "
                "use to_functional() to get it back."
            )
        sequential = to_sequential(self.pipeline_layers, self._inputs, f"{self.name}_sequential", copy)
        if not copy:  # copies are made on one device; shared weights stay on the cells'
            keep_off_xla(sequential, self._devices)
        return sequential

    def to_functional(self, *, copy: bool = False) -> keras.Model:
        """The Functional model this one was made from: the same graph over the same layers.

        ``copy=False`` (default) returns that model, sharing the layers and weights. ``copy=True``
        clones it (``keras.models.clone_model``) with the current weights.
        """
        if self._graph is None:
            raise TypeError(
                f"PipelineModel {self.name!r} was made from a layer sequence, not a Functional model; "
                "use to_sequential() (or keras.Sequential(model.pipeline_layers))."
            )
        model = self._graph.model
        if not copy:
            return model
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        return clone
