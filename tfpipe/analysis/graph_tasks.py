"""Which pipeline task and phase each op of a step's graph belongs to, read back from the tasks' markers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from tfpipe import schedule
from tfpipe.graph.names import GRADIENT_SUM, LOSS_FUNCTION, TASK_START, TRACED_VJP
from tfpipe.schedule import task_scope_name

PHASES = ("forward", "loss", "recompute", "backward", "accumulate", "transfer", "optimizer", "other")
TRANSFER_TYPES = ("_Send", "_Recv", "_HostSend", "_HostRecv")  # op types that move tensors between devices

_SCOPE = re.compile(r"([FBW])_(\d+)_(\d+|all)")
# Summing a cell's gradients over micro-batches.
_ACCUMULATE = re.compile(r"^[BW]_\d+_(\d+|all)/(add|concat)(_\d+)?(/|$)")
_SYMBOLIC = "gradients"  # the scope of tf.gradients' ops (zero bubble's split VJP: tfpipe/backward/split_vjp.py)
_TAPE = "gradient_tape/"  # tape gradients are named after their forward ops: "gradient_tape/F_1_3/..."
_OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "lamb", "lion")
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
_SUM = re.compile(r"^(add|AddV2|concat)(_\d+)?$")


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """Where a graph op belongs: its task ("F_0_1", or "" outside tasks), phase and device."""

    task: str
    phase: str
    device: str
    recomputes: bool = False  # a call that recomputes and differentiates: ops inside it have their own phases


def parse_task_name(name: str) -> schedule.Task | None:
    """The task whose name scope is ``name`` ("B_1_3" -> B(1,3)), else None; the inverse of task_scope_name."""
    found = _SCOPE.fullmatch(name)
    if not found:
        return None
    micro_batch = schedule.ALL if found.group(3) == "all" else int(found.group(3))
    return schedule.Task(found.group(1), int(found.group(2)), micro_batch)


def parse_marker(name: str) -> schedule.Task | None:
    """The task whose start marker op is named ``name`` ("B_1_3/task_start" -> B(1,3)), else None."""
    scope, _, rest = name.partition("/")
    return parse_task_name(scope) if rest == TASK_START else None


def assign_tasks(names: Sequence[str]) -> list[str]:
    """The task scope name of each op, given the op names in graph creation order ("" outside tasks).

    An op belongs to the task whose start marker precedes it, as long as every op
    in between is in that task's name scope or a tape gradient ("gradient_tape/...",
    named after the forward op it differentiates, so its name alone does not say
    which task created it); any other op ends the task.
    """
    tasks, current = [], ""
    for name in names:
        marker = parse_marker(name)
        if marker is not None:
            current = task_scope_name(marker)
        elif current and not (name.startswith(current + "/") or name.startswith(_TAPE)):
            current = ""
        tasks.append(current)
    return tasks


def assign_phases(ops: Sequence[tuple[str, str, bool]], tasks: Sequence[str]) -> list[str]:
    """The phase (one of PHASES) of each op, given as (name, op type, calls a gradient function), in task ``tasks``.

    In a forward task, ops from the first gradient on compute the loss's gradient
    ("loss"); in a backward task, ops before the first gradient recompute the
    forward ("recompute") and non-gradient sums of a cell's gradients are
    "accumulate". Outside tasks, ops are "optimizer" or "other".
    """
    if len(ops) != len(tasks):
        raise ValueError(
            f"assign_phases got {len(ops)} ops but {len(tasks)} tasks; pass the ops' assign_tasks(names) result."
        )
    phases, previous, seen_grad = [], "", False
    for (name, op_type, calls_gradient), task in zip(ops, tasks):
        seen_grad = seen_grad and task == previous  # each task starts before its gradients
        previous = task
        grad = name.startswith(_TAPE) or calls_gradient
        seen_grad = seen_grad or (bool(task) and grad)
        phases.append(_phase(name, op_type, task, grad, seen_grad))
    return phases


def _phase(name: str, op_type: str, task: str, grad: bool, seen_grad: bool) -> str:
    """One op's phase; ``task`` is "" outside tasks, ``seen_grad`` whether the task has had a gradient by this op."""
    if not task:
        return "optimizer" if _optimizer_op(name) else "other"
    if op_type in TRANSFER_TYPES:
        return "transfer"
    if task.startswith("F"):
        return "loss" if seen_grad or "/compile_loss" in name else "forward"
    if not seen_grad:
        return "recompute"
    return "accumulate" if not grad and _ACCUMULATE.match(name) else "backward"


def _optimizer_op(name: str) -> bool:
    """Ops of the optimizer's update (Keras names them after the optimizer) or variable writes."""
    head = name.split("/")[0].lower()
    return head in _OPTIMIZERS or head.startswith(("assign", "adam", "sgd"))


def calls_gradient_function(op: Any) -> bool:
    """Whether graph op ``op`` calls the gradient function TensorFlow generated for a traced cell.

    A cell's ops run inside function call ops; the profiler names them after the call
    ("B_1_0/PartitionedCall_1/gradients/..."), so they are attributed through the call op.
    """
    return op.type in _CALLS and ("__backward_" in op.get_attr("f").name or calls_traced_vjp(op))


def calls_traced_vjp(op: Any) -> bool:
    """Whether graph op ``op`` calls a function that recomputes a cell and takes its VJP (a backward task)."""
    return _calls(op, TRACED_VJP)


def _calls(op: Any, function: str) -> bool:
    return op.type in _CALLS and function in op.get_attr("f").name


def attribute(graph: Any) -> dict[str, OpInfo]:
    """Task, phase and device of every op (and name scope) of a step's ``tf.Graph``, by creation order."""
    ops = graph.get_operations()
    tasks = assign_tasks([op.name for op in ops])
    phases = assign_phases([(op.name, op.type, calls_gradient_function(op)) for op in ops], tasks)
    info = {
        op.name: OpInfo(task, _called_phase(op, task) or phase, op.device, calls_traced_vjp(op))
        for op, task, phase in zip(ops, tasks, phases)
    }
    for name, found in list(info.items()):  # name scopes, for ops that Grappler adds or renames
        parts = name.split("/")
        for n in range(1, len(parts)):
            info.setdefault("/".join(parts[:n]), found)
    return info


def _called_phase(op: Any, task: str) -> str | None:
    """The phase of a task's call of one of tfpipe's own functions, known by its name; else None."""
    if task and _calls(op, GRADIENT_SUM):
        return "accumulate"
    if task and _calls(op, LOSS_FUNCTION):
        return "loss"
    return None


def lookup(info: dict[str, OpInfo], op: str) -> OpInfo | None:
    """The attribution of an executed op named ``op``: its own, else that of its innermost known name scope.

    Inside a call that recomputes and differentiates (inlined, its ops are named under the
    call), gradients (of a tape or ``tf.gradients``) are "backward", sums into the running
    gradients "accumulate", and the rest "recompute".
    """
    parts = op.split("/")
    for n in range(len(parts), 0, -1):
        found = info.get("/".join(parts[:n]))
        if found is not None and found.recomputes and n < len(parts):
            inner = parts[n:]
            grad = _TAPE.rstrip("/") in inner or _SYMBOLIC in inner
            phase = "backward" if grad else "accumulate" if _SUM.match(inner[0]) else "recompute"
            return dataclasses.replace(found, phase=phase, recomputes=False)
        if found is not None:
            return found
    return None
