"""A Keras Functional model as a sequence of nodes, and the tensors that cross each cut of that sequence.

The order is Keras' own execution order (``Functional`` runs its nodes by
decreasing depth, in the order each depth lists them), with every nested
Functional model replaced by its own nodes. Every layer call and every
``keras.ops`` call is a node. Cut into contiguous segments, every edge points
forward: a segment reads the model's inputs and the outputs of earlier
segments, and hands on what later segments (or the model's outputs) read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from tfpipe import _compat
from tfpipe.routes import MODEL_INPUT, Routes


def is_functional(model: object) -> bool:
    """Whether ``model`` is a Keras model defined by a graph of symbolic calls (not a Sequential)."""
    return isinstance(model, keras.Model) and not isinstance(model, keras.Sequential) and hasattr(model, "operations")


@dataclasses.dataclass(eq=False)
class Node:
    """One call of a layer or a ``keras.ops`` operation, reading and writing tensors by key."""

    operation: Any  # a keras.layers.Layer or a keras Operation
    arguments: Any  # Keras' record of the call's arguments (symbolic tensors and constants)
    keys: dict[int, int]  # id of each symbolic tensor argument -> key of the tensor it stands for
    outputs: list[int]  # keys of the tensors the call produces, in Keras' flattened order

    @property
    def inputs(self) -> list[int]:
        """Keys of the tensors the call reads, each once, in argument order."""
        return list(dict.fromkeys(self.keys.values()))

    @property
    def name(self) -> str:
        """The operation's name, for messages."""
        return self.operation.name

    def run(self, values: Mapping[int, Any], training: bool | None) -> list[Any]:
        """Call the operation on ``values`` (key -> tensor) as Keras' Functional call does; its flat outputs."""
        args, kwargs = self.arguments.fill_in({i: values[k] for i, k in self.keys.items()})
        # What keras.src.models.functional.operation_fn does with the call-context argument `training`.
        if training is not None and "training" in getattr(self.operation, "_call_context_args", ()):
            kwargs["training"] = training
        return keras.tree.flatten(self.operation(*args, **kwargs))


@dataclasses.dataclass
class Segment:
    """Consecutive nodes run as one cell: ``outputs = segment(inputs)``, both tuples of tensors by key order."""

    nodes: list[Node]
    inputs: list[int]  # keys read from outside: the model's inputs first, then earlier segments' outputs
    outputs: list[int]  # keys produced here and read later (by later segments or as the model's outputs)

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The distinct layers the nodes call (``keras.ops`` nodes have none), in node order."""
        found = {id(n.operation): n.operation for n in self.nodes if isinstance(n.operation, keras.layers.Layer)}
        return list(found.values())

    def __call__(self, x: Sequence[Any], training: bool | None = None) -> tuple[Any, ...]:
        """Run the nodes on the inputs ``x`` (ordered as ``inputs``); the outputs, ordered as ``outputs``."""
        values = dict(zip(self.inputs, x))
        for node in self.nodes:
            values.update(zip(node.outputs, node.run(values, training)))
        return tuple(values[k] for k in self.outputs)


class Graph:
    """The nodes of a Functional model in execution order, its inputs and outputs as keys, and their specs."""

    def __init__(self, model: keras.Model):
        if not is_functional(model):
            raise TypeError(f"Graph takes a Functional keras.Model, got {type(model).__name__}.")
        self.model = model
        self.specs: dict[int, keras.KerasTensor] = {}  # key -> symbolic tensor (shape, dtype)
        self.nodes: list[Node] = []
        self._expanded: set[int] = {id(model)}  # the models whose nodes are in the graph (nested ones flattened)
        self.inputs = [self._new_key(t) for t in model.inputs]
        aliases = {id(t): k for t, k in zip(model.inputs, self.inputs)}
        self.outputs = self._expand(model, aliases, model.name)
        self._check_layers_called_once()

    def _new_key(self, tensor: keras.KerasTensor) -> int:
        key = len(self.specs)
        self.specs[key] = tensor
        return key

    def _expand(self, model: keras.Model, aliases: dict[int, int], path: str) -> list[int]:
        """Append the nodes of ``model`` (nested models expanded); the keys of its outputs.

        ``aliases`` maps the id of each of its input tensors to the key of the tensor fed to it.
        """
        for node in _compat.execution_order(model):
            operation, where = node.operation, f"{type(node.operation).__name__} {node.operation.name!r} of {path}"
            if not isinstance(operation, keras.Operation):
                raise ValueError(f"The node {where} calls {operation!r}, which is not a Keras layer or operation.")
            args = list(node.arguments.keras_tensors)
            missing = [t.name for t in args if id(t) not in aliases]
            if missing:
                raise ValueError(f"The node {where} reads {missing}, which nothing before it in the graph produces.")
            if is_functional(operation) and not node.arguments.kwargs:
                inner = dict(zip((id(t) for t in operation.inputs), (aliases[id(t)] for t in _inputs_of(node))))
                self._expanded.add(id(operation))
                outer = self._expand(operation, inner, f"{path}/{operation.name}")
                for t, key in zip(node.outputs, outer):
                    aliases[id(t)] = key
                continue
            keys = {id(t): aliases[id(t)] for t in args}
            outputs = [self._new_key(t) for t in node.outputs]
            aliases.update((id(t), k) for t, k in zip(node.outputs, outputs))
            self.nodes.append(Node(operation, node.arguments, keys, outputs))
        return [aliases[id(t)] for t in model.outputs]

    def _check_layers_called_once(self) -> None:
        calls: dict[int, list[int]] = {}
        for index, node in enumerate(self.nodes):
            if isinstance(node.operation, keras.layers.Layer) and node.operation.weights:
                calls.setdefault(id(node.operation), []).append(index)
        self._shared = {k: v for k, v in calls.items() if len(v) > 1}

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The model's layers in its own order (``model.layers``, weights ordered alike), nested models flattened."""
        return self._layers_of(self.model)

    def _layers_of(self, model: keras.Model) -> list[keras.layers.Layer]:
        found: list[keras.layers.Layer] = []
        for layer in model.layers:
            if id(layer) in self._expanded:
                found.extend(self._layers_of(layer))
            elif not isinstance(layer, keras.layers.InputLayer):
                found.append(layer)
        return found

    def pack_outputs(self, leaves: Sequence[Any]) -> Any:
        """The model's output structure (``model.output``) with ``leaves`` in place of its tensors."""
        return keras.tree.pack_sequence_as(self.model.output, list(leaves))

    def flatten_inputs(self, x: Any) -> list[Any]:
        """The leaves of a batch shaped like ``model.input``, in the order of ``inputs``."""
        structure = self.model.input
        if isinstance(structure, dict) and isinstance(x, dict):
            return [x[name] for name in keras.tree.flatten(_names(structure))]
        if len(self.inputs) == 1 and not isinstance(x, (list, tuple, dict)):
            return [x]
        leaves = keras.tree.flatten(x)
        if len(leaves) != len(self.inputs):
            raise ValueError(
                f"Model {self.model.name!r} takes {len(self.inputs)} inputs, got a batch of {len(leaves)} tensors."
            )
        return leaves

    def cut(self, sizes: Sequence[int]) -> list[Segment]:
        """Contiguous segments of ``sizes`` nodes each, with the keys each reads from outside and hands on."""
        starts = np.cumsum([0] + list(sizes))
        groups = [self.nodes[starts[k] : starts[k + 1]] for k in range(len(sizes))]
        self._check_shared_layers(groups)
        owner = {k: -1 for k in self.inputs}
        for index, nodes in enumerate(groups):
            for node in nodes:
                owner.update((k, index) for k in node.outputs)
        read_after: dict[int, set[int]] = {}  # key -> segments that read it; len(sizes) stands for the outputs
        for index, nodes in enumerate(groups):
            for node in nodes:
                for k in node.inputs:
                    if owner[k] != index:
                        read_after.setdefault(k, set()).add(index)
        for k in self.outputs:
            read_after.setdefault(k, set()).add(len(sizes))
        segments = []
        for index, nodes in enumerate(groups):
            inputs = sorted((k for k, readers in read_after.items() if index in readers), key=lambda k: (owner[k], k))
            outputs = sorted(k for k, readers in read_after.items() if owner[k] == index and readers)
            segments.append(Segment(nodes, inputs, outputs))
        return segments

    def routes(self, segments: Sequence[Segment]) -> Routes:
        """Where each segment's inputs and the model's outputs come from, for a pipeline of these segments."""
        source = {k: (MODEL_INPUT, pos) for pos, k in enumerate(self.inputs)}
        for index, segment in enumerate(segments):
            source.update((k, (index, pos)) for pos, k in enumerate(segment.outputs))
        return Routes(
            feeds=[[source[k] for k in segment.inputs] for segment in segments],
            results=[source[k] for k in self.outputs],
            flatten_inputs=self.flatten_inputs,
            pack_outputs=self.pack_outputs,
        )

    def _check_shared_layers(self, groups: Sequence[Sequence[Node]]) -> None:
        cell_of = {id(n): k for k, nodes in enumerate(groups) for n in nodes}
        for calls in self._shared.values():
            cells = sorted({cell_of[id(self.nodes[i])] for i in calls})
            if len(cells) > 1:
                layer = self.nodes[calls[0]].operation
                raise ValueError(
                    f"Layer {layer.name!r} is called at nodes {calls} of the graph, which the balance puts in cells "
                    f"{cells}; a layer's weights must stay in one cell. Change balance so that nodes "
                    f"{calls[0]}..{calls[-1]} fall in one cell, or use a separate layer for each call."
                )

    def live_bytes(self) -> list[float]:
        """Bytes per sample of the tensors that would cross a cut after each node (skips and inputs included)."""
        last_read = {k: len(self.nodes) for k in self.outputs}
        for index, node in enumerate(self.nodes):
            for k in node.inputs:
                last_read[k] = max(last_read.get(k, index), index)
        produced = {k: -1 for k in self.inputs}
        for index, node in enumerate(self.nodes):
            produced.update((k, index) for k in node.outputs)
        return [
            float(sum(tensor_bytes(self.specs[k]) for k, end in last_read.items() if produced[k] <= cut < end))
            for cut in range(len(self.nodes))
        ]

    def crossing(self, segments: Sequence[Segment]) -> list[list[int]]:
        """For each cut between segments, the keys of the tensors that cross it."""
        produced_before, result = set(self.inputs), []
        for index in range(len(segments) - 1):
            for node in segments[index].nodes:
                produced_before.update(node.outputs)
            later = {k for s in segments[index + 1 :] for k in s.inputs} | set(self.outputs)
            result.append(sorted(produced_before & later))
        return result


def tensor_bytes(spec: keras.KerasTensor) -> float:
    """Bytes per sample of a symbolic tensor (its batch dimension left out)."""
    elements = math.prod(int(d) if d is not None else 1 for d in spec.shape[1:])
    return float(elements * np.dtype(keras.backend.standardize_dtype(spec.dtype)).itemsize)


def _inputs_of(node: Any) -> list[keras.KerasTensor]:
    """The symbolic tensors a nested model's call was given, flattened as the model flattens its inputs."""
    args = node.arguments.args
    return keras.tree.flatten(args[0] if len(args) == 1 else args)


def _names(structure: dict[str, Any]) -> dict[str, str]:
    return {name: name for name in structure}
