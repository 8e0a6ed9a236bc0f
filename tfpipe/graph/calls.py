"""Call ops of traced functions that skip TensorFlow's shape walk of the called body, for the many tasks of a step.

An unrolled step calls each cell's traced functions once per micro-batch. Making a
call op the usual way, TensorFlow infers its output shapes by walking the called
body (``ShapeRefiner::InferShapesForFunction``) at every call, which adds up over the
many calls of a first step
(docs/notes/2026-11-benchmark-passes.md#tenth-pass-where-the-first-step-of-k2-m32-goes-and-call-ops-without-the-shape-walk-2026-11-25).
The function's output shapes are known when it is traced, so the op made here carries
``_disable_call_shape_inference`` and gets those shapes set. It is the op TensorFlow
makes otherwise, so the step runs the same.

Only for calls that no tape differentiates: the op gets no gradient function. A
function TensorFlow inlines (one not marked ``_noinline``) is called the usual way:
inlining replaces its call op before the step runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat

_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> (not inlined, stateful body)


def _facts(function: Any) -> tuple[bool, bool]:
    """Whether ``function`` is marked ``_noinline``, and whether its body is stateful; read once per function."""
    if function not in _FACTS:
        stateful = any(op.op_def.is_stateful for op in function.graph.get_operations())
        _FACTS[function] = (_compat.is_noinline(function), stateful)
    return _FACTS[function]


def call(function: Any, args: Sequence[Any]) -> list[tf.Tensor]:
    """``function(*args)`` for a ConcreteFunction with flat outputs: one call op made without the shape walk
    when ``function`` is not inlined, else the usual call."""
    if tf.executing_eagerly():
        return list(function(*args))
    if not _facts(function)[0]:
        results = list(function(*args))
        if results and _facts(function)[1]:
            _unchained(results[0].op)
        return results
    graph = tf.compat.v1.get_default_graph()
    function.add_to_graph(graph)
    inputs = [tf.convert_to_tensor(a) for a in args] + list(function.captured_inputs)
    # Not ``function.outputs``: once TensorFlow differentiates the function, its graph also outputs intermediates.
    outputs = function.function_type.flat_outputs
    op = _compat.call_op(graph, function, inputs, [t.dtype for t in outputs], stateful=_facts(function)[1])
    for out, like in zip(op.outputs, outputs):
        out.set_shape(like.shape)
    if _facts(function)[1]:
        _unchained(op)
    return list(op.outputs)


def _unchained(op: tf.Operation) -> None:
    """A stateful call that touches no variable (a loss whose shapes are checked at run time traces an ``Assert``)
    is ordered by its task's chain alone, not after every such op of every device made before it."""
    if not any(t.dtype == tf.resource for t in op.inputs):
        _compat.run_independently(op)
