"""PipelineModel: a keras.Model whose train, test and predict steps run the layers as a GPipe pipeline."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfpipe import balance as balance_lib
from tfpipe import checkpoint, devices as devices_lib, microbatch
from tfpipe.pipeline import Pipeline
from tfpipe.stage import Cell, check_no_shared_variables


def _layer_list(layers: Any) -> list[keras.layers.Layer]:
    if isinstance(layers, keras.Sequential):
        layers = layers.layers
    elif isinstance(layers, keras.layers.Layer):
        raise TypeError(
            f"layers must be a list of Keras layers or a keras.Sequential, got the single layer {layers.name!r}; "
            "wrap it in a list."
        )
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of Keras layers or a keras.Sequential, got {type(layers).__name__}.")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; give at least one Keras layer.")
    seen: dict[int, int] = {}
    for k, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"layers[{k}] is a {type(layer).__name__} ({layer!r:.60}), not a keras.layers.Layer; "
                "wrap functions in keras.layers.Lambda or a Layer subclass."
            )
        if id(layer) in seen:
            raise ValueError(
                f"Layer {layer.name!r} appears twice in layers (positions {seen[id(layer)]} and {k}); a layer object "
                "can sit in only one place of the pipeline. Create a separate layer for each position."
            )
        seen[id(layer)] = k
    return layers


def _check_micro_batches(num_micro_batches: Any) -> int:
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, (int, np.integer)):
        raise TypeError(f"num_micro_batches must be an integer >= 1, got {num_micro_batches!r}.")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}; use 1 to disable micro-batching.")
    return int(num_micro_batches)


def _is_shape(s: Any) -> bool:
    return isinstance(s, (tuple, list, tf.TensorShape)) and all(d is None or isinstance(d, (int, np.integer)) for d in s)


def _spec(input_shape: Any) -> Any:
    """Symbolic inputs from shapes (as Keras passes them to ``build``) or from tensors."""
    if isinstance(input_shape, (tf.Tensor, np.ndarray, keras.KerasTensor)):
        dtype = keras.backend.standardize_dtype(input_shape.dtype)
        return keras.KerasTensor((None,) + tuple(input_shape.shape[1:]), dtype=dtype)
    if _is_shape(input_shape):
        return keras.KerasTensor(tuple(input_shape))
    if isinstance(input_shape, dict):
        return {k: _spec(v) for k, v in input_shape.items()}
    return type(input_shape)(_spec(s) for s in input_shape)


def _device_of(variable: Any) -> str:
    return (variable.value if isinstance(variable, keras.Variable) else variable).device


def _place_on_variable_devices(optimizer: keras.optimizers.Optimizer) -> None:
    """Create each optimizer slot, and run each variable's update, on that variable's device.

    Keras asks tf.distribute to colocate them, which does nothing for slots built
    eagerly and leaves the update math unplaced in the graph.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or getattr(opt, "_tfpipe_placed", False):
            continue
        create, update = opt.add_variable_from_reference, opt.update_step

        def add_variable_from_reference(reference_variable, *args, _create=create, **kwargs):
            with tf.device(_device_of(reference_variable)):
                return _create(reference_variable, *args, **kwargs)

        def update_step(gradient, variable, learning_rate, _update=update):
            with tf.device(_device_of(variable)):
                return _update(gradient, variable, learning_rate)

        opt.add_variable_from_reference = add_variable_from_reference
        opt.update_step = update_step
        opt._tfpipe_placed = True


class PipelineModel(keras.Model):
    """A sequence of Keras layers cut into cells on devices and trained as a GPipe pipeline.

    Args:
      layers: a list of Keras layers, or a ``keras.Sequential``; each layer feeds the next.
      balance: layers per cell, summing to ``len(layers)``.
      num_partitions: instead of ``balance``, the number of cells (near-equal layer counts).
      devices: one device string per cell; default: all GPUs, else the logical CPU
        devices, else ``/CPU:0`` for every cell.
      num_micro_batches: M, the number of micro-batches each mini-batch is split into.
      remat: re-materialization: ``"always"``, ``"except_last"`` (recompute all but
        the last micro-batch, torchgpipe's default) or ``"never"``.
    """

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer] | keras.Sequential,
        *,
        balance: Optional[Sequence[int]] = None,
        num_partitions: Optional[int] = None,
        devices: Optional[Sequence[str]] = None,
        num_micro_batches: int = 1,
        remat: str = "except_last",
        **kwargs: Any,
    ):
        layer_list = _layer_list(layers)
        if (balance is None) == (num_partitions is None):
            raise ValueError(
                "Give exactly one of balance=[layers per cell] or num_partitions=K; got "
                f"balance={balance!r}, num_partitions={num_partitions!r}."
            )
        if balance is not None:
            cell_sizes = balance_lib.check(balance, len(layer_list))
        else:
            cell_sizes = balance_lib.uniform(len(layer_list), num_partitions)
        m = _check_micro_batches(num_micro_batches)
        remat = checkpoint.check_mode(remat)
        cell_devices = devices_lib.resolve(devices, len(cell_sizes))
        super().__init__(**kwargs)
        self.pipeline_layers = layer_list  # tracked first, so weights are ordered as in keras.Sequential
        starts = np.cumsum([0] + cell_sizes)
        cells = [Cell(k, layer_list[starts[k]:starts[k + 1]], d) for k, d in enumerate(cell_devices)]
        self._balance = list(cell_sizes)
        self._devices = list(cell_devices)
        self._pipeline = Pipeline(cells, m, remat)

    # Read-only configuration --------------------------------------------------------------
    @property
    def balance(self) -> list[int]:
        """Layers per cell."""
        return list(self._balance)

    @property
    def devices(self) -> list[str]:
        """The device of each cell."""
        return list(self._devices)

    @property
    def num_micro_batches(self) -> int:
        """M, the number of micro-batches per mini-batch."""
        return self._pipeline.num_micro_batches

    @property
    def remat(self) -> str:
        """The re-materialization mode."""
        return self._pipeline.remat

    @property
    def cells(self) -> list[Cell]:
        """The cells, in pipeline order."""
        return list(self._pipeline.cells)

    # Building and calling ------------------------------------------------------------------
    def build(self, input_shape: Any) -> None:
        """Build every cell on its device, feeding each the output spec of the previous one.

        ``input_shape`` is a shape, a nested structure of shapes, or a batch of tensors.
        """
        x = _spec(input_shape)
        for cell in self._pipeline.cells:
            x = cell.build(x)
        check_no_shared_variables(self._pipeline.cells)
        self.built = True

    def call(self, inputs: Any, training: Optional[bool] = False) -> Any:
        """Pipelined forward pass over micro-batches; in training mode state updates are merged and applied."""
        training = bool(training)
        sizes = microbatch.sizes(inputs, self.num_micro_batches, allow_empty=not training)
        parts = microbatch.split(inputs, sizes)
        result = self._pipeline.forward(parts, training=training, fractions=microbatch.fractions(sizes))
        self._assign(result.state_updates)
        with tf.device(self._devices[-1]):
            return microbatch.merge(result.outputs)

    @staticmethod
    def _assign(updates: Sequence[tuple[keras.Variable, tf.Tensor]]) -> None:
        if keras.src.backend.in_stateless_scope():
            return  # symbolic tracing: nothing to assign
        for variable, value in updates:
            variable.assign(value)

    # Keras training --------------------------------------------------------------------------
    def compile(self, *args: Any, jit_compile: Any = "auto", **kwargs: Any) -> None:
        """Keras ``compile``, with XLA kept off for the pipelined step (an XLA cluster ignores tf.device)."""
        if jit_compile is True:
            raise ValueError(
                "jit_compile=True would compile the whole pipeline into one XLA cluster on one device, ignoring "
                "the cells' devices; leave jit_compile unset (tfpipe turns it off)."
            )
        super().compile(*args, jit_compile=False, **kwargs)
        if self.optimizer is not None:
            _place_on_variable_devices(self.optimizer)

    def _loss_reduction(self) -> str:
        compiled = self._compile_loss
        if compiled is None:
            return "sum"
        reductions = {getattr(entry.loss, "reduction", "sum_over_batch_size") for entry in compiled._flat_losses}
        if len(reductions) > 1:
            raise ValueError(
                f"The compiled losses use different reductions {sorted(reductions)}; tfpipe weights micro-batch "
                "losses by one rule, so give all losses the same reduction."
            )
        return reductions.pop() if reductions else "sum"

    def train_step(self, data: Any) -> dict[str, Any]:
        """One optimizer step over a mini-batch, pipelined over micro-batches."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not self.built:
            self.build(x)
        sizes = microbatch.sizes(x, self.num_micro_batches)
        xs, ys, sws = (microbatch.split(s, sizes) for s in (x, y, sample_weight))
        weights: list[tf.Tensor] = []

        def loss_fn(j: int, y_pred: Any) -> tf.Tensor:
            if self._compile_loss is None:
                return tf.constant(0.0)
            value = self._compile_loss(ys[j], y_pred, sws[j])
            if not weights:  # the compiled loss is built by its first call
                weights.extend(microbatch.loss_weights(self._loss_reduction(), sizes, sws))
            return tf.cast(value, tf.float32) * weights[j]

        scale = self.optimizer.scale_loss(tf.constant(1.0)) if self.optimizer is not None else 1.0
        result = self._pipeline.train(xs, loss_fn, microbatch.fractions(sizes), loss_scale=scale)
        n = microbatch.batch_size(x)
        self._loss_tracker.update_state(
            keras.src.losses.loss.unscale_loss_for_distribution(result.loss), sample_weight=n)
        if result.variables:
            self.optimizer.apply_gradients(zip(result.gradients, result.variables))
        self._assign(result.state_updates)
        with tf.device(self._devices[-1]):
            y_pred = microbatch.merge(result.outputs)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def fit(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, *args: Any, **kwargs: Any):
        """Keras ``fit``; checks first that no training batch will be smaller than num_micro_batches."""
        self._check_training_batches(x, batch_size, kwargs.get("validation_split") or 0.0)
        return super().fit(x, y, batch_size, *args, **kwargs)

    def _check_training_batches(self, x: Any, batch_size: Optional[int], validation_split: float) -> None:
        m = self.num_micro_batches
        if batch_size is not None and batch_size < m:
            raise ValueError(
                f"batch_size={batch_size} is smaller than num_micro_batches={m}; every micro-batch needs a sample. "
                f"Use batch_size >= {m} or lower num_micro_batches."
            )
        leaves = [leaf for leaf in tf.nest.flatten(x) if isinstance(leaf, (np.ndarray, tf.Tensor))]
        if not leaves or len(leaves) != len(tf.nest.flatten(x)):
            return  # a dataset or generator: its batches are checked when the step is traced
        n = int(math.floor(int(leaves[0].shape[0]) * (1.0 - validation_split)))  # as Keras splits
        size = batch_size or 32
        last = n % size
        if 0 < last < m:
            raise ValueError(
                f"{n} samples in batches of {size} leave a last batch of {last}, smaller than num_micro_batches={m}. "
                f"Choose a batch_size that leaves no remainder or one of at least {m}, or drop the last {last} samples."
            )

    # Presentation -------------------------------------------------------------------------------
    def summary(self, line_length: Optional[int] = None, positions: Any = None,
                print_fn: Optional[Callable[[str], None]] = None, **kwargs: Any) -> None:
        """Print each cell with its device, layers and parameter count."""
        print_fn = print_fn or print
        width = line_length or 98
        rows = [("Cell", "Device", "Layers", "Params")]
        for cell in self._pipeline.cells:
            params = f"{cell.count_params():,}" if self.built else "unbuilt"
            rows.append((str(cell.index), cell.device, cell.describe(), params))
        cols = [4, 24, width - 4 - 24 - 14 - 6, 14]

        def fmt(row):
            return "  ".join(str(c)[:w].ljust(w) for c, w in zip(row, cols)).rstrip()

        print_fn(f'PipelineModel "{self.name}": {len(self._balance)} cells, balance={self._balance}, '
                 f"num_micro_batches={self.num_micro_batches}, remat={self.remat!r}")
        print_fn("=" * width)
        print_fn(fmt(rows[0]))
        print_fn("-" * width)
        for row in rows[1:]:
            print_fn(fmt(row))
        print_fn("=" * width)
        if self.built:
            trainable = sum(int(np.prod(v.shape)) for v in self.trainable_weights)
            total = sum(int(np.prod(v.shape)) for v in self.weights)
            print_fn(f"Total params: {total:,}")
            print_fn(f"Trainable params: {trainable:,}")
            print_fn(f"Non-trainable params: {total - trainable:,}")
