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
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tfpipe import _compat

REPEATED_LAYERS = ("inline", "call")


def check(repeated_layers: str) -> str:
    """Validate ``repeated_layers``: ``"inline"`` (each layer's ops in its cell's graph) or ``"call"``."""
    if repeated_layers not in REPEATED_LAYERS:
        raise ValueError(
            f"repeated_layers={repeated_layers!r}; use 'inline' (every layer's ops in its cell's functions) "
            "or 'call' (a run of alike layers traced once and called per layer)."
        )
    return repeated_layers


def own_variables(layer: keras.layers.Layer) -> tuple[list[keras.Variable], list[keras.Variable]]:
    """A layer's trainable weights and its other state (seed states included), each once, as a cell orders them."""
    seen: set[int] = set()
    trainable = []
    for v in layer.weights:
        if v.trainable and id(v) not in seen:
            seen.add(id(v))
            trainable.append(v)
    other = []
    for v in layer.non_trainable_variables:
        if id(v) not in seen:
            seen.add(id(v))
            other.append(v)
    return trainable, other


def _structure(layer: keras.layers.Layer) -> Any:
    """What two layers must share to be called through one trace: class, configuration but the name, variables."""
    try:
        config = {k: v for k, v in layer.get_config().items() if k != "name"}
    except Exception:  # noqa: BLE001 - no usable config: the layer runs inline
        return None
    trainable, other = own_variables(layer)
    shapes = tuple((tuple(v.shape), str(v.dtype)) for v in trainable + other)
    return (type(layer), repr(config), len(trainable), shapes)


def runs(layers: Sequence[keras.layers.Layer]) -> list[tuple[int, int]]:
    """The [start, end) spans of at least two consecutive alike layers whose variables no other layer uses."""
    counts: dict[int, int] = {}
    for layer in layers:
        trainable, other = own_variables(layer)
        for v in trainable + other:
            counts[id(v)] = counts.get(id(v), 0) + 1
    keys = []
    for layer in layers:
        trainable, other = own_variables(layer)
        alone = layer.built and all(counts[id(v)] == 1 for v in trainable + other)
        keys.append(_structure(layer) if alone else None)
    spans, start = [], 0
    for end in range(1, len(layers) + 1):
        if end == len(layers) or keys[end] is None or keys[end] != keys[start]:
            if keys[start] is not None and end - start >= 2:
                spans.append((start, end))
            start = end
    return spans


class Repeats:
    """A cell's runs of alike layers, each traced once per graph and input signature and called per layer."""

    def __init__(self, placed: Callable[[], contextlib.AbstractContextManager]):
        self._placed = placed  # the cell's device and gradient scope, entered again inside each trace
        self._traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {key: function or None}
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
            if end > i + 1 and self._callable(x):
                for layer in layers[i:end]:
                    x = self._call(layers[i], layer, x, training, scope)
            else:
                for layer in layers[i:end]:
                    x = layer(x, training=training)
            i = end
        return x

    @staticmethod
    def _callable(x: Any) -> bool:
        """Whether ``x`` can cross a function boundary unchanged: one tensor with nothing Keras hung on it."""
        if not tf.is_tensor(x) or isinstance(x, tf.SparseTensor | tf.RaggedTensor):
            return False
        return _compat.hung(x, _compat.MASK) is None and _compat.hung(x, _compat.LOGITS) is None

    def _call(
        self,
        template: keras.layers.Layer,
        layer: keras.layers.Layer,
        x: tf.Tensor,
        training: bool,
        scope: keras.StatelessScope,
    ) -> Any:
        """``layer(x)`` as a call of ``template``'s trace with ``layer``'s current values; inline if it has none."""
        trainable, other = own_variables(layer)
        values = [scope.get_current_value(v) for v in trainable + other]
        if any(v is None for v in values):  # a variable the cell's scope does not map: run it as Keras would
            return layer(x, training=training)
        trace = self._function(template, x, values, training)
        if trace is None:
            return layer(x, training=training)
        outputs = trace.function(x, *values)
        for k, new in zip(trace.changed, outputs[1:]):
            scope.add_update((other[k], new))
        if trace.losses and scope.collect_losses:
            scope.add_loss(outputs[-1])
        return outputs[0]

    def _function(
        self, template: keras.layers.Layer, x: tf.Tensor, values: Sequence[tf.Tensor], training: bool
    ) -> _Trace | None:
        """``template`` traced as (x, weights..., state...) -> (y, new state..., added loss); None if it cannot be."""
        key = (id(template), bool(training), tuple(x.shape), x.dtype, tuple((tuple(v.shape), v.dtype) for v in values))
        traces = self._traces.setdefault(tf.compat.v1.get_default_graph(), {})
        if key not in traces:
            traces[key] = self._trace(template, x, values, training)
        return traces[key]

    def _trace(
        self, template: keras.layers.Layer, x: tf.Tensor, values: Sequence[tf.Tensor], training: bool
    ) -> _Trace | None:
        trainable, other = own_variables(template)
        found: dict[str, Any] = {"ok": True, "changed": [], "losses": False}

        def block(x_in: tf.Tensor, *flat: tf.Tensor) -> list[tf.Tensor]:
            mapping = list(zip(trainable + other, flat))
            with self._placed(), keras.StatelessScope(state_mapping=mapping, collect_losses=True) as inner:
                y = template(x_in, training=training)
                new = [inner.get_current_value(v) for v in other]
                losses = [tf.cast(tf.reduce_sum(loss), tf.float32) for loss in inner.losses]
            if not self._callable(y):  # a mask or logits would be dropped at the boundary: run the layers inline
                found["ok"] = False
                y = tf.zeros([])
            # Only the state the layer assigns comes back: an unchanged value stays the tensor passed in.
            found["changed"] = [k for k, (n, was) in enumerate(zip(new, flat[len(trainable) :])) if n is not was]
            found["losses"] = bool(losses)
            return [y, *[new[k] for k in found["changed"]], tf.add_n(losses) if losses else tf.constant(0.0)]

        block.__name__ = f"tfpipe_repeated_{template.name}"
        self.num_traces += 1
        specs = [tf.TensorSpec(x.shape, x.dtype)] + [tf.TensorSpec(v.shape, v.dtype) for v in values]
        options = {"experimental_attributes": _compat.noinline()}
        function = tf.function(block, autograph=False, **options).get_concrete_function(*specs)
        return _Trace(function, found["changed"], found["losses"]) if found["ok"] else None


class _Trace(NamedTuple):
    """A run's first layer traced for one signature: the function, which states it assigns, whether it adds losses."""

    function: Any
    changed: list[int]
    losses: bool
