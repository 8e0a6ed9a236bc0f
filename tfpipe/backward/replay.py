"""A traced cell's forward and backward, as TensorFlow built them for its call op, replayed as ops inside a traced VJP.

A cell's forward function is differentiated once by TensorFlow whichever way the step
takes it: the tape's gradient of a kept micro-batch's call op builds a backward function
and a forward that also returns the intermediates the backward reads (cached per
function). A recomputed micro-batch's traced VJP (``traced_vjp.TracedVJPs``) used to
run the cell's layers again and differentiate them on a tape of its own: a second trace
and a second symbolic differentiation per cell, about half a second each for a
4-block Transformer cell. Here the VJP's body instead imports that forward and backward
as ops, with a custom gradient that links them, so every cell is traced and
differentiated once.

The bodies are imported, not called: the traced VJP stays one flat graph, which
``tfpipe.graph.slim`` cleans as before, and the step's call sites convert no nested bodies.
The ops are the ones TensorFlow runs for a kept micro-batch, so the gradients are those
of the tape's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat
from tfpipe.graph import slim


def call(function: Any, args: Sequence[tf.Tensor]) -> list[tf.Tensor] | None:
    """``function(*args)`` (a cell's ConcreteFunction) as imported ops whose gradient is its backward function.

    None where that cannot be done exactly (the body or the backward captures tensors
    from elsewhere): the caller then runs the layers itself.
    """
    graph = function.graph
    if graph.captures:
        return None
    backward = _compat.backward_function(function)  # builds the pair once; the tape's gradient later reuses it
    n_out = len(function.function_type.flat_outputs)  # graph.outputs also holds the intermediates now
    positions = {id(t): k for k, t in enumerate(graph.outputs)}
    captured = list(backward.captured_inputs)
    if any(id(t) not in positions for t in captured):
        return None
    forward_def, backward_def = _local(graph.as_graph_def()), _local(backward.graph.as_graph_def())
    trainable = [k for k, t in enumerate(graph.outputs[:n_out]) if _compat.is_trainable(t)]
    structure = backward.graph.structured_outputs

    @tf.custom_gradient
    def run(*flat: tf.Tensor):
        outputs = _imported(forward_def, graph.inputs, flat, graph.outputs, "forward")

        def grad(*dys: Any) -> list[Any]:
            given = [dys[k] if dys[k] is not None else tf.zeros_like(outputs[k]) for k in trainable]
            given = [tf.convert_to_tensor(g) for g in given]  # the backward takes dense gradients
            feeds = given + [outputs[positions[id(t)]] for t in captured]
            flat_grads = _imported(backward_def, backward.graph.inputs, feeds, backward.graph.outputs, "backward")
            return _packed(structure, flat_grads)

        return outputs[:n_out], grad

    return list(run(*args))


def _imported(
    graph_def: Any, inputs: Sequence[tf.Tensor], feeds: Sequence[tf.Tensor], outputs: Sequence[tf.Tensor], name: str
) -> list[tf.Tensor]:
    """The ops of ``graph_def`` added here with ``inputs`` fed ``feeds``: the tensors that stand for ``outputs``.

    An output may be an input itself (one the backward reads): it is then its feed.
    """
    return slim.imported(graph_def, {t.name: f for t, f in zip(inputs, feeds)}, [t.name for t in outputs], name)


def _packed(structure: Sequence[Any], flat: Sequence[tf.Tensor]) -> list[Any]:
    """``flat`` packed as ``structure`` (tensors, IndexedSlices, None for no gradient)."""
    rest = iter(flat)
    packed: list[Any] = []
    for item in structure:
        if item is None:  # no tensor of its own in the flat outputs
            packed.append(None)
            continue
        parts = [next(rest) for _ in tf.nest.flatten(item, expand_composites=True)]
        packed.append(tf.nest.pack_sequence_as(item, parts, expand_composites=True))
    return packed


def _local(graph_def: Any) -> Any:
    """``graph_def`` without colocations with nodes it does not hold (gradients colocate with forward ops).

    Every op is on the cell's device anyway; the import refuses a colocation it cannot resolve.
    """
    names = {node.name for node in graph_def.node}
    for node in graph_def.node:
        groups = node.attr["_class"].list.s if "_class" in node.attr else []
        if any(g.startswith(b"loc:@") and g[5:].decode() not in names for g in groups):
            kept = [g for g in groups if not g.startswith(b"loc:@") or g[5:].decode() in names]
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(kept)
            if not kept:
                del node.attr["_class"]
    return graph_def
