"""``PipelineModel(layers, plan="auto", memory_budget=...)``: planned by the first fit, on its own training batch.

The planner needs the batch size and a batch to measure with, which a Keras user gives to
``fit``, not to the constructor. So the model starts as one placeholder cell, and the first
``fit`` (or ``train_on_batch``) runs ``tfpipe.plan`` on its first batch, then cuts the
layers as the plan says before any step is traced. ``tfpipe.planner`` sits above the model
and registers itself here (``PLANNER``), so the model needs no import of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat, messages
from tfpipe import settings as settings_lib
from tfpipe.planning.plans import parse_bytes

PLANNER: list[Callable[..., Any]] = []  # tfpipe.plan, registered by tfpipe.planner
AUTO = "auto"


def check(plan: Any, memory_budget: Any, given: dict[str, Any]) -> bool:
    """Whether ``plan`` is "auto"; with it, the settings the plan chooses must be left at their defaults.

    Without a plan, ``memory_budget`` is each device's stated limit (``tfpipe.planning.budget``); with a
    ``tfpipe.plan`` result it belongs to the planner.
    """
    if plan != AUTO:
        if memory_budget is not None and plan is not None:
            raise ValueError(
                f'memory_budget={memory_budget!r} is for plan="auto"; with plan=<a tfpipe.plan(...)>, give the '
                "budget to tfpipe.plan, or drop memory_budget."
            )
        return False
    if memory_budget is not None:
        parse_bytes(memory_budget)  # a bad budget is an error now, not at the first fit
    clashes = [name for name, value in given.items() if value != settings_lib.PLANNED_DEFAULTS[name]]
    if clashes:
        raise ValueError(
            f'plan="auto" chooses {", ".join(clashes)}; leave {"it" if len(clashes) == 1 else "them"} out (devices '
            "may be given: the devices to plan over), or drop plan= and give every setting yourself."
        )
    return True


def first_batch(x: Any, batch_size: int | None) -> tuple[Any, int]:
    """The first training batch's inputs and its size, from what ``fit`` was given: arrays or a tf.data.Dataset."""
    if isinstance(x, tf.data.Dataset):
        element = next(iter(x.take(1)))
        inputs = element[0] if isinstance(element, tuple) else element
        leaf = tf.nest.flatten(inputs)[0]
        return tf.nest.map_structure(np.asarray, inputs), int(leaf.shape[0])
    leaves = tf.nest.flatten(x)
    if x is None or not leaves or not all(isinstance(t, (np.ndarray, tf.Tensor)) for t in leaves):
        raise ValueError(
            'plan="auto" plans on the first training batch, from arrays or a tf.data.Dataset given to fit; this '
            f"data is neither ({type(x).__name__}). Plan with tfpipe.plan(layers, batch_size, sample=...) and pass "
            "plan=<the plan> instead."
        )
    size = min(batch_size or _compat.DEFAULT_BATCH_SIZE, int(leaves[0].shape[0]))
    return tf.nest.map_structure(lambda t: np.asarray(t[:size]), x), size


class AutoPlan(keras.Model):
    """The part of ``PipelineModel`` that plans itself at the first fit when made with ``plan="auto"``."""

    _graph: Any = None  # PipelineModel's: a Functional model's nodes, or None for a layer sequence
    _auto_budget: Any = None
    _auto_devices: list[Any] | None = None  # as given: one list of devices, unchecked until planned
    _auto_pending = False
    plan: Any = None  # the tfpipe.Plan the model follows, once there is one

    def _wait_for_plan(self, memory_budget: Any, devices: list[Any] | None) -> None:
        """Plan at the first fit, over ``devices`` (None: the planner's default) under ``memory_budget``."""
        self._auto_budget, self._auto_devices, self._auto_pending = memory_budget, devices, True

    def _plan_now(self, x: Any, batch_size: int | None) -> None:
        """If still to plan: plan on fit's first batch and cut the layers as the plan says."""
        if not self._auto_pending:
            return
        if not PLANNER:
            raise RuntimeError('plan="auto" needs tfpipe.planner; import tfpipe (not only tfpipe.model).')
        sample, size = first_batch(x, batch_size)
        optimizer = self.optimizer if isinstance(self.optimizer, keras.optimizers.Optimizer) else "adam"
        messages.say(f"tfpipe: planning {self.name!r} for batches of {size} (plan='auto'): measuring its layers.")
        planned = self._graph.model if self._graph is not None else self.pipeline_layers
        plan = PLANNER[0](planned, size, self._auto_devices, self._auto_budget, sample=sample, optimizer=optimizer)
        self._follow(plan)
        messages.say(f"tfpipe: planned {self.name!r}: {plan.candidates[0].config.describe()}.")

    def get_config(self) -> dict[str, Any]:
        """As saved once planned; before, ``plan="auto"`` with the budget and devices, to be planned when loaded."""
        config = super().get_config()
        if self._auto_pending:
            for name in settings_lib.PLANNED_DEFAULTS:
                config.pop(name, None)
            config.update(plan=AUTO, memory_budget=self._auto_budget, devices=self._auto_devices)
        return config

    def _follow(self, plan: Any) -> None:
        """Take the plan's settings and cut; variables already made move to their new cells' devices."""
        arguments = plan.pipeline_arguments()
        graph = self._graph
        units = len(graph.nodes) if graph is not None else len(self.pipeline_layers)
        settings = settings_lib.check(
            graph.model if graph is not None else self.pipeline_layers,
            graph,
            units,
            arguments["balance"],
            None,
            self._cost,
            arguments["devices"],
            arguments["num_micro_batches"],
            arguments["remat"],
            self._unroll,
            arguments["schedule"],
        )
        self._keep_settings(settings)
        self._make_pipeline(settings.cell_sizes)
        self.plan, self._auto_pending = plan, False
        if self.built:  # a deferred model's weights are made now, on the planned cells' devices
            self._move_variables(seeds_only=False)
