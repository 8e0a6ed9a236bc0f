"""Where an unrolled step's tensors go between cells: to the next cell, or along a Functional graph's routes.

Without routes each cell takes the previous cell's output (the first the micro-batch) and the last
cell's output is the model's. With routes each cell takes tensors from any earlier cell and the
model's inputs, straight from their producers; a tensor's gradient is the sum of what every cell
that reads it sends back. Between devices in different processes activations and their gradients
are sent explicitly (``tfpipe.distributed.sendrecv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe import schedule
from tfpipe.distributed import sendrecv
from tfpipe.leaves import flat
from tfpipe.partition.cell import Cell
from tfpipe.partition.routes import MODEL_INPUT, Routes
from tfpipe.schedule import task_scope_name
from tfpipe.step.handoff import Handoff


class Wiring:
    """The cells' connections: which tensors a task reads, and where its outputs and input gradients go."""

    def __init__(self, cells: Sequence[Cell], routes: Routes | None):
        self.cells, self.routes = cells, routes

    def pairs(self) -> list[tuple[str, str]]:
        """(source, destination) devices between which tensors cross, both ways, the same device left out."""
        if self.routes is None:
            pairs = {(a.device, b.device) for a, b in zip(self.cells, self.cells[1:])}
        else:
            pairs = {(p.device, self.cells[c].device) for p in self.cells for c in self.routes.readers(p.index)}
        # Activations go forward, their gradients back: both ways across processes are sent explicitly.
        pairs |= {(b, a) for a, b in pairs}
        return sorted((a, b) for a, b in pairs if a != b)

    def begin(self, step: Handoff) -> None:
        """Routes: each micro-batch's input leaves, which cells read by position."""
        if self.routes is not None:
            step.flat_inputs = [self.routes.flatten_inputs(x) for x in step.inputs]

    def input_of(self, i: int, j: int, step: Handoff) -> Any:
        """Cell i's input for micro-batch j: the previous cell's output, or its sources' tensors (routes)."""
        if self.routes is None:
            return step.inputs[j] if i == 0 else step.acts[(i - 1, j)]
        return tuple(self._leaf(source, j, step, self.cells[i].device) for source in self.routes.feeds[i])

    def constants(self, i: int, n_x: int) -> Any:
        """Which of cell i's ``n_x`` input leaves need no gradient: the model's inputs."""
        return (n_x if i == 0 else 0) if self.routes is None else self.routes.constants(i)

    def model_outputs(self, j: int, y: Any, step: Handoff) -> tuple[list[tf.Tensor], Any]:
        """Micro-batch j's model outputs from the last cell's ``y``: (the tensors that make them, their structure)."""
        if self.routes is None:
            return flat(y), y
        device = self.cells[-1].device
        leaves = [self._leaf(source, j, step, device) for source in self.routes.results]
        return leaves, self.routes.pack_outputs(leaves)

    @staticmethod
    def _leaf(source: tuple[int, int], j: int, step: Handoff, device: str) -> tf.Tensor:
        """A routed tensor as read on ``device``: the producer's, or the copy sent there explicitly."""
        p, pos = source
        if p == MODEL_INPUT:
            return step.flat_inputs[j][pos]
        return step.received.get((p, j, device), {}).get(pos, step.acts[(p, j)][pos])

    def send(self, task: schedule.Task, y: Any, step: Handoff) -> list[Any]:
        """Explicit sends of F(i, j)'s outputs to the devices in other processes that read them.

        The next task of this device waits for the sends (see tfpipe/distributed/sendrecv.py).
        """
        i, j, src = task.cell, task.micro_batch, self.cells[task.cell].device
        if self.routes is None:
            dst = self.cells[i + 1].device if i + 1 < len(self.cells) else None
            if dst is None or not sendrecv.known(src, dst):
                return []
            step.acts[(i, j)], sent = sendrecv.transfer(y, f"tfpipe_{task_scope_name(task)}", src, dst)
            return sent
        wanted: dict[str, set[int]] = {}
        for consumer, positions in self.routes.readers(i).items():
            dst = self.cells[consumer].device
            if dst != src and sendrecv.known(src, dst):
                wanted.setdefault(dst, set()).update(positions)
        sends: list[Any] = []
        for n, (dst, needed) in enumerate(sorted(wanted.items())):
            moved, made = sendrecv.transfer(
                [y[p] for p in sorted(needed)], f"tfpipe_{task_scope_name(task)}_{n}", src, dst
            )
            step.received[(i, j, dst)] = dict(zip(sorted(needed), moved))
            sends.extend(made)
        return sends

    def loss_gradients(self, i: int, j: int, grads: list[Any], step: Handoff) -> None:
        """Hand the gradients of micro-batch j's loss to the last cell ``i`` (routes: to the outputs' producers)."""
        if self.routes is None:
            step.dys[(i, j)] = grads
        else:
            deliver(step, j, self.routes.results, grads)

    def output_gradients(self, i: int, j: int, step: Handoff) -> list[Any]:
        """What arrived for B(i, j): the gradients of cell i's outputs (routes: each output's list of parts)."""
        if self.routes is None:
            return step.dys.pop((i, j))
        sent = step.dys.pop((i, j), {})
        return [sent.get(pos) for pos in range(len(step.acts[(i, j)]))]

    def summed(self, dy: list[Any]) -> list[Any]:
        """Routes: each output's gradient as the sum of what its readers sent back, added on this device."""
        if self.routes is None:
            return dy
        return [None if g is None else g[0] if len(g) == 1 else tf.add_n(g) for g in dy]

    def pass_back(self, task: schedule.Task, dx: list[Any], step: Handoff, produced: list[Any]) -> None:
        """B(i, j)'s input gradients to the cells that produced the inputs (sends join ``produced``)."""
        i, j = task.cell, task.micro_batch
        if self.routes is not None:
            deliver(step, j, self.routes.feeds[i], self._send_back(task, dx, self.routes.feeds[i], produced))
        elif i > 0:
            step.dys[(i - 1, j)] = self._send_back(task, dx, [(i - 1, n) for n in range(len(dx))], produced)

    def _send_back(
        self, task: schedule.Task, dx: list[Any], sources: Sequence[tuple[int, int]], produced: list[Any]
    ) -> list[Any]:
        """B(i, j)'s input gradients, each sent explicitly to its producer's device in another process.

        As for activations (``send``): TensorFlow's own transfer is a ``_Send`` that a one-thread
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


def deliver(step: Handoff, j: int, sources: Sequence[tuple[int, int]], grads: Sequence[Any]) -> None:
    """Hand each gradient back to the cell that produced its tensor, to be summed there (routes)."""
    for (p, pos), g in zip(sources, grads):
        if p != MODEL_INPUT and g is not None:
            step.dys.setdefault((p, j), {}).setdefault(pos, []).append(g)
