"""Control-dependency chains: each device runs its tasks in the schedule's order, each task a named scope.

TensorFlow runs any op whose inputs are ready; the only way to make a device run its tasks in the
schedule's order is to give each task a control dependency on the previous task of the same
device. Each task is also a name scope ``F_i_j`` / ``B_i_j`` / ``W_i_j`` so that the order can be
read back from the graph (``tfpipe.analysis.graph_tasks``).
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
        if graph is not None:
            for op in graph.get_operations()[made_before:]:
                if op.type in _UNORDERED:
                    _compat.run_independently(op)


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
