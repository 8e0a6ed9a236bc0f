"""PipelineModel: a keras.Model whose train, test and predict steps run the layers as a GPipe pipeline.

One class, in the order a user meets it: made (the layers cut into cells on devices), its settings read back,
built, called, trained a step, compiled and run by Keras' loops, saved. It holds its parts rather than
inheriting them: the checked settings (``tfpipe.settings.Settings``), the pipeline that runs the cells
(``tfpipe.step``), what ``plan="auto"`` plans over until the first fit (``tfpipe.auto_plan``); saving and
conversion are functions of the model (``tfpipe.saving``).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat, auto_plan, messages, recovery, saving, updates
from tfpipe import balance as balance_lib
from tfpipe import cost as cost_lib
from tfpipe import settings as settings_lib
from tfpipe import training as training_lib
from tfpipe.distributed import devices as devices_lib
from tfpipe.distributed import faults, sendrecv
from tfpipe.keras_api import with_fewer_rewrites
from tfpipe.partition import deferred, functional, hub, repeats, specs
from tfpipe.partition import state as state_lib
from tfpipe.partition.cell import Cell, hang, tie
from tfpipe.partition.sequence import layer_list
from tfpipe.planning import budget as budget_lib
from tfpipe.planning import summary as summary_lib
from tfpipe.step import microbatch, replicated
from tfpipe.step.replicated import Replicated
from tfpipe.step.unrolled import Pipeline


def _settings(
    layers: Any, graph: Any, units: int, plan: Any, memory_budget: Any, given: dict[str, Any]
) -> tuple[settings_lib.Settings, bool, list[str] | None]:
    """The constructor's settings, checked: as ``given``, as a ``Plan`` sets them, or one placeholder cell until the
    first fit plans (``plan="auto"``); also whether it waits for that plan, and the devices it may plan over."""
    chosen = {name: given[name] for name in settings_lib.PLANNED_DEFAULTS}
    auto = auto_plan.check(plan, memory_budget, chosen)
    devices = given["devices"]
    plan_devices = list(devices) if auto and devices is not None else None
    settings = dict(given)
    if auto:  # one placeholder cell until the first fit plans
        settings.update(balance=[units], devices=None if devices is None else [devices_lib.check(devices[0])])
        plan = None
    if plan is not None:
        planned = settings_lib.from_plan(plan, units, settings)
        settings.update({k: planned[k] for k in ("balance", "devices", "num_micro_batches", "remat", "schedule")})
    checked = settings_lib.check(
        layers, graph, units, settings["balance"], settings["num_partitions"], settings["cost"], settings["devices"],
        settings["num_micro_batches"], settings["remat"], settings["unroll"], settings["schedule"],
    )  # fmt: skip
    return checked, auto, plan_devices


_Model = TypeVar("_Model", bound="PipelineModel")  # the class a classmethod is called on


@keras.saving.register_keras_serializable(package="tfpipe")
class PipelineModel(keras.Model):
    """A sequence of Keras layers cut into cells on devices and trained as a GPipe pipeline.

    Args:
      layers: a list of Keras layers or a ``keras.Sequential`` (each layer feeds the next), or a
        Functional ``keras.Model``: its nodes (every layer call and ``keras.ops`` call, nested
        models flattened) in Keras' execution order are cut into cells, and every tensor that
        crosses a cut goes straight from the cell that makes it to each cell that reads it.
      balance: layers per cell, summing to ``len(layers)``; for a Functional model, nodes per cell.
      num_partitions: instead of ``balance``, the number of cells K; the layers are then
        split to minimize the most expensive cell under ``cost``.
      cost: per-layer cost for ``num_partitions`` (and shown by ``summary``): ``"flops"``
        (forward FLOPs, the default), ``"params"``, ``"time"`` (measured forward and
        backward), or a callable ``layer -> float``. String costs need the input shape,
        so the split is made when the model is built (first fit/evaluate/predict or
        ``build``), on copies of the layers, before any variable is created.
      devices: one device string per cell; default: all GPUs, else the logical CPU
        devices, else ``/CPU:0`` for every cell. Or R lists of one device per cell: R
        data-parallel replicas of the pipeline (``tfpipe.step.replicated``), each taking 1/R of every
        batch in M micro-batches; the variables live once, on replica 0's devices, and one
        optimizer step applies the gradients summed over all replicas.
      num_micro_batches: M, the number of micro-batches each mini-batch is split into.
      remat: re-materialization: ``"always"``, ``"except_last"`` (recompute all but
        the last micro-batch, torchgpipe's default) or ``"never"``.
      unroll: how a step's graph holds the pipeline, as Keras RNN's ``unroll`` chooses
        between an unrolled graph and a symbolic loop. ``True`` (default): every task of
        the K x M schedule is its own call, chained per device in the schedule's order,
        with activations kept where ``remat`` says; the fastest steps, but the first one
        grows with K x M. ``False``: two loops over GPipe's M + K - 1 clock cycles
        (forward, backward), so the graph and the first step do not grow with M; every
        micro-batch is recomputed in the backward pass (not with ``remat="never"``), and
        later steps are slower on CPUs (docs/benchmarks.md#the-first-step).
      schedule: the order of each cell's forward and backward tasks (``tfpipe.schedule``).
        ``"gpipe"`` (default): all forwards, then all backwards; a cell holds the activations
        of all M micro-batches. ``"1f1b"``: after min(K-i, M) forwards, cell i alternates a
        backward and a forward, so it holds at most K-i micro-batches; the same bubble and
        the same synchronous step (the weights agree to float rounding). ``"zero_bubble"``
        (ZB-H1): 1F1B with each backward split into B (the input gradient, which the previous
        cell waits for) and W (the weight gradient, run later, in what would be idle time);
        at most K micro-batches held, about a third of 1F1B's bubble. ``"gpipe_batched_w"``
        (with ``remat="never"``): GPipe with each backward split the same way, and each
        cell's weight gradients computed once, after its last B, over all M micro-batches
        concatenated: one large product instead of M small ones, where every op of the
        cell's weight gradient works example by example or sums over examples (else, with a
        warning, once per micro-batch); it holds each micro-batch's output gradients too
        until then. Five schedules put v = K/D of the K cells on each of D devices (``devices``
        then lists the D devices), so the bubble shrinks about v-fold: ``"interleaved_1f1b"``
        (Megatron-LM's virtual stages, cell c on device c mod D), ``"looped_bfs"`` (the same
        cells, GPipe's order a cell at a time), ``"interleaved_zero_bubble"``, ``"zbv"``
        (cells d and 2D-1-d on device d, so the loss is on the first device; 1F1B's memory)
        and ``"dualpipev"`` (DualPipeV, the same V; M >= 2D - 1).
        Or a schedule written as data: a list per device of its tasks in order ("F(0,1)",
        "B(0,1)", "W(0,1)", or torch's "0F1"; ``tfpipe.schedule.written``), checked for
        completeness and deadlock here. Non-GPipe schedules need ``unroll=True``.
      plan: a ``tfpipe.plan(...)`` result: its balance, devices (with replicas), M, remat and
        schedule, in place of those arguments (docs/guide/planning.md). Or ``"auto"``: the
        first ``fit`` plans on its first batch, over ``devices`` (default: the planner's)
        under ``memory_budget``, before its first step; ``model.plan`` is the plan then.
      memory_budget: the bytes each device may hold: one value for all (an int or a string such as "12GiB"), one
        per cell, or a dict by device. With ``plan="auto"``, the planner keeps every device's predicted peak
        within it. Otherwise it is checked before any weight is made and again before training: a cell whose
        weights, gradients and optimizer slots alone exceed its device's budget is refused with a ValueError
        naming the device, what the cell needs, and the smallest K or budget that holds it
        (``tfpipe.planning.budget``).
      repeated_layers: ``"inline"`` (default): a cell's traced functions hold every layer's ops. ``"call"``:
        each run of alike consecutive layers (a Transformer's blocks) is traced once, as a function of its
        weights, and called once per layer, so the graph, the memory the training process and workers keep
        for it, and the first step's tracing stop growing with depth; a function call per block and task
        (``tfpipe.partition.repeats``). For deep models.
    """

    plan: Any = None  # with plan="auto": the tfpipe.Plan the first fit made

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer] | keras.Sequential,
        *,
        balance: Sequence[int] | None = None,
        num_partitions: int | None = None,
        cost: cost_lib.Cost = "flops",
        devices: Sequence[str] | Sequence[Sequence[str]] | None = None,
        num_micro_batches: int = 1,
        remat: str = "except_last",
        unroll: bool = True,
        schedule: str | Sequence[Sequence[str]] = "gpipe",
        plan: Any = None,
        memory_budget: Any = None,
        repeated_layers: str = "inline",
        **kwargs: Any,
    ):
        repeats.check(repeated_layers)
        graph = functional.Graph(layers) if functional.is_functional(layers) else None
        layers_ = graph.layers if graph is not None else layer_list(layers)
        units = len(graph.nodes) if graph is not None else len(layers_)
        given = dict(balance=balance, num_partitions=num_partitions, devices=devices, cost=cost, unroll=unroll)
        given.update(num_micro_batches=num_micro_batches, remat=remat, schedule=schedule)
        settings, auto, plan_devices = _settings(layers, graph, units, plan, memory_budget, given)
        super().__init__(**kwargs)
        # XLA would compile the pipeline for one device (see compile); Keras' "auto" means XLA wherever a GPU
        # is, for an uncompiled model's predict too
        self.jit_compile = False
        self.pipeline_layers = layers_  # tracked first, so weights are ordered as in keras.Sequential
        self._graph = graph  # a Functional model's nodes, or None for a layer sequence
        self._settings = settings
        self._balance: list[int] = []  # the cut made: layers (or nodes) per cell, once known
        # until the first fit plans; its probes built as this model will train
        self._auto = auto_plan.Pending(memory_budget, plan_devices, repeated_layers) if auto else None
        self._memory_budget = None if auto else memory_budget
        self._estimate: cost_lib.Estimate | None = None
        self._inputs: Any = None  # symbolic inputs the model was built for, batch dimension included
        self._built_spec: tuple[Any, Any] | None = None  # (inputs, outputs) as build ran the layers on them
        self._pipeline: Pipeline | Replicated | None = None
        self._cells_jit = False  # compile(jit_compile=True): XLA per cell
        self._repeated_layers = repeated_layers
        self._skips = recovery.Skips()  # batches a resumed fit draws and does not train on (tfpipe.recovery)
        cell_sizes = settings.cell_sizes if settings.cell_sizes is not None else self._split_early(layers, units)
        if cell_sizes is not None:
            self._make_pipeline(cell_sizes)
        if memory_budget is not None and not auto:
            budget_lib.budgets(memory_budget, self._devices)  # a bad budget is an error now
        if graph is not None:  # its layers are built: so is this model, for the graph's inputs
            self.check_memory_budget(None)  # before a deferred model's weights are made
            self._move_variables(seeds_only=False)
            hub.forget_traced(graph.model)
            self.build(graph.model.input)
        if isinstance(layers, keras.Model):  # the user's model keeps these layers, and so their devices
            saving.keep_off_xla(layers, self._devices)

    # The settings, read back -------------------------------------------------------------------------
    @property
    def balance(self) -> list[int] | None:
        """Layers per cell; ``None`` until built when ``num_partitions`` splits by an estimated cost."""
        return list(self._balance) if self._pipeline else None

    @property
    def devices(self) -> list[str] | list[list[str]]:
        """The device of each cell; with replicas, one such list per replica."""
        if self.num_replicas > 1:
            return [list(row) for row in self._settings.replica_devices]
        return self._devices

    @property
    def _devices(self) -> list[str]:
        """Replica 0's device of each cell: its cells own the variables."""
        return list(self._settings.replica_devices[0])

    @property
    def num_replicas(self) -> int:
        """R, the number of data-parallel replicas of the pipeline (1 unless ``devices`` gives R lists)."""
        return len(self._settings.replica_devices)

    @property
    def num_partitions(self) -> int:
        """K, the number of cells."""
        return self._settings.num_cells

    @property
    def num_devices(self) -> int:
        """The devices the cells are laid over: K, or K/v where the schedule puts v cells on each device."""
        return self._settings.num_devices

    @property
    def num_micro_batches(self) -> int:
        """M, the number of micro-batches per mini-batch."""
        return self._settings.num_micro_batches

    @property
    def remat(self) -> str:
        """The re-materialization mode."""
        return self._settings.remat

    @property
    def unroll(self) -> bool:
        """Whether each step is an unrolled graph of tasks (True) or two loops over clock cycles (False)."""
        return self._settings.unroll

    @property
    def schedule(self) -> str:
        """The order of the tasks: one of ``tfpipe.schedule.ALL_SCHEDULES`` (``"gpipe"`` by default), or a written
        schedule's text (``tfpipe.schedule.written``)."""
        return self._settings.schedule

    @property
    def unrolled(self) -> bool | None:
        """How the step is built now (loops fall back to unrolled if a cell cannot be traced); None before a split."""
        return self._pipeline.unroll if self._pipeline else None

    @property
    def cost(self) -> cost_lib.Cost:
        """The per-layer cost used to balance the cells and shown by ``summary``."""
        return self._settings.cost

    @property
    def output_names(self) -> list[str] | None:
        """The Functional model's output names, which ``compile`` matches dict losses and metrics to (else None)."""
        return list(self._graph.model.output_names) if self._graph is not None else None

    @property
    def cells(self) -> list[Cell]:
        """The cells, in pipeline order (empty until the balance is known)."""
        return list(self._pipeline.cells) if self._pipeline else []

    # Cutting the layers into cells ---------------------------------------------------------------------
    def _split_early(self, layers: Any, units: int) -> list[int] | None:
        """The balance for ``num_partitions`` where it can be found before ``build``; else None (build splits)."""
        if self.num_partitions in (1, units):
            return balance_lib.uniform(units, self.num_partitions)  # the only split there is
        if callable(self.cost) or self._graph is not None:  # a callable needs no shapes; the graph knows them
            return self._split_by_cost(None)
        if isinstance(layers, keras.Model) and layers.built and layers.inputs:
            return self._split_by_cost(layers.inputs[0] if len(layers.inputs) == 1 else layers.inputs)
        return None

    def _make_pipeline(self, cell_sizes: Sequence[int]) -> None:
        self._balance = [int(n) for n in cell_sizes]
        if self._graph is not None:
            segments = self._graph.cut(cell_sizes)
            cells = [Cell(k, s.layers, d, program=s) for k, (s, d) in enumerate(zip(segments, self._devices))]
            routes = self._graph.routes(segments)
        else:
            starts = np.cumsum([0] + list(cell_sizes))
            layers = self.pipeline_layers
            cells = [Cell(k, layers[starts[k] : starts[k + 1]], d) for k, d in enumerate(self._devices)]
            routes = None
        pipelines = [
            Pipeline(
                cells if r == 0 else replicated.replica_cells(cells, devices),
                self.num_micro_batches,
                self.remat,
                self.unroll,
                routes,
                self.schedule,
                self.num_devices,
            )
            for r, devices in enumerate(self._settings.replica_devices)
        ]
        self._pipeline = pipelines[0] if len(pipelines) == 1 else Replicated(pipelines)
        self._apply_cell_options()

    def _remake_pipeline(self) -> None:
        """A new pipeline over the same layers and new step functions: the workers were replaced (``recovery``)."""
        self._make_pipeline(self._balance)
        assert self._pipeline is not None  # just made
        tie(self._pipeline.cells)
        self.train_function = self.test_function = self.predict_function = None
        if self._graph is not None:  # the user's model (a keras_hub task's generate) traced the old variables too
            hub.forget_traced(self._graph.model)

    def _move_variables(self, seeds_only: bool) -> None:
        """Make or move variables to their cells' devices, as a layer list's weights are made there.

        A Functional model's weights were made where it was built (``seeds_only=False``); a random layer's
        seed state is made with the layer, on the default device, and a cell would read and write it
        across devices every step. Weights built under ``tfpipe.deferred_weights()`` have no value yet: each
        is made on its cell's device, then their blocks' recorded loads run. Under a distribution strategy,
        which owns placement, nothing moves and deferred weights are made where the strategy puts them.
        """
        default = _compat.is_default_strategy(tf.distribute.get_strategy())
        placed: set[int] = set()  # a layer called in several cells (tied weights) stays with the first
        blocks: list[deferred.Record] = []
        assert self._pipeline is not None  # made before variables move (__init__, build, recovery)
        for cell in self._pipeline.cells:
            device = cell.device if default and devices_lib.tpu_core(cell.device) is None else None
            for layer in cell.layers:
                for variable in layer.variables:
                    if id(variable) in placed:
                        continue
                    placed.add(id(variable))
                    if deferred.waiting(variable):
                        if self._auto is None:  # plan="auto": made once the plan has cut the model
                            blocks.append(deferred.place(variable, device))
                    elif (
                        device is not None
                        and state_lib.is_seed_state(variable) == seeds_only
                        and not devices_lib.matches(variable.value.device, device)
                    ):
                        _compat.move_variable(variable, device)
        deferred.finish(blocks)

    # Planned by the first fit (plan="auto") ---------------------------------------------------------
    def _plan_first(self, x: Any, batch_size: int | None) -> None:
        """If still to plan: plan on fit's first batch of ``x`` and cut the layers as the plan says."""
        if self._auto is None:
            return
        optimizer = self.optimizer if isinstance(self.optimizer, keras.optimizers.Optimizer) else "adam"
        planned = self._graph.model if self._graph is not None else self.pipeline_layers
        self._follow(auto_plan.plan_on(self.name, planned, self._auto, x, batch_size, optimizer))

    def _follow(self, plan: Any) -> None:
        """Take the plan's settings and cut; variables already made move to their new cells' devices."""
        graph = self._graph
        units = len(graph.nodes) if graph is not None else len(self.pipeline_layers)
        layers = graph.model if graph is not None else self.pipeline_layers
        given = dict(settings_lib.PLANNED_DEFAULTS, devices=None, cost=self.cost, unroll=self.unroll)
        self._settings = _settings(layers, graph, units, plan, None, given)[0]  # as plan=<the plan> would set them
        assert self._settings.cell_sizes is not None  # a plan gives the balance
        self._make_pipeline(self._settings.cell_sizes)
        self.plan, self._auto = plan, None
        if self.built:  # a deferred model's weights are made now, on the planned cells' devices
            self._move_variables(seeds_only=False)

    def check_memory_budget(self, optimizer: Any = "model") -> None:
        """Refuse a cut whose cells' state (weights, gradients, ``optimizer``'s slots) exceeds ``memory_budget``.

        ``optimizer``: the compiled one by default; None counts no slots. Does nothing without a budget, or
        before the model is built (a layer list's weights are made at its first fit, which checks then).
        """
        if self._memory_budget is None or self._pipeline is None:
            return
        cells = self._pipeline.cells
        if any(not layer.built for cell in cells for layer in cell.layers):
            return
        optimizer = self.optimizer if optimizer == "model" else optimizer
        name, slots = budget_lib.slots_of(optimizer)
        states = [
            budget_lib.cell_state(cell.device, cell.weights, cell.trainable_variables, cell.borrowed, slots)
            for cell in cells
        ]
        units = (
            [getattr(node.operation, "weights", []) for node in self._graph.nodes]
            if self._graph is not None
            else [layer.weights for layer in self.pipeline_layers]
        )
        limits = budget_lib.budgets(self._memory_budget, self._devices)
        states, firsts = budget_lib.per_device(states)  # cells that share a device hold their state together
        budget_lib.check(states, [limits[i] for i in firsts], budget_lib.unit_states(units, slots), name)

    def _split_by_cost(self, input_shape: Any) -> list[int]:
        """Estimate every layer's cost for inputs shaped ``input_shape``; return the optimal balance."""
        self._estimate = self._estimate_costs(input_shape)
        return balance_lib.partition(
            self._estimate.costs, self.num_partitions, boundary_bytes=self._estimate.output_bytes or None
        )

    def _estimate_costs(self, input_shape: Any) -> cost_lib.Estimate:
        """Per-layer costs; string costs are measured on copies fed with a generated micro-batch."""
        if self._graph is not None:
            batch = specs.first_batch_dim(input_shape) if input_shape is not None else None
            return cost_lib.estimate_graph(self._graph, self.cost, batch, self.num_micro_batches)
        sample = None
        if not callable(self.cost):
            m = self.num_micro_batches
            sample = specs.estimation_sample(specs.symbolic(input_shape), specs.first_batch_dim(input_shape), m)
        # Counted costs need only the copies' shapes: their weights are made where the first cell will live, a worker's
        # CPU or GPU, not in this process (a copy of a 201M-parameter block took its peak from 1.15 to 2.5 GB)
        first = self._devices[0]
        on_worker = sendrecv.any_remote([first]) and tf.DeviceSpec.from_string(first).device_type in ("CPU", "GPU")
        device = first if self.cost in ("flops", "params") and on_worker else None
        estimate = cost_lib.estimate(self.pipeline_layers, sample, self.cost, device=device)
        if device is not None:  # the copies, held in reference cycles, leave that worker before the cells are built
            gc.collect()
        return estimate

    # Building and calling ------------------------------------------------------------------
    def build(self, input_shape: Any) -> None:
        """Split by cost if still to do, then build every cell on its device, feeding each the previous one's output.

        ``input_shape`` is a shape, a nested structure of shapes, or a batch of tensors.
        """
        x = specs.symbolic(input_shape)
        self._inputs = specs.symbolic(input_shape, keep_batch=True)
        if self._pipeline is None:
            self._make_pipeline(self._split_by_cost(input_shape))
        assert self._pipeline is not None  # made now if not before
        given = x
        for cell in self._pipeline.cells if self._graph is None else ():  # a graph's layers are built
            x = cell.build(x)
        self._built_spec = (given, x) if self._graph is None else None
        tie(self._pipeline.cells)  # so that summary() counts tied weights once
        self._move_variables(seeds_only=True)
        self.built = True

    def call(self, inputs: Any, training: bool | None = False) -> Any:
        """Pipelined forward pass over micro-batches; in training mode state updates are merged and applied."""
        training = bool(training)
        if not training and _compat.in_stateless_scope():
            # Keras' symbolic build (compute_output_spec) needs only the outputs' spec, and in inference the
            # layers give the same values unpipelined: run them once instead of tracing K x M tasks.
            if self._graph is not None:
                return self._graph.model(inputs, training=False)
            known = self._built_output_spec(inputs)
            if known is not None:  # build already ran every layer on inputs like these
                return known
            for layer in self.pipeline_layers:
                inputs = layer(inputs, training=False)
            return inputs
        assert self._pipeline is not None  # made by build, which Keras runs before call
        sizes = microbatch.sizes(inputs, self._pipeline.micro_batches_per_step, allow_empty=not training)
        parts = microbatch.split(inputs, sizes)
        result = self._pipeline.forward(parts, training=training, fractions=microbatch.fractions(sizes))
        if result.added_loss is not None:  # the layers' add_loss terms, which Keras' evaluate adds to the loss
            self.add_loss(result.added_loss)
        self._assign(result.state_updates)
        with devices_lib.scope(self._devices[-1]):
            return hang(microbatch.merge(result.outputs))

    def _built_output_spec(self, inputs: Any) -> Any:
        """The outputs' spec that ``build`` found, for inputs shaped as it was built for (any batch size); else None.

        Keras' symbolic build (before the first step) asks for it: running the layers again
        would lengthen the first step
        (docs/notes/2026-11-benchmark-passes.md#figures-moved-out-of-docstrings-2026-11-26).
        """
        if self._built_spec is None:
            return None
        given, found = self._built_spec
        try:
            tf.nest.assert_same_structure(inputs, given)
        except (ValueError, TypeError):
            return None
        pairs = list(zip(tf.nest.flatten(inputs), tf.nest.flatten(given)))
        for a, b in pairs:
            if not hasattr(a, "shape") or tuple(a.shape)[1:] != tuple(b.shape)[1:]:
                return None
            if keras.backend.standardize_dtype(a.dtype) != b.dtype:
                return None
        batch = tuple(pairs[0][0].shape)[0] if pairs else None
        return tf.nest.map_structure(
            lambda t: keras.KerasTensor((batch,) + tuple(t.shape)[1:], dtype=t.dtype, sparse=t.sparse), found
        )

    @staticmethod
    def _assign(updates: Sequence[tuple[keras.Variable, tf.Tensor]]) -> None:
        if _compat.in_stateless_scope():
            return  # symbolic tracing: nothing to assign
        changed: set[int] = set()
        for variable, value in updates:
            if id(variable) in changed:  # a layer with state, called in two cells (weights alone may be tied)
                raise ValueError(
                    f"Variable {variable.path!r} is state that two cells change in training (BatchNormalization "
                    "statistics or a random layer's seed); tfpipe merges state across micro-batches per cell. "
                    "Change balance so that the layer's calls fall in one cell, or use a separate layer per call."
                )
            changed.add(id(variable))
            variable.assign(value)

    # The training step ---------------------------------------------------------------------------
    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, training: bool = True
    ) -> Any:
        """Keras' loss hook. In a pipelined train step it is called once per micro-batch and returns
        the compiled loss alone: the pipeline adds each cell's ``add_loss`` and regularization terms.

        Override it as in Keras; in training the result is taken as the micro-batch's mean loss
        (Keras' default reduction) and weighted by the micro-batch's share of the samples.
        """
        if not training:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        compiled = _compat.compiled_loss(self)
        return compiled(y, y_pred, sample_weight) if compiled is not None else tf.constant(0.0)

    def train_step(self, data: Any) -> dict[str, Any]:
        """One optimizer step over a mini-batch, pipelined over micro-batches."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not self.built:
            self.build(x)
        assert self._pipeline is not None  # made by build
        sizes = microbatch.sizes(x, self._pipeline.micro_batches_per_step)  # R x M with replicas
        xs, ys, sws = self._split(sizes, x, y, sample_weight)
        loss_fn = training_lib.MicroBatchLoss(self, PipelineModel.compute_loss, xs, ys, sws, sizes)
        tasks = self.num_partitions * self._pipeline.micro_batches_per_step
        if tasks > 1 and not tf.executing_eagerly():  # once per trace
            loops = not self._pipeline.unroll
            messages.say(
                messages.building_step(
                    self.name, self.num_partitions, self.num_micro_batches, self.remat, loops, self.num_replicas
                )
            )
        scale = self.optimizer.scale_loss(tf.constant(1.0)) if self.optimizer is not None else 1.0
        result = self._pipeline.train(xs, loss_fn, microbatch.fractions(sizes), loss_scale=scale)
        _compat.loss_tracker(self).update_state(
            training_lib.unscale_for_distribution(result.loss), sample_weight=microbatch.batch_size(x)
        )
        if result.variables:
            training_lib.apply_on_variable_devices(self.optimizer, result.gradients, result.variables)
        self._assign(result.state_updates)
        with devices_lib.scope(self._devices[-1]):
            y_pred = hang(microbatch.merge(result.outputs))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _split(self, sizes: list[Any], x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """The micro-batches of x (made on the first cell's device) and of y and sample_weight (on the last's).

        Split on the client, each micro-batch would be its own transfer there, and a
        worker's one thread would wait on 2M receives at the start of every step.
        """
        if self.num_replicas > 1:  # each replica's share goes to its own devices
            return microbatch.split(x, sizes), microbatch.split(y, sizes), microbatch.split(sample_weight, sizes)
        with devices_lib.scope(self._devices[0]):
            xs = microbatch.split(x, sizes)
        with devices_lib.scope(self._devices[-1]):
            return xs, microbatch.split(y, sizes), microbatch.split(sample_weight, sizes)

    # Compiling -----------------------------------------------------------------------------------
    def compile(self, *args: Any, jit_compile: Any = "auto", **kwargs: Any) -> None:
        """Keras ``compile``; ``jit_compile=True`` compiles each cell's tasks by XLA on the cell's device.

        The step itself is never one XLA cluster, which would ignore the cells' devices. ``"auto"`` (Keras'
        default, which means XLA wherever a GPU is) and False leave the cells to TensorFlow's executor.
        """
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}.")
        if jit_compile is True and kwargs.get("run_eagerly"):
            warnings.warn("run_eagerly=True runs the cells' layers eagerly: jit_compile=True is ignored.", stacklevel=2)
        super().compile(*args, jit_compile=False, **kwargs)
        self._cells_jit = jit_compile is True and not self.run_eagerly
        self._apply_cell_options()
        if hasattr(self, "_compile_config"):  # saved and loaded with the user's choice, not the outer step's
            self._compile_config.config["jit_compile"] = jit_compile
        if self.optimizer is not None:
            training_lib.place_on_variable_devices(self.optimizer)
            updates.share(self.optimizer, self._repeated_layers == "call")
            training_lib.check_slices_finite(self.optimizer)

    @property
    def cells_jit_compile(self) -> bool:
        """Whether each cell's traced tasks are compiled by XLA on its device (``compile(jit_compile=True)``)."""
        return self._cells_jit

    @property
    def repeated_layers(self) -> str:
        """How a cell traces runs of alike layers: ``"inline"``, or ``"call"`` (``tfpipe.partition.repeats``)."""
        return self._repeated_layers

    def _apply_cell_options(self) -> None:
        for pipeline in getattr(self._pipeline, "pipelines", [self._pipeline] if self._pipeline else []):
            for cell in pipeline.cells:
                cell.jit_compile = self._cells_jit
                cell.repeated_layers = self._repeated_layers

    # The step functions Keras' loops call --------------------------------------------------------
    def make_train_function(self, force: bool = False) -> Callable:
        """Keras' train function; a step that calls its cells runs with fewer Grappler passes.

        See ``with_fewer_rewrites``.
        """
        return self._made("train_function", super().make_train_function, force)

    def make_test_function(self, force: bool = False) -> Callable:
        """Keras' test function, as ``make_train_function`` makes it."""
        return self._made("test_function", super().make_test_function, force)

    def make_predict_function(self, force: bool = False) -> Callable:
        """Keras' predict function, as ``make_train_function`` makes it."""
        return self._made("predict_function", super().make_predict_function, force)

    def _made(self, name: str, make: Callable[[bool], Any], force: bool) -> Callable:
        if getattr(self, name) is None or force:
            make(force)
            made = with_fewer_rewrites(getattr(self, name), self._calls_cells)
            setattr(self, name, recovery.skipping(made, self, self._skips) if name == "train_function" else made)
        return getattr(self, name)

    def _calls_cells(self) -> bool:
        """Whether the step is unrolled with the cells called as functions TensorFlow does not inline."""
        pipeline = self._pipeline
        cells = pipeline.cells if pipeline is not None and pipeline.unroll else []
        return any(cell.noinline and cell.traceable for cell in cells)  # not on TPU cores: cells run inline there

    # Keras' loops ----------------------------------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, *args: Any, **kwargs: Any):
        """Keras ``fit``; checks first that no training batch will be smaller than num_micro_batches.

        A keras_hub task's ``preprocessor`` is applied to the data first, as the task's own ``fit`` does.
        With a ``keras.callbacks.BackupAndRestore`` callback, SIGTERM writes a backup and ends the process, and
        a dead worker of ``LocalCluster(max_restarts=N)`` or ``connect(max_restarts=N)`` is recovered from
        within this call (``tfpipe.recovery``).
        """
        if self.preprocess is not None:
            x, kwargs = hub.for_fit(self.preprocess, x, y, batch_size, kwargs)
            y = batch_size = None
        self._plan_first(x, batch_size)  # plan="auto": planned on the first batch (tfpipe.auto_plan)
        split = kwargs.get("validation_split") or 0.0
        training_lib.check_batches(x, batch_size, split, self.num_micro_batches, self.num_replicas)
        keras_fit = super().fit
        positional = len(args) > 2  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
        given = args[2] if positional else kwargs.get("callbacks")

        def run(callbacks: list) -> Any:
            self._before_tracing(x, y, kwargs.get("sample_weight"))
            self.check_memory_budget()
            call_args = (*args[:2], callbacks, *args[3:]) if positional else args
            call_kwargs = kwargs if positional else dict(kwargs, callbacks=callbacks)
            with faults.reporting(), training_lib.short_batch_errors():  # named workers, short messages
                return keras_fit(x, y, batch_size, *call_args, **call_kwargs)

        return recovery.fit(self, run, given, self._skips, self._remake_pipeline)

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, *args: Any, **kwargs: Any):
        """Keras ``evaluate``, after the task's ``preprocessor`` as in ``fit``."""
        if self.preprocess is not None and not kwargs.get("_use_cached_eval_dataset"):  # fit's validation: done
            x, kwargs = hub.for_evaluate(self.preprocess, x, y, batch_size, kwargs)
            y = batch_size = None
        self._before_tracing(x, y, kwargs.get("sample_weight"))
        with faults.reporting():
            return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x: Any, batch_size: int | None = None, *args: Any, **kwargs: Any):
        """Keras ``predict``, after the task's ``preprocessor`` as in ``fit``."""
        if self.preprocess is not None:
            x, batch_size = hub.for_predict(self.preprocess, x, batch_size), None
        self._before_tracing(None, None, None)
        with faults.reporting():
            return super().predict(x, batch_size, *args, **kwargs)

    def train_on_batch(self, x: Any = None, y: Any = None, sample_weight: Any = None, *args: Any, **kwargs: Any):
        """Keras ``train_on_batch``, with the variables created before the step is traced."""
        if self.preprocess is not None:
            x, y, sample_weight = hub.for_batch(self.preprocess, x, y, sample_weight)
        self._plan_first(x, None)
        self._before_tracing(x, y, sample_weight)
        self.check_memory_budget()
        with faults.reporting():
            return super().train_on_batch(x, y, sample_weight, *args, **kwargs)

    def test_on_batch(self, x: Any = None, y: Any = None, sample_weight: Any = None, *args: Any, **kwargs: Any):
        """Keras ``test_on_batch``, with the variables created before the step is traced."""
        if self.preprocess is not None:
            x, y, sample_weight = hub.for_batch(self.preprocess, x, y, sample_weight)
        self._before_tracing(x, y, sample_weight)
        with faults.reporting():
            return super().test_on_batch(x, y, sample_weight, *args, **kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        """Keras ``predict_on_batch``, after the task's ``preprocessor``."""
        if self.preprocess is not None:
            x = hub.for_batch(self.preprocess, x)[0]
        self._before_tracing(None, None, None)
        with faults.reporting():
            return super().predict_on_batch(x)

    @property
    def preprocess(self) -> hub.Preprocess | None:
        """The keras_hub task's ``preprocess_samples``, applied to the data by fit, evaluate and predict; else None."""
        return hub.preprocess_of(self._graph.model) if self._graph is not None else None

    def _before_tracing(self, x: Any, y: Any, sample_weight: Any) -> None:
        """Variables created, and explicit transfers between processes prepared, before Keras traces a step."""
        if x is not None:
            training_lib.build_before_tracing(self, x, y, sample_weight)
        if self._pipeline is not None:
            self._pipeline.prepare()

    # Presentation -------------------------------------------------------------------------------
    def layer_costs(self) -> cost_lib.Estimate | None:
        """Per-layer costs under ``cost``: those the split used, else estimated now (needs a built model)."""
        if self._estimate is None and (callable(self.cost) or self._inputs is not None):
            self._estimate = self._estimate_costs(self._inputs)
        return self._estimate

    def _cut_tensors(self) -> list[list[tuple[str, tuple, float]]] | None:
        """For a Functional model split into cells: per cut, the tensors crossing it (maker, shape, bytes/sample)."""
        if self._graph is None or self._pipeline is None:
            return None
        segments = []
        for cell in self._pipeline.cells:
            assert isinstance(cell.program, functional.Segment)  # a Functional model's cells run its segments
            segments.append(cell.program)
        return self._graph.crossing(segments)

    def summary(
        self,
        line_length: int | None = None,
        positions: Any = None,
        print_fn: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """Print each cell: device, layers, parameters, estimated cost and its share, bytes handed on.

        Ends with the predicted pipeline efficiency: M / (M + K - 1) times mean / max cell cost.
        """
        summary_lib.print_summary(self, line_length, print_fn, self._cut_tensors())

    # Saving, loading and conversion (tfpipe.saving) -------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """The layers, the split, devices, M, remat, unroll and schedule; before ``plan="auto"`` has planned, the
        budget and devices to plan over when loaded (``tfpipe.saving.model_config``)."""
        config = saving.model_config(self, self._graph.model if self._graph is not None else None, self._memory_budget)
        return config if self._auto is None else auto_plan.unplanned_config(config, self._auto)

    @classmethod
    def from_config(cls: type[_Model], config: dict[str, Any], custom_objects: Any = None) -> _Model:
        """A model from ``get_config``; saved devices this machine lacks are replaced by its own (with a warning)."""
        return saving.model_from_config(cls, config, custom_objects)

    def get_build_config(self) -> dict[str, Any] | None:
        """The shapes and dtypes of the inputs the model was built for."""
        return {"inputs": specs.to_config(self._inputs)} if self._inputs is not None else None

    def build_from_config(self, config: dict[str, Any] | None) -> None:
        """Build for the inputs recorded by ``get_build_config`` (loading then finds every variable)."""
        if config and "inputs" in config:
            self.build(specs.from_config(config["inputs"]))

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile as saved, creating the optimizer's variables on their devices so that its state loads."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def _tfpipe_seed_states(self) -> saving.SeedStates:
        # Keras saves every KerasSaveable attribute of a model, so this one puts the seed
        # states in their own group (a keras.Sequential loading the file ignores it). Set
        # without Keras' attribute tracking, so that it is not one of the model's layers.
        if "_seed_saver" not in self.__dict__:
            states = saving.SeedStates(lambda: state_lib.seed_states(self.pipeline_layers))
            object.__setattr__(self, "_seed_saver", states)
        return self.__dict__["_seed_saver"]

    @classmethod
    def from_sequential(cls: type[_Model], model: keras.Sequential, *, copy: bool = True, **kwargs: Any) -> _Model:
        """A PipelineModel of a Sequential's layers; ``kwargs`` as for the constructor.

        ``copy=True`` (default) clones the layers and copies their weights, so the new
        variables are created on the cells' devices and the Sequential is left alone.
        ``copy=False`` shares the layer objects, and with them the variables, wherever
        they already are.
        """
        return saving.from_sequential(cls, model, copy, kwargs)

    def to_sequential(self, *, copy: bool = False) -> keras.Sequential:
        """The same layers as a plain ``keras.Sequential`` (for serving or export), built if this model is.

        ``copy=False`` (default) shares the layers and weights: training one trains the
        other. ``copy=True`` clones the layers and copies the current weights.
        """
        if self._graph is not None:
            raise TypeError(
                f"PipelineModel {self.name!r} was made from the Functional model {self._graph.model.name!r}; "
                "use to_functional() to get it back."
            )
        sequential = saving.to_sequential(self.pipeline_layers, self._inputs, f"{self.name}_sequential", copy)
        if not copy:  # copies are made on one device; shared weights stay on the cells'
            saving.keep_off_xla(sequential, self._devices)
        return sequential

    def to_functional(self, *, copy: bool = False) -> keras.Model:
        """The Functional model this one was made from: the same graph over the same layers.

        ``copy=False`` (default) returns that model, sharing the layers and weights. ``copy=True``
        clones it (``keras.models.clone_model``) with the current weights.
        """
        if self._graph is None:
            raise TypeError(
                f"PipelineModel {self.name!r} was made from a layer sequence, not a Functional model; "
                "use to_sequential() (or keras.Sequential(model.pipeline_layers))."
            )
        model = self._graph.model
        if not copy:
            return model
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        return clone
