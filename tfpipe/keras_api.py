"""PipelineModel's Keras entry points: compile, fit, evaluate, predict, the *_on_batch forms, their step functions.

Each readies the pipeline (checked batch sizes, keras_hub preprocessing, variables and transfers made before
Keras traces a step, XLA per cell), then runs Keras' own.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import keras

from tfpipe import _compat, recovery
from tfpipe import training as training_lib
from tfpipe.distributed import faults
from tfpipe.partition import functional, hub
from tfpipe.step.replicated import Replicated
from tfpipe.step.unrolled import Pipeline


class KerasEntryPoints(keras.Model):
    """The Keras methods a user calls on a PipelineModel, wrapped around the pipeline that ``model.py`` builds.

    A base class of ``PipelineModel`` alone: it reads the pipeline and graph that the model's constructor sets.
    """

    _graph: functional.Graph | None
    _pipeline: Pipeline | Replicated | None
    _cells_jit: bool

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
        self._apply_cells_jit()
        if hasattr(self, "_compile_config"):  # saved and loaded with the user's choice, not the outer step's
            self._compile_config.config["jit_compile"] = jit_compile
        if self.optimizer is not None:
            training_lib.place_on_variable_devices(self.optimizer)
            training_lib.check_slices_finite(self.optimizer)

    @property
    def cells_jit_compile(self) -> bool:
        """Whether each cell's traced tasks are compiled by XLA on its device (``compile(jit_compile=True)``)."""
        return self._cells_jit

    def _apply_cells_jit(self) -> None:
        for pipeline in getattr(self._pipeline, "pipelines", [self._pipeline] if self._pipeline else []):
            for cell in pipeline.cells:
                cell.jit_compile = self._cells_jit

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
            setattr(self, name, recovery.skipping(made, self) if name == "train_function" else made)
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
        self._plan_now(x, batch_size)  # plan="auto": planned on the first batch (tfpipe.auto_plan)
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

        return recovery.fit(self, run, given)

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
        self._plan_now(x, None)
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


def with_fewer_rewrites(function: Callable, calls_cells: Callable[[], bool]) -> Callable:
    """``function`` (a Keras step function) called without two Grappler passes when ``calls_cells()``.

    TensorFlow's runtime inlines every call it may (``LowerFunctionalOpsPass``) before
    Grappler sees the step. What is left of an unrolled step with many tasks are the cells'
    ``_noinline`` calls, and Grappler's function optimizer rebuilds the body of each of them,
    call site by call site, before it reads the mark and leaves it alone, a cost that grows
    with the call sites of the first step. Its TFG optimizer (MLIR passes that sink ops into
    the branches of If and Case, and tidy the function library) changes nothing in such a
    step and still takes time. Both are off for the step and the functions it calls; later
    steps measured the same. With cells inlined (fewer tasks) neither rebuilds anything of
    theirs, and both stay on: across worker processes the step measured no faster with the
    function optimizer off
    (docs/notes/2026-11-benchmark-passes.md#twelfth-pass-per-call-site-costs-of-tensorflows-first-run-taken-off-2026-11-25).
    The user's other Grappler settings stay as they are.
    """

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not calls_cells():
            return function(*args, **kwargs)
        with _compat.fewer_rewrites():
            return function(*args, **kwargs)

    return call
