"""The step as two loops over GPipe's clock cycles, forward then backward: a graph that does not grow with M.

At clock cycle t, cell k runs micro-batch j = t - k (``schedule.gpipe``). Unrolled, a
step holds 2 K M cell calls; here it holds 2 K, inside two ``tf.while_loop``s of
M + K - 1 iterations whose iterations may overlap, so each cell runs as soon as its
input has arrived. At a cycle where a cell has no micro-batch (a bubble) a ``tf.cond``
skips it: an empty batch goes on, nothing is added. Every backward recomputes its
cell from the input stashed by the forward loop, so re-materialization is always on
(the backward loop: ``tfpipe.step.loop_backward``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.distributed import devices
from tfpipe.leaves import fill, flat
from tfpipe.partition.cell import Cell, tie
from tfpipe.partition.routes import Routes
from tfpipe.step import loop_backward, loss
from tfpipe.step.executor import Executor, StepResult, step_result
from tfpipe.step.loop_backward import LossGrads
from tfpipe.step.loop_cycles import (
    Cycle,
    LoopOutputs,
    Loops,
    LoopTraces,
    array,
    empty,
    micro_batch_at,
    rows,
    unknown_batch,
)
from tfpipe.step.loss import LossFn

__all__ = ["Looped", "LoopTraces", "Unsupported", "build", "micro_batch_at"]  # micro_batch_at: GPipe's clock, for tests


class Unsupported(Exception):
    """The pipeline cannot run as loops (a cell cannot be traced, or a tensor between cells has an unknown
    inner dimension); raised before any op of the loops is made, so the caller can unroll instead."""


class Looped(Executor):
    """Runs each step as two loops over GPipe's clock cycles, recomputing every cell in the backward loop."""

    cells: list[Cell]
    num_micro_batches: int
    micro_batches_per_step: int  # M: one pipeline's step splits its batch M ways
    unroll = False

    def __init__(self, cells: Sequence[Cell], num_micro_batches: int, routes: Routes | None = None):
        self.cells, self.num_micro_batches, self.routes = list(cells), num_micro_batches, routes
        self.micro_batches_per_step = num_micro_batches
        tpu = [cell.device for cell in self.cells if devices.tpu_core(cell.device) is not None]
        if tpu:
            raise ValueError(
                f"unroll=False needs cells traced as functions, which TPU cores {tpu} do not run; use unroll=True."
            )

    def prepare(self) -> None:
        """Nothing to learn: the loops send nothing explicitly between processes."""

    def forward(
        self,
        inputs: Sequence[Any],
        training: bool = False,
        fractions: Sequence[tf.Tensor] | None = None,
        first: int = 0,
        merge: bool = True,
    ) -> StepResult:
        """Forward-only pass over the micro-batches ``inputs`` (``first`` and ``merge`` as ``Pipeline.forward``'s)."""
        tie(self.cells)
        return self.run(self.plan(inputs, training), inputs, training, None, fractions, first=first, merge=merge)

    def train(
        self,
        inputs: Sequence[Any],
        loss_fn: LossFn,
        fractions: Sequence[tf.Tensor],
        loss_scale: tf.Tensor | float = 1.0,
        first: int = 0,
        merge: bool = True,
    ) -> StepResult:
        """Forward and backward of one step (the arguments as ``Pipeline.train``'s)."""
        tie(self.cells)
        plan = self.plan(inputs, True)
        return self.run(plan, inputs, True, loss.offset(loss_fn, first), fractions, loss_scale, first, merge)

    def plan(self, inputs: Sequence[Any], training: bool) -> LoopTraces:
        """The weights read for the step and every cell traced for its inputs; ``Unsupported`` where the loops
        cannot run the model, before any op of theirs."""
        if self.routes is not None:
            raise Unsupported(
                "a Functional model's cells take their inputs through routes (tensors may skip cells), which the "
                "loops do not carry"
            )
        weights = [cell.read() for cell in self.cells]
        traces, structures = _trace_forward(self.cells, weights, inputs[0], training)
        return LoopTraces(weights, traces, structures)

    def run(
        self,
        plan: LoopTraces,
        inputs: Sequence[Any],
        training: bool,
        loss_fn: LossFn | None,
        fractions: Sequence[Any] | None,
        loss_scale: Any = 1.0,
        first: int = 0,
        merge: bool = True,
    ) -> StepResult:
        """The planned step; ``loss_fn`` (None: forward only) numbers this executor's micro-batches from 0."""
        loss_grads = None
        if loss_fn is not None:
            last = self.cells[-1]
            loss_grads = functools.partial(loss.on_cell, loss_fn, loss_scale=loss_scale, leaves=None, cell=last)
        result = build(self.cells, plan, inputs, fractions, loss_grads, loss_scale, first)
        return step_result(
            self.cells,
            self.num_micro_batches,
            result.outputs,
            result.losses if loss_fn is not None else None,
            result.added,
            result.grads,
            result.new_state,
            plan.weights,
            fractions if training and merge else None,
        )


def build(
    cells: Sequence[Cell],
    plan: LoopTraces,
    inputs: Sequence[Any],
    fractions: Sequence[Any] | None,
    loss_grads: LossGrads | None = None,
    loss_scale: Any = 1.0,
    first: int = 0,
) -> LoopOutputs:
    """Forward (and with ``loss_grads`` backward) of one step over the micro-batches ``inputs``, as planned.

    ``first`` is the global number of micro-batch 0 (a replica's first), from which seeds are drawn.
    """
    m = len(inputs)
    with devices.scope(cells[0].device):
        shares = tf.stack([tf.cast(f, tf.float32) for f in (fractions or [1.0] * m)])
        sources = _input_arrays(inputs)
    loops = Loops(cells, plan, [flat(s) for s in plan.structures], shares, m, first)
    stashes, states, outs, added = _forward_loop(loops, sources, backward=loss_grads is not None)
    result = _forward_results(loops, states, outs, added)
    if loss_grads is not None:
        loop_backward.backward(loops, stashes, loss_grads, loss_scale, result)
    return result


def _input_arrays(inputs: Sequence[Any]) -> list[tf.TensorArray]:
    """Each input leaf's micro-batches in one array, indexed by micro-batch."""
    sources = []
    for position, leaf in enumerate(tf.nest.flatten(inputs[0])):
        if leaf is None:
            continue
        parts = array(tf.TensorSpec(leaf.shape, leaf.dtype), len(inputs))
        for j, part in enumerate(inputs):
            parts = parts.write(j, tf.nest.flatten(part)[position])
        sources.append(parts)
    return sources


def _forward_variables(loops: Loops, backward: bool) -> tuple[list, list, list, list, list]:
    """The forward loop's variables at cycle 0: (what each cell sends on, stashed inputs (training), state
    values per cycle, output arrays, added losses)."""
    carries, stashes, states, added = [], [], [], []
    for k, cell in enumerate(loops.cells):
        with devices.scope(cell.device):
            if k > 0:
                carries.append([empty(s) for s in loops.specs[k]])
            stashes.append([array(s, loops.cycles) for s in loops.specs[k]] if backward else [])
            old, changed = loops.plan.weights[k][1], loops.plan.traces[k].changed
            states.append([array(tf.TensorSpec(old[c].shape, old[c].dtype), loops.cycles) for c in changed])
            added.append(tf.constant(0.0))
    with devices.scope(loops.cells[-1].device):
        outs = [array(s, loops.cycles) for s in loops.specs[-1]]
    return carries, stashes, states, outs, added


def _forward_loop(loops: Loops, sources: list[tf.TensorArray], backward: bool) -> tuple[list, list, list, list]:
    """The forward loop over the cycles: (stashed inputs per cell, state arrays per cell, outputs, added losses)."""
    cells, k_cells, structures = loops.cells, len(loops.cells), loops.plan.structures

    def forward_body(t, carries, stashes, states, outs, added):
        arrived = list(carries)  # what the cells sent in the previous cycle
        carries, stashes, states, added = list(carries), list(stashes), list(states), list(added)
        for k, cell in enumerate(cells):
            with devices.scope(cell.device):
                c = Cycle(t, k, loops.m, loops.shares)
                leaves = [rows(a.read(c.clipped), c.valid) for a in sources] if k == 0 else arrived[k - 1]
                if backward:
                    stashes[k] = [a.write(t, x) for a, x in zip(stashes[k], leaves)]
                x = tf.nest.pack_sequence_as(structures[k], fill(structures[k], leaves))
                trace, trainable = loops.plan.traces[k], loops.plan.weights[k][0]
                y_leaves, changed, terms = _forward_or_bubble(
                    trace, x, trainable, loops.seeds(k, c), c.valid, loops.specs[k + 1]
                )
                states[k] = [a.write(t, v) for a, v in zip(states[k], changed)]
                added[k] = added[k] + terms * c.share
                if k < k_cells - 1:
                    carries[k] = y_leaves
                else:
                    outs = [a.write(t, leaf) for a, leaf in zip(outs, y_leaves)]
        return t + 1, carries, stashes, states, outs, added

    variables = _forward_variables(loops, backward)
    _, _, stashes, states, outs, added = tf.while_loop(
        lambda t, *_: t < loops.cycles,
        forward_body,
        (tf.constant(0), *variables),
        parallel_iterations=loops.cycles,  # any cycle may start once its inputs exist: cell 0 runs ahead, as in GPipe
    )
    return stashes, states, outs, added


def _forward_results(loops: Loops, states: list, outs: list, added: list) -> LoopOutputs:
    """The forward loop's arrays read per micro-batch: the model's outputs and each cell's state values."""
    cells, k_cells, m, structures = loops.cells, len(loops.cells), loops.m, loops.plan.structures
    result = LoopOutputs(outputs=[], losses=[], added=list(added), grads=[], new_state={})
    with devices.scope(cells[-1].device):
        for j in range(m):
            leaves = fill(structures[-1], [a.read(j + k_cells - 1) for a in outs])
            result.outputs.append(tf.nest.pack_sequence_as(structures[-1], leaves))
    for k, cell in enumerate(cells):
        with devices.scope(cell.device):
            for j in range(m):
                values = list(loops.plan.weights[k][1])
                for a, i in zip(states[k], loops.plan.traces[k].changed):
                    values[i] = a.read(j + k)
                result.new_state[(k, j)] = values
    return result


def _forward_or_bubble(trace, x, trainable, seeds, valid, out_specs):
    """The cell's forward at one cycle: (output leaves, changed state values, added losses); a bubble skips it.

    A bubble's outputs are empty batches, its state values the ones it was given, its added loss 0.
    """

    def forward():
        y, new_state, terms = trace.apply(x, trainable, seeds)
        return flat(y), [new_state[i] for i in trace.changed], terms

    def bubble():
        return [empty(s) for s in out_specs], [tf.identity(seeds[i]) for i in trace.changed], tf.constant(0.0)

    return tf.cond(valid, forward, bubble)


def _trace_forward(cells, weights, first_input, training):
    """Each cell traced for a micro-batch of unknown size; the structures of specs between the cells."""
    structure = tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec(unknown_batch(t.shape), t.dtype), first_input
    )
    traces, structures = [], [structure]
    for k, cell in enumerate(cells):
        trace = cell.traced(structure, weights[k][0], weights[k][1], training)
        if trace is None:
            raise Unsupported(f"cell {k} cannot be traced as a function")
        outputs = iter(trace.function.outputs)
        leaves = [None if leaf is None else next(outputs) for leaf in tf.nest.flatten(trace.y)]
        structure = tf.nest.pack_sequence_as(
            trace.y, [None if t is None else tf.TensorSpec(unknown_batch(t.shape), t.dtype) for t in leaves]
        )
        unknown = [t for t in flat(structure) if not t.shape[1:].is_fully_defined()]
        if unknown:  # a bubble passes on an empty batch, which needs every other dimension
            raise Unsupported(f"cell {k} outputs {unknown[0]}, whose inner dimensions are not all known")
        traces.append(trace)
        structures.append(structure)
    return traces, structures
