"""A cell: a contiguous group of layers placed on one device and run as a pure function."""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tfpipe import _compat, leaves
from tfpipe.backward import remat, traced_vjp
from tfpipe.distributed import devices, grouped
from tfpipe.graph import cpu_gradients
from tfpipe.partition import functional, repeats, state
from tfpipe.partition.cell_trace import CellTrace


class Hung(NamedTuple):
    """A cell's output with what Keras hangs on a tensor, carried across the cut as tensors of their own.

    A function boundary drops these attributes: the next layers read the mask (``_keras_mask``),
    and Keras' cross-entropy reads the logits of a softmax or sigmoid output (``_keras_logits``).
    """

    tensor: Any
    mask: Any  # None when there is none
    logits: Any  # None when there are none


def carry_hung(y: Any) -> Any:
    """``y``, or ``Hung(y, its mask, its logits)`` when Keras hung either on the single tensor ``y``."""
    if not tf.is_tensor(y):
        return y
    mask, logits = _compat.hung(y, _compat.MASK), _compat.hung(y, _compat.LOGITS)
    return y if mask is None and logits is None else Hung(y, mask, logits)


def hang(x: Any) -> Any:
    """The tensor of a ``Hung``, with its mask and logits hung back on it as Keras left them; else ``x``."""
    if not isinstance(x, Hung):
        return x
    for attribute, value in ((_compat.MASK, x.mask), (_compat.LOGITS, x.logits)):
        if value is not None:
            _compat.hang(x.tensor, attribute, value)  # Keras' own attributes, as its backend sets them
    return x.tensor


class Cell:
    """Layers ``layers`` on ``device``, callable as ``y = f(weights, state, x)`` without side effects.

    The layers run one after the other, each on the previous one's output; or, given a
    ``program`` (a segment of a Functional graph, ``tfpipe.partition.functional.Segment``), as it calls them.
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[keras.layers.Layer],
        device: str,
        program: Callable[[Any, bool], Any] | None = None,
    ):
        self.index = index
        self.layers = list(layers)
        self.device = device
        self.program = program
        self._merger: state.StateMerger | None = None
        # TPU cores are entered through the strategy, where nested function calls are untested: run inline there.
        self._traceable = devices.tpu_core(device) is None
        self._traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # outer graph -> {signature: CellTrace}
        self._layer_runs = 0  # the layers' Python run to trace a function
        # Whether the traced functions stay one call op each (not inlined): see Pipeline.__init__.
        self.noinline = False
        # Whether the traced functions are compiled by XLA, each on the cell's device (compile(jit_compile=True)).
        self.jit_compile = False
        # The traced backward of re-materialized micro-batches (traced_vjp.TracedVJPs).
        self.vjps = traced_vjp.TracedVJPs(self._placed, self.function_options)
        # Ids of the variables an earlier cell also uses (tied weights; set by ``tie``).
        self.borrowed: set[int] = set()
        # "call": each run of alike layers traced once and called per layer (tfpipe.partition.repeats).
        self.repeated_layers = "inline"
        self.repeats = repeats.Repeats(self._placed)

    @property
    def traceable(self) -> bool:
        """Whether the cell runs as traced functions (False on TPU cores, or once tracing failed)."""
        return self._traceable

    @property
    def num_traces(self) -> int:
        """How many times the layers' Python ran to trace a function.

        Once per input signature for the forward. A recomputed backward replays TensorFlow's
        differentiation of that forward (tfpipe/backward/replay.py) and runs the layers again only
        where it cannot (a signature the forward was not traced for).
        """
        return self._layer_runs

    def function_options(self) -> dict[str, Any]:
        """The ``tf.function`` options of the cell's traced functions: inlined or not, compiled by XLA or not."""
        return {
            "experimental_attributes": _compat.noinline() if self.noinline else None,
            "jit_compile": True if self.jit_compile else None,
        }

    @contextlib.contextmanager
    def _placed(self) -> Iterator[None]:
        # The device explicit, so a traced body stays on the cell's device wherever it runs; on a CPU,
        # MatMuls get the gradient laid out for CPU kernels (tfpipe/graph/cpu_gradients.py).
        with devices.scope(self.device), cpu_gradients.scope(self.device):
            yield

    # Variables -----------------------------------------------------------------------
    def _unique(self, attr: str) -> list[keras.Variable]:
        seen, out = set(), []
        for layer in self.layers:
            for v in getattr(layer, attr):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    @property
    def trainable_variables(self) -> list[keras.Variable]:
        """The cell's trainable variables, in layer order: each weight whose own ``trainable`` is set.

        As Keras' ``Model.trainable_weights`` decides, not each layer's: LoRA freezes a
        decoder block and then unfreezes the attention layers' LoRA weights inside it.
        """
        return state.split_variables(self.layers)[0]

    @property
    def non_trainable_variables(self) -> list[keras.Variable]:
        """The cell's other state: frozen weights, BatchNorm statistics, seed-generator states."""
        return state.split_variables(self.layers)[1]

    @property
    def weights(self) -> list[keras.Variable]:
        """The cell's weights, trainable and not (seed states excluded), each once, in layer order."""
        return self._unique("weights")

    def count_params(self) -> int:
        """Number of scalars in the cell's weights (seed states excluded), less those it borrows (``tie``)."""
        return int(sum(math.prod(v.shape) for v in self.weights if id(v) not in self.borrowed))

    @property
    def merger(self) -> state.StateMerger:
        """How this cell's state updates are merged across micro-batches."""
        if self._merger is None:
            self._merger = state.StateMerger(self.layers)
        return self._merger

    # Building ---------------------------------------------------------------------------
    def build(self, input_spec: Any) -> Any:
        """Create the cell's variables on its device from the input spec; return the output spec."""
        x = input_spec
        if self.program is not None:  # a Functional graph's layers were built when the graph was
            return None
        with tf.init_scope(), devices.scope(self.device):
            for layer in self.layers:
                x = layer.compute_output_spec(x) if layer.built else layer(x)
        return x

    def read(self) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Read the current trainable and non-trainable values once, on the cell's device (one call if remote)."""

        def both() -> tuple[list[tf.Tensor], list[tf.Tensor]]:
            trainable = [tf.identity(v.value) for v in self.trainable_variables]
            return trainable, [tf.identity(v.value) for v in self.non_trainable_variables]

        return grouped.run_on(self.device, both)

    @property
    def has_regularizers(self) -> bool:
        """Whether any trainable variable the cell owns (does not borrow) has a weight regularizer."""
        return any(self._regularized(v) for v in self.trainable_variables)

    def _regularized(self, v: keras.Variable) -> bool:
        return getattr(v, "regularizer", None) is not None and id(v) not in self.borrowed

    def regularization_loss(self, trainable: Sequence[tf.Tensor]) -> tf.Tensor:
        """Sum of the weight regularizers of the variables the cell owns, evaluated on the given weight values."""
        terms = [
            tf.cast(v.regularizer(w), tf.float32)
            for v, w in zip(self.trainable_variables, trainable)
            if self._regularized(v)
        ]
        return tf.add_n(terms) if terms else tf.constant(0.0)

    def regularization_gradients(
        self, trainable: Sequence[tf.Tensor], scale: tf.Tensor
    ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """The cell's regularization penalty on ``trainable``, and its gradients times ``scale`` (the loss scale);
        None for a weight without a regularizer."""
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(trainable)
            penalty = self.regularization_loss(trainable)
            scaled = penalty * scale
        return penalty, tape.gradient(scaled, trainable)

    # Running ------------------------------------------------------------------------------
    def run_inline(
        self,
        trainable: Sequence[tf.Tensor],
        non_trainable: Sequence[tf.Tensor],
        x: Any,
        training: bool,
    ) -> tuple[Any, list[tf.Tensor], tf.Tensor]:
        """Run the layers on given variable values: (outputs, new non-trainable values, added losses).

        Nothing is assigned: Keras' StatelessScope maps every variable to the
        given tensor and collects assignments and ``add_loss`` terms instead.
        """
        mapping = list(zip(self.trainable_variables, trainable)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )
        # add_loss terms are collected in inference too: Keras' evaluate adds them to its loss.
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            calling = self.repeated_layers == "call" and not tf.executing_eagerly()
            if isinstance(self.program, functional.Segment):
                runner = self.repeats.node_runner(self.program.nodes, training, scope) if calling else None
                x = self.program(x, training, runner)
            elif self.program is not None:
                x = self.program(x, training)
            else:
                x = hang(x)
                if calling:
                    x = self.repeats.run(self.layers, repeats.runs(self.layers), x, training, scope)
                else:
                    for layer in self.layers:
                        x = layer(x, training=training)
                x = carry_hung(x)
            new_state = [scope.get_current_value(v) for v in self.non_trainable_variables]
            losses = [tf.cast(tf.reduce_sum(loss), tf.float32) for loss in scope.losses]
        added = tf.add_n(losses) if losses else tf.constant(0.0)
        return x, new_state, added

    def run_traced(
        self,
        trainable: Sequence[tf.Tensor],
        non_trainable: Sequence[tf.Tensor],
        x: Any,
        training: bool,
        forward: str = remat.RECORDED,
    ) -> tuple[Any, list[tf.Tensor], tf.Tensor]:
        """What ``run_inline`` returns, through one function call op traced once per input signature and graph.

        The layers' Python then runs once per cell and micro-batch size instead of once per
        micro-batch, and the tape differentiates the call op with a gradient function that
        TensorFlow also traces once. A non-trainable value the cell leaves unchanged comes back
        as the very tensor passed in (``StateMerger`` relies on it). If the layers cannot be
        traced as a function, the cell runs inline, as ``run_inline``.

        Eagerly the cell also runs inline: there is no graph to trace, and measured with
        TF 2.21 the tape's eager gradient of a concrete-function call was wrong for
        AmoebaNet-D in training mode (BatchNorm), while the graph-mode gradient is exact.
        """
        if not self._traceable or tf.executing_eagerly():
            return self.run_inline(trainable, non_trainable, x, training)
        if forward not in remat.FORWARDS:
            raise ValueError(f"forward={forward!r}; use one of {remat.FORWARDS} (tfpipe.backward.remat).")
        if forward == remat.REPLAYED:  # a recomputation in a traced VJP: TensorFlow's differentiation of the forward
            trace = self._outer_trace(x, trainable, non_trainable, training)
            replayed = trace.replay(x, trainable, non_trainable) if trace is not None else None
            if replayed is not None:
                return replayed
            self._layer_runs += 1
            return self.run_inline(trainable, non_trainable, x, training)
        trace = self.traced(x, trainable, non_trainable, training)
        if trace is None:
            return self.run_inline(trainable, non_trainable, x, training)
        return trace.apply(x, trainable, non_trainable, cheap=forward == remat.UNRECORDED)

    def traced(
        self, x: Any, trainable: Sequence[Any], non_trainable: Sequence[Any], training: bool
    ) -> CellTrace | None:
        """The cell traced for inputs like these (tensors or TensorSpecs), once per graph and signature.

        None where the cell runs inline (a TPU core, or tracing failed: then with a warning).
        """
        if not self._traceable:
            return None
        key, args, n_x = self._signature(x, trainable, non_trainable, training)
        traces = self._traces.setdefault(tf.compat.v1.get_default_graph(), {})
        if key not in traces:
            try:
                with _compat.name_scopes_restored():  # a failed trace leaves no Keras name scope open
                    traces[key] = self._trace(x, args, n_x, len(trainable), training)
            except Exception as error:  # noqa: BLE001 - any tracing failure: run the layers inline instead
                warnings.warn(
                    f"Cell {self.index} ({self.describe()}) cannot be traced as a function, so its layers "
                    f"run inline once per micro-batch (slower to trace): {type(error).__name__}: {error}",
                    stacklevel=3,
                )
                self._traceable = False
                return None
        return traces[key]

    @staticmethod
    def _signature(x: Any, trainable: Sequence[Any], non_trainable: Sequence[Any], training: bool):
        """(key of a trace, its flat arguments, how many of them are inputs) for inputs like these."""
        xs = leaves.flat(x)
        xs = [t if isinstance(t, tf.TensorSpec) else tf.convert_to_tensor(t) for t in xs]
        args = xs + list(trainable) + list(non_trainable)
        key = (
            bool(training),
            repr(tf.nest.map_structure(lambda t: t is None, x)),
            tuple((tuple(a.shape), a.dtype) for a in args),
        )
        return key, args, len(xs)

    def _outer_trace(self, x: Any, trainable: Sequence[Any], non_trainable: Sequence[Any], training: bool):
        """The forward trace for these inputs made in a graph around the current one (a traced VJP's step), if any."""
        key = self._signature(x, trainable, non_trainable, training)[0]
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            found = self._traces.get(graph, {}).get(key)
            if found is not None:
                return found
            graph = getattr(graph, "outer_graph", None)
        return None

    def _trace(self, x: Any, args: Sequence[tf.Tensor], n_x: int, n_w: int, training: bool) -> CellTrace:
        """Trace the cell as a concrete function of (inputs, trainable values, non-trainable values)."""
        found: dict[str, Any] = {}

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            x_in = tf.nest.pack_sequence_as(x, leaves.fill(x, flat[:n_x]))
            old = list(flat[n_x + n_w :])
            with self._placed():
                y, new_state, added = self.run_inline(list(flat[n_x : n_x + n_w]), old, x_in, training)
            found["y"] = y
            found["changed"] = [k for k, (new, was) in enumerate(zip(new_state, old)) if new is not was]
            return leaves.flat(y) + [new_state[k] for k in found["changed"]] + [added]

        self._layer_runs += 1
        specs = [tf.TensorSpec(a.shape, a.dtype) for a in args]
        function = tf.function(body, autograph=False, **self.function_options()).get_concrete_function(*specs)
        outs = tf.nest.flatten(found["y"])
        template = tf.nest.pack_sequence_as(found["y"], [None if t is None else 0 for t in outs])
        return CellTrace(function, template, [i for i, t in enumerate(outs) if t is not None], found["changed"])

    def describe(self, width: int | None = None) -> str:
        """The cell's layers: all names when few, else first and last with the count; cut to ``width`` characters
        with an ellipsis, the count kept."""
        names = [layer.name for layer in self.layers]
        text, count = (
            (", ".join(names), "") if len(names) <= 3 else (f"{names[0]} .. {names[-1]}", f" ({len(names)} layers)")
        )
        if width is not None and len(text) + len(count) > width:
            text = text[: max(width - len(count) - 1, 0)] + "\u2026"
        return text + count


def tie(cells: Sequence[Cell]) -> None:
    """Mark in each cell the variables an earlier cell also uses (``Cell.borrowed``: tied weights).

    A variable used by several cells (an embedding tied to the output projection) lives on the
    device of the first; each cell differentiates its own use and the pipeline sums the gradients
    there (``step.sums.tied_gradients``). Its regularizer and its parameters count once, in the
    first cell, as in plain Keras. Called where the cells' variables may have changed: when the model
    is built or remade, and as an executor starts a step (a deferred model's weights are made late).
    """
    seen: set[int] = set()
    for cell in cells:
        mine = {id(v) for v in cell.trainable_variables + cell.non_trainable_variables}
        cell.borrowed = mine & seen
        seen |= mine


def owned(cells: Sequence[Cell]) -> list[tuple[keras.Variable, int]]:
    """Each trainable variable once, in order, with the first cell that uses it (as ``tie`` marked them)."""
    return [(v, cell.index) for cell in cells for v in cell.trainable_variables if id(v) not in cell.borrowed]
