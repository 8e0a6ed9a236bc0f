"""The graph of one step: forward and backward tasks in schedule order, chained per device (or as loops).

Each task of the schedule is built into one graph (``tfpipe.step.tasks``), chained after the previous
task of its device (``tfpipe.step.chain``), its tensors wired to the cells that read them
(``tfpipe.step.wiring``). With ``unroll=False`` the step is instead handed to the looped executor
(``tfpipe.step.looped``): two loops over the same clock cycles, whose graph does not grow with M.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe import schedule
from tfpipe.backward import remat as remat_lib
from tfpipe.backward.gradients import sum_gradients
from tfpipe.distributed import devices, sendrecv
from tfpipe.graph.names import TASK_START
from tfpipe.partition.cell import Cell, tie
from tfpipe.partition.routes import Routes
from tfpipe.schedule import task_scope_name
from tfpipe.step import looped, loss, microbatch
from tfpipe.step.chain import Chain
from tfpipe.step.executor import Executor, StepResult, step_result
from tfpipe.step.handoff import Handoff
from tfpipe.step.loss import LossFn
from tfpipe.step.sums import tied_gradients
from tfpipe.step.tasks import Tasks
from tfpipe.step.wiring import Wiring

# Names importers took from here before the step was split by job.
__all__ = [
    "NOINLINE_TASKS",
    "NOINLINE_TASKS_ACROSS_PROCESSES",
    "TASK_START",
    "LossFn",
    "Pipeline",
    "StepResult",
    "check_remat",
    "check_unroll",
    "sum_gradients",
    "task_scope_name",
    "tied_gradients",
]

# From this many tasks per step (2 K M) on, cells are called as functions that TensorFlow does not inline: inlined,
# Grappler optimizes all K x M copies of every cell before the first run, but a call not inlined costs its own
# dispatch and loses fusions across it. Below the threshold the steady state wins, above it the first step
# (docs/notes/2026-11-benchmark-passes.md#figures-moved-out-of-docstrings-2026-11-26).
NOINLINE_TASKS = 64
# Where a cell is in another process than the client's, a call not inlined costs more (the same note).
NOINLINE_TASKS_ACROSS_PROCESSES = 128


def noinline_tasks(cell_devices: Sequence[str]) -> int:
    """From how many tasks a step stops inlining its cells: later where a cell is in a process not the client's."""
    return NOINLINE_TASKS_ACROSS_PROCESSES if sendrecv.any_remote(cell_devices) else NOINLINE_TASKS


def check_unroll(unroll: Any, remat: str, schedule_name: str = "gpipe") -> bool:
    """Validate ``unroll``: True or False; False (loops) needs re-materialization and runs GPipe's order only."""
    if not isinstance(unroll, bool):
        raise TypeError(f"unroll must be True (one call per task) or False (two loops); got {unroll!r}.")
    if unroll is False and remat == "never":
        raise ValueError(
            "unroll=False runs the step as loops that recompute every cell in the backward pass, so it "
            "cannot keep activations as remat='never' asks; use remat='always' or 'except_last', or unroll=True."
        )
    if unroll is False and schedule_name != "gpipe":
        raise ValueError(
            f"unroll=False runs GPipe's clock cycles as loops; schedule={schedule_name!r} needs unroll=True."
        )
    return unroll


def check_remat(remat: str, schedule_name: str) -> str:
    """Validate ``remat`` for the schedule: "gpipe_batched_w" keeps every activation until W, so it takes "never"."""
    if schedule.batches_weights(schedule_name) and remat != "never":
        raise ValueError(
            f"schedule={schedule_name!r} holds every micro-batch's activations until its weight gradients, "
            f"which recomputation cannot save; use remat='never' with it, not remat={remat!r}."
        )
    return remat


class Pipeline(Executor):
    """Runs cells over micro-batches in the schedule's order (GPipe's by default), with explicit per-task backward.

    Without ``routes`` each cell takes the previous cell's output (the first the
    micro-batch) and the last cell's output is the model's. With ``routes`` (a
    Functional graph) each cell takes tensors from any earlier cell and the model's
    inputs, straight from their producers; a tensor's gradient is the sum of what
    every cell that reads it sends back.

    With ``unroll=False`` each step runs on the looped executor (``looped.Looped``) for as long as
    the loops can run the model; the first step they cannot (``looped.Unsupported``) says so and
    unrolls, as does every step after it.
    """

    cells: list[Cell]
    num_micro_batches: int
    micro_batches_per_step: int  # M: one pipeline's step splits its batch M ways

    def __init__(
        self,
        cells: Sequence[Cell],
        num_micro_batches: int,
        remat: str,
        unroll: bool = True,
        routes: Routes | None = None,
        schedule_name: str = "gpipe",
        num_devices: int | None = None,
    ):
        self.cells = list(cells)
        self.num_devices = len(self.cells) if num_devices is None else num_devices  # K the schedule lays cells over
        self.routes = routes
        self.schedule = schedule.check_name(schedule_name)
        self.remat = check_remat(remat_lib.check_mode(remat), self.schedule)
        check_unroll(unroll, self.remat, self.schedule)
        self.num_micro_batches = self.micro_batches_per_step = num_micro_batches
        self._wiring = Wiring(self.cells, routes)
        self._tasks = Tasks(self.cells, self._wiring, self.schedule, self.remat, num_micro_batches)
        # Loops (tfpipe/step/looped.py) build in a time that does not grow with M, but their later steps are slower
        # than unrolled ones on CPUs (docs/benchmarks.md#the-first-step): the user chooses.
        self._loops = None if unroll else looped.Looped(self.cells, num_micro_batches, routes)
        large = 2 * len(self.cells) * num_micro_batches >= noinline_tasks([cell.device for cell in self.cells])
        for cell in self.cells:
            cell.noinline = large or not unroll

    @property
    def unroll(self) -> bool:
        """Whether steps are unrolled graphs of tasks: asked for, or the loops could not run the model."""
        return self._loops is None

    def prepare(self) -> None:
        """Eagerly, before a step is traced: learn what explicit transfers between processes need."""
        if self._loops is not None:
            self._loops.prepare()
            return
        sendrecv.discover(self._wiring.pairs())

    @tf.autograph.experimental.do_not_convert  # plain Python loops over tasks: converting them only costs trace time
    def forward(
        self,
        inputs: Sequence[Any],
        training: bool = False,
        fractions: Sequence[tf.Tensor] | None = None,
        first: int = 0,
        merge: bool = True,
    ) -> StepResult:
        """Forward-only pass over the micro-batches ``inputs``; training mode also merges state updates.

        ``first`` numbers the micro-batches from there (seeds and ``loss_fn`` take global numbers, as
        a replica's do); ``merge=False`` leaves the state merge to the caller (``StepResult.new_states``).
        """
        return self._run(inputs, training=training, loss_fn=None, fractions=fractions, first=first, merge=merge)

    @tf.autograph.experimental.do_not_convert
    def train(
        self,
        inputs: Sequence[Any],
        loss_fn: LossFn,
        fractions: Sequence[tf.Tensor],
        loss_scale: tf.Tensor | float = 1.0,
        first: int = 0,
        merge: bool = True,
    ) -> StepResult:
        """Forward and backward of one step: summed gradients, loss and merged state updates.

        ``loss_fn(j, y_j)`` is micro-batch j's share of the mini-batch loss (already
        weighted); ``loss_scale`` multiplies every loss before differentiation
        (mixed-precision loss scaling) and is not part of the reported loss. ``first`` and ``merge``
        as for ``forward``.
        """
        return self._run(inputs, True, loss_fn, fractions, loss_scale, first, merge)

    def _run(self, inputs, training, loss_fn, fractions, loss_scale=1.0, first=0, merge=True) -> StepResult:
        if loss_fn is not None:  # the loss of micro-batch j is the caller's micro-batch first + j
            loss_fn = loss.offset(loss_fn, first)
        tie(self.cells)  # a tied variable's regularizer counts in its first cell only
        plan = self._loop_plan(inputs, training)
        if plan is not None:
            assert self._loops is not None  # the plan is the loops'
            return self._loops.run(plan, inputs, training, loss_fn, fractions, loss_scale, first, merge)
        if not tf.executing_eagerly():  # traced by a custom loop too (train_step in the user's tf.function)
            with tf.init_scope():  # the endpoints of explicit sends are learned eagerly (found once per connection)
                self.prepare()
        step = self._begin(inputs, training, loss_fn, fractions, loss_scale, first)
        chain = Chain(self.cells)
        backward = loss_fn is not None
        tasks = schedule.steps(self.schedule, len(self.cells), self.num_micro_batches, backward, self.num_devices)
        for task in tasks:
            self._tasks.run(task, step, chain)
        if loss_fn is not None and self.schedule == "gpipe_batched_w" and first == 0:  # replica 0 takes penalties
            self._tasks.penalties(step)
        m = self.num_micro_batches
        return step_result(
            self.cells,
            m,
            [step.outputs[j] for j in range(m)],
            [step.losses[j] for j in range(m)] if loss_fn is not None else None,
            step.added,
            [chain.held(i, grads) for i, grads in enumerate(step.grads)],
            step.new_state,
            step.weights,
            fractions if training and merge else None,
        )

    def _loop_plan(self, inputs: Sequence[Any], training: bool) -> looped.LoopTraces | None:
        """Which executor runs this step, chosen before it is built: the loops' plan of it, or None to unroll.

        None where ``unroll=True``, or where the loops cannot run the model: then a warning says why
        and the choice stays made, for this step and every later one.
        """
        if self._loops is None:
            return None
        try:
            return self._loops.plan(inputs, training)
        except looped.Unsupported as why:
            # stacklevel: the caller of train or forward, past _run.
            warnings.warn(f"unroll=False: the step cannot run as loops, so it is unrolled: {why}.", stacklevel=4)
            self._loops = None
            return None

    def _begin(self, inputs, training, loss_fn, fractions, loss_scale, first) -> Handoff:
        """A step's bookkeeping, with what every task reads: the weights (read once per step), each cell's
        loss scale, and on each device its own copy of the micro-batches' shares and penalty weights."""
        step = Handoff(
            inputs=inputs,
            training=training,
            loss_fn=loss_fn,
            fractions=fractions,
            loss_scale=loss_scale,
            weights=[cell.read() for cell in self.cells],
            first=first,
        )
        self._wiring.begin(step)
        if loss_fn is not None:
            for cell in self.cells:
                with devices.scope(cell.device):
                    step.scales.append(tf.cast(loss_scale, tf.float32))
            for device in dict.fromkeys(cell.device for cell in self.cells):  # each device reads its own copy
                step.shares[device] = microbatch.unfoldable(fractions, devices.scope(device))
                step.reg_weights[device] = microbatch.unfoldable([1.0, 0.0], devices.scope(device))
        return step
