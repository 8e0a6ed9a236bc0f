"""The graph of one step: forward and backward tasks in schedule order, chained per device (or as loops).

TensorFlow runs any op whose inputs are ready; the only way to make a device
run its tasks in the schedule's order is to give each task a control
dependency on the previous task of the same device. Each task is also a name
scope ``F_i_j`` / ``B_i_j`` so that the order can be read back from the graph.
With ``unroll=False`` the step is instead handed to ``tfpipe.step.looped``: two loops
over the same clock cycles, whose graph does not grow with M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfpipe.backward import remat as remat_lib
from tfpipe.distributed import devices, sendrecv
from tfpipe.graph.names import TASK_END, TASK_START
from tfpipe.partition.cell import Cell, add_dense, tie
from tfpipe.partition.routes import MODEL_INPUT, Routes
from tfpipe.step import looped, loss, microbatch, schedule, state
from tfpipe.step.loss import LossFn
from tfpipe.step.schedule import task_scope_name

# From this many tasks per step (2 K M) on, cells are called as functions that TensorFlow does not
# inline. Inlined, Grappler optimizes all K x M copies of every cell before the first run: an
# 8-block Transformer's first step took 120 s at K=2, M=32 (54 s not inlined) and 118 s at K=8,
# M=32 (60 s). But a call that is not inlined costs its own dispatch and loses fusions across the
# call, measured on single-thread workers: an MLP (8 x Dense(256), batch 1024) at K=1, M=8 ran
# 0.74x as fast as inlined. Below the threshold the steady state wins; above it the first step.
NOINLINE_TASKS = 64


@dataclasses.dataclass
class StepResult:
    """What one pipelined step produced."""

    outputs: list[Any]  # per micro-batch outputs of the last cell
    loss: tf.Tensor | None = None  # total (unscaled) loss of the mini-batch
    # Forward only: the layers' add_loss terms (activity regularizers), each micro-batch's weighted by its share.
    added_loss: tf.Tensor | None = None
    gradients: list[tf.Tensor] = dataclasses.field(default_factory=list)  # aligned with ``variables``
    variables: list[keras.Variable] = dataclasses.field(default_factory=list)
    state_updates: list[tuple[keras.Variable, tf.Tensor]] = dataclasses.field(default_factory=list)
    # Unmerged, for a caller that merges several pipelines' (replicas'): each cell's values as read at the
    # step's start, (trainable, non-trainable), and its non-trainable values after each micro-batch.
    weights: list[tuple[list[tf.Tensor], list[tf.Tensor]]] = dataclasses.field(default_factory=list)
    new_states: list[list[list[tf.Tensor]]] = dataclasses.field(default_factory=list)


def _flat(x: Any) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(x) if t is not None]


def _differentiated(out: Any) -> list[tf.Tensor]:
    """What a cell's backward differentiates of its (outputs, new state, added losses): outputs and added losses."""
    return _flat(out[0]) + [out[2]]


class _Chain:
    """Control-dependency chains, one per device, plus the device scope of each task."""

    def __init__(self, cells: Sequence[Cell]):
        self._cells = cells
        self._last: dict[str, list[tf.Tensor]] = {}

    @contextlib.contextmanager
    def task(self, task: schedule.Task, extra_deps: Sequence[tf.Tensor] = ()) -> Iterator[list[tf.Tensor]]:
        """Open the task's device, name and control scope; the caller appends the task's results."""
        device = self._cells[task.cell].device
        produced: list[tf.Tensor] = []
        deps = [t for t in list(self._last.get(device, [])) + list(extra_deps) if t is not None]
        with devices.scope(device), tf.name_scope(task_scope_name(task)), tf.control_dependencies(deps):
            # Marks where the task's ops begin in the graph; tape gradients are named
            # after their forward ops, so names alone cannot attribute them to a task.
            start = tf.no_op(name=TASK_START)
            yield produced
            self._last[device] = _task_end(produced) or [start]  # a task that computes nothing passes it on


def _task_end(produced: Sequence[Any]) -> list[Any]:
    """What the device's next task waits for: one op that reads every tensor the task produced, and its ops.

    Not the tensors themselves: a control edge from the output of a function call that TensorFlow
    inlines becomes an edge from the call's control outputs, which a pure function does not have.
    The next task could then start with this one's inputs, not after its outputs; measured on
    workers, 1F1B's cell 1 ran F3 B3 F7 B7 F6 B6 ... instead of F0 B0 F1 B1 ...
    Eagerly (``run_eagerly=True``) tasks run in program order and there is nothing to wait for.
    """
    if tf.executing_eagerly():
        return []
    tensors, ops = [], []
    for item in produced:
        if isinstance(item, tf.IndexedSlices):
            tensors += [item.values, item.indices]
        elif isinstance(item, tf.Operation):
            ops.append(item)
        else:
            tensors.append(item)
    if tensors:
        ops.append(tf.raw_ops.IdentityN(input=tensors, name=TASK_END)[0].op)
    return ops


def check_unroll(unroll: Any, remat: str) -> bool:
    """Validate ``unroll``: True or False; False (loops) needs re-materialization."""
    if not isinstance(unroll, bool):
        raise TypeError(f"unroll must be True (one call per task) or False (two loops); got {unroll!r}.")
    if unroll is False and remat == "never":
        raise ValueError(
            "unroll=False runs the step as loops that recompute every cell in the backward pass, so it "
            "cannot keep activations as remat='never' asks; use remat='always' or 'except_last', or unroll=True."
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


class Pipeline:
    """Runs cells over micro-batches in the schedule's order (GPipe's by default), with explicit per-task backward.

    Without ``routes`` each cell takes the previous cell's output (the first the
    micro-batch) and the last cell's output is the model's. With ``routes`` (a
    Functional graph) each cell takes tensors from any earlier cell and the model's
    inputs, straight from their producers; a tensor's gradient is the sum of what
    every cell that reads it sends back.
    """

    def __init__(
        self,
        cells: Sequence[Cell],
        num_micro_batches: int,
        remat: str,
        unroll: bool = True,
        routes: Routes | None = None,
        schedule_name: str = "gpipe",
    ):
        self.cells = list(cells)
        self.routes = routes
        self.schedule = schedule.check_name(schedule_name)
        if not unroll and self.schedule != "gpipe":
            raise ValueError(
                f"unroll=False runs GPipe's clock cycles as loops; schedule={schedule_name!r} needs unroll=True."
            )
        self.num_micro_batches = num_micro_batches
        self.remat = check_remat(remat_lib.check_mode(remat), self.schedule)
        self._unbatched: set[int] = set()  # cells told that their W does not batch (warned once)
        # Loops (tfpipe/step/looped.py) build in a time that does not grow with M, but their later steps were
        # 10-55% slower than unrolled ones on CPUs (docs/benchmarks.md): the user chooses.
        self.unroll = check_unroll(unroll, self.remat)
        tpu = [cell.device for cell in self.cells if devices.tpu_core(cell.device) is not None]
        if not self.unroll and tpu:
            raise ValueError(
                f"unroll=False needs cells traced as functions, which TPU cores {tpu} do not run; use unroll=True."
            )
        large = 2 * len(self.cells) * num_micro_batches >= NOINLINE_TASKS
        for cell in self.cells:
            cell.noinline = large or not self.unroll

    def prepare(self) -> None:
        """Eagerly, before a step is traced: learn what explicit transfers between processes need."""
        if not self.unroll:
            return
        if self.routes is None:
            pairs = {(a.device, b.device) for a, b in zip(self.cells, self.cells[1:])}
        else:
            pairs = {(p.device, self.cells[c].device) for p in self.cells for c in self.routes.readers(p.index)}
        # Activations go forward, their gradients back: both ways across processes are sent explicitly.
        pairs |= {(b, a) for a, b in pairs}
        sendrecv.discover(sorted((a, b) for a, b in pairs if a != b))

    def _schedule(self, backward: bool) -> list[schedule.Task]:
        return schedule.steps(self.schedule, len(self.cells), self.num_micro_batches, backward=backward)

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
        if not self.unroll:
            try:
                return self._run_loops(inputs, training, loss_fn, fractions, loss_scale, first, merge)
            except looped.Unsupported as why:
                warnings.warn(f"unroll=False: the step cannot run as loops, so it is unrolled: {why}.", stacklevel=3)
                self.unroll = True
        step = _Step(
            inputs=inputs,
            training=training,
            loss_fn=loss_fn,
            fractions=fractions,
            loss_scale=loss_scale,
            weights=[cell.read() for cell in self.cells],
            first=first,
        )  # read once per step
        if self.routes is not None:
            step.flat_inputs = [self.routes.flatten_inputs(x) for x in inputs]
        chain = _Chain(self.cells)
        if loss_fn is not None:
            for cell in self.cells:
                with devices.scope(cell.device):
                    step.scales.append(tf.cast(loss_scale, tf.float32))
            for device in dict.fromkeys(cell.device for cell in self.cells):  # each device reads its own copy
                step.shares[device] = microbatch.unfoldable(fractions, devices.scope(device))
                step.reg_weights[device] = microbatch.unfoldable([1.0, 0.0], devices.scope(device))
        for task in self._schedule(backward=loss_fn is not None):
            if task.kind == "F":
                self._forward_task(task, step, chain)
            elif task.kind == "B":
                self._backward_task(task, step, chain)
            else:
                self._weight_task(task, step, chain)
        if loss_fn is not None and self.schedule == "gpipe_batched_w" and first == 0:  # replica 0 takes penalties
            for i, cell in enumerate(self.cells):
                if cell.has_regularizers:
                    with devices.scope(cell.device):
                        penalty, extra = cell.regularization_gradients(step.weights[i][0], step.scales[i])
                        step.grads[i] = add_dense(self._running(step, i), extra)
                        step.added.append(penalty)

        m = self.num_micro_batches
        return self._result(
            [step.outputs[j] for j in range(m)],
            [step.losses[j] for j in range(m)] if loss_fn is not None else None,
            step.added,
            step.grads,
            step.new_state,
            step.weights,
            fractions if training and merge else None,
        )

    def _run_loops(self, inputs, training, loss_fn, fractions, loss_scale, first, merge) -> StepResult:
        if self.routes is not None:
            raise looped.Unsupported(
                "a Functional model's cells take their inputs through routes (tensors may skip cells), which the "
                "loops do not carry"
            )
        weights = [cell.read() for cell in self.cells]
        loss_grads = None
        if loss_fn is not None:
            last = self.cells[-1]
            loss_grads = functools.partial(
                self._loss_and_gradients, loss_fn, loss_scale=loss_scale, leaves=None, cell=last
            )
        result = looped.run(self.cells, weights, inputs, training, fractions, loss_grads, loss_scale, first)
        return self._result(
            result.outputs,
            result.losses if loss_fn is not None else None,
            result.added,
            result.grads,
            result.new_state,
            weights,
            fractions if training and merge else None,
        )

    def _result(self, outputs, losses, added, grads, new_state, weights, fractions) -> StepResult:
        """The step's result: the loss from the micro-batches' ``losses`` (None: forward only) and ``added`` terms,
        gradients per variable, merged state updates (training)."""
        m = self.num_micro_batches
        result = StepResult(outputs=list(outputs), weights=list(weights))
        result.new_states = [[new_state[(i, j)] for j in range(m)] for i in range(len(self.cells))]
        if losses is None:
            result.added_loss = _sum_on_devices(added) if added else None
        else:
            result.loss = _sum_on_devices(list(losses) + list(added))
            result.variables, result.gradients = tied_gradients(self.cells, grads)
        if fractions is not None:
            for i, cell in enumerate(self.cells):
                with devices.scope(cell.device):
                    result.state_updates.extend(
                        cell.merger.merge(cell.non_trainable_variables, weights[i][1], result.new_states[i], fractions)
                    )
        return result

    def _forward_task(self, task: schedule.Task, step: _Step, chain: _Chain) -> None:
        """F(i, j): run cell i on micro-batch j; on the last cell also the loss and its gradient."""
        i, j = task.cell, task.micro_batch
        cell, (trainable, other) = self.cells[i], step.weights[i]
        backward, training = step.loss_fn is not None, step.training
        x = self._input_of(i, j, step)
        with chain.task(task) as produced:
            x = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), x)  # arrive on this device
            seeds = state.micro_batch_states(cell.non_trainable_variables, other, step.first + j) if training else other
            if step.shares:
                # Penalties count in the step's first micro-batch: a replica's other than replica 0's do not.
                reg_weight = step.reg_weights[cell.device][0 if step.first + j == 0 else 1]
                share = step.shares[cell.device][j]
            else:  # forward only: plain numbers, no ops
                share = step.fractions[j] if step.fractions is not None else 1.0
                reg_weight = 0.0
            # Weight regularizers count once per step: in micro-batch 0's task, or after the cell's one W
            # under gpipe_batched_w, whose W batches only what is the same function in every micro-batch.
            regularized = backward and cell.has_regularizers and self.schedule != "gpipe_batched_w"
            n_w = len(trainable)

            def fn(x_in, *rest):
                w, s, (share_, reg_weight_) = rest[:n_w], rest[n_w:-2], rest[-2:]
                y, new_state, added = cell.run_traced(list(w), list(s), x_in, training=training)
                added = added * share_  # add_loss terms are batch means, as Keras normalizes them
                if regularized:
                    added = added + reg_weight_ * cell.regularization_loss(list(w))
                return y, new_state, added

            extras = list(seeds) + [share, reg_weight]
            if backward:
                flat_x = _flat(x)
                n_x = len(flat_x)
                record = remat_lib.Checkpoint(
                    lambda *src: fn(tf.nest.pack_sequence_as(x, _unflat(x, src)), *src[n_x:]),
                    flat_x + list(trainable),
                    recompute=remat_lib.recomputes(self.remat, j, self.num_micro_batches),
                    constant=(n_x if i == 0 else 0) if self.routes is None else self.routes.constants(i),
                    extras=extras,
                    traced=cell.vjps if cell.traceable else None,
                    key=repr(tf.nest.map_structure(lambda t: t is None, x)),
                    split=(n_w, _differentiated) if schedule.splits_backward(self.schedule) else None,
                )
                step.records[(i, j)] = record
                y, new_state, added = record.outputs
            else:
                y, new_state, added = fn(x, *trainable, *extras)
            step.acts[(i, j)], step.new_state[(i, j)] = y, new_state
            step.added.append(added)
            produced.extend(_flat(y) + [added])
            produced.extend(self._send(task, y, step))
            if i == len(self.cells) - 1:
                leaves = _flat(y) if self.routes is None else self._result_leaves(j, step)
                step.outputs[j] = y if self.routes is None else self.routes.pack_outputs(leaves)
                if backward:
                    produced.append(self._loss_task(i, j, step.outputs[j], leaves, step))

    def _input_of(self, i: int, j: int, step: _Step) -> Any:
        """Cell i's input for micro-batch j: the previous cell's output, or its sources' tensors (routes)."""
        if self.routes is None:
            return step.inputs[j] if i == 0 else step.acts[(i - 1, j)]
        return tuple(self._leaf(source, j, step, self.cells[i].device) for source in self.routes.feeds[i])

    def _result_leaves(self, j: int, step: _Step) -> list[tf.Tensor]:
        """Micro-batch j's tensors that make the model's outputs of a routed graph, read on the last device."""
        device = self.cells[-1].device
        return [self._leaf(source, j, step, device) for source in self.routes.results]

    @staticmethod
    def _leaf(source: tuple[int, int], j: int, step: _Step, device: str) -> tf.Tensor:
        """A routed tensor as read on ``device``: the producer's, or the copy sent there explicitly."""
        p, pos = source
        if p == MODEL_INPUT:
            return step.flat_inputs[j][pos]
        return step.received.get((p, j, device), {}).get(pos, step.acts[(p, j)][pos])

    def _send(self, task: schedule.Task, y: Any, step: _Step) -> list[Any]:
        """Explicit sends of F(i, j)'s outputs to the devices in other processes that read them.

        The next task of this device waits for the sends (see tfpipe/distributed/sendrecv.py).
        """
        i, j, src = task.cell, task.micro_batch, self.cells[task.cell].device
        if self.routes is None:
            dst = self.cells[i + 1].device if i + 1 < len(self.cells) else None
            if dst is None or not sendrecv.known(src, dst):
                return []
            step.acts[(i, j)], sends = sendrecv.transfer(y, f"tfpipe_{task_scope_name(task)}", src, dst)
            return sends
        wanted: dict[str, set[int]] = {}
        for consumer, positions in self.routes.readers(i).items():
            dst = self.cells[consumer].device
            if dst != src and sendrecv.known(src, dst):
                wanted.setdefault(dst, set()).update(positions)
        sends: list[Any] = []
        for n, (dst, positions) in enumerate(sorted(wanted.items())):
            moved, made = sendrecv.transfer(
                [y[p] for p in sorted(positions)], f"tfpipe_{task_scope_name(task)}_{n}", src, dst
            )
            step.received[(i, j, dst)] = dict(zip(sorted(positions), moved))
            sends.extend(made)
        return sends

    def _loss_task(self, i: int, j: int, y: Any, leaves: list[tf.Tensor], step: _Step) -> tf.Tensor:
        """Micro-batch j's weighted loss of the model's outputs ``y`` and its gradient for the tensors ``leaves``."""
        step.losses[j], grads = self._loss_and_gradients(step.loss_fn, j, y, step.loss_scale, leaves, self.cells[i])
        if self.routes is None:
            step.dys[(i, j)] = grads
        else:
            _deliver(step, j, self.routes.results, grads)
        return step.losses[j]

    @staticmethod
    def _loss_and_gradients(loss_fn, j, y, loss_scale, leaves, cell: Cell) -> tuple[tf.Tensor, list[Any]]:
        """The loss task on ``cell``'s device: traced once per step when the cell's calls are."""
        if not cell.traceable:
            return loss.loss_and_gradients(loss_fn, j, y, loss_scale, leaves)
        return loss.loss_and_gradients(loss_fn, j, y, loss_scale, leaves, cell.device, cell.function_options())

    def _backward_task(self, task: schedule.Task, step: _Step, chain: _Chain) -> None:
        """B(i, j): the VJP of cell i on micro-batch j (recomputing it if so recorded); sum weight gradients."""
        i, j = task.cell, task.micro_batch
        record = step.records.pop((i, j))
        if self.routes is None:
            dy = step.dys.pop((i, j))
        else:  # the gradient of each output is the sum of what its readers sent back, added on this device
            sent = step.dys.pop((i, j), {})
            dy = [sent.get(pos) for pos in range(len(step.acts[(i, j)]))]
        n_w = len(step.weights[i][0])
        with chain.task(task, extra_deps=[g for g in tf.nest.flatten(dy) if g is not None]) as produced:
            if self.routes is not None:
                dy = [None if g is None else g[0] if len(g) == 1 else tf.add_n(g) for g in dy]
            # Through identities made here: a tape's gradient ops (a kept forward's backward) take no control
            # dependencies, so without them the backward ran as soon as its gradients arrived, out of turn.
            grads_out = [None if g is None else tf.identity(g) for g in dy] + [step.scales[i]]
            batched = self._batched_weights(record, task, step) if schedule.batches_weights(self.schedule) else None
            if batched is not None:  # W(i, all) takes the weights' gradients of every micro-batch at once
                dx = record.input_vjp(grads_out, batched)[: len(record.sources) - n_w]
                step.records[(i, j)] = record
                produced.extend(record.computed)
            elif schedule.splits_backward(self.schedule):
                dx = record.input_vjp(grads_out)[: len(record.sources) - n_w]
                if schedule.batches_weights(self.schedule):  # this cell's W does not batch: it runs here
                    step.grads[i] = record.weight_vjp(self._running(step, i))
                    produced.extend(step.grads[i])
                else:  # W(i, j) takes the weights' gradients later
                    step.records[(i, j)] = record
                produced.extend(record.computed)
            else:
                grads = record.vjp(_differentiated, grads_out, accumulate=self._running(step, i))
                dx, step.grads[i] = grads[: len(grads) - n_w], grads[len(grads) - n_w :]
                produced.extend(step.grads[i])
            produced.extend([g for g in dx if g is not None])
            if self.routes is not None:
                _deliver(step, j, self.routes.feeds[i], self._send_back(task, dx, self.routes.feeds[i], produced))
            elif i > 0:
                step.dys[(i - 1, j)] = self._send_back(task, dx, [(i - 1, n) for n in range(len(dx))], produced)

    def _send_back(
        self, task: schedule.Task, dx: list[Any], sources: Sequence[tuple[int, int]], produced: list[Any]
    ) -> list[Any]:
        """B(i, j)'s input gradients, each sent explicitly to its producer's device in another process.

        As for activations (``_send``): TensorFlow's own transfer is a ``_Send`` that a one-thread
        worker queues behind its next task, and the previous cell waited for it. The sends join
        ``produced``, so the device's next task waits for them.
        """
        src, out = self.cells[task.cell].device, list(dx)
        by_device: dict[str, list[int]] = {}
        for n, ((p, _), g) in enumerate(zip(sources, dx)):
            if p != MODEL_INPUT and g is not None:
                dst = self.cells[p].device
                if dst != src and sendrecv.known(src, dst):
                    by_device.setdefault(dst, []).append(n)
        for k, (dst, positions) in enumerate(sorted(by_device.items())):
            values = [tf.convert_to_tensor(out[n]) for n in positions]  # slices go dense to cross
            moved, sends = sendrecv.transfer(values, f"tfpipe_{task_scope_name(task)}_{k}", src, dst)
            for n, value in zip(positions, moved):
                out[n] = value
            produced.extend(sends)
        return out

    def _weight_task(self, task: schedule.Task, step: _Step, chain: _Chain) -> None:
        """W(i, j) (zero bubble): cell i's weight gradients on micro-batch j, added to their running sums.

        W(i, all) ("gpipe_batched_w") computes them over every micro-batch at once.
        """
        i, j = task.cell, task.micro_batch
        if j == schedule.ALL:
            batched = step.batched.get(i)
            if batched is None:  # every B took its micro-batch's weight gradients
                return
            records = [step.records.pop((i, k)) for k in range(self.num_micro_batches)]
            with chain.task(task) as produced:
                step.grads[i] = remat_lib.batched_weight_vjp(records, batched)
                produced.extend(step.grads[i])
            return
        record = step.records.pop((i, j))
        with chain.task(task) as produced:
            step.grads[i] = record.weight_vjp(self._running(step, i))
            produced.extend(step.grads[i])

    def _batched_weights(self, record: remat_lib.Checkpoint, task: schedule.Task, step: _Step) -> Any:
        """Cell i's W cut to run once over all micro-batches (``backward.batched_w``), made at its first B (``task``,
        whose ``record`` is out of ``step.records``); None where it cannot (a warning says why, once per cell) or
        there is nothing to batch."""
        i = task.cell
        if i not in step.batched:
            # In GPipe's order every forward of the cell ran before its first B.
            records = [record if k == task.micro_batch else step.records[(i, k)] for k in range(self.num_micro_batches)]
            # The last differentiated output is the added losses, whose gradient is the loss scale, step.scales[i].
            n_out = len(_differentiated(record.outputs))
            cut = remat_lib.batch_weights(records, [False] * (n_out - 1) + [True])
            if isinstance(cut, str):
                if i not in self._unbatched:
                    self._unbatched.add(i)
                    warnings.warn(
                        f"schedule='gpipe_batched_w': cell {i} computes its weight gradients once per micro-batch, "
                        f"as exact but not faster, because {cut}.",
                        stacklevel=4,
                    )
                cut = None
            step.batched[i] = cut
        return step.batched[i]

    @staticmethod
    def _running(step: _Step, i: int) -> list[Any]:
        """Cell i's running sums of weight gradients (None before its first backward)."""
        return step.grads[i] if step.grads[i] is not None else [None] * len(step.weights[i][0])


@dataclasses.dataclass
class _Step:
    """Everything one step's tasks hand to each other, keyed by (cell, micro-batch)."""

    inputs: Sequence[Any]
    training: bool
    loss_fn: LossFn | None
    fractions: Sequence[tf.Tensor] | None
    loss_scale: Any
    weights: list[tuple[list[tf.Tensor], list[tf.Tensor]]]
    first: int = 0  # the global number of micro-batch 0 (a replica's first), for seeds
    acts: dict = dataclasses.field(default_factory=dict)  # cell outputs
    outputs: dict = dataclasses.field(default_factory=dict)  # the model's outputs per micro-batch
    flat_inputs: list = dataclasses.field(default_factory=list)  # routes: each micro-batch's input leaves
    received: dict = dataclasses.field(default_factory=dict)  # routes: (cell, micro-batch, device) -> {pos: copy}
    records: dict = dataclasses.field(default_factory=dict)  # checkpoints awaiting their backward (and W)
    new_state: dict = dataclasses.field(default_factory=dict)  # non-trainable values after each forward
    dys: dict = dataclasses.field(default_factory=dict)  # gradients arriving at each cell's outputs (routes: lists)
    losses: dict = dataclasses.field(default_factory=dict)  # weighted loss per micro-batch
    added: list = dataclasses.field(default_factory=list)  # add_loss and regularization terms
    grads: list = dataclasses.field(default_factory=list)  # summed weight gradients per cell
    batched: dict = dataclasses.field(default_factory=dict)  # cell -> its W cut to run once ("gpipe_batched_w")
    scales: list = dataclasses.field(default_factory=list)  # per cell: the loss scale, the gradient of added losses
    shares: dict = dataclasses.field(default_factory=dict)  # device -> fractions Grappler cannot fold (unfoldable)
    reg_weights: dict = dataclasses.field(default_factory=dict)  # device -> [1, 0] (micro-batch 0, others), likewise

    def __post_init__(self):
        self.grads = [None] * len(self.weights)


def _deliver(step: _Step, j: int, sources: Sequence[tuple[int, int]], grads: Sequence[Any]) -> None:
    """Hand each gradient back to the cell that produced its tensor, to be summed there (routes)."""
    for (p, pos), g in zip(sources, grads):
        if p != MODEL_INPUT and g is not None:
            step.dys.setdefault((p, j), {}).setdefault(pos, []).append(g)


def tied_gradients(cells: Sequence[Cell], grads: Sequence[Any]) -> tuple[list[keras.Variable], list[Any]]:
    """Each trainable variable once with its gradient: a variable that several cells use (tied weights) gets the
    sum of their gradients, on the device of the first of them, where it lives.

    ``grads[i]`` is cell i's list aligned with its ``trainable_variables`` (None where it has none).
    """
    owned = tie(cells)
    per_variable: dict[int, list[Any]] = {id(v): [] for v, _ in owned}
    for cell, g in zip(cells, grads):
        for v, gv in zip(cell.trainable_variables, g or [None] * len(cell.trainable_variables)):
            per_variable[id(v)].append(gv)
    gradients = []
    for v, first in owned:
        with devices.scope(cells[first].device):
            gradients.append(sum_gradients(per_variable[id(v)]))
    return [v for v, _ in owned], gradients


def sum_gradients(grads: Sequence[Any]) -> Any:
    """The sum of one variable's gradients (None where none flows; slices stay slices unless one is dense)."""
    present = [g for g in grads if g is not None]
    if len(present) <= 1:
        return present[0] if present else None
    if all(isinstance(g, tf.IndexedSlices) for g in present):
        return tf.IndexedSlices(
            tf.concat([g.values for g in present], 0),
            tf.concat([tf.cast(g.indices, tf.int64) for g in present], 0),
            next((g.dense_shape for g in present if g.dense_shape is not None), None),
        )
    # An embedding's rows and a dense gradient of the same table (tied to an output projection): add densely.
    return tf.add_n([tf.convert_to_tensor(g) for g in present])


def _sum_on_devices(terms: Sequence[tf.Tensor]) -> tf.Tensor:
    """The sum of scalar ``terms``, each device adding up its own first.

    The step's loss has a term per micro-batch and cell (the losses, the added losses): added
    where they are read, each crossed on its own, and every crossing cost a one-thread worker
    0.1-0.7 ms of its step (measured, 16 x Dense(256), K=2, M=8).
    """
    if tf.executing_eagerly():
        return tf.add_n(list(terms))
    by_device: dict[str, list[tf.Tensor]] = {}
    for term in terms:
        by_device.setdefault(term.device, []).append(term)
    partial = []
    for device, on_device in by_device.items():
        with tf.device(device or None):
            partial.append(tf.add_n(on_device))
    return tf.add_n(partial)


def _unflat(structure: Any, sources: Sequence[tf.Tensor]) -> list[Any]:
    """Put the first sources back in the places of the non-None leaves of ``structure``."""
    it = iter(sources)
    return [None if leaf is None else next(it) for leaf in tf.nest.flatten(structure)]
