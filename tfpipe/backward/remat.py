"""Re-materialization: run a cell so that its vector-Jacobian product can be taken later.

A recomputed cell keeps no activations after its forward task; its backward task
runs the pure cell function again under a tape (same inputs, same seeds, so the
same result) and differentiates that. A kept cell records its forward on a tape.
Because cells are pure functions of tensors, recomputation changes no result.

Inside a graph, a recomputed backward can be one traced function, cached per cell in
``tfpipe.backward.traced_vjp.TracedVJPs``: recompute, VJP and the sum into the running
weight gradients, traced once per cell and called once per micro-batch, so that the step
graph does not grow with M by a tape gradient and a sum per weight for every task.
One W over all micro-batches' records (zero bubble's W where every op of it allows, ``tfpipe.backward.batched_w``)
reads the records' split VJPs: ``batch_weights`` and ``batched_weight_vjp``, at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat
from tfpipe.backward import batched_w
from tfpipe.backward import split_vjp as split_lib
from tfpipe.backward.gradients import differentiable, sum_gradients
from tfpipe.backward.traced_vjp import Traced, TracedVJPs
from tfpipe.graph import calls, slim
from tfpipe.graph.names import TRACED_VJP

# Reached through this module by the step (remat_lib.batch_weights, ...), and TracedVJPs by tests.
__all__ = [
    "REMAT_MODES",
    "Checkpoint",
    "TracedVJPs",
    "batch_weights",
    "batched_weight_vjp",
    "check_mode",
    "recomputes",
]

REMAT_MODES = ("always", "except_last", "never")

# How a Checkpoint runs its function, told to it as ``fn(*sources, *extras, forward=...)`` so that the cell it runs
# knows (``Cell.run_traced``): RECORDED, a forward that a tape records (a kept micro-batch's, or a recomputation
# outside a traced VJP); UNRECORDED, the first forward of a micro-batch to recompute, which nothing records (a traced
# cell may run its cheapest form); REPLAYED, the forward again inside a traced VJP (a traced cell replays
# TensorFlow's own differentiation of its forward, so that the recomputation is the forward's own ops).
RECORDED, UNRECORDED, REPLAYED = "recorded", "unrecorded", "replayed"
FORWARDS = (RECORDED, UNRECORDED, REPLAYED)


def _after(anchors: Sequence[tf.Tensor], tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``tensors`` through identities that wait for ``anchors`` (a traced VJP's incoming gradients).

    Inlined into the step, a recomputation is the same ops on the same inputs as the
    forward it repeats, and Grappler's common-subexpression elimination merged the two:
    the forward's activations then lived until the backward and remat saved nothing
    (docs/notes/2026-11-benchmark-passes.md#seventh-pass-fewer-crossings-to-the-client-and-remat-recomputes-again-2026-11-25-later).
    Waiting for the gradients makes the recomputed ops distinct, and starts them when the
    backward's turn comes.
    """
    if not anchors:
        return list(tensors)
    with tf.control_dependencies(anchors):
        return [tf.identity(t) for t in tensors]


def check_mode(remat: str) -> str:
    """Validate a re-materialization mode."""
    if remat not in REMAT_MODES:
        raise ValueError(f"Unknown remat={remat!r}; use one of {', '.join(repr(m) for m in REMAT_MODES)}.")
    return remat


def recomputes(remat: str, micro_batch: int, num_micro_batches: int) -> bool:
    """Whether micro-batch j is recomputed in the backward pass (torchgpipe's checkpoint_stop)."""
    if remat == "always":
        return True
    if remat == "except_last":
        return micro_batch < num_micro_batches - 1
    return False


class Checkpoint:
    """The forward of a pure function ``fn(*sources, *extras)`` whose VJP is taken later by ``vjp``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        sources: Sequence[tf.Tensor],
        recompute: bool,
        constant: int = 0,
        extras: Sequence[tf.Tensor] = (),
        traced: TracedVJPs | None = None,
        key: Any = None,
        split: tuple[int, Callable[[Any], Sequence[tf.Tensor]]] | None = None,
    ):
        """``constant``: how many leading sources need no gradient (the inputs of the first cell).

        ``extras`` are further inputs that need no gradient (seeds, weights of terms). With
        ``traced``, a recomputed VJP inside a graph is a function cached under ``key``, which
        must tell apart every ``fn`` that differs other than through sources and extras.

        ``split=(n, select)`` splits the VJP between ``input_vjp`` (the gradients of all
        sources but the last n, for the gradients of ``select(outputs)``) and ``weight_vjp``
        (those of the last n, the weights), to be called later (zero bubble). Inside a graph
        with ``traced``, W then redoes nothing of B (``tfpipe.backward.split_vjp``); otherwise B computes
        both and W only adds.
        """
        self._fn = fn
        self._sources = list(sources)
        self._extras = list(extras)
        self._recompute = recompute
        self._cache = traced
        self._key = key
        self._wanted = [i for i, s in enumerate(self._sources) if i >= constant and differentiable(s)]
        self._tape: tf.GradientTape | None = None
        self._split_at: int | None  # where the weights start among the sources: B before, W from there (split)
        self._select: Callable[[Any], Sequence[tf.Tensor]] | None  # the outputs B is given gradients of (split)
        self._split_at, self._select = (len(self._sources) - split[0], split[1]) if split else (None, None)
        self._parts: split_lib.SplitVJP | None = None
        self._env: dict[str, tf.Tensor] = {}
        self._weight_grads: list[Any] = []
        self.computed: list[Any] = []  # what input_vjp computed, for W to wait on (the task chain)
        if split and traced is not None and not tf.executing_eagerly():
            self._parts = traced.lookup(self._split_key(), functools.partial(self._trace_split, traced))
            self._env = dict(zip(self._parts.inputs, self._sources + self._extras))
        if self._parts is not None:
            self._parts.part("forward", recompute)(self._env)
            self.outputs = self._parts.unpack(self._env)
        elif recompute:
            self.outputs = fn(*self._sources, *self._extras, forward=UNRECORDED)
        else:
            self._tape, self.outputs = self._record(self._sources, self._extras, RECORDED)

    @property
    def cut(self) -> bool:
        """Whether the VJP is traced cut in B and W parts (split, in a graph, the cell traceable)."""
        return self._parts is not None

    @property
    def sources(self) -> list[tf.Tensor]:
        """The tensors whose gradients the VJP gives."""
        return self._sources

    @property
    def _traced(self) -> TracedVJPs | None:
        """Where the whole VJP is traced: only a recomputation can be (a kept one has its tape)."""
        return self._cache if self._recompute else None

    def _record(self, sources: Sequence[tf.Tensor], extras: Sequence[tf.Tensor], forward: str):
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            for i in self._wanted:
                tape.watch(sources[i])
            outputs = self._fn(*sources, *extras, forward=forward)
        return tape, outputs

    def vjp(
        self,
        select: Callable[[Any], Sequence[tf.Tensor]],
        output_grads: Sequence[tf.Tensor | None],
        accumulate: Sequence[Any] | None = None,
    ) -> list[tf.Tensor | None]:
        """Gradients of the sources for the given gradients of ``select(outputs)``.

        ``accumulate``, if given, holds running sums for the last ``len(accumulate)``
        sources: their gradients come back added to them. Call it inside the backward
        task's device and control-dependency scope: a recomputation then runs there,
        after the incoming gradients exist.
        """
        if self._traced is not None and not tf.executing_eagerly():
            return self._traced_vjp(select, output_grads, list(accumulate or []))
        if self._recompute:
            tape, outputs = self._record(self._sources, self._extras, RECORDED)
        else:
            tape, outputs = self._tape, self.outputs
        self._tape = None  # a kept tape is used once; let its activations go
        grads = self._gradient(tape, outputs, self._sources, select, output_grads)
        result: list[Any] = [None] * len(self._sources)
        for i, g in zip(self._wanted, grads):
            result[i] = g
        return self._accumulate(result, accumulate)

    def input_vjp(
        self, output_grads: Sequence[tf.Tensor | None], batched: batched_w.BatchedW | None = None
    ) -> list[tf.Tensor | None]:
        """B: the gradients of the sources before the weights (None for the weights), as ``vjp``'s.

        Call it inside the B task's scope; ``weight_vjp`` later gives the weights' gradients, or,
        with ``batched`` (``batch_weights``), ``batched_weight_vjp`` those of all micro-batches.
        """
        if self._split_at is None:
            raise ValueError("input_vjp needs a Checkpoint made with split=(number of weights, select).")
        assert self._select is not None  # given with _split_at: split=(n, select)
        if self._parts is None:  # eagerly or untraced: the whole VJP now, the weights' part kept for W
            whole = self.vjp(self._select, output_grads)
            self._weight_grads = whole[self._split_at :]
            self.computed = [g for g in whole if g is not None]
            return whole[: self._split_at] + [None] * (len(whole) - self._split_at)
        given = [g for t, g in zip(self._select(self.outputs), output_grads) if differentiable(t)]
        for name, g, spec in zip(self._parts.dys, given, self._parts.dy_specs):
            self._env[name] = tf.zeros(spec.shape, spec.dtype) if g is None else g
        part = self._parts.part("inputs", self._recompute) if batched is None else batched.inputs_part(self._parts)
        self.computed = part(self._env)
        result: list[Any] = [None] * len(self._sources)
        for i, name in zip([i for i in self._wanted if i < self._split_at], self._parts.dx):
            result[i] = self._env[name]
        return result

    def weight_vjp(self, accumulate: Sequence[Any]) -> list[Any]:
        """W: the weights' gradients added to their running sums ``accumulate``, after ``input_vjp``."""
        assert self._split_at is not None  # a split Checkpoint's, as input_vjp before it
        grads: list[Any]
        if self._parts is None:
            grads = self._weight_grads
        else:
            self._parts.part("weights", self._recompute)(self._env)
            grads = [None] * (len(self._sources) - self._split_at)
            weights = [i - self._split_at for i in self._wanted if i >= self._split_at]
            for k, g in zip(weights, self._parts.weight_gradients(self._env)):
                grads[k] = g
        self._env, self._weight_grads = {}, []  # let go of what W read
        result = [None] * self._split_at + list(grads)
        return self._accumulate(result, accumulate)[self._split_at :]

    def _split_key(self) -> Any:
        return (
            "split",
            self._key,
            self._split_at,
            tuple(self._wanted),
            tuple((tuple(a.shape), a.dtype) for a in self._sources + self._extras),
        )

    def _specs(self, records: Sequence[Checkpoint] = ()) -> list[tf.TensorSpec]:
        """The specs of the sources and extras; with ``records``, the sources before the weights hold all their rows."""
        assert self._split_at is not None  # only a split Checkpoint is traced as one graph (_trace_split)
        specs = []
        for k, a in enumerate(self._sources + self._extras):
            shape = a.shape
            if records and k < self._split_at and shape.rank:
                rows = [r._sources[k].shape[0] for r in records]
                shape = tf.TensorShape([None if None in rows else sum(rows)]).concatenate(shape[1:])
            specs.append(tf.TensorSpec(shape, a.dtype))
        return specs

    def _trace_split(self, traced: TracedVJPs, records: Sequence[Checkpoint] = ()) -> split_lib.SplitVJP:
        """Trace the forward and VJP as one graph, to be cut into forward, B and W (``tfpipe.backward.split_vjp``).

        With ``records``, the sources hold the rows of all of them (W over all micro-batches at once).
        """
        n_src = len(self._sources)

        def body(*flat: tf.Tensor):
            assert self._split_at is not None and self._select is not None  # a split Checkpoint's
            sources, extras = list(flat[:n_src]), list(flat[n_src:])
            with traced.tracing():
                outputs = self._fn(*sources, *extras, forward=REPLAYED)
                targets = [t for t in self._select(outputs) if differentiable(t)]
                dys = [_compat.placeholder(t.dtype, t.shape) for t in targets]
                wanted = [sources[i] for i in self._wanted]
                # Symbolic gradients, not a tape: they honour the cell's gradient overrides (cpu_gradients).
                grads = tf.gradients(
                    targets, wanted, grad_ys=dys, unconnected_gradients=tf.UnconnectedGradients.ZERO
                ) if targets else [tf.zeros_like(w) for w in wanted]  # fmt: skip
            dx = [g for i, g in zip(self._wanted, grads) if i < self._split_at]
            dw = [g for i, g in zip(self._wanted, grads) if i >= self._split_at]
            return outputs, dys, dx, dw

        traced.num_traces += 1
        return split_lib.SplitVJP(body, self._specs(records), traced.wrap, calls.call)

    def _accumulate(self, result: list[Any], accumulate: Sequence[Any] | None) -> list[Any]:
        """``result`` with the gradients of the last ``len(accumulate)`` sources added to their running sums."""
        if accumulate is None:
            accumulate = ()
        n_acc = len(accumulate)
        pairs = [(k, len(self._sources) - n_acc + k) for k in range(n_acc)]
        pairs = [(k, i) for k, i in pairs if accumulate[k] is not None and result[i] is not None]
        dense = [(k, i) for k, i in pairs if not isinstance(accumulate[k], tf.IndexedSlices)]
        dense = [(k, i) for k, i in dense if not isinstance(result[i], tf.IndexedSlices)]
        if self._cache is None or tf.executing_eagerly():
            dense = []
        if dense:  # one call op for all the dense sums instead of one AddV2 per weight in the step graph
            assert self._cache is not None  # none without it
            totals = self._cache.sum([accumulate[k] for k, _ in dense], [result[i] for _, i in dense])
            for (_, i), total in zip(dense, totals):
                result[i] = total
        for k, i in pairs:
            if (k, i) not in dense:
                result[i] = sum_gradients([accumulate[k], result[i]])
        return result

    def _gradient(self, tape, outputs, sources, select, output_grads) -> list[Any]:
        targets = list(select(outputs))
        pairs = [(t, g) for t, g in zip(targets, output_grads) if differentiable(t) and g is not None]
        if not pairs:
            return [tf.zeros_like(sources[i]) for i in self._wanted]
        return tape.gradient(
            [t for t, _ in pairs],
            [sources[i] for i in self._wanted],
            output_gradients=[g for _, g in pairs],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )

    def _traced_vjp(self, select, output_grads, accumulate) -> list[Any]:
        """The VJP as one call of a function traced once per key and signature.

        Dense weight gradients are summed into their running sums inside the function;
        sparse ones (embeddings) come back as slices and are added outside, as ``add`` does.
        """
        cache = self._traced
        assert cache is not None  # vjp comes here for a traced recomputation only
        n_src, n_acc = len(self._sources), len(accumulate)
        grads_in = [tf.convert_to_tensor(g) for g in output_grads if g is not None]
        key = (
            self._key,
            tuple(g is None for g in output_grads),
            tuple(self._wanted),
            tuple((tuple(a.shape), a.dtype) for a in self._sources + self._extras + grads_in),
            n_acc,
        )
        summed = [k for k in range(n_acc) if n_src - n_acc + k in self._wanted]
        sparse = cache.sparse(key)  # known once the key was traced (in any graph)
        sums = []
        for k in summed:
            source, running = self._sources[n_src - n_acc + k], accumulate[k]
            if n_src - n_acc + k in sparse or isinstance(running, tf.IndexedSlices):
                sums.append(cache.placeholder(source))  # unused: slices are summed outside
            elif running is None:  # the first task of a cell adds zeros, so that every task calls one function
                sums.append(tf.zeros_like(source))
            else:
                sums.append(running)
        args = self._sources + self._extras + grads_in + sums
        traced = cache.lookup(key, functools.partial(self._trace, select, output_grads, args, summed, n_acc))
        outputs = iter(calls.call(traced.function, args))
        result: list[Any] = [None] * n_src
        for i in self._wanted:
            if i in traced.sparse:
                values, indices, shape = next(outputs), next(outputs), next(outputs)
                result[i] = tf.IndexedSlices(values, indices, shape)
                k = i - (n_src - n_acc)
                if k >= 0 and accumulate[k] is not None:
                    result[i] = sum_gradients([accumulate[k], result[i]])
            else:
                result[i] = next(outputs)
        return result

    def _trace(self, select, output_grads, args, summed, n_acc) -> Traced:
        cache = self._traced
        assert cache is not None  # traced for a traced recomputation only (_traced_vjp)
        n_src, n_ex = len(self._sources), len(self._extras)
        mask = [g is not None for g in output_grads]
        n_in = sum(mask)
        positions = {n_src - n_acc + k: s for s, k in enumerate(summed)}
        sparse: set[int] = set()

        def body(*flat: tf.Tensor) -> list[tf.Tensor]:
            sources, extras = list(flat[:n_src]), list(flat[n_src : n_src + n_ex])
            given = iter(flat[n_src + n_ex : n_src + n_ex + n_in])
            grads_in = [next(given) if m else None for m in mask]
            sums = flat[n_src + n_ex + n_in :]
            with cache.tracing():
                sources = _after([g for g in grads_in if g is not None], sources)
                tape, outputs = self._record(sources, extras, REPLAYED)
                grads = self._gradient(tape, outputs, sources, select, grads_in)
            out: list[tf.Tensor] = []
            for i, g in zip(self._wanted, grads):
                if isinstance(g, tf.IndexedSlices):  # its running sum is kept outside, as slices
                    sparse.add(i)
                    out += [g.values, g.indices, tf.cast(g.dense_shape, tf.int64)]
                elif i in positions:
                    total = g + sums[positions[i]]
                    total.set_shape(g.shape)
                    out.append(total)
                else:
                    out.append(g)
            return out

        body.__name__ = TRACED_VJP  # how tfpipe.analysis.graph_tasks recognizes the call in a step's graph
        cache.num_traces += 1
        # Running sums are typed without a static shape: a sparse gradient's slot gets an empty placeholder.
        specs = [tf.TensorSpec(a.shape, a.dtype) for a in args[: len(args) - len(summed)]]
        specs += [tf.TensorSpec([None] * a.shape.rank, a.dtype) for a in args[len(args) - len(summed) :]]
        options = cache.options()
        function = tf.function(body, autograph=False, **options).get_concrete_function(*specs)
        if options["experimental_attributes"]:  # called, not inlined: once per micro-batch, each call site
            with cache.tracing():  # costing with the body's size
                function = slim.slimmed(function, TRACED_VJP, options)
        return Traced(function, frozenset(sparse))


# One W over a cell's micro-batches: from the records' split VJPs (Checkpoint's own state) to batched_w.BatchedW.


def batch_weights(records: Sequence[Checkpoint], shared_grads: Sequence[bool]) -> batched_w.BatchedW | str | None:
    """Cut the W of one cell's micro-batches ``records`` (after their forwards) so that it runs once over all of them.

    ``shared_grads[k]`` says that the gradient of the k-th selected output will be the same
    tensor in every micro-batch (the loss scale, for added losses). Returns the cut, to be
    handed to each record's ``input_vjp`` and to ``batched_weight_vjp``; else why not (a
    string), or None where there is nothing to batch (one micro-batch; no traced W, as eagerly).
    """
    first = records[0]
    parts = [r._parts for r in records if r._parts is not None]
    if len(records) < 2 or len(parts) < len(records) or any(r._recompute for r in records) or first._cache is None:
        return None
    assert first._select is not None  # a record with parts was made with split=(n, select)
    given = [d for t, d in zip(first._select(first.outputs), shared_grads) if differentiable(t)]
    shared = {name for name, d in zip(parts[0].dys, given) if d}
    # The inputs fed as the same tensor to every micro-batch (a weight, a seed); a capture of the traced body is
    # not fed, and W does not read it (an activity regularizer's leaves one).
    fed = [name for name in parts[0].inputs if name in first._env]
    shared |= {name for name in fed if all(r._env.get(name) is first._env[name] for r in records)}
    try:
        key = ("batched", tuple(r._split_key() for r in records))
        big = first._cache.lookup(key, functools.partial(first._trace_split, first._cache, records))
        return batched_w.BatchedW(parts, big, shared)
    except batched_w.Unbatchable as why:
        return str(why)


def batched_weight_vjp(records: Sequence[Checkpoint], batched: batched_w.BatchedW) -> list[Any]:
    """W over all micro-batches' ``records``, each after ``input_vjp(..., batched)``: the summed weight gradients."""
    first = records[0]
    assert first._split_at is not None  # batch_weights cut the W of split records
    grads = batched.run([r._env for r in records])
    result: list[Any] = [None] * (len(first._sources) - first._split_at)
    for k, g in zip([i - first._split_at for i in first._wanted if i >= first._split_at], grads):
        result[k] = g
    for r in records:
        r._env = {}  # let go of what W read
    return result
