"""Zero bubble's split backward: one traced VJP of a cell, cut into forward, B (input gradients) and W (weights').

The cell's forward and VJP are traced once, as one graph, and its ops are cut in
three: the forward (what the cell's outputs need), B (what the gradients of the
cell's inputs need beyond the forward) and W (what only the weight gradients
need: for a Dense layer, the one MatMul x^T dy). Each part becomes a function of
the tensors it reads from the parts before it, so W runs later from the
activations and intermediate gradients B leaves it, redoing neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat

PARTS = ("forward", "inputs", "weights")


@dataclasses.dataclass
class _Part:
    """One part of the graph as a function: the tensors (by name in the whole graph) it reads and returns."""

    function: Any  # a ConcreteFunction of the ``feeds`` returning the ``fetches`` (None if it has none)
    feeds: list[str]
    fetches: list[str]
    call: Callable[[Any, list[tf.Tensor]], list[tf.Tensor]]  # how a task calls ``function`` on its arguments

    def __call__(self, env: dict[str, tf.Tensor]) -> list[tf.Tensor]:
        """Run it on the tensors in ``env``; its results join ``env`` under their names, and are returned."""
        if not self.fetches:  # nothing of it is needed: its results are the inputs themselves
            return []
        outputs = list(self.call(self.function, [env[name] for name in self.feeds]))
        env.update(zip(self.fetches, outputs))
        return outputs


class SplitVJP:
    """A cell's forward and VJP traced as one graph of (sources, extras), cut into forward, B and W parts.

    Callers keep an ``env``: the graph's input tensors by name, to which each part
    adds the tensors it computes; a later part reads what it needs from there.
    """

    def __init__(
        self,
        body: Callable[..., tuple[Any, list[tf.Tensor], list[Any], list[Any]]],
        specs: Sequence[tf.TensorSpec],
        wrap: Callable[[Any, Sequence[tf.TensorSpec], str], Any],
        call: Callable[[Any, list[tf.Tensor]], list[tf.Tensor]] = lambda function, args: list(function(*args)),
    ):
        """``body(*inputs)`` returns (outputs, output-gradient placeholders, input gradients, weight gradients).

        ``outputs`` is any nest of tensors and None; ``body`` makes a placeholder for the
        gradient of each output it differentiates. Weight gradients that are
        ``tf.IndexedSlices`` (embeddings) come back as three tensors. ``wrap(fn, specs, part)``
        makes a part's function (a function of tensors) into the function the step graph calls, and
        ``call(function, args)`` calls that.
        """
        found: dict[str, Any] = {}

        def traced(*flat: tf.Tensor) -> list[tf.Tensor]:
            outputs, found["dys"], dx, dw = body(*flat)
            leaves = tf.nest.flatten(outputs)
            found["template"] = tf.nest.pack_sequence_as(outputs, [None if t is None else 0 for t in leaves])
            found["outputs"] = leaves
            found["sparse"] = frozenset(k for k, g in enumerate(dw) if isinstance(g, tf.IndexedSlices))
            found["dx"] = [tf.convert_to_tensor(g) for g in dx]
            found["dw"] = [t for g in dw for t in _components(g)]
            return [t for t in leaves if t is not None] + found["dx"] + found["dw"]

        whole = _compat.wrap_function(traced, specs)
        # Only its graph is kept: the parts are cut from it and called, never the whole. Kept, the whole's
        # function outlived the step (its cell's traces hold the outer graph) and, after a worker restart and a new
        # connection, TensorFlow's removal of it from the old context failed the restore (tfpipe.recovery).
        self._graph: tf.Graph = whole.graph
        self._wrap, self._call = wrap, call
        self._template = found["template"]
        self.inputs = [t.name for t in whole.inputs]  # the sources and extras, in order
        self.dys = [t.name for t in found["dys"]]
        self.dy_specs = [tf.TensorSpec(t.shape, t.dtype) for t in found["dys"]]
        self.outputs = [None if t is None else t.name for t in found["outputs"]]
        self.dx = [t.name for t in found["dx"]]
        self.dw = [t.name for t in found["dw"]]
        self.sparse = found["sparse"]  # positions among the weight gradients that are slices
        graph = self._graph
        placeholders = {graph.get_tensor_by_name(name).op for name in self.inputs + self.dys}
        forward = ancestors(graph.get_tensor_by_name(n) for n in self.outputs if n is not None) - placeholders
        backward = ancestors(graph.get_tensor_by_name(n) for n in self.dx) - forward - placeholders
        weights = ancestors(graph.get_tensor_by_name(n) for n in self.dw) - forward - backward - placeholders
        self._sets = {"forward": forward, "backward": backward, "weights": weights, "inputs": placeholders}
        self._parts: dict[Any, _Part] = {}
        self._graph_def: Any = None

    @property
    def graph(self) -> tf.Graph:
        """The traced graph of the forward and VJP, whose tensor names the parts and ``env`` use."""
        return self._graph

    def unpack(self, env: dict[str, tf.Tensor]) -> Any:
        """The outputs, as ``body`` returned them, from the tensors in ``env``."""
        leaves = [None if name is None else env[name] for name in self.outputs]
        return tf.nest.pack_sequence_as(self._template, leaves)

    def weight_gradients(self, env: dict[str, tf.Tensor]) -> list[Any]:
        """The weight gradients from the tensors in ``env``, slices put back together."""
        flat, out = iter(self.dw), []
        for k in range(len(self.dw) - 2 * len(self.sparse)):
            if k in self.sparse:
                values, indices, shape = env[next(flat)], env[next(flat)], env[next(flat)]
                out.append(tf.IndexedSlices(values, indices, shape))
            else:
                out.append(env[next(flat)])
        return out

    def part(self, name: str, recompute: bool) -> _Part:
        """The function of part ``name`` (one of PARTS), for a forward kept or recomputed in B."""
        if (name, recompute) not in self._parts:
            self._parts[(name, recompute)] = self._cut(name, recompute)
        return self._parts[(name, recompute)]

    def _ops(self, name: str, recompute: bool) -> set[tf.Operation]:
        sets = self._sets
        if name == "inputs" and recompute:  # B runs the forward again, and hands W what W reads of it
            return sets["forward"] | sets["backward"]
        return sets["backward" if name == "inputs" else name]

    def _wanted(self, name: str) -> list[str]:
        return {"forward": [n for n in self.outputs if n is not None], "inputs": self.dx, "weights": self.dw}[name]

    def _inside(self, tensor: str, ops: set[tf.Operation]) -> bool:
        """Whether a part with ``ops`` computes ``tensor`` itself (a constant, every part copies)."""
        op = self._graph.get_tensor_by_name(tensor).op
        return op in ops or op.type == "Const"

    def _needs(self, name: str, recompute: bool) -> list[str]:
        """What part ``name`` takes from the graph's inputs and the parts before it."""
        ops = self._ops(name, recompute)
        outside = [n for n in self._wanted(name) if not self._inside(n, ops)]  # results a part before computes
        every = set().union(*self._sets.values())
        return list(dict.fromkeys(_read(ops, every - ops) + outside))

    def _cut(self, name: str, recompute: bool) -> _Part:
        ops = self._ops(name, recompute)
        later = ("weights",) if name == "inputs" else PARTS[PARTS.index(name) + 1 :]
        if name == "forward" and recompute:  # B runs the forward again and hands W what it reads: only the outputs
            later = ()
        wanted = self._wanted(name) + [n for p in later for n in self._needs(p, recompute)]
        return self._make(name, ops, wanted)

    def ops(self, part: str) -> set[tf.Operation]:
        """The ops of part ``part`` (one of PARTS) of a forward that is kept, not recomputed."""
        return set(self._ops(part, recompute=False))

    def cut(self, key: Any, name: str, ops: set[tf.Operation], wanted: Sequence[str]) -> _Part:
        """A part of any ``ops`` of the graph that returns those of ``wanted`` they compute, made once per ``key``."""
        if key not in self._parts:
            self._parts[key] = self._make(name, ops, wanted)
        return self._parts[key]

    def _make(self, name: str, ops: set[tf.Operation], wanted: Sequence[str]) -> _Part:
        fetches = list(dict.fromkeys(n for n in wanted if self._inside(n, ops)))
        feeds = _read(ops, set().union(*self._sets.values()) - ops)
        graph = self._graph
        specs = [tf.TensorSpec(graph.get_tensor_by_name(n).shape, graph.get_tensor_by_name(n).dtype) for n in feeds]
        subgraph = self._subgraph(ops | {graph.get_tensor_by_name(n).op for n in fetches})

        def run(*flat: tf.Tensor) -> list[tf.Tensor]:
            return tf.graph_util.import_graph_def(
                subgraph, input_map=dict(zip(feeds, flat)), return_elements=fetches, name=name
            )

        return _Part(self._wrap(run, specs, name) if fetches else None, feeds, fetches, self._call)

    def _subgraph(self, ops: set[tf.Operation]) -> Any:
        """A GraphDef of just ``ops`` and the constants they read; other inputs come from ``input_map``.

        (``WrappedFunction.prune`` would copy every ancestor of its feeds too, and trips over
        ops with several outputs of which only some are fed.)
        """
        if self._graph_def is None:
            self._graph_def = self._graph.as_graph_def()
        names = {op.name for op in ops} | {t.op.name for op in ops for t in op.inputs if t.op.type == "Const"}
        subgraph = type(self._graph_def)()
        subgraph.versions.CopyFrom(self._graph_def.versions)
        subgraph.library.CopyFrom(self._graph_def.library)
        for node in self._graph_def.node:
            if node.name in names:
                copy = subgraph.node.add()
                copy.CopyFrom(node)
                del copy.input[:]  # control inputs from ops of other parts go: those ops ran before
                copy.input.extend(i for i in node.input if not i.startswith("^") or i[1:] in names)
                if "_class" in copy.attr:  # colocation with an op of another part: its device says where
                    kept = [c for c in copy.attr["_class"].list.s if c.decode().removeprefix("loc:@") in names]
                    del copy.attr["_class"].list.s[:]
                    copy.attr["_class"].list.s.extend(kept)
                    if not kept:
                        del copy.attr["_class"]
        return subgraph


def _components(g: Any) -> list[tf.Tensor]:
    if isinstance(g, tf.IndexedSlices):
        return [g.values, g.indices, tf.cast(g.dense_shape, tf.int64)]
    return [g]


def ancestors(tensors: Iterable[tf.Tensor]) -> set[tf.Operation]:
    """Every op that ``tensors`` depend on, by data or control edges, their own ops included."""
    seen: set[tf.Operation] = set()
    stack = [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def _read(consumers: set[tf.Operation], producers: set[tf.Operation]) -> list[str]:
    """Names of the tensors of ``producers`` that ``consumers`` read, constants excepted (each part has its own)."""
    names: dict[str, None] = {}
    for op in sorted(consumers, key=lambda o: o.name):
        for t in op.inputs:
            if t.op in producers and t.op.type != "Const":
                names[t.name] = None
    return list(names)
