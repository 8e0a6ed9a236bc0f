"""A Keras Functional model as a sequence of nodes, and the tensors that cross each cut of that sequence.

The order is Keras' own execution order (``Functional`` runs its nodes by
decreasing depth, in the order each depth lists them), with every nested
Functional model replaced by its own nodes. Every layer call and every
``keras.ops`` call is a node. Cut into contiguous segments, every edge points
forward: a segment reads the model's inputs and the outputs of earlier
segments, and hands on what later segments (or the model's outputs) read.

Keras hangs two things on a tensor that a cut would lose: its mask
(``_keras_mask``, which the next layers read) and, on a softmax or sigmoid
output, its logits (``_keras_logits``, which Keras' cross-entropy reads for
exactness). Each travels as a companion tensor of its own key, read wherever
the tensor is read, and is hung back on it there.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat
from tfpipe.partition.routes import MODEL_INPUT, Routes


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
        # What Keras' Functional call does with the call-context argument `training`.
        if training is not None and _compat.takes_training(self.operation):
            kwargs["training"] = training
        return keras.tree.flatten(self.operation(*args, **kwargs))


Companions = dict[int, list[tuple[str, int]]]  # key -> [(attribute, key of the companion tensor)]


def hang_companions(values: dict[int, Any], keys: Sequence[int], companions: Companions) -> None:
    """Hang the companions present in ``values`` back on their tensors (as Keras would have left them)."""
    for k in keys:
        for attribute, c in companions.get(k, ()):
            if c in values and k in values:
                _compat.hang(values[k], attribute, values[c])


@dataclasses.dataclass
class Segment:
    """Consecutive nodes run as one cell: ``outputs = segment(inputs)``, both tuples of tensors by key order."""

    nodes: list[Node]
    inputs: list[int]  # keys read from outside: the model's inputs first, then earlier segments' outputs
    outputs: list[int]  # keys produced here and read later (by later segments or as the model's outputs)
    companions: Companions = dataclasses.field(default_factory=dict)

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The distinct layers the nodes call (``keras.ops`` nodes have none), in node order."""
        found = {id(n.operation): n.operation for n in self.nodes if isinstance(n.operation, keras.layers.Layer)}
        return list(found.values())

    def __call__(
        self,
        x: Sequence[Any],
        training: bool | None = None,
        run: Callable[[int, Node, Mapping[int, Any]], list[Any]] | None = None,
    ) -> tuple[Any, ...]:
        """Run the nodes on the inputs ``x`` (ordered as ``inputs``); the outputs, ordered as ``outputs``.

        ``run(i, node, values)``, if given, runs the i-th node instead of ``node.run`` (``tfpipe.partition.repeats``).
        """
        values = dict(zip(self.inputs, x))
        hang_companions(values, self.inputs, self.companions)
        for i, node in enumerate(self.nodes):
            values.update(zip(node.outputs, run(i, node, values) if run else node.run(values, training)))
            for k in node.outputs:
                for attribute, c in self.companions.get(k, ()):
                    values[c] = _compat.hung(values[k], attribute)
                    if values[c] is None:
                        raise ValueError(
                            f"Node {node.name!r} gave a tensor without the {attribute} that its symbolic call "
                            "had; tfpipe carries it across cuts and needs it in every call."
                        )
        return tuple(values[k] for k in self.outputs)


class Graph:
    """The nodes of a Functional model in execution order, its inputs and outputs as keys, and their specs."""

    def __init__(self, model: keras.Model):
        if not is_functional(model):
            raise TypeError(f"Graph takes a Functional keras.Model, got {type(model).__name__}.")
        if not _compat.runs_as_functional(model):
            raise ValueError(
                f"Model {model.name!r}: its class {type(model).__name__} overrides call(), so its graph of layers "
                "may not be what it runs, and tfpipe runs the graph. Pass a Functional model whose call is Keras' "
                "own (or the layers as a list)."
            )
        self.model = model
        self.specs: dict[int, keras.KerasTensor] = {}  # key -> symbolic tensor (shape, dtype)
        self.nodes: list[Node] = []
        self.whole: dict[str, str] = {}  # path of each nested model kept as one node -> why it was not expanded
        self.inputs = [self._new_key(t) for t in model.inputs]
        aliases = {id(t): k for t, k in zip(model.inputs, self.inputs)}
        self.outputs = self._expand(model, aliases, model.name)
        if self.whole:
            warnings.warn(f"{model.name!r}: {self.whole_note()}; the balance cannot cut inside them.", stacklevel=3)
        self.companions: Companions = {}
        for k, spec in list(self.specs.items()):
            mask = _compat.hung(spec, _compat.MASK)
            if mask is not None and k not in self.inputs:
                self.companions[k] = [(_compat.MASK, self._new_key(mask))]
        for k in _with_logits(self.nodes, self.outputs, self.specs):
            self.companions.setdefault(k, []).append((_compat.LOGITS, self._new_key(self.specs[k])))

    def whole_note(self) -> str:
        """Which nested models stay one node each and why ("" if none)."""
        if not self.whole:
            return ""
        return "kept as one node: " + "; ".join(f"{path!r}, as {why}" for path, why in self.whole.items())

    def _new_key(self, tensor: keras.KerasTensor) -> int:
        key = len(self.specs)
        self.specs[key] = tensor
        return key

    def _expand(self, model: keras.Model, aliases: dict[int, int], path: str) -> list[int]:
        """Append the nodes of ``model`` (nested models expanded); the keys of its outputs.

        ``aliases`` maps the id of each of its input tensors to the key of the tensor fed to it.
        """
        for node in _compat.execution_order(model):
            operation = node.operation
            where = f"{type(operation).__name__} {getattr(operation, 'name', operation)!r} of {path}"
            if not isinstance(operation, keras.Operation):
                raise ValueError(
                    f"The node {where} is not a Keras layer or operation, so tfpipe cannot run it in a cell; "
                    "wrap it in a keras.layers.Layer."
                )
            args = list(node.arguments.keras_tensors)
            missing = [t.name for t in args if id(t) not in aliases]
            if missing:
                raise ValueError(f"The node {where} reads {missing}, which nothing before it in the graph produces.")
            kept = _kept_whole(operation, node.arguments.kwargs) if is_functional(operation) else None
            if kept:
                self.whole[f"{path}/{operation.name}"] = kept
            elif kept is not None:
                inner = dict(zip((id(t) for t in operation.inputs), (aliases[id(t)] for t in _inputs_of(node))))
                outer = self._expand(operation, inner, f"{path}/{operation.name}")
                for t, key in zip(node.outputs, outer):
                    aliases[id(t)] = key
                continue
            keys = {id(t): aliases[id(t)] for t in args}
            outputs = [self._new_key(t) for t in node.outputs]
            aliases.update((id(t), k) for t, k in zip(node.outputs, outputs))
            self.nodes.append(Node(operation, node.arguments, keys, outputs))
        return [aliases[id(t)] for t in model.outputs]

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The model's own layers (``model.layers`` without its inputs): weights and saved files as the model's."""
        return [layer for layer in self.model.layers if not isinstance(layer, keras.layers.InputLayer)]

    def pack_outputs(self, leaves: Sequence[Any]) -> Any:
        """The model's output structure (``model.output``) from the tensors of ``results``, companions hung on."""
        values = dict(zip(self.results, leaves))
        hang_companions(values, self.outputs, self.companions)
        return keras.tree.pack_sequence_as(self.model.output, [values[k] for k in self.outputs])

    def flatten_inputs(self, x: Any) -> list[Any]:
        """The leaves of a batch shaped like ``model.input``, in the order of ``inputs``."""
        structure = self.model.input
        if isinstance(structure, dict) and isinstance(x, dict):
            return [x[name] for name in sorted(structure)]  # as model.inputs: keras.tree sorts dict keys
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
        owner = {k: -1 for k in self.inputs}
        for index, nodes in enumerate(groups):
            for node in nodes:
                owner.update((k, index) for k in self._with_companions(node.outputs))
        read_after: dict[int, set[int]] = {}  # key -> segments that read it; len(sizes) stands for the outputs
        for index, nodes in enumerate(groups):
            for node in nodes:
                for k in self._with_companions(node.inputs):
                    if owner[k] != index:
                        read_after.setdefault(k, set()).add(index)
        for k in self.results:
            read_after.setdefault(k, set()).add(len(sizes))
        segments = []
        for index, nodes in enumerate(groups):
            inputs = sorted((k for k, readers in read_after.items() if index in readers), key=lambda k: (owner[k], k))
            outputs = sorted(k for k, readers in read_after.items() if owner[k] == index and readers)
            segments.append(Segment(nodes, inputs, outputs, self.companions))
        return segments

    def _with_companions(self, keys: Sequence[int]) -> list[int]:
        return [c for k in keys for c in [k] + [c for _, c in self.companions.get(k, ())]]

    @property
    def results(self) -> list[int]:
        """The keys the model's outputs need: the outputs, then their companions (masks, logits)."""
        return self.outputs + [c for k in self.outputs for _, c in self.companions.get(k, ())]

    def routes(self, segments: Sequence[Segment]) -> Routes:
        """Where each segment's inputs and the model's outputs come from, for a pipeline of these segments."""
        source = {k: (MODEL_INPUT, pos) for pos, k in enumerate(self.inputs)}
        for index, segment in enumerate(segments):
            source.update((k, (index, pos)) for pos, k in enumerate(segment.outputs))
        return Routes(
            feeds=[[source[k] for k in segment.inputs] for segment in segments],
            results=[source[k] for k in self.results],
            flatten_inputs=self.flatten_inputs,
            pack_outputs=self.pack_outputs,
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

    def crossing(self, segments: Sequence[Segment]) -> list[list[tuple[str, tuple, float]]]:
        """For each cut between segments, the tensors that cross it: (what makes it, shape, bytes per sample)."""
        produced_before, result = set(self.inputs), []
        for index in range(len(segments) - 1):
            for node in segments[index].nodes:
                produced_before.update(node.outputs)
            later = {k for s in segments[index + 1 :] for k in s.inputs} | set(self.outputs)
            result.append([self._describe(k) for k in sorted(produced_before & later)])
        return result

    def _describe(self, key: int) -> tuple[str, tuple, float]:
        spec = self.specs[key]
        if key in self.inputs:
            name = f"input {self.model.inputs[self.inputs.index(key)].name!r}"
        else:
            node = next(n for n in self.nodes if key in n.outputs)
            name = node.name if len(node.outputs) == 1 else f"{node.name}[{node.outputs.index(key)}]"
        return name, tuple(spec.shape), tensor_bytes(spec)


def _with_logits(nodes: Sequence[Node], outputs: Sequence[int], specs: Mapping[int, Any]) -> list[int]:
    """The model outputs that Keras' backend gives logits (softmax, sigmoid), found by tracing their nodes once."""
    found: list[int] = []
    for node in nodes:
        wanted = [k for k in node.outputs if k in outputs]
        if wanted:
            made = _trace_alone(node, specs)
            found.extend(k for k in wanted if _compat.hung(made.get(k), _compat.LOGITS) is not None)
    return found


def _trace_alone(node: Node, specs: Mapping[int, Any]) -> dict[int, Any]:
    """The node's outputs, traced on its own in a function graph (empty if it cannot be)."""
    made: dict[int, Any] = {}

    def trace(*x: tf.Tensor) -> list[tf.Tensor]:
        with keras.StatelessScope():
            made.update(zip(node.outputs, node.run(dict(zip(node.inputs, x)), training=False)))
        return list(made.values())

    try:
        tf.function(trace, autograph=False).get_concrete_function(
            *[tf.TensorSpec(specs[k].shape, specs[k].dtype) for k in node.inputs]
        )
    except Exception:  # noqa: BLE001 - a node that cannot be traced alone: its outputs carry no logits
        return {}
    return made


def tensor_bytes(spec: keras.KerasTensor) -> float:
    """Bytes per sample of a symbolic tensor (its batch dimension left out)."""
    elements = math.prod(int(d) if d is not None else 1 for d in spec.shape[1:])
    return float(elements * np.dtype(keras.backend.standardize_dtype(spec.dtype)).itemsize)


def _kept_whole(model: keras.Model, kwargs: Mapping[str, Any]) -> str:
    """Why a nested Functional model called with ``kwargs`` must stay one node; "" if its nodes can be expanded.

    Expanded, its nodes run as Keras' Functional call runs them: with the ``training`` of the
    outermost call, which overrides a ``training=`` given to the nested call (as Keras'
    ``operation_fn`` does), and with no masks, which keras_hub tasks pass as a structure of Nones.
    """
    if not _compat.runs_as_functional(model):
        return f"its class {type(model).__name__} overrides call(), so the graph may not be what it runs"
    masks = [m for m in keras.tree.flatten(kwargs.get("mask")) if m is not None]
    if masks:
        return "it is called with a mask, which Keras hangs on its inputs for the layers inside it alone"
    others = sorted(k for k, v in kwargs.items() if k not in ("mask", "training") and v is not None)
    if others:
        return f"it is called with {', '.join(others)}=..., which Keras passes to every layer inside it"
    return ""


def _inputs_of(node: Any) -> list[keras.KerasTensor]:
    """The symbolic tensors a nested model's call was given, flattened as the model flattens its inputs."""
    args = node.arguments.args
    return keras.tree.flatten(args[0] if len(args) == 1 else args)
