"""Optimizer updates traced once per kind of variable and called per variable (``repeated_layers="call"``).

Keras' optimizers write every variable's update into the step as ops of their own: Adam's
is about 35 ops a variable (its bias corrections recomputed for each), so a deep model's
step holds more optimizer ops than layer ops once its blocks are called
(``tfpipe.partition.repeats``), and TensorFlow's training process keeps each of them. Here
the update of the first variable of each kind (shape, dtype, slots' shapes) is traced as a
function of (gradient, the variable's value, its slots' values, step counter, learning
rate) that returns their new values, and every variable of that kind calls it and assigns
what it returns: the same ops on the same values, so the same numbers.

The optimizer's own update math runs unchanged under Keras' ``StatelessScope``; only its
``assign``, ``assign_add`` and ``assign_sub`` (public ``Optimizer`` methods, which Keras' TF
backend writes to the variable directly) are made to record instead while it is traced. A
variable's update is traced on its own, as Keras writes it, where sharing is not exact: a
sparse gradient, a slot not made from its variable (``add_variable_from_reference``), or an
update that reads or writes any other variable (Nadam's running product).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfpipe import _compat

_SLOTS = "_tfpipe_slots"  # on an optimizer: id(variable or its tf.Variable) -> (the variable, the slots made from it)
_SHARED = "_tfpipe_shared_updates"  # on an optimizer: whether its updates are shared (set by ``share``)
_TRACES = "_tfpipe_update_traces"  # on an optimizer: graph -> {kind: (function, changed) or None}


def share(optimizer: keras.optimizers.Optimizer, on: bool) -> None:
    """Make ``optimizer``'s updates (and an inner optimizer's) calls of shared traces, or not."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None:
            setattr(opt, _SHARED, on)


def traces(optimizer: keras.optimizers.Optimizer) -> list[dict[Any, Any]]:
    """The optimizer's shared traces, one dict per graph: kind -> (function, changed), or None where not shared."""
    return list(getattr(optimizer, _TRACES, {}).values())


def record_slot(optimizer: keras.optimizers.Optimizer, reference: Any, slot: Any) -> None:
    """Note that ``slot`` was made from ``reference`` (``add_variable_from_reference``)."""
    if not hasattr(optimizer, _SLOTS):
        setattr(optimizer, _SLOTS, {})
    known = getattr(optimizer, _SLOTS)
    entry = known.setdefault(id(reference), (reference, []))
    entry[1].append(slot)
    # Keras' TF backend hands update_step the tf.Variable inside a Keras variable
    raw = _compat.backing_variable(reference) if isinstance(reference, keras.Variable) else None
    if raw is not None:
        known[id(raw)] = entry


def shared_update(
    optimizer: keras.optimizers.Optimizer,
    update: Callable[..., Any],
    gradient: Any,
    variable: Any,
    learning_rate: Any,
    counter: Any,
) -> bool:
    """Run ``update(gradient, variable, learning_rate)`` as a call of its kind's trace and assign the results.

    False (nothing done) where it is not shared: the caller runs ``update`` as Keras would.
    """
    if not getattr(optimizer, _SHARED, False) or tf.executing_eagerly() or isinstance(gradient, tf.IndexedSlices):
        return False
    entry = getattr(optimizer, _SLOTS, {}).get(id(variable))
    if entry is None:
        return False
    gradient, learning_rate, counter = (tf.convert_to_tensor(t) for t in (gradient, learning_rate, counter))
    state = [entry[0], *entry[1]]
    kind = (
        tuple((tuple(v.shape), str(v.dtype)) for v in state),
        gradient.dtype,
        learning_rate.dtype,
        counter.dtype,
    )
    traces = getattr(optimizer, _TRACES, None)
    if traces is None:
        traces = weakref.WeakKeyDictionary()
        setattr(optimizer, _TRACES, traces)
    mine = traces.setdefault(tf.compat.v1.get_default_graph(), {})
    if kind not in mine:
        mine[kind] = _trace(optimizer, update, state, variable, (gradient, learning_rate, counter))
    if mine[kind] is None:
        return False
    function, changed = mine[kind]
    new = function(gradient, learning_rate, counter, *[v.value for v in state])
    for k, value in zip(changed, new):
        state[k].assign(value)
    return True


def _trace(
    optimizer: keras.optimizers.Optimizer,
    update: Callable[..., Any],
    template: Sequence[Any],
    handed: Any,
    inputs: Sequence[tf.Tensor],
) -> tuple[Any, list[int]] | None:
    """``update`` on ``template`` (a variable and its slots) traced with all of them as arguments; None if unshareable.

    ``handed`` is the variable as Keras hands it to ``update_step`` (its tf.Variable); ``inputs`` are the gradient,
    learning rate and step counter.
    """
    found: dict[str, Any] = {"changed": [], "ok": True}

    def body(g: tf.Tensor, lr: tf.Tensor, step: tf.Tensor, *values: tf.Tensor) -> list[tf.Tensor]:
        mapping = list(zip(template, values))
        with keras.StatelessScope(state_mapping=mapping) as scope, _recording(optimizer, handed, template[0]):
            with _compat.step_counter_as(optimizer, step):
                update(g, handed, lr)
            touched = set(scope.state_mapping) - {id(v) for v in template}
            new = [scope.get_current_value(v) for v in template]
        found["ok"] = not touched
        found["changed"] = [k for k, (n, was) in enumerate(zip(new, values)) if n is not was]
        return [new[k] for k in found["changed"]] or [tf.constant(0.0)]

    body.__name__ = "tfpipe_optimizer_update"
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs]
    specs += [tf.TensorSpec(v.shape, v.dtype) for v in template]
    options = {"experimental_attributes": _compat.noinline()}
    try:
        function = tf.function(body, autograph=False, **options).get_concrete_function(*specs)
    except Exception:  # noqa: BLE001 - update math that cannot be traced this way: Keras' own ops instead
        return None
    # Reading any other variable (a capture) would share one variable's state among all of its kind.
    if not found["ok"] or not found["changed"] or function.captured_inputs:
        return None
    return function, found["changed"]


@contextlib.contextmanager
def _recording(optimizer: keras.optimizers.Optimizer, handed: Any, variable: Any) -> Iterator[None]:
    """Within: the optimizer's ``assign``, ``assign_add`` and ``assign_sub`` record in the stateless scope
    (``handed``, the tf.Variable Keras passed, as its Keras ``variable``)."""

    def keras_variable(target: Any) -> Any:
        return variable if target is handed else target

    def assign(target: Any, value: Any) -> None:
        target = keras_variable(target)
        target.assign(tf.cast(value, target.dtype))

    def assign_add(target: Any, value: Any) -> None:
        target = keras_variable(target)
        target.assign(target.value + tf.cast(value, target.dtype))

    def assign_sub(target: Any, value: Any) -> None:
        target = keras_variable(target)
        target.assign(target.value - tf.cast(value, target.dtype))

    names = {"assign": assign, "assign_add": assign_add, "assign_sub": assign_sub}
    saved = {name: vars(optimizer).get(name) for name in names}  # an instance's own, if it had any
    for name, method in names.items():
        setattr(optimizer, name, method)
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(optimizer, name)  # the class's method again
            else:
                setattr(optimizer, name, method)
