"""A traced function with its body cleaned once by Grappler, before a step calls it at many call sites.

TensorFlow's passes over a step graph convert the body of every called function once per
call site: the lowering of calls (``LowerFunctionalOpsPass``), and XLA's
``EncapsulateSubgraphsPass``, which runs with XLA unused and does it twice per call site.
Their cost grows with call sites x body size. A traced VJP of a Transformer cell
(recomputation, tape gradient, running sums) holds many duplicate nodes (shapes, broadcast
arguments, constants) that Grappler removes anyway when the function is instantiated.
Cleaned here once, in Python, every call site converts the smaller body, which shortens
the step's instantiation
(docs/notes/2026-11-benchmark-passes.md#twelfth-pass-per-call-site-costs-of-tensorflows-first-run-taken-off-2026-11-25).

Only device-independent cleanups run (pruning, common-subexpression elimination,
constant folding, the dependency optimizer): the body keeps standard TensorFlow ops, which
the runtime's Grappler still fuses for the cell's device when it instantiates the function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfpipe import _compat

OPTIMIZERS = ("pruning", "common_subgraph_elimination", "constfold", "dependency")


def slimmed(function: Any, name: str, options: dict[str, Any]) -> Any:
    """``function`` (a ConcreteFunction of flat tensors) traced again from its Grappler-cleaned body.

    The new function is named ``name`` (how tfpipe.analysis.graph_tasks knows it) and is made with the ``tf.function``
    options ``options``.
    A body that captures tensors or has control outputs (stateful ops run for their effect)
    is returned as it is: pruning to the outputs would drop those.
    """
    graph = function.graph
    if graph.captures or graph.control_outputs:
        return function
    inputs = [t.name for t in graph.inputs]
    outputs = [t.name for t in graph.outputs]
    cleaned = _compat.grappler_optimize(graph.as_graph_def(), [t.op.name for t in graph.outputs], OPTIMIZERS)
    present = {node.name for node in cleaned.node}
    nodes = [tensor.split(":")[0] for tensor in inputs]
    kept = [(k, node) for k, node in enumerate(nodes) if node in present]  # Grappler prunes unread inputs

    def body(*flat: tf.Tensor) -> list[tf.Tensor]:
        mapping = {inputs[k]: flat[k] for k, _ in kept}
        # Control inputs from a placeholder (the identities that make a recomputation wait for
        # its gradients) must follow it too, or the imported placeholder would be run unfed.
        mapping.update({f"^{node}": flat[k] for k, node in kept})
        return imported(cleaned, mapping, outputs, name="")

    body.__name__ = name
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in graph.inputs]
    return tf.function(body, autograph=False, **options).get_concrete_function(*specs)


def imported(graph_def: Any, input_map: dict[str, tf.Tensor], outputs: Sequence[str], name: str) -> list[tf.Tensor]:
    """The tensors ``outputs`` of ``graph_def`` imported here, its placeholders replaced by ``input_map``'s tensors.

    The replaced placeholders are left out: imported, they would stay in the body as nodes
    that nothing reads, one per argument, which each call site converts again. An output
    that is one of them is its replacement.
    """
    node_of = lambda ref: ref.lstrip("^").split(":")[0]  # noqa: E731 - "^a", "a:1" -> "a"
    mapped = {node_of(key) for key in input_map}
    trimmed = graph_pb2.GraphDef(versions=graph_def.versions, library=graph_def.library)
    trimmed.node.extend(node for node in graph_def.node if not (node.op == "Placeholder" and node.name in mapped))
    # With its node gone, a key must be an input some node reads.
    read = {ref if ref.startswith("^") or ":" in ref else f"{ref}:0" for node in trimmed.node for ref in node.input}
    used = {key: t for key, t in input_map.items() if node_of(key) not in mapped or key in read}
    wanted = [ref for ref in outputs if ref not in input_map]
    made = iter(tf.graph_util.import_graph_def(trimmed, input_map=used, return_elements=wanted, name=name))
    return [input_map[ref] if ref in input_map else next(made) for ref in outputs]
