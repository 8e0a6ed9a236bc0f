"""What PipelineModel's Keras training needs around the pipeline: the loss per micro-batch, batch
checks before fit, variables created before tracing, and optimizer updates placed on the cells' devices."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat, updates
from tfpipe.distributed import grouped
from tfpipe.leaves import flat
from tfpipe.step import microbatch

DEFAULT_REDUCTION = "sum_over_batch_size"  # what compile() gives a loss given as a string or function


def loss_reduction(loss: Any) -> str:
    """The one reduction of the losses given to ``compile(loss=...)``; a ValueError if they differ."""
    reductions = set()
    for entry in (e for e in tf.nest.flatten(loss) if e is not None):
        if isinstance(entry, str):  # Keras picks the crossentropy later; every string loss gets the default
            entry = None if entry.lower() in ("crossentropy", "ce") else keras.losses.get(entry)
        reductions.add(entry.reduction if isinstance(entry, keras.losses.Loss) else DEFAULT_REDUCTION)
    if len(reductions) > 1:
        raise ValueError(
            f"The compiled losses use different reductions {sorted(reductions)}; tfpipe weights micro-batch "
            "losses by one rule, so give all losses the same reduction."
        )
    return reductions.pop() if reductions else "sum"


class MicroBatchLoss:
    """``loss(j, y_pred)``: micro-batch j's share of the mini-batch loss, weighted so the shares add up.

    Without an override of ``compute_loss`` (``default_hook`` is the class's own) the
    compiled loss is weighted by its reduction, and the loss is ``tfpipe.step.loss.Traceable``:
    it reads only micro-batch j's targets, sample weights and weight. An override is called
    per micro-batch and, as Keras' losses do by default, taken as a mean over the micro-batch.
    """

    def __init__(
        self,
        model: keras.Model,
        default_hook: Callable,
        xs: Sequence[Any],
        ys: Sequence[Any],
        sws: Sequence[Any],
        sizes: Sequence[Any],
    ):
        self._model, self._xs, self._ys, self._sws, self._sizes = model, xs, ys, sws, sizes
        overridden = type(model).compute_loss is not default_hook
        self._none = not overridden and _compat.compiled_loss(model) is None
        self._traceable = not overridden and not self._none
        self._reduction = DEFAULT_REDUCTION if overridden or self._none else loss_reduction(model.loss)
        self._weights: list[tf.Tensor] = []
        self.traces: dict = {}  # tfpipe.step.loss's traced functions

    def _weight(self, j: int) -> tf.Tensor:
        if not self._weights:  # made at the first loss, inside the task that uses them
            weights = microbatch.loss_weights(self._reduction, self._sizes, self._sws)
            self._weights.extend(microbatch.unfoldable(weights))  # one traced loss function for every call
        return self._weights[j]

    def __call__(self, j: int, y_pred: Any) -> tf.Tensor:
        if self._none:
            return tf.constant(0.0)
        # Not overridden, the model's hook returns the compiled loss alone in training.
        value = self._model.compute_loss(
            x=self._xs[j], y=self._ys[j], y_pred=y_pred, sample_weight=self._sws[j], training=True
        )
        return tf.cast(value, tf.float32) * self._weight(j)

    def loss_inputs(self, j: int) -> list[tf.Tensor] | None:
        """Micro-batch j's targets, sample weights and weight, flat; None for an overridden ``compute_loss``
        or targets that are not dense tensors."""
        if not self._traceable:
            return None
        leaves = flat((self._ys[j], self._sws[j]))
        if any(isinstance(t, (tf.SparseTensor, tf.RaggedTensor)) for t in leaves):
            return None  # the traced function takes dense tensors; these losses run per micro-batch as before
        return [tf.convert_to_tensor(t) for t in leaves] + [self._weight(j)]

    def loss_of(self, inputs: Sequence[tf.Tensor], y_pred: Any) -> tf.Tensor:
        """The weighted loss of ``y_pred`` for the tensors ``loss_inputs`` gave (in a traced function)."""
        parts = iter(inputs)
        y, sw = tf.nest.map_structure(lambda t: None if t is None else next(parts), (self._ys[0], self._sws[0]))
        value = self._model.compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=sw, training=True)
        return tf.cast(value, tf.float32) * next(parts)


def unscale_for_distribution(loss: tf.Tensor) -> tf.Tensor:
    """The loss as ``fit`` reports it: Keras divides losses by the replica count; undo that."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * replicas if replicas > 1 else loss


def check_batches(
    x: Any, batch_size: int | None, validation_split: float, num_micro_batches: int, num_replicas: int = 1
) -> None:
    """Refuse, before fit starts, a batch size or sample count that leaves a batch smaller than R x M."""
    m = num_micro_batches * num_replicas
    what = f"num_micro_batches={m}" if num_replicas == 1 else f"{num_replicas} replicas x {num_micro_batches} = {m}"
    if batch_size is not None and batch_size < m:
        raise ValueError(
            f"batch_size={batch_size} is smaller than {what} micro-batches; every micro-batch needs a sample. "
            f"Use batch_size >= {m} or lower num_micro_batches."
        )
    if isinstance(x, tf.data.Dataset):
        batching = _compat.dataset_batching(x)
        if batching is not None and not batching[2] and 0 < batching[0] % batching[1] < m:
            n, size = batching[:2]
            raise ValueError(
                f"The dataset's {n} samples in batches of {size} leave a last batch of {n % size}, smaller than "
                f"{what} micro-batches. Batch with drop_remainder=True, or choose a batch size that leaves no "
                f"remainder or one of at least {m}."
            )
        return
    leaves = [leaf for leaf in tf.nest.flatten(x) if isinstance(leaf, (np.ndarray, tf.Tensor))]
    if not leaves or len(leaves) != len(tf.nest.flatten(x)):
        return  # a generator, or a dataset of unknown batching: its batches are checked in the step
    n = int(math.floor(int(leaves[0].shape[0]) * (1.0 - validation_split)))  # as Keras splits
    size = batch_size or _compat.DEFAULT_BATCH_SIZE
    last = n % size
    if 0 < last < m:
        raise ValueError(
            f"{n} samples in batches of {size} leave a last batch of {last}, smaller than {what} micro-batches. "
            f"Choose a batch_size that leaves no remainder or one of at least {m}, or drop the last {last} samples."
        )


@contextlib.contextmanager
def short_batch_errors() -> Iterator[None]:
    """The in-graph check of a batch smaller than R x M, as one short ValueError instead of a graph traceback."""
    try:
        yield
    except tf.errors.InvalidArgumentError as err:
        if microbatch.SHORT_BATCH not in str(err):
            raise
        line = next(x for x in str(err).splitlines() if microbatch.SHORT_BATCH in x)
        raise ValueError(line[line.index(microbatch.SHORT_BATCH) :].split(" [")[0].strip()) from None


def build_before_tracing(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> None:
    """Create the model's, metrics' and optimizer's variables before Keras traces a step.

    Without a distribution strategy Keras creates them while tracing, and a variable
    created in a trace makes TensorFlow trace the whole unrolled pipeline a second
    time, a large share of a first fit
    (docs/notes/2026-11-benchmark-passes.md#figures-moved-out-of-docstrings-2026-11-26).
    """
    if not model.compiled:
        return
    if isinstance(x, tf.data.Dataset):
        batch = x.element_spec
    elif all(
        isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in tf.nest.flatten((x, y, sample_weight)) if leaf is not None
    ):
        batch = (x, y, sample_weight)
    else:
        return  # generators and PyDatasets: Keras builds while tracing, as usual
    symbolic = tf.nest.map_structure(
        lambda t: (
            None
            if t is None
            else keras.KerasTensor((None,) + tuple(t.shape[1:]), keras.backend.standardize_dtype(t.dtype))
        ),
        batch,
    )
    with model.distribute_strategy.scope():  # where Keras itself would create them
        if not model.built:  # ourselves: Keras would build inside a StatelessScope, which defers variable
            model.build(keras.utils.unpack_x_y_sample_weight(symbolic)[0])  # creation past our device scopes
        _compat.symbolic_build(model, symbolic)


def _device_of(variable: Any) -> str:
    return (variable.value if isinstance(variable, keras.Variable) else variable).device


def apply_on_variable_devices(optimizer: keras.optimizers.Optimizer, gradients: Any, variables: Any) -> None:
    """The optimizer step of a pipelined ``train_step``: each variable's update on that variable's device.

    The gradients arrive on the devices of their cells. The hooks ``compile`` installed on the optimizer
    (``place_on_variable_devices``, before ``build`` makes the slots, so that they are placed too, and
    ``check_slices_finite``) run each update, and the step counter and learning rate it reads, there; the
    ops Keras' optimizer wrappers add without a device (a LossScaleOptimizer's finite check and unscaling)
    go beside their inputs instead of to the client.
    """
    with beside_inputs():
        optimizer.apply_gradients(zip(gradients, variables))


def place_on_variable_devices(optimizer: keras.optimizers.Optimizer) -> None:
    """Create each optimizer slot, and run each variable's update, on that variable's device.

    Keras asks tf.distribute to colocate them, which does nothing for slots built
    eagerly and leaves the update math unplaced in the graph. Both hooks are public
    Optimizer methods; they are wrapped on this instance (and a LossScaleOptimizer's
    inner one), as is the gradients' cross-replica sum, which runs per variable device.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or _compat.patched(opt, "placed"):
            continue
        _compat.wrap_optimizer_method(
            opt, "add_variable_from_reference", functools.partial(_created_on_variable_device, opt=opt)
        )
        read = _reads_per_device()
        _compat.wrap_optimizer_method(
            opt, "update_step", functools.partial(_updated_on_variable_device, opt=opt, read=read)
        )
        _compat.wrap_optimizer_method(opt, "_distributed_tf_update_step", _grouped_by_device)
        _compat.set_gradient_all_reduce(opt, _by_device(_compat.gradient_all_reduce(opt)))
        _compat.mark_patched(opt, "placed")


def _created_on_variable_device(create: Callable[..., Any], opt: keras.optimizers.Optimizer) -> Callable[..., Any]:
    """``add_variable_from_reference`` that creates the slot on its variable's device (and notes whose it is)."""

    def add_variable_from_reference(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        with tf.device(_device_of(reference_variable)):
            slot = create(reference_variable, *args, **kwargs)
        updates.record_slot(opt, reference_variable, slot)
        return slot

    return add_variable_from_reference


def _updated_on_variable_device(
    update: Callable[..., Any], opt: keras.optimizers.Optimizer, read: Callable[[Any, str], Any]
) -> Callable[..., Any]:
    """``update_step`` that runs on its variable's device, reading the step counter and learning rate there;
    a call of its kind's shared trace where the optimizer's updates are shared (``tfpipe.updates``)."""

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        device = _device_of(variable)
        counter = read(_compat.step_counter(opt), device)  # Adam and others read it in every update
        rate = read(learning_rate, device)
        with tf.device(device):
            if updates.shared_update(opt, update, gradient, variable, rate, counter):
                return None
            with _compat.step_counter_as(opt, counter):
                return update(gradient, variable, rate)

    return update_step


def _grouped_by_device(update_all: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' loop over every variable's update, each remote device's variables as one call (``grouped.run_on``)."""

    def update(distribution: Any, grads_and_vars: Any, learning_rate: Any) -> Any:
        every = list(grads_and_vars)
        groups = _positions_by_device(every)
        if not any(grouped.elsewhere(device) for device in groups):
            return update_all(distribution, every, learning_rate)
        for device, positions in groups.items():
            pairs = [every[i] for i in positions]
            grouped.run_on(device, functools.partial(update_all, distribution, pairs, learning_rate))
        return None

    return update


def check_slices_finite(optimizer: keras.optimizers.Optimizer) -> None:
    """Make a LossScaleOptimizer's finite check read sparse gradients' values, so that it skips their overflows.

    Keras checks a ``tf.IndexedSlices`` by scattering its rows into a dense tensor; where an index
    repeats (an embedding's rows, and more so with micro-batches and replicas, whose slices are
    concatenated), a later finite row overwrites a non-finite one, and the step is applied with inf
    or NaN. ``check_finite`` is a public method; it is wrapped on this instance.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or _compat.patched(optimizer, "slices"):
        return
    _compat.wrap_optimizer_method(optimizer, "check_finite", _reading_slice_values)
    _compat.mark_patched(optimizer, "slices")


def _reading_slice_values(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check_finite`` that checks a ``tf.IndexedSlices``' values instead of its scattered dense form."""

    def check_finite(grads: Any) -> Any:
        return check([g.values if isinstance(g, tf.IndexedSlices) else g for g in grads])

    return check_finite


def _reads_per_device() -> Callable[[Any, str], Any]:
    """``read(value, device)``: a variable's value read once per device and traced step, else ``value``.

    Keras passes the learning rate as a variable to every update step, which read it
    anew on the client for each variable: a worker waited on one receive per variable
    at the start of every step. The same for the step counter that Adam reads.
    """
    reads: dict[tuple[int, str], tf.Tensor] = {}

    def read(value: Any, device: str) -> Any:
        if tf.executing_eagerly() or not isinstance(value, (keras.Variable, tf.Variable)):
            return value
        graph = tf.compat.v1.get_default_graph()
        found = reads.get((id(value), device))
        if found is None or found.graph is not graph:
            with tf.device(device):
                found = reads[(id(value), device)] = tf.identity(tf.convert_to_tensor(value))
        return found

    return read


def _by_device(reduce: Callable[[list[tuple[Any, Any]]], list[tuple[Any, Any]]]):
    """``reduce`` of (gradient, variable) pairs, called once per variable device under that device.

    Called once on every pair, the default strategy's identity is one op that TensorFlow
    puts on the client, so across workers every gradient crossed to the client and back
    every step
    (docs/notes/2026-11-benchmark-passes.md#sixth-pass-gradients-stay-on-their-devices-data-arrives-whole-2026-11-25).
    """

    def reduce_by_device(grads_and_vars: Any) -> list[tuple[Any, Any]]:
        pairs = list(grads_and_vars)
        groups = _positions_by_device(pairs)
        reduced: list[Any] = [None] * len(pairs)
        for device, positions in groups.items():
            with tf.device(device):
                for i, pair in zip(positions, reduce([pairs[i] for i in positions]), strict=True):
                    reduced[i] = pair
        return reduced

    return reduce_by_device


def _positions_by_device(grads_and_vars: Sequence[tuple[Any, Any]]) -> dict[str, list[int]]:
    """The positions of the (gradient, variable) pairs, by their variable's device, in order."""
    groups: dict[str, list[int]] = {}
    for i, (_, variable) in enumerate(grads_and_vars):
        groups.setdefault(_device_of(variable), []).append(i)
    return groups


def _device_of_tensor(tensor: tf.Tensor) -> str:
    """The device that ``tensor`` is made on; for a value captured into a branch, the captured value's device."""
    while not tensor.device:
        outer = next((value for value, inner in getattr(tensor.graph, "captures", ()) if inner is tensor), None)
        if outer is None:
            return ""
        tensor = outer
    return tensor.device


@contextlib.contextmanager
def beside_inputs() -> Iterator[None]:
    """Place each op made inside that names no device on the device of its first placed input.

    Keras' optimizer wrappers work on the gradients without a device: a
    LossScaleOptimizer's finite check and unscaling ran on the client, so every
    gradient crossed there and back. An op with a device of its own keeps it.
    """

    def device(op: tf.Operation) -> str:
        if op.device:
            return op.device
        for tensor in op.inputs:
            found = _device_of_tensor(tensor)
            if found:
                return found
        return ""

    with tf.compat.v1.get_default_graph().device(device):
        yield
