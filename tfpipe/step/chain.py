"""Control-dependency chains: each device runs its tasks in the schedule's order, each task a named scope.

TensorFlow runs any op whose inputs are ready; the only way to make a device run its tasks in the
schedule's order is to give each task a control dependency on the previous task of the same
device. Each task is also a name scope ``F_i_j`` / ``B_i_j`` / ``W_i_j`` so that the order can be
read back from the graph (``tfpipe.analysis.graph_tasks``). A cell's summed gradients also wait for the
last task of its device that sends to another (``Chain.held``), so that its optimizer update does not run among
the ops another device waits for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat, schedule
from tfpipe.distributed import devices
from tfpipe.graph.names import TASK_END, TASK_START
from tfpipe.partition.cell import Cell
from tfpipe.schedule import task_scope_name

# Checks and prints touch no variable, so tf.function chains each after every other such op of every device, in the
# order traced (a replica's loss waited on the replica's before it where Keras' losses check shapes at run time).
# Each task's are ordered by the task's own chain instead. Collectives are not: every device must run them in order.
_UNORDERED = frozenset({"Assert", "PrintV2"})


class Chain:
    """Control-dependency chains, one per device, plus the device scope of each task."""

    def __init__(self, cells: Sequence[Cell]):
        self._cells = cells
        self._last: dict[str, list[tf.Tensor]] = {}
        self._count: dict[str, int] = {}  # tasks built so far on each device
        self._sent: dict[str, tuple[int, list[tf.Tensor]]] = {}  # each device's latest task that sends: (number, end)
        self._done: dict[int, int] = {}  # each cell's latest task's number on its device

    @contextlib.contextmanager
    def task(self, task: schedule.Task, extra_deps: Sequence[tf.Tensor] = ()) -> Iterator[list[tf.Tensor]]:
        """Open the task's device, name and control scope; the caller appends the task's results."""
        device = self._cells[task.cell].device
        produced: list[tf.Tensor] = []
        deps = [t for t in list(self._last.get(device, [])) + list(extra_deps) if t is not None]
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        made_before = len(graph.get_operations()) if graph is not None else 0
        with devices.scope(device), tf.name_scope(task_scope_name(task)), tf.control_dependencies(deps):
            # Marks where the task's ops begin in the graph; tape gradients are named
            # after their forward ops, so names alone cannot attribute them to a task.
            start = tf.no_op(name=TASK_START)
            yield produced
            self._last[device] = task_end(produced) or [start]  # a task that computes nothing passes it on
        number = self._count[device] = self._count.get(device, 0) + 1
        self._done[task.cell] = number
        if self._sends(task):
            self._sent[device] = (number, self._last[device])
        if graph is not None:
            for op in graph.get_operations()[made_before:]:
                if op.type in _UNORDERED:
                    _compat.run_independently(op)

    def _sends(self, task: schedule.Task) -> bool:
        """Whether ``task``'s results go to another device: a forward's to the next cell, a backward's to the one
        before (a Functional model's skips may also go further; the order they follow is a matter of speed only)."""
        device = self._cells[task.cell].device
        if task.kind == "F":
            return task.cell + 1 < len(self._cells) and self._cells[task.cell + 1].device != device
        return task.kind == "B" and task.cell > 0 and self._cells[task.cell - 1].device != device

    def held(self, cell: int, gradients: Sequence[Any] | None) -> Sequence[Any] | None:
        """Cell ``cell``'s summed ``gradients``, made to wait for the last task of its device that sends to another.

        With several cells a device, a cell's backward can end before another cell's input gradients leave its
        device (interleaved 1F1B: cell 3's last B comes before cell 1's). Otherwise its optimizer update, ready
        then, runs between those backwards' ops on a one-thread worker and holds back the device that waits for
        them (Adam: the step 0.93x with it made to wait, docs/benchmarks.md#schedules); made to wait, it runs while
        that device works. A cell whose device sends nothing after the cell's last task is left as it is, and so are
        ``gradients`` None (a step without a backward).
        """
        device = self._cells[cell].device
        number, end = self._sent.get(device, (0, []))
        if gradients is None or tf.executing_eagerly() or number <= self._done.get(cell, 0):
            return gradients
        with devices.scope(device), tf.control_dependencies(end):
            return [_waiting(g) for g in gradients]


def _waiting(gradient: Any) -> Any:
    """``gradient`` through an identity made under the caller's control dependencies (None stays None)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), gradient.indices, gradient.dense_shape)
    return tf.identity(gradient)


def task_end(produced: Sequence[Any]) -> list[Any]:
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
