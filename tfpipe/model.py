"""PipelineModel: a keras.Model whose train, test and predict steps run the layers as a GPipe pipeline."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfpipe import balance as balance_lib
from tfpipe import checkpoint, cost as cost_lib, devices as devices_lib, microbatch, schedule
from tfpipe import messages, saving, state as state_lib
from tfpipe.sequence import layer_list
from tfpipe.pipeline import Pipeline
from tfpipe.stage import Cell, check_no_shared_variables


def _check_micro_batches(num_micro_batches: Any) -> int:
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, (int, np.integer)):
        raise TypeError(f"num_micro_batches must be an integer >= 1, got {num_micro_batches!r}.")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}; use 1 to disable micro-batching.")
    return int(num_micro_batches)


def _is_shape(s: Any) -> bool:
    return isinstance(s, (tuple, list, tf.TensorShape)) and all(d is None or isinstance(d, (int, np.integer)) for d in s)


def _spec(input_shape: Any, keep_batch: bool = False) -> Any:
    """Symbolic inputs from shapes (as Keras passes them to ``build``) or from tensors.

    A tensor's batch dimension becomes None unless ``keep_batch``.
    """
    if isinstance(input_shape, (tf.Tensor, np.ndarray, keras.KerasTensor)):
        dtype = keras.backend.standardize_dtype(input_shape.dtype)
        batch = input_shape.shape[0] if keep_batch else None
        return keras.KerasTensor((batch,) + tuple(input_shape.shape[1:]), dtype=dtype)
    if _is_shape(input_shape):
        return keras.KerasTensor(tuple(input_shape))
    if isinstance(input_shape, dict):
        return {k: _spec(v, keep_batch) for k, v in input_shape.items()}
    return type(input_shape)(_spec(s, keep_batch) for s in input_shape)


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


@keras.saving.register_keras_serializable(package="tfpipe")
class PipelineModel(keras.Model):
    """A sequence of Keras layers cut into cells on devices and trained as a GPipe pipeline.

    Args:
      layers: a list of Keras layers, or a ``keras.Sequential``; each layer feeds the next.
      balance: layers per cell, summing to ``len(layers)``.
      num_partitions: instead of ``balance``, the number of cells K; the layers are then
        split to minimize the most expensive cell under ``cost``.
      cost: per-layer cost for ``num_partitions`` (and shown by ``summary``): ``"flops"``
        (forward FLOPs, the default), ``"params"``, ``"time"`` (measured forward and
        backward), or a callable ``layer -> float``. String costs need the input shape,
        so the split is made when the model is built (first fit/evaluate/predict or
        ``build``), on copies of the layers, before any variable is created.
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
        cost: cost_lib.Cost = "flops",
        devices: Optional[Sequence[str]] = None,
        num_micro_batches: int = 1,
        remat: str = "except_last",
        **kwargs: Any,
    ):
        layers_ = layer_list(layers)
        if (balance is None) == (num_partitions is None):
            raise ValueError(
                "Give exactly one of balance=[layers per cell] or num_partitions=K; got "
                f"balance={balance!r}, num_partitions={num_partitions!r}."
            )
        cost = cost_lib.check_kind(cost)
        if cost == "memory":
            raise ValueError("cost='memory' needs a measurement outside the training graph; compute "
                             "balance=tfpipe.balance.by_memory(layers, K, sample) first and pass it as balance=.")
        cell_sizes = balance_lib.check(balance, len(layers_)) if balance is not None else None
        num_cells = len(cell_sizes) if cell_sizes else balance_lib.check_num_partitions(num_partitions, len(layers_))
        m = _check_micro_batches(num_micro_batches)
        remat = checkpoint.check_mode(remat)
        cell_devices = devices_lib.resolve(devices, num_cells)
        super().__init__(**kwargs)
        self.pipeline_layers = layers_  # tracked first, so weights are ordered as in keras.Sequential
        self._cost = cost
        self._num_cells, self._m, self._remat, self._devices = num_cells, m, remat, list(cell_devices)
        self._estimate: Optional[cost_lib.Estimate] = None
        self._inputs: Any = None  # symbolic inputs the model was built for, batch dimension included
        self._pipeline: Optional[Pipeline] = None
        if cell_sizes is None and num_cells in (1, len(layers_)):
            cell_sizes = balance_lib.uniform(len(layers_), num_cells)  # the only split there is
        elif cell_sizes is None and callable(cost):
            cell_sizes = self._split_by_cost(None)
        elif cell_sizes is None and isinstance(layers, keras.Sequential) and layers.built and layers.inputs:
            cell_sizes = self._split_by_cost(layers.inputs[0] if len(layers.inputs) == 1 else layers.inputs)
        if cell_sizes is not None:
            self._make_pipeline(cell_sizes)

    def _make_pipeline(self, cell_sizes: Sequence[int]) -> None:
        starts = np.cumsum([0] + list(cell_sizes))
        layers = self.pipeline_layers
        cells = [Cell(k, layers[starts[k]:starts[k + 1]], d) for k, d in enumerate(self._devices)]
        self._pipeline = Pipeline(cells, self._m, self._remat)

    def _split_by_cost(self, input_shape: Any) -> list[int]:
        """Estimate every layer's cost for inputs shaped ``input_shape``; return the optimal balance."""
        self._estimate = self._estimate_costs(input_shape)
        return balance_lib.partition(self._estimate.costs, self._num_cells,
                                     boundary_bytes=self._estimate.output_bytes or None)

    def _estimate_costs(self, input_shape: Any) -> cost_lib.Estimate:
        """Per-layer costs; string costs are measured on copies fed with a generated micro-batch."""
        sample = None
        if not callable(self._cost):
            sample = _estimation_sample(_spec(input_shape), _first_batch_dim(input_shape), self._m)
        return cost_lib.estimate(self.pipeline_layers, sample, self._cost)

    # Read-only configuration --------------------------------------------------------------
    @property
    def balance(self) -> Optional[list[int]]:
        """Layers per cell; ``None`` until built when ``num_partitions`` splits by an estimated cost."""
        return [len(cell.layers) for cell in self._pipeline.cells] if self._pipeline else None

    @property
    def devices(self) -> list[str]:
        """The device of each cell."""
        return list(self._devices)

    @property
    def num_micro_batches(self) -> int:
        """M, the number of micro-batches per mini-batch."""
        return self._m

    @property
    def remat(self) -> str:
        """The re-materialization mode."""
        return self._remat

    @property
    def cost(self) -> cost_lib.Cost:
        """The per-layer cost used to balance the cells and shown by ``summary``."""
        return self._cost

    @property
    def cells(self) -> list[Cell]:
        """The cells, in pipeline order (empty until the balance is known)."""
        return list(self._pipeline.cells) if self._pipeline else []

    # Building and calling ------------------------------------------------------------------
    def build(self, input_shape: Any) -> None:
        """Split by cost if still to do, then build every cell on its device, feeding each the previous one's output.

        ``input_shape`` is a shape, a nested structure of shapes, or a batch of tensors.
        """
        x = _spec(input_shape)
        self._inputs = _spec(input_shape, keep_batch=True)
        if self._pipeline is None:
            self._make_pipeline(self._split_by_cost(input_shape))
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
        with devices_lib.scope(self._devices[-1]):
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

        if self._num_cells * self.num_micro_batches > 1 and not tf.executing_eagerly():  # once per trace
            messages.say(messages.building_step(self.name, self._num_cells, self.num_micro_batches, self.remat))
        scale = self.optimizer.scale_loss(tf.constant(1.0)) if self.optimizer is not None else 1.0
        result = self._pipeline.train(xs, loss_fn, microbatch.fractions(sizes), loss_scale=scale)
        n = microbatch.batch_size(x)
        self._loss_tracker.update_state(
            keras.src.losses.loss.unscale_loss_for_distribution(result.loss), sample_weight=n)
        if result.variables:
            self.optimizer.apply_gradients(zip(result.gradients, result.variables))
        self._assign(result.state_updates)
        with devices_lib.scope(self._devices[-1]):
            y_pred = microbatch.merge(result.outputs)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def fit(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, *args: Any, **kwargs: Any):
        """Keras ``fit``; checks first that no training batch will be smaller than num_micro_batches."""
        self._check_training_batches(x, batch_size, kwargs.get("validation_split") or 0.0)
        self._build_state_before_tracing(x, y, kwargs.get("sample_weight"))
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any):
        """Keras ``evaluate``."""
        self._build_state_before_tracing(x, y, kwargs.get("sample_weight"))
        return super().evaluate(x, y, *args, **kwargs)

    def train_on_batch(self, x: Any = None, y: Any = None, sample_weight: Any = None, *args: Any, **kwargs: Any):
        """Keras ``train_on_batch``, with the variables created before the step is traced."""
        self._build_state_before_tracing(x, y, sample_weight)
        return super().train_on_batch(x, y, sample_weight, *args, **kwargs)

    def test_on_batch(self, x: Any = None, y: Any = None, sample_weight: Any = None, *args: Any, **kwargs: Any):
        """Keras ``test_on_batch``, with the variables created before the step is traced."""
        self._build_state_before_tracing(x, y, sample_weight)
        return super().test_on_batch(x, y, sample_weight, *args, **kwargs)

    def _build_state_before_tracing(self, x: Any, y: Any, sample_weight: Any) -> None:
        """Create the model's, metrics' and optimizer's variables before Keras traces a step.

        Without a distribution strategy Keras creates them while tracing, and a
        variable created in a trace makes TensorFlow trace the whole unrolled
        pipeline a second time (about a third of a first fit, measured).
        """
        if not self.compiled or not hasattr(self, "_symbolic_build"):
            return
        if isinstance(x, tf.data.Dataset):
            batch = x.element_spec
        elif all(isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in tf.nest.flatten((x, y, sample_weight))
                 if leaf is not None):
            batch = (x, y, sample_weight)
        else:
            return  # generators and PyDatasets: Keras builds while tracing, as usual
        symbolic = tf.nest.map_structure(
            lambda t: None if t is None else keras.KerasTensor((None,) + tuple(t.shape[1:]),
                                                               keras.backend.standardize_dtype(t.dtype)), batch)
        with self.distribute_strategy.scope():  # where Keras itself would create them
            if not self.built:  # ourselves: Keras would build inside a StatelessScope, which defers variable
                self.build(keras.utils.unpack_x_y_sample_weight(symbolic)[0])  # creation past our device scopes
            self._symbolic_build(data_batch=symbolic)

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

    # Saving and converting ------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """The layers, the split (balance once known, else K and the cost), devices, M and remat.

        A callable ``cost`` cannot be saved; its balance is, so a loaded model is split the same way.
        """
        config: dict[str, Any] = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
            "layers": [saving.layer_config(layer) for layer in self.pipeline_layers],
            "devices": self.devices,
            "num_micro_batches": self._m,
            "remat": self._remat,
            "cost": self._cost if isinstance(self._cost, str) else "flops",
        }
        if self.balance is not None:
            config["balance"] = self.balance
        else:
            config["num_partitions"] = self._num_cells
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "PipelineModel":
        """A model from ``get_config``; saved devices this machine lacks are replaced by its own (with a warning)."""
        config = dict(config)
        layers = [keras.saving.deserialize_keras_object(c, custom_objects=custom_objects) for c in config.pop("layers")]
        num_cells = len(config["balance"]) if config.get("balance") else config["num_partitions"]
        devices, why = devices_lib.restore(config.pop("devices"), num_cells)
        if why:
            warnings.warn(f"Loading PipelineModel {config.get('name')!r}: {why}.", stacklevel=2)
        return cls(layers, devices=devices, **config)

    def get_build_config(self) -> Optional[dict[str, Any]]:
        """The shapes and dtypes of the inputs the model was built for."""
        return {"inputs": saving.spec_config(self._inputs)} if self._inputs is not None else None

    def build_from_config(self, config: Optional[dict[str, Any]]) -> None:
        """Build for the inputs recorded by ``get_build_config`` (loading then finds every variable)."""
        if config and "inputs" in config:
            self.build(saving.spec_from_config(config["inputs"]))

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile as saved, creating the optimizer's variables on their devices so that its state loads."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def _seed_states(self) -> list[keras.Variable]:
        """The layers' seed-generator states, in layer order."""
        seen: dict[int, keras.Variable] = {}
        for layer in self.pipeline_layers:
            for v in layer.variables:
                if state_lib.is_seed_state(v):
                    seen.setdefault(id(v), v)
        return list(seen.values())

    @property
    def _tfpipe_seed_states(self) -> "saving.SeedStates":
        # Keras saves every KerasSaveable attribute of a model, so this one puts the seed
        # states in their own group (a keras.Sequential loading the file ignores it). Set
        # without Keras' attribute tracking, so that it is not one of the model's layers.
        if "_seed_saver" not in self.__dict__:
            object.__setattr__(self, "_seed_saver", saving.SeedStates(self._seed_states))
        return self.__dict__["_seed_saver"]

    @classmethod
    def from_sequential(cls, model: keras.Sequential, *, copy: bool = True, **kwargs: Any) -> "PipelineModel":
        """A PipelineModel of a Sequential's layers; ``kwargs`` as for the constructor.

        ``copy=True`` (default) clones the layers and copies their weights, so the new
        variables are created on the cells' devices and the Sequential is left alone.
        ``copy=False`` shares the layer objects, and with them the variables, wherever
        they already are.
        """
        if not isinstance(model, keras.Sequential):
            raise TypeError(f"from_sequential takes a keras.Sequential, got {type(model).__name__}; "
                            "for a list of layers use PipelineModel(layers, ...).")
        if not copy:
            return cls(model, **kwargs)
        layers = layer_list(model)
        pipelined = cls([saving.clone(layer) for layer in layers], **kwargs)
        if model.built and model.inputs:
            pipelined.build(model.inputs[0] if len(model.inputs) == 1 else model.inputs)
            saving.copy_weights(layers, pipelined.pipeline_layers)
        return pipelined

    def to_sequential(self, *, copy: bool = False) -> keras.Sequential:
        """The same layers as a plain ``keras.Sequential`` (for serving or export), built if this model is.

        ``copy=False`` (default) shares the layers and weights: training one trains the
        other. ``copy=True`` clones the layers and copies the current weights.
        """
        layers = [saving.clone(layer) for layer in self.pipeline_layers] if copy else list(self.pipeline_layers)
        if self._inputs is None:
            return keras.Sequential(layers, name=f"{self.name}_sequential")
        if not isinstance(self._inputs, keras.KerasTensor):
            raise ValueError("keras.Sequential takes a single input; this model was built for "
                             f"{tf.nest.map_structure(lambda t: tuple(t.shape), self._inputs)}.")
        spec = self._inputs
        sequential = keras.Sequential([keras.Input(shape=spec.shape[1:], dtype=spec.dtype), *layers],
                                      name=f"{self.name}_sequential")
        if copy:
            saving.copy_weights(self.pipeline_layers, layers)
        return sequential

    # Presentation -------------------------------------------------------------------------------
    def layer_costs(self) -> Optional[cost_lib.Estimate]:
        """Per-layer costs under ``cost``: those the split used, else estimated now (needs a built model)."""
        if self._estimate is None and (callable(self._cost) or self._inputs is not None):
            self._estimate = self._estimate_costs(self._inputs)
        return self._estimate

    def summary(self, line_length: Optional[int] = None, positions: Any = None,
                print_fn: Optional[Callable[[str], None]] = None, **kwargs: Any) -> None:
        """Print each cell: device, layers, parameters, estimated cost and its share, bytes handed on.

        Ends with the predicted pipeline efficiency: M / (M + K - 1) times mean / max cell cost.
        """
        print_fn = print_fn or print
        width = line_length or 120
        cost_name = self._cost if isinstance(self._cost, str) else "custom"
        try:
            estimate, problem = self.layer_costs(), None
        except ValueError as err:
            estimate, problem = None, str(err)
        balance = self.balance
        per_cell = balance_lib.cell_costs(estimate.costs, balance) if estimate and balance else None
        rows = [("Cell", "Device", "Layers", "Params", f"Cost ({cost_lib.UNITS.get(cost_name, 'cost')})", "Share",
                 "Out bytes/sample")]
        for cell in self.cells:
            k = cell.index
            params = f"{cell.count_params():,}" if self.built else "unbuilt"
            cost = share = out = "-"
            if per_cell is not None:
                total = sum(per_cell) or 1.0
                cost, share = _si(per_cell[k]), f"{100.0 * per_cell[k] / total:.1f}%"
                if estimate.output_bytes:
                    out = _si(estimate.output_bytes[sum(balance[:k + 1]) - 1]) + "B"
            rows.append((str(k), cell.device, cell.describe(), params, cost, share, out))
        fixed = [4, 24, 0, 12, 20, 6, 16]
        fixed[2] = max(12, width - sum(fixed) - 2 * (len(fixed) - 1))

        def fmt(row):
            return "  ".join(str(c)[:w].ljust(w) for c, w in zip(row, fixed)).rstrip()

        print_fn(f'PipelineModel "{self.name}": {self._num_cells} cells, balance={balance}, '
                 f"num_micro_batches={self.num_micro_batches}, remat={self.remat!r}, cost={cost_name!r}")
        print_fn("=" * width)
        print_fn(fmt(rows[0]))
        print_fn("-" * width)
        if len(rows) == 1:
            print_fn(f"(the balance is decided at build, from cost={cost_name!r})")
        for row in rows[1:]:
            print_fn(fmt(row))
        print_fn("=" * width)
        if self.built:
            trainable = sum(int(np.prod(v.shape)) for v in self.trainable_weights)
            total = sum(int(np.prod(v.shape)) for v in self.weights)
            print_fn(f"Total params: {total:,}")
            print_fn(f"Trainable params: {trainable:,}")
            print_fn(f"Non-trainable params: {total - trainable:,}")
        if per_cell is not None:
            bubble_free = 1.0 - schedule.bubble_fraction(self._num_cells, self._m)
            print_fn(f"Predicted pipeline efficiency: {100 * balance_lib.efficiency(per_cell, self._m):.1f}% "
                     f"= M/(M+K-1) {100 * bubble_free:.1f}% x mean/max cell cost "
                     f"{100 * balance_lib.evenness(per_cell):.1f}%")
        elif problem:
            print_fn(f"Costs not estimated: {problem}")


def _si(value: float) -> str:
    """A number with an SI prefix: 1234567 -> '1.23 M'."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g}"


ESTIMATION_BATCH = 8  # samples per estimation batch when the model's batch size is not known


def _first_batch_dim(input_shape: Any) -> Optional[int]:
    if _is_shape(input_shape):
        return input_shape[0] if len(input_shape) else None
    if hasattr(input_shape, "shape"):
        return input_shape.shape[0] if len(input_shape.shape) else None
    leaves = list(input_shape.values()) if isinstance(input_shape, dict) else list(input_shape)
    return _first_batch_dim(leaves[0]) if leaves else None


def _estimation_sample(spec: Any, batch: Optional[int], num_micro_batches: int) -> Any:
    """Generated data shaped like one micro-batch of a batch of ``batch`` inputs (or of ESTIMATION_BATCH)."""
    n = -(-int(batch) // num_micro_batches) if batch else ESTIMATION_BATCH
    rng = np.random.default_rng(0)

    def make(spec: keras.KerasTensor) -> np.ndarray:
        shape = (n,) + tuple(spec.shape[1:])
        if any(d is None for d in shape):
            raise ValueError(
                f"Estimating layer costs needs the input's full shape but one sample is {tuple(spec.shape[1:])}; "
                "build the model with a full shape, e.g. model.build((None, 128)), or pass balance=[...]."
            )
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if "float" in dtype:
            return rng.standard_normal(shape).astype(dtype if dtype != "bfloat16" else "float32")
        return np.zeros(shape, dtype if dtype != "string" else object)

    return tf.nest.map_structure(make, spec)
