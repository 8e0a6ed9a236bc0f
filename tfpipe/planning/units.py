"""What the planner cuts into cells: a list of layers, or a Functional model's nodes, each walked alone on copies.

A layer list's units are its layers, each fed the one before's output. A Functional model's (a keras_hub task's
included) are its nodes in ``partition.functional``'s order, each fed the tensors it reads, wherever they were made:
skips across cuts, several inputs and outputs, nested models expanded. The planner measures every unit on copies of
its layer (the user's weights are never built, run or read, so a model built under ``tfpipe.deferred_weights()``
plans as it is), counts each layer's weights at its first node, and counts a layer called at several nodes (a
keras_hub task's embedding, tied to its output projection) again wherever another cell reads it (``Tied``). Its
probe steps train a fresh model of the same units (``fresh``): new layers, or a clone of the Functional model whose
weights are made on the probe's devices (``deferred_weights``), so no probe needs the whole model on one device
before it is cut.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat
from tfpipe.partition import deferred, functional
from tfpipe.partition.sequence import copy_layer, layer_list
from tfpipe.planning import walk as walk_lib
from tfpipe.planning.walk import restoring_random_state, tensor_bytes


class Nodes:
    """A Functional model's nodes as the planner's units (``len`` is their count)."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.graph = functional.Graph(model)

    def __len__(self) -> int:
        return len(self.graph.nodes)


def of(model: Any) -> list[keras.layers.Layer] | Nodes:
    """The units of what ``tfpipe.plan`` was given: a Functional model's nodes, else its layers (a list or a
    ``keras.Sequential``; the TypeErrors of ``layer_list`` otherwise)."""
    if isinstance(model, Nodes):
        return model
    return Nodes(model) if functional.is_functional(model) else layer_list(model)


def names(units: Any) -> list[str]:
    """Each unit's name, for messages and summaries."""
    if isinstance(units, Nodes):
        return [node.name for node in units.graph.nodes]
    return [layer.name for layer in units]


@dataclasses.dataclass(frozen=True)
class Tied:
    """A layer's weights read by a later unit than the one that counts them (its first): a tied embedding."""

    owner: int  # the unit that counts the weights (and, in its cell, their optimizer slots)
    reader: int  # another unit that reads them: a cell holding it but not ``owner`` holds a copy and its gradient
    weight_bytes: float
    trainable_bytes: float


def variable_bytes(variable: Any) -> float:
    """The bytes of one variable's value (from its shape and dtype: a deferred variable has no value yet)."""
    return float(math.prod(variable.shape) * tf.as_dtype(keras.backend.standardize_dtype(variable.dtype)).size)


def weights(units: Nodes) -> tuple[list[float], list[float], list[Tied]]:
    """Per node, the bytes of its weights and of its trainable weights (a layer's counted at its first node), and
    the nodes that read a layer counted earlier. Read from the user's own (built) layers: a frozen layer (a LoRA base
    weight) has no gradient and no slots. (A layer list's layers may be unbuilt: ``profile.measure`` counts their
    built copies.)"""
    first: dict[int, int] = {}
    all_bytes, trainable, tied = [], [], []
    for index, node in enumerate(units.graph.nodes):
        layer = node.operation if isinstance(node.operation, keras.layers.Layer) else None
        every = sum(variable_bytes(v) for v in layer.weights) if layer is not None else 0.0
        train = sum(variable_bytes(v) for v in layer.trainable_variables) if layer is not None else 0.0
        if layer is not None and id(layer) in first:
            if every:
                tied.append(Tied(first[id(layer)], index, every, train))
            every = train = 0.0
        elif layer is not None:
            first[id(layer)] = index
        all_bytes.append(every)
        trainable.append(train)
    return all_bytes, trainable, tied


class _NodeCopy:
    """One node of a clone of the model, called as the measurements call a layer: ``copy(inputs, training)`` with
    ``inputs`` the tuple of tensors the node reads."""

    def __init__(self, node: functional.Node):
        self._node = node
        self._layer = node.operation if isinstance(node.operation, keras.layers.Layer) else None
        self.name = node.name

    @property
    def weights(self) -> list[Any]:
        return list(self._layer.weights) if self._layer is not None else []

    @property
    def trainable_variables(self) -> list[Any]:
        return list(self._layer.trainable_variables) if self._layer is not None else []

    @property
    def non_trainable_variables(self) -> list[Any]:
        return list(self._layer.non_trainable_variables) if self._layer is not None else []

    @property
    def call(self) -> Any:
        """The layer's own ``call`` (whose signature says whether it takes ``training``)."""
        return self._layer.call if self._layer is not None else self._node.operation.call

    def get_config(self) -> dict[str, Any]:
        """What makes two nodes do the same work: the operation's class and configuration."""
        operation = self._node.operation
        kind = {"operation": f"{type(operation).__module__}.{type(operation).__qualname__}"}
        try:
            return {**kind, **operation.get_config()}
        except Exception:  # noqa: BLE001 - a config Keras cannot give (keras_hub's Llama block): its weights' shapes
            return {**kind, "weights": [(tuple(v.shape), str(v.dtype)) for v in self.weights]}

    def _filled(self, inputs: Sequence[Any]) -> tuple[tuple, dict]:
        return self._node.arguments.fill_in({i: inputs[self._node.inputs.index(k)] for i, k in self._node.keys.items()})

    def __call__(self, inputs: Sequence[Any], training: bool | None = None) -> list[Any]:
        return self._node.run(dict(zip(self._node.inputs, inputs)), training)

    def stateless_call(self, trainable: Any, non_trainable: Any, inputs: Sequence[Any], **kwargs: Any) -> Any:
        """The layer's ``stateless_call`` on the node's arguments filled with ``inputs``."""
        assert self._layer is not None  # called for a copy with weights, which only a layer has
        args, given = self._filled(inputs)
        return self._layer.stateless_call(trainable, non_trainable, *args, **{**given, **kwargs})


@dataclasses.dataclass
class Walked:
    """One unit walked on a copy: the copy, what it was fed, what it gave, and the bytes of every tensor that would
    cross a cut right after it (its output for a layer; every tensor still to be read for a node, skips included)."""

    copy: Any
    inputs: Any
    outputs: Any
    crossing_bytes: float


def walk(units: Any, sample: Any, rows: int, device: str) -> Iterator[Walked]:
    """Each unit in order on ``device``, on a copy, fed ``rows`` rows made from ``sample`` (the seeds restored)."""
    units = of(units)
    with tf.device(device), restoring_random_state((random.getstate(), np.random.get_state())):
        x = tf.nest.map_structure(lambda t: tf.convert_to_tensor(_resized(t, rows)), sample)
        if not isinstance(units, Nodes):
            for _, _, copy, x_in, y in walk_lib.walk(list(units), x, run=True):
                yield Walked(copy, x_in, y, tensor_bytes(y))
            return
        yield from _walk_nodes(units, x, device)


def _walk_nodes(units: Nodes, x: Any, device: str) -> Iterator[Walked]:
    # A clone of the model, its weights deferred and each node's made on ``device`` as the walk reaches it: keras_hub's
    # blocks are made by their backbone's constructor, and not all of them can be remade from their own config
    clone = fresh(units, "to plan it", "pass balance=[...] instead")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user's model's graph said already which nested models stay whole
        graph = functional.Graph(clone)
    if [type(n.operation) for n in graph.nodes] != [type(n.operation) for n in units.graph.nodes]:
        raise ValueError(
            f"A clone of {units.model.name!r} (keras.models.clone_model) has other nodes than the model, so its nodes "
            "cannot be measured on a copy; pass balance=[...] instead."
        )
    values = dict(zip(graph.inputs, graph.flatten_inputs(x)))
    last_read = {k: len(graph.nodes) for k in graph.outputs}
    for index, node in enumerate(graph.nodes):
        for k in node.inputs:
            last_read[k] = max(last_read.get(k, index), index)
    last_use = {id(node.operation): index for index, node in enumerate(graph.nodes)}  # a layer called at several
    for index, node in enumerate(graph.nodes):
        for variable in getattr(node.operation, "variables", []):
            if deferred.waiting(variable):
                deferred.place(variable, device)
        copy = _NodeCopy(node)
        inputs = tuple(values[k] for k in node.inputs)
        try:
            outputs = copy(inputs, training=False)
        except Exception as err:  # noqa: BLE001 - any failure here means the sample does not fit the model
            raise ValueError(
                f"Node {index} ({node.name}) of {units.model.name!r} cannot run on the sample's tensors: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Give a sample shaped like "
                "the model's real input batch."
            ) from None
        values.update(zip(node.outputs, outputs))
        for k in [k for k, end in last_read.items() if end <= index and k in values]:
            del values[k]  # read for the last time: not held by the walk
        live = [values[k] for k, end in last_read.items() if end > index and k in values]
        yield Walked(copy, inputs, outputs, tensor_bytes(live))
        if last_use[id(node.operation)] == index:  # measured for the last time: its weights go, so that the walk
            for variable in getattr(node.operation, "variables", []):  # holds one node's, not the model's
                _compat.release(variable)


def _resized(t: Any, batch: int) -> np.ndarray:
    """A sample leaf cut or tiled to ``batch`` rows."""
    array = np.asarray(t)
    reps = -(-batch // array.shape[0])
    return np.concatenate([array] * reps)[:batch] if reps > 1 else array[:batch]


def fresh(units: Any, purpose: str, alternative: str) -> Any:
    """What a probe's ``PipelineModel`` takes: new copies of the layers, or a clone of the Functional model whose
    weights are made on the cells' devices when the probe is cut (``purpose`` and ``alternative``: as
    ``copy_layer``'s)."""
    units = of(units)
    if not isinstance(units, Nodes):
        return [copy_layer(layer, purpose, alternative) for layer in units]
    with deferred.deferred_weights():
        try:
            return _compat.clone_uncompiled(units.model)
        except Exception as err:  # noqa: BLE001 - report whatever stops the clone, with the fix
            raise ValueError(
                f"Cannot clone model {units.model.name!r} {purpose}: {type(err).__name__}: {err}. Give its layers a "
                f"get_config() that returns their constructor arguments, or {alternative}."
            ) from None
