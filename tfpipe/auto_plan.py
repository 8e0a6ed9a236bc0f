"""``PipelineModel(layers, plan="auto", memory_budget=...)``: planned by the first fit, on its own training batch.

The planner needs the batch size and a batch to measure with, which a Keras user gives to
``fit``, not to the constructor. So the model starts as one placeholder cell, remembers what
to plan over (``Pending``), and its first ``fit`` (or ``train_on_batch``) calls ``plan_on``
with the first batch, then cuts the layers as the plan says before any step is traced.

``tfpipe.planner`` sits above the model (its calibration builds models), so ``plan_on`` imports
it when it is called: the one call in the package that runs upward, made once, at the first fit
of a model made with ``plan="auto"`` (tests/unit/test_package.py names it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from tfpipe import _compat, messages
from tfpipe import settings as settings_lib
from tfpipe.planning.plans import parse_bytes

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


@dataclasses.dataclass(frozen=True)
class Pending:
    """What a model made with ``plan="auto"`` plans over at its first fit."""

    memory_budget: Any  # as given to the constructor, checked
    devices: list[Any] | None  # as given: one list of devices, unchecked until planned; None: the planner's
    repeated_layers: str = "inline"  # the model's: its probes are built so


def plan_on(name: str, planned: Any, pending: Pending, x: Any, batch_size: int | None, optimizer: Any) -> Any:
    """``tfpipe.plan`` of ``planned`` (the model's layers or Functional model) on fit's first batch of ``x``."""
    from tfpipe.planner import choose  # above the model: see the module's docstring

    sample, size = first_batch(x, batch_size)
    messages.say(f"tfpipe: planning {name!r} for batches of {size} (plan='auto'): measuring its layers.")
    plan = choose.plan(
        planned, size, pending.devices, pending.memory_budget, sample=sample, optimizer=optimizer,
        repeated_layers=pending.repeated_layers,
    )  # fmt: skip
    messages.say(f"tfpipe: planned {name!r}: {plan.candidates[0].config.describe()}.")
    return plan


def unplanned_config(config: dict[str, Any], pending: Pending) -> dict[str, Any]:
    """A model's config saved before its first fit planned it: ``plan="auto"``, to be planned when loaded."""
    config = {k: v for k, v in config.items() if k not in settings_lib.PLANNED_DEFAULTS}
    config.update(plan=AUTO, memory_budget=pending.memory_budget, devices=pending.devices)
    return config
