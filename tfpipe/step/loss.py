"""A micro-batch's loss task: its weighted loss and the loss's gradients for the last cell's outputs.

Unrolled, a step computes the loss and its gradient M times; traced each time, a
Transformer's cross-entropy and its tape gradient were about 60 ops per micro-batch,
more than half of the step graph at M=32 (2,000 of 3,800 ops), each traced in Python and
optimized by Grappler. A loss that says which tensors it reads (``Traceable``) is traced
once per graph as one function, and each micro-batch is one call of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import tensorflow as tf

from tfpipe.distributed import devices
from tfpipe.graph import calls
from tfpipe.graph.names import LOSS_FUNCTION
from tfpipe.leaves import flat
from tfpipe.partition.cell import Cell, hang
from tfpipe.step import microbatch

LossFn = Callable[[int, Any], tf.Tensor]


@runtime_checkable
class Traceable(Protocol):
    """A ``LossFn`` that can be traced once: ``loss(j, y) == loss_of(loss_inputs(j), y)``.

    ``loss_inputs(j)`` returns micro-batch j's tensors that the loss reads besides the
    model's outputs (targets, sample weights, its weight), or None where the loss cannot
    be traced apart from them; ``traces`` is where the traced functions are kept.
    """

    traces: dict

    def __call__(self, j: int, y_pred: Any) -> tf.Tensor: ...

    def loss_inputs(self, j: int) -> list[tf.Tensor] | None: ...

    def loss_of(self, inputs: Sequence[tf.Tensor], y_pred: Any) -> tf.Tensor: ...


class Offset:
    """``loss_fn`` seen from a replica whose micro-batch j is the mini-batch's ``first + j``."""

    def __init__(self, loss_fn: LossFn, first: int):
        self._loss_fn, self._first = loss_fn, first
        self.traces = getattr(loss_fn, "traces", {})

    def __call__(self, j: int, y_pred: Any) -> tf.Tensor:
        return self._loss_fn(self._first + j, y_pred)

    def loss_inputs(self, j: int) -> list[tf.Tensor] | None:
        """The wrapped loss's inputs for micro-batch ``first + j``, if it is traceable."""
        return self._loss_fn.loss_inputs(self._first + j) if isinstance(self._loss_fn, Traceable) else None

    def loss_of(self, inputs: Sequence[tf.Tensor], y_pred: Any) -> tf.Tensor:
        """The wrapped loss of the given inputs."""
        assert isinstance(self._loss_fn, Traceable)  # asked only where loss_inputs gave inputs
        return self._loss_fn.loss_of(inputs, y_pred)


def offset(loss_fn: LossFn, first: int) -> LossFn:
    """``loss_fn`` numbering micro-batches from ``first`` (a replica's), still traceable if it was."""
    return loss_fn if first == 0 else Offset(loss_fn, first)


def loss_and_gradients(
    loss_fn: LossFn,
    j: int,
    y: Any,
    loss_scale: Any,
    leaves: Sequence[tf.Tensor] | None = None,
    device: str | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[tf.Tensor, list[Any]]:
    """Micro-batch j's weighted loss, and the gradients of the scaled loss for ``leaves`` (default: the leaves
    of ``y``; None where integer). The leaves may include tensors hung on ``y``'s, such as Keras' logits.

    Given the ``device`` it runs on, in a graph, a ``Traceable`` loss is one call of a function
    traced once per signature, made with the ``tf.function`` ``options`` of the cell it runs beside
    (``Cell.function_options``: inlined or not, compiled by XLA or not); otherwise the ops are made here.
    """
    flat_y = flat(y)
    ys = flat_y if leaves is None else list(leaves)
    if isinstance(loss_fn, Traceable) and device is not None:
        inputs = loss_fn.loss_inputs(j)
        if inputs is not None and not tf.executing_eagerly():
            found_at = [next((p for p, t in enumerate(flat_y) if t is leaf), None) for leaf in ys]
            at = [p for p in found_at if p is not None]
            if len(at) == len(found_at):
                return _traced(loss_fn, y, flat_y, inputs, loss_scale, at, device, options or {})
    floating = [t for t in ys if t.dtype.is_floating]
    loss, grads = _with_gradients(lambda: loss_fn(j, hang(y)), floating, loss_scale)
    found = iter(grads)
    return loss, [next(found) if t.dtype.is_floating else None for t in ys]


def on_cell(
    loss_fn: LossFn, j: int, y: Any, loss_scale: Any, leaves: Sequence[tf.Tensor] | None, cell: Cell
) -> tuple[tf.Tensor, list[Any]]:
    """``loss_and_gradients`` as the loss task on ``cell``'s device: traced once per step when the cell's calls are."""
    if not cell.traceable:
        return loss_and_gradients(loss_fn, j, y, loss_scale, leaves)
    return loss_and_gradients(loss_fn, j, y, loss_scale, leaves, cell.device, cell.function_options())


def _with_gradients(loss: Callable[[], tf.Tensor], watched: list[tf.Tensor], scale: Any) -> tuple[tf.Tensor, list]:
    """``loss()`` as float32, and the gradients of ``loss() * scale`` for ``watched`` (zeros where unconnected)."""
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(watched)
        value = tf.cast(loss(), tf.float32)
        scaled = value * scale
    return value, tape.gradient(scaled, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO)


def _spec(t: tf.Tensor) -> tf.TensorSpec:
    return tf.TensorSpec(t.shape, t.dtype)


def _traced(
    loss_fn: Traceable,
    y: Any,
    flat_y: Sequence[tf.Tensor],
    inputs: Sequence[tf.Tensor],
    loss_scale: Any,
    at: Sequence[int],
    device: str,
    options: dict[str, Any],
) -> tuple[tf.Tensor, list[Any]]:
    """``loss_and_gradients`` as one call; ``at`` places each wanted leaf among ``flat_y``, the leaves of ``y``."""
    structure = tf.nest.map_structure(lambda t: None if t is None else 0, y)
    graph = tf.compat.v1.get_default_graph()
    # One scale tensor per graph, made in the first loss task (so it waits for that task's turn).
    scale_key = ("scale", graph, device)
    if scale_key not in loss_fn.traces:
        with devices.scope(device):
            (loss_fn.traces[scale_key],) = microbatch.unfoldable([loss_scale])
    scale = loss_fn.traces[scale_key]
    wanted = [p for p in at if flat_y[p].dtype.is_floating]
    specs = [_spec(t) for t in flat_y] + [_spec(t) for t in inputs]
    key = (graph, device, repr(options), repr(structure), tuple(specs), tuple(wanted))
    if key not in loss_fn.traces:
        n_y = len(flat_y)

        def body(*args: tf.Tensor) -> list[tf.Tensor]:
            y_leaves, rest, factor = list(args[:n_y]), list(args[n_y:-1]), args[-1]
            leaves = iter(y_leaves)
            y_pred = tf.nest.map_structure(lambda s: None if s is None else next(leaves), structure)
            loss, grads = _with_gradients(
                lambda: loss_fn.loss_of(rest, hang(y_pred)), [y_leaves[p] for p in wanted], factor
            )
            return [loss, *grads]

        body.__name__ = LOSS_FUNCTION  # how tfpipe.analysis.graph_tasks recognizes the call in a step's graph
        function = tf.function(body, autograph=False, **options)
        with devices.scope(device):
            loss_fn.traces[key] = function.get_concrete_function(*specs, tf.TensorSpec([], tf.float32))
    loss, *grads = calls.call(loss_fn.traces[key], [*flat_y, *inputs, scale])
    found = dict(zip(wanted, grads))
    return loss, [found.get(p) for p in at]
