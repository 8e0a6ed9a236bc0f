"""Repeated blocks traced once: a run of alike layers in a cell called as one function per layer.

A deep model is mostly one block repeated (a Transformer's decoder block, a ResNet's bottleneck).
Traced layer by layer, a cell's function holds every block's ops, and so does the step that calls
it, its gradient and its recomputation: TensorFlow's training process keeps each op of the step
about 10 KB whatever device runs it, and the workers keep their partitions' again
(docs/results/client_memory.md). A 224-block Transformer on 8 workers held 9.9 GiB in the training
process though each device used 0.6 GiB.

With ``PipelineModel(..., repeated_layers="call")`` a cell traces the first layer of each run of
alike layers (same class and configuration, same variables' shapes, input spec) once, as a function
of (input, the layer's weights, its other state), and calls it once per layer of the run with that
layer's weights. TensorFlow differentiates the function once, so the forward, backward and
recomputation of the run hold one block's ops and a call per layer. The calls are not inlined
(each is one call op where it runs), at the cost of a function call per block and task.

A layer joins a run only where this is exact: a single tensor in and out with no Keras mask or
logits hung on it, its own variables (none shared with another layer), and its state changes
(seed generators, BatchNorm statistics) returned like a cell's. Otherwise it runs inline, as it
would without this option.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tfpipe import _compat
from tfpipe.partition import state

REPEATED_LAYERS = ("inline", "call")
_NAMES = ("name", "path", "parent_path")  # attributes that differ between alike layers: where each sits


def check(repeated_layers: str) -> str:
    """Validate ``repeated_layers``: ``"inline"`` (each layer's ops in its cell's graph) or ``"call"``."""
    if repeated_layers not in REPEATED_LAYERS:
        raise ValueError(
            f"repeated_layers={repeated_layers!r}; use 'inline' (every layer's ops in its cell's functions) "
            "or 'call' (a run of alike layers traced once and called per layer)."
        )
    return repeated_layers


def _structure(layer: keras.layers.Layer) -> Any:
    """What two layers must share to be called through one trace: class, configuration but the name, variables;
    None where the layer's configuration cannot be compared (alike to none)."""
    described = settings(layer)
    if described is None:
        return None
    trainable, other = state.split_variables([layer])
    return (type(layer), described, len(trainable), variable_shapes(trainable + other))


def variable_shapes(variables: Sequence[Any]) -> tuple:
    """Each variable's shape and dtype, in order."""
    return tuple((tuple(v.shape), str(v.dtype)) for v in variables)


def _configuration(layer: keras.layers.Layer) -> str | None:
    """The layer's configuration but its name, as a string; None where ``get_config`` fails."""
    try:
        return repr({k: v for k, v in layer.get_config().items() if k != "name"})
    except Exception:  # noqa: BLE001 - no usable configuration
        return None


def settings(layer: keras.layers.Layer) -> str | None:
    """What makes layers alike (``tfpipe.planning.walk.same_layer_key`` keys the planner's measurements by it too):
    the configuration but the name; where ``get_config`` fails (keras_hub's Llama decoder block reads an attribute it
    never set), the attributes of it and of every layer in it but their names and paths: the public ones described,
    the private ones where plain; None where a public one cannot be described (not plain, a layer, a variable, a
    function or configurable): such layers are alike to none."""
    config = _configuration(layer)
    if config is not None:
        return config
    parts = []
    for sub in _compat.flatten_layers(layer):  # sub-layers in order: each compared by its own attributes
        kept = []
        for key, value in sorted(vars(sub).items()):
            if key.lstrip("_") in _NAMES or (key.startswith("_") and not _plain(value)):
                continue  # where it sits, and Keras' own bookkeeping (lists of variables and layers, trackers)
            described = _described(value, sub)
            if described is None:
                return None
            kept.append((key, described))
        parts.append((type(sub).__qualname__, kept))
    return repr(parts)


def _plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _described(value: Any, owner: keras.layers.Layer) -> str | None:
    """``value`` as a string two layers configured alike share; None where it cannot be compared."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, tuple | list):
        items = [_described(v, owner) for v in value]
        return None if None in items else f"[{', '.join(str(i) for i in items)}]"
    if isinstance(value, keras.layers.Layer):
        return "layer"  # compared as one of ``flatten_layers``
    if isinstance(value, keras.Variable | tf.Variable):
        return "variable"  # compared by shape and dtype (``_structure``, ``same_layer_key``)
    method = getattr(value, "__wrapped__", value)  # Keras wraps each layer's build and quantize on the instance
    if isinstance(method, types.MethodType) and method.__self__ is owner:
        return f"method {method.__func__.__qualname__}@{id(method.__func__)}"  # its own class's: alike by class
    if callable(value) and not hasattr(value, "get_config"):
        return f"function {getattr(value, '__qualname__', type(value).__qualname__)}@{id(value)}"  # the same object
    try:  # initializers, regularizers, dtype policies, seed generators (their state is the layer's)
        return f"{type(value).__qualname__}{ {k: v for k, v in value.get_config().items() if k != 'name'}!r}"
    except Exception:  # noqa: BLE001 - not configurable: not comparable
        return None


def _variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    trainable, other = state.split_variables([layer])
    return trainable + other


def _uses(layers: Sequence[keras.layers.Layer | None]) -> dict[int, int]:
    """How many times each variable of ``layers`` appears among them (a layer twice counts twice)."""
    counts: dict[int, int] = {}
    for layer in layers:
        for v in _variables(layer) if layer is not None else []:
            counts[id(v)] = counts.get(id(v), 0) + 1
    return counts


def _spans(keys: Sequence[Any]) -> list[tuple[int, int]]:
    """The [start, end) spans of at least two consecutive equal keys that are not None."""
    spans, start = [], 0
    for end in range(1, len(keys) + 1):
        if end == len(keys) or keys[end] is None or keys[end] != keys[start]:
            if keys[start] is not None and end - start >= 2:
                spans.append((start, end))
            start = end
    return spans


def runs(layers: Sequence[keras.layers.Layer]) -> list[tuple[int, int]]:
    """The [start, end) spans of at least two consecutive alike layers whose variables no other layer uses."""
    counts = _uses(layers)
    alone = [layer.built and all(counts[id(v)] == 1 for v in _variables(layer)) for layer in layers]
    return _spans([_structure(layer) if ok else None for layer, ok in zip(layers, alone)])


def node_runs(nodes: Sequence[Any]) -> list[tuple[int, int]]:
    """The [start, end) spans of at least two consecutive alike calls among a Functional segment's ``nodes``.

    Alike: their layers alike (as ``runs``), each layer called once, and the same arguments but the tensors.
    """
    layers = [n.operation if isinstance(n.operation, keras.layers.Layer) else None for n in nodes]
    counts = _uses(layers)
    keys: list[Any] = []
    for node, layer in zip(nodes, layers):
        alone = layer is not None and layer.built and all(counts[id(v)] == 1 for v in _variables(layer))
        structure = _structure(layer) if alone else None
        keys.append((structure, _arguments(node)) if structure is not None else None)
    return _spans(keys)


def _arguments(node: Any) -> str:
    """A node's call arguments with each tensor replaced by its place among the node's inputs."""
    places = {k: i for i, k in enumerate(node.inputs)}
    arguments = node.arguments
    filled = arguments.fill_in({i: f"<input {places[k]}>" for i, k in node.keys.items()})
    return repr(filled)


class Repeats:
    """A cell's runs of alike layers, each traced once per graph and input signature and called per layer."""

    def __init__(self, placed: Callable[[], contextlib.AbstractContextManager]):
        self._placed = placed  # the cell's device and gradient scope, entered again inside each trace
        self._traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {key: _Trace or None}
        self.num_traces = 0

    def run(
        self,
        layers: Sequence[keras.layers.Layer],
        spans: Sequence[tuple[int, int]],
        x: Any,
        training: bool,
        scope: keras.StatelessScope,
    ) -> Any:
        """The layers on ``x`` in the cell's ``scope``: the runs in ``spans`` through their traces, others inline."""
        starts = dict(spans)
        i = 0
        while i < len(layers):
            end = starts.get(i, i + 1)
            call = functools.partial(_call_layer, layers[i], training)
            for layer in layers[i:end]:
                shared = self._shared(layers[i], call, layer, [x], training, scope) if end > i + 1 else None
                x = shared[0] if shared is not None else layer(x, training=training)
            i = end
        return x

    def node_runner(
        self, nodes: Sequence[Any], training: bool | None, scope: keras.StatelessScope
    ) -> Callable[[int, Any, Any], list[Any]]:
        """``run(i, node, values)`` for a Functional segment's ``nodes``: the node's flat outputs, a call of its run's
        trace for a node in a run of alike calls (``node_runs``), else ``node.run``."""
        first = {k: start for start, end in node_runs(nodes) for k in range(start, end)}

        def run(i: int, node: Any, values: Any) -> list[Any]:
            if i in first:
                template = nodes[first[i]]

                def call(xs: Sequence[tf.Tensor]) -> list[Any]:
                    return template.run(dict(zip(template.inputs, xs)), training)

                inputs = [values[k] for k in node.inputs]
                shared = self._shared(template.operation, call, node.operation, inputs, training, scope)
                if shared is not None:
                    return shared
            return node.run(values, training)

        return run

    @staticmethod
    def _callable(x: Any) -> bool:
        """Whether ``x`` can cross a function boundary unchanged: one tensor with nothing Keras hung on it."""
        if not tf.is_tensor(x) or isinstance(x, tf.SparseTensor | tf.RaggedTensor):
            return False
        return _compat.hung(x, _compat.MASK) is None and _compat.hung(x, _compat.LOGITS) is None

    def _shared(
        self,
        template: keras.layers.Layer,
        call: Callable[[Sequence[tf.Tensor]], list[Any]],
        layer: keras.layers.Layer,
        inputs: Sequence[Any],
        training: bool | None,
        scope: keras.StatelessScope,
    ) -> list[Any] | None:
        """What ``layer`` gives on ``inputs``, as a call of ``template``'s trace (``call`` runs the template) with
        ``layer``'s current values; None where it cannot be (the caller runs the layer itself)."""
        if not all(self._callable(t) for t in inputs):
            return None
        trainable, other = state.split_variables([layer])
        values = [scope.get_current_value(v) for v in trainable + other]
        if any(v is None for v in values):  # a variable the cell's scope does not map: run it as Keras would
            return None
        key = (id(template), training, tuple((tuple(t.shape), t.dtype) for t in [*inputs, *values]))
        traces = self._traces.setdefault(tf.compat.v1.get_default_graph(), {})
        if key not in traces:
            traces[key] = self._trace(template, call, inputs, values)
        trace = traces[key]
        if trace is None:
            return None
        outputs = trace.function(*inputs, *values)
        for k, new in zip(trace.changed, outputs[trace.n_y :]):
            scope.add_update((other[k], new))
        if trace.losses and scope.collect_losses:
            scope.add_loss(outputs[-1])
        return list(outputs[: trace.n_y])

    def _trace(
        self,
        template: keras.layers.Layer,
        call: Callable[[Sequence[tf.Tensor]], list[Any]],
        inputs: Sequence[tf.Tensor],
        values: Sequence[tf.Tensor],
    ) -> _Trace | None:
        """``call`` traced as (inputs..., weights..., state...) -> (outputs..., new state..., added loss); None if a
        result would not cross the boundary unchanged (a mask or logits hung on it, not a tensor)."""
        trainable, other = state.split_variables([template])
        n_in = len(inputs)
        found: dict[str, Any] = {"ok": True, "changed": [], "losses": False, "n_y": 0}

        def block(*flat: tf.Tensor) -> list[tf.Tensor]:
            mapping = list(zip(trainable + other, flat[n_in:]))
            with self._placed(), keras.StatelessScope(state_mapping=mapping, collect_losses=True) as inner:
                ys = call(list(flat[:n_in]))
                new = [inner.get_current_value(v) for v in other]
                losses = [tf.cast(tf.reduce_sum(loss), tf.float32) for loss in inner.losses]
            if not all(self._callable(y) for y in ys):
                found["ok"] = False
                ys = []
            # Only the state the layer assigns comes back: an unchanged value stays the tensor passed in.
            found["changed"] = [k for k, (n, was) in enumerate(zip(new, flat[n_in + len(trainable) :])) if n is not was]
            found["losses"], found["n_y"] = bool(losses), len(ys)
            return [*ys, *[new[k] for k in found["changed"]], tf.add_n(losses) if losses else tf.constant(0.0)]

        block.__name__ = f"tfpipe_repeated_{template.name}"
        self.num_traces += 1
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in [*inputs, *values]]
        options = {"experimental_attributes": _compat.noinline()}
        function = tf.function(block, autograph=False, **options).get_concrete_function(*specs)
        return _Trace(function, found["n_y"], found["changed"], found["losses"]) if found["ok"] else None


def _call_layer(layer: keras.layers.Layer, training: bool, xs: Sequence[tf.Tensor]) -> list[Any]:
    return [layer(xs[0], training=training)]


class _Trace(NamedTuple):
    """A run's first layer traced for one signature: the function, its outputs' count, which states it assigns,
    whether it adds losses."""

    function: Any
    n_y: int
    changed: list[int]
    losses: bool
