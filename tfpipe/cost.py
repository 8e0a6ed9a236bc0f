"""Per-layer cost estimates (parameters, FLOPs, time, memory), measured on working copies of the layers.

Every estimate walks the layer sequence with a sample batch: each layer is
copied (``from_config``), the copy is built for the output of the previous one
and measured, and the copy is dropped. The user's layers are never built, run
or changed here, so estimating before the cells exist leaves every variable to
be created later on its cell's device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import timeit
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Union

import keras
import numpy as np
import tensorflow as tf

from tfpipe._args import positive_int
from tfpipe.partition import functional, hub, specs
from tfpipe.partition.sequence import layer_list
from tfpipe.planning import flops as flops_lib
from tfpipe.planning.walk import restoring_random_state, same_layer_key, tensor_bytes, walk

KINDS = ("flops", "params", "time", "memory")
Cost = Union[str, Callable[[keras.layers.Layer], float]]
UNITS = {"flops": "FLOPs/sample", "params": "params", "time": "s/batch", "memory": "bytes/batch"}


class CostEstimateWarning(UserWarning):
    """A layer's cost was estimated by a fallback rule rather than measured or counted."""


@dataclasses.dataclass
class Estimate:
    """Costs of a layer sequence: one value per layer, with the size of what each layer hands on."""

    kind: str
    costs: list[float]
    output_bytes: list[float]  # bytes per sample of each layer's output (what crosses a cell boundary)
    notes: dict[int, str] = dataclasses.field(default_factory=dict)  # layer index -> fallback used


def check_kind(cost: Any) -> Cost:
    """Validate a cost: one of KINDS or a callable ``layer -> float``."""
    if callable(cost) or cost in KINDS:
        return cost
    raise ValueError(f"Unknown cost={cost!r}; use one of {', '.join(map(repr, KINDS))} or a callable layer -> float.")


def estimate(layers: Any, sample: Any, cost: Cost = "flops", device: str | None = None, repeats: int = 5) -> Estimate:
    """Estimate every layer's cost on copies of the layers fed with ``sample`` (a batch, possibly nested).

    A callable cost is applied to the user's layers; with ``sample=None`` it needs no
    copies, and the output sizes stay unknown (empty).

    ``"flops"``: forward FLOPs per sample, counted from the traced graph (a
    multiply-add is 2 FLOPs). ``"params"``: parameter count. ``"time"``: median
    seconds of a forward and backward of the sample batch on ``device``.
    ``"memory"``: peak bytes a forward and backward of the sample batch adds on
    ``device``, plus the layer's weights. A callable is applied to each layer.
    """
    layers = layer_list(layers)
    cost = check_kind(cost)
    if callable(cost) and sample is None:
        costs = [float(cost(layer)) for layer in layers]
        for index, (layer, value) in enumerate(zip(layers, costs)):
            _check_value(value, index, layer)
        return Estimate("custom", costs, output_bytes=[])
    repeats = positive_int("repeats", repeats)
    if cost == "memory" and not tf.executing_eagerly():
        raise ValueError("cost='memory' is measured eagerly only; call tfpipe.balance.by_memory outside tf.function.")
    batch = batch_size(sample)
    device = device or _default_device()
    measure = _measure_fn(cost, batch, device, repeats)
    run = cost in ("time", "memory")
    result = Estimate(kind=cost if isinstance(cost, str) else "custom", costs=[], output_bytes=[])
    seeds = random.getstate(), np.random.get_state()  # copies draw initializer seeds; leave the user's stream as it was
    # Run eagerly even while Keras traces a step; but only then: allocations made under
    # init_scope do not show in get_memory_info (measured with TF 2.21).
    eager = contextlib.nullcontext() if tf.executing_eagerly() else tf.init_scope()
    with eager, tf.device(device), restoring_random_state(seeds):
        x = tf.nest.map_structure(tf.convert_to_tensor, sample)
        measured: dict[int, tuple[float, str | None]] = {}  # id(copy) -> its cost: a reused copy is measured once
        for index, layer, copy, x_in, y in walk(layers, x, run):
            if callable(cost):
                value, note = float(cost(layer)), None
            else:
                assert measure is not None  # every kind but a callable is measured
                if id(copy) not in measured:
                    measured[id(copy)] = measure(copy, x_in)
                value, note = measured[id(copy)]
            _check_value(value, index, layer)
            result.costs.append(value)
            result.output_bytes.append(tensor_bytes(y) / batch)
            if note:
                result.notes[index] = note
    _warn_fallbacks(result, [f"layer {i} ({layer.name})" for i, layer in enumerate(layers)])
    return result


def estimate_graph(
    graph: functional.Graph,
    cost: Cost,
    batch: int | None,
    num_micro_batches: int = 1,
    device: str | None = None,
    repeats: int = 5,
) -> Estimate:
    """Every node's cost in a Functional graph, for micro-batches of a batch of ``batch`` samples.

    Dimensions the model leaves unknown after the batch (a language model's sequence length)
    are taken as ``hub.stand_in_length(graph.model)``.

    As ``estimate``, one value per node; the nodes call the model's own (built) layers with
    nothing assigned, since a Functional model has its variables already. A layer called at
    several nodes counts its parameters at the first. ``output_bytes`` are the bytes per
    sample of every tensor that would cross a cut after each node, skips included. A callable
    cost is applied to each node's layer or ``keras.ops`` operation.
    """
    cost = check_kind(cost)
    result = Estimate(kind=cost if isinstance(cost, str) else "custom", costs=[], output_bytes=graph.live_bytes())
    device = device or _default_device()
    n = -(-int(batch) // num_micro_batches) if batch else specs.ESTIMATION_BATCH
    length = hub.stand_in_length(graph.model)
    measure = _measure_fn(cost, n, device, positive_int("repeats", repeats))
    measured: dict[str, tuple[float, str | None]] = {}  # identical nodes (class, config, input spec) counted once
    counted: set[int] = set()
    eager = contextlib.nullcontext() if tf.executing_eagerly() else tf.init_scope()
    with eager, tf.device(device):
        for index, node in enumerate(graph.nodes):
            call = _NodeCall(node)
            spec = tuple(graph.specs[k] for k in node.inputs)
            if callable(cost):
                value, note = float(cost(node.operation)), None
            elif cost == "params":
                value, note = (0.0 if id(node.operation) in counted else float(call.count_params())), None
                counted.add(id(node.operation))
            else:
                key = f"node {index}"
                if cost == "flops":  # traced, not run: specs, and identical nodes counted once
                    x = tuple(keras.KerasTensor(specs.filled((n,) + tuple(t.shape[1:]), length), t.dtype) for t in spec)
                    key = same_layer_key(node.operation, x) or key
                else:
                    x = tuple(tf.convert_to_tensor(a) for a in specs.estimation_sample(spec, n, 1, length))
                assert measure is not None  # every kind but a callable is measured
                if key not in measured:
                    measured[key] = measure(call, x)
                value, note = measured[key]
            _check_value(value, index, node.operation)
            result.costs.append(value)
            if note:
                result.notes[index] = note
    _warn_fallbacks(result, [f"node {i} ({node.name})" for i, node in enumerate(graph.nodes)])
    return result


def _warn_fallbacks(result: Estimate, names: Sequence[str]) -> None:
    """One warning naming every layer (or node) whose cost a fallback rule estimated."""
    if result.notes:
        lines = "; ".join(f"{names[i]}: {note}" for i, note in result.notes.items())
        warnings.warn(
            f"Some {result.kind} costs are estimates by a fallback rule: {lines}", CostEstimateWarning, stacklevel=3
        )


class _NodeCall:
    """A graph node called as the measurements call a layer copy: ``call(x, training)`` with ``x`` its inputs."""

    def __init__(self, node: functional.Node):
        self._node = node
        layer = node.operation if isinstance(node.operation, keras.layers.Layer) else None
        self.trainable_variables = list(layer.trainable_variables) if layer else []
        self.weights = list(layer.weights) if layer else []

    def count_params(self) -> int:
        """The parameters of the node's layer (none for a keras.ops call)."""
        return int(sum(math.prod(v.shape) for v in self.weights))

    def __call__(self, x: Sequence[Any], training: bool | None = None) -> list[Any]:
        with keras.StatelessScope():  # the model's own layers: measured, nothing assigned
            return self._node.run(dict(zip(self._node.inputs, x)), training)


def batch_size(sample: Any) -> int:
    """The batch size of a sample batch (possibly nested); a ValueError if it is not a batch."""
    leaves = tf.nest.flatten(sample)
    shapes = [getattr(leaf, "shape", None) for leaf in leaves]
    if not leaves or any(s is None or len(s) == 0 or s[0] is None for s in shapes):
        raise ValueError(
            f"sample must be a batch of data (arrays or tensors with a leading batch dimension, possibly nested), "
            f"got {sample!r:.80}."
        )
    first = shapes[0]
    assert first is not None  # checked above
    return int(first[0])


def _check_value(value: float, index: int, layer: keras.layers.Layer) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"The cost of layer {index} ({layer.name}) is {value}; costs must be finite and >= 0.")


def _default_device() -> str:
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def _measure_fn(
    cost: Cost, batch: int, device: str, repeats: int
) -> Callable[[Any, Any], tuple[float, str | None]] | None:
    """How to measure a built copy given its input: (cost, fallback note); None for a callable cost."""
    if cost == "flops":
        return lambda copy, spec: _flops(copy, spec, batch)
    if cost == "params":
        return lambda copy, spec: (float(copy.count_params()), None)
    if cost == "time":
        return lambda copy, x: (_seconds(copy, x, repeats), None)
    if cost == "memory":
        return lambda copy, x: (_peak_bytes(copy, x, device), None)
    return None  # a callable is applied to the user's layer instead


# FLOPs -------------------------------------------------------------------------------------------
def _flops(copy: keras.layers.Layer, spec: Any, batch: int) -> tuple[float, str | None]:
    """Forward FLOPs per sample of a built layer, counted op by op in its traced training graph."""
    signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), spec)

    def forward(x):
        return copy(x, training=True)

    try:
        graph = tf.function(forward).get_concrete_function(signature).graph
    except Exception as err:  # noqa: BLE001 - untraceable layer: documented fallback
        params = copy.count_params()
        return 2.0 * params, f"not traceable ({type(err).__name__}); counted 2 x {params} parameters per sample"
    total, unknown = flops_lib.graph_flops(graph)
    note = f"ops {sorted(unknown)} counted as one FLOP per output element" if unknown else None
    return total / batch, note


_NO_MEMORY_INFO = (
    "Memory on {device} cannot be measured: its allocator does not report every allocation. On a CPU set "
    "TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow starts; or use cost='time' or 'flops'."
)


# Time and memory -------------------------------------------------------------------------------
def _forward_backward(copy: keras.layers.Layer) -> Callable[[Any], Any]:
    """A compiled training forward and backward of one layer copy (gradients of weights and float inputs)."""

    @tf.function
    def step(x):
        floats = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            y = copy(x, training=True)
            loss = tf.add_n(
                [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y) if t.dtype.is_floating]
                or [tf.constant(0.0)]
            )
        return tape.gradient(
            loss,
            [v.value for v in copy.trainable_variables] + floats,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )

    return step


def _seconds(copy: keras.layers.Layer, x: Any, repeats: int) -> float:
    step = _forward_backward(copy)
    for _ in range(2):  # trace, then one warm run
        step(x)
    tf.test.experimental.sync_devices()
    times = []
    for _ in range(repeats):
        began = timeit.default_timer()
        step(x)
        tf.test.experimental.sync_devices()
        times.append(timeit.default_timer() - began)
    return float(np.median(times))


def _peak_bytes(copy: keras.layers.Layer, x: Any, device: str) -> float:
    # TensorFlow's default CPU allocator reports only large allocations (seen with TF 2.21): refuse, not guess
    on_cpu = (tf.DeviceSpec.from_string(device).device_type or "CPU").upper() == "CPU"
    if on_cpu and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() not in ("1", "true"):
        raise ValueError(_NO_MEMORY_INFO.format(device=device))
    step = _forward_backward(copy)
    step(x)  # trace outside the measurement
    name = device.lstrip("/").upper().replace("DEVICE:", "")
    tf.config.experimental.reset_memory_stats(name)
    base = tf.config.experimental.get_memory_info(name)["current"]
    grads = step(x)
    tf.test.experimental.sync_devices()
    peak = tf.config.experimental.get_memory_info(name)["peak"]
    del grads
    if peak == 0:
        raise ValueError(_NO_MEMORY_INFO.format(device=device))
    weights = sum(tensor_bytes(v) for v in copy.weights)
    return float(peak - base + weights)
