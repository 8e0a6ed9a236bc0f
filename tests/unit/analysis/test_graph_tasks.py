"""tfpipe.analysis.graph_tasks reads tasks and phases back from op names: rules on lists, then a traced step."""

import types

import keras
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import schedule
from tfpipe.analysis.graph_tasks import (
    GRADIENT_SUM,
    PHASES,
    TASK_START,
    OpInfo,
    assign_phases,
    assign_tasks,
    attribute,
    calls_gradient_function,
    calls_traced_vjp,
    lookup,
    parse_marker,
    parse_task_name,
    task_scope_name,
)
from tfpipe.schedule import Task


def test_task_names_round_trip():
    for task in schedule.flatten(schedule.gpipe(3, 12)):
        assert parse_task_name(task_scope_name(task)) == task
    assert task_scope_name(Task("B", 10, 31)) == "B_10_31"
    assert task_scope_name(Task("W", 2, schedule.ALL)) == "W_2_all"
    assert parse_task_name("W_2_all") == Task("W", 2, schedule.ALL)


@pytest.mark.parametrize("name", ["", "F_1", "X_1_2", "F_1_2_3", "f_1_2", "F_1_2/MatMul", "F_a_2", "W_1_any"])
def test_other_names_are_not_tasks(name):
    assert parse_task_name(name) is None


def test_markers_parse_into_kind_cell_and_micro_batch():
    assert TASK_START == "task_start"
    assert parse_marker("B_1_3/task_start") == Task("B", 1, 3)
    found = parse_marker("F_12_0/task_start")
    assert (found.kind, found.cell, found.micro_batch) == ("F", 12, 0)
    for name in [
        "F_0_0",
        "F_0_0/task_start_1",
        "F_0_0/x/task_start",
        "gradient_tape/F_0_0/task_start",
        "task_start",
        "G_0_0/task_start",
    ]:
        assert parse_marker(name) is None, name


def test_ops_belong_to_the_task_whose_marker_precedes_them():
    names = [
        "x",
        "F_0_0/task_start",
        "F_0_0/MatMul",
        "gradient_tape/F_0_0/MatMul",
        "F_0_1/task_start",
        "F_0_1/add",
        "Identity",
        "F_0_1/late",
        "B_0_1/task_start",
        "gradient_tape/F_0_1/add",
        "B_0_1/PartitionedCall",
        "F_1_0/stray",
        "B_0_1/after_stray",
        "SGD/update",
    ]
    assert assign_tasks(names) == [
        "",
        "F_0_0",
        "F_0_0",
        "F_0_0",
        "F_0_1",
        "F_0_1",
        "",
        "",
        "B_0_1",
        "B_0_1",
        "B_0_1",
        "",
        "",
        "",
    ]
    assert assign_tasks([]) == []


def test_phases_of_a_forward_with_the_loss_a_backward_and_the_update():
    ops = [
        ("F_1_0/task_start", "NoOp", False),
        ("F_1_0/MatMul", "MatMul", False),
        ("F_1_0/compile_loss/mse/Mean", "Mean", False),
        ("F_1_0/Cast", "Cast", False),
        ("gradient_tape/F_1_0/compile_loss/mse/Mul", "Mul", False),
        ("F_1_0/after_grad", "Identity", False),
        ("F_1_0/send", "_Send", False),
        ("B_1_0/task_start", "NoOp", False),
        ("B_1_0/PartitionedCall", "PartitionedCall", False),
        ("B_1_0/PartitionedCall_1", "PartitionedCall", True),
        ("B_1_0/add_1", "AddV2", False),
        ("B_1_0/concat_2/axis", "Const", False),
        ("B_1_0/mul", "Mul", False),
        ("gradient_tape/B_1_0/add", "AddV2", False),
        ("F_0_1/task_start", "NoOp", False),
        ("F_0_1/MatMul", "MatMul", False),
        ("SGD/update", "ResourceApplyGradientDescent", False),
        ("AssignVariableOp", "AssignVariableOp", False),
        ("Adam/Pow", "Pow", False),
        ("Identity", "Identity", False),
    ]
    tasks = assign_tasks([name for name, _, _ in ops])
    assert assign_phases(ops, tasks) == [
        "forward",
        "forward",
        "loss",
        "forward",
        "loss",
        "loss",
        "transfer",
        "recompute",
        "recompute",
        "backward",
        "accumulate",
        "accumulate",
        "backward",
        "backward",
        "forward",
        "forward",  # a new task starts before its gradients
        "optimizer",
        "optimizer",
        "optimizer",
        "other",
    ]
    assert set(assign_phases(ops, tasks)) <= set(PHASES)


def test_a_backward_without_recomputation_starts_with_its_gradient():
    ops = [
        ("B_0_1/task_start", "NoOp", False),
        ("gradient_tape/F_0_1/MatMul", "MatMul", False),
        ("B_0_1/add", "AddV2", False),
        ("B_0_1/recv", "_Recv", False),
    ]
    assert assign_phases(ops, assign_tasks([name for name, _, _ in ops])) == [
        "recompute",
        "backward",
        "accumulate",
        "transfer",
    ]


def test_phases_need_one_task_per_op():
    with pytest.raises(ValueError, match="got 2 ops but 1 tasks"):
        assign_phases([("a", "NoOp", False), ("b", "NoOp", False)], [""])


def test_gradient_calls_are_told_by_the_called_function():
    def op(op_type, function):
        return types.SimpleNamespace(type=op_type, get_attr=lambda key: types.SimpleNamespace(name=function))

    assert calls_gradient_function(op("PartitionedCall", "__backward_fn_123_456"))
    assert calls_gradient_function(op("StatefulPartitionedCall", "__inference___backward_fn_7_8"))
    assert not calls_gradient_function(op("PartitionedCall", "__inference_fn_123"))
    assert not calls_gradient_function(op("MatMul", "__backward_fn"))


def test_lookup_falls_back_to_the_innermost_known_scope():
    scope, own = OpInfo("B_0_0", "recompute", "/CPU:0"), OpInfo("B_0_0", "backward", "/CPU:0")
    info = {"B_0_0": scope, "B_0_0/PartitionedCall_1": own}
    assert lookup(info, "B_0_0/PartitionedCall_1") is own
    assert lookup(info, "B_0_0/PartitionedCall_1/gradients/MatMul") is own
    assert lookup(info, "B_0_0/other") is scope
    assert lookup(info, "B_0_1/PartitionedCall_1") is None
    assert lookup({}, "x") is None


def _two_cell_step_graph(remat: str, schedule_name: str = "gpipe") -> tf.Graph:
    """The traced train step of Dense(4), Dense(3) as two cells on /CPU:2 and /CPU:3, M=2."""
    model = tfpipe.PipelineModel(
        [keras.layers.Dense(4), keras.layers.Dense(3)],
        num_partitions=2,
        devices=["/CPU:2", "/CPU:3"],
        num_micro_batches=2,
        remat=remat,
        schedule=schedule_name,
    )
    model.compile(optimizer="sgd", loss="mse")
    model.build((None, 8))
    model.optimizer.build(model.trainable_variables)
    return tf.function(model.train_step).get_concrete_function((tf.ones((4, 8)), tf.ones((4, 3)))).graph


def test_a_traced_step_is_attributed_to_its_tasks_phases_and_devices():
    graph = _two_cell_step_graph("except_last")
    info = attribute(graph)
    ops = {op.name: op for op in graph.get_operations()}
    assert set(info) >= set(ops)
    found = {info[name].task for name in ops} - {""}
    assert found == {task_scope_name(t) for t in schedule.flatten(schedule.gpipe(2, 2))}
    phases = {(info[name].task, info[name].phase, op.type) for name, op in ops.items() if info[name].task}
    # except_last: micro-batch 0 is recomputed and differentiated in one call; the last keeps its activations.
    # Cell 1's input gradients go to another device: its backward is called in parts, the inputs' first.
    recomputed = {info[name].task for name, op in ops.items() if calls_traced_vjp(op)}
    assert recomputed == {"B_0_0", "B_1_0", "B_1_1"}
    assert {task for task, phase, op_type in phases if phase == "backward" and op_type == "PartitionedCall"} == {
        "B_0_0",
        "B_0_1",
        "B_1_0",
        "B_1_1",
    }
    call = next(name for name, op in ops.items() if calls_traced_vjp(op) and name.startswith("B_0_0/"))
    # Inlined, the call's ops are named under it: recomputed forward, tape gradients, sums into the running ones.
    assert lookup(info, f"{call}/dense/MatMul").phase == "recompute"
    assert lookup(info, f"{call}/gradient_tape/dense/MatMul").phase == "backward"
    assert lookup(info, f"{call}/add_1").phase == "accumulate"
    assert lookup(info, call).phase == "backward"
    assert {task for task, phase, _ in phases if phase == "loss"} == {"F_1_0", "F_1_1"}  # the last cell's
    for name, op in ops.items():
        task = parse_task_name(info[name].task) if info[name].task else None
        if task is not None:
            assert tf.DeviceSpec.from_string(op.device).device_index == task.cell + 2, name
    kept = next(name for name, op in ops.items() if name.startswith("B_0_1/") and calls_gradient_function(op))
    assert lookup(info, f"{kept}/gradients/MatMul").phase == "backward"  # inside TensorFlow's gradient function


def test_kept_tasks_sum_their_gradients_in_one_call_attributed_to_accumulate():
    graph = _two_cell_step_graph("never")
    info = attribute(graph)
    sums = {
        info[op.name].task: info[op.name].phase
        for op in graph.get_operations()
        if op.type == "PartitionedCall" and GRADIENT_SUM in op.get_attr("f").name
    }
    # B_i_1 runs first and starts the running sums; B_i_0 adds to them, all weights in one call.
    assert sums == {"B_0_0": "accumulate", "B_1_0": "accumulate"}


def test_zero_bubbles_b_and_w_parts_are_backward_and_its_forward_part_forward():
    graph = _two_cell_step_graph("never", "zero_bubble")
    info = attribute(graph)
    ops = {op.name: op for op in graph.get_operations()}
    assert {info[name].task for name in ops} - {""} == {
        task_scope_name(t) for t in schedule.steps("zero_bubble", 2, 2)
    }  # F, B and W tasks
    calls = {name: op for name, op in ops.items() if op.type == "PartitionedCall" and info[name].task}
    forward = [name for name in calls if name.startswith("F_1_0/") and info[name].phase == "forward"]
    assert forward and not any(calls_traced_vjp(calls[name]) for name in forward)
    for kind, part in (("B", "inputs"), ("W", "weights")):
        call = next(name for name in calls if name.startswith(f"{kind}_1_0/") and calls_traced_vjp(calls[name]))
        # Inlined, the part's ops are named under the call, then the part, then tf.gradients' scope.
        assert lookup(info, f"{call}/{part}/gradients/dense_1/MatMul_grad/MatMul").phase == "backward"


def test_batched_w_runs_one_w_task_per_cell_whose_sums_are_backward():
    graph = _two_cell_step_graph("never", "gpipe_batched_w")
    info = attribute(graph)
    tasks = {info[op.name].task for op in graph.get_operations()} - {""}
    assert tasks == {task_scope_name(t) for t in schedule.steps("gpipe_batched_w", 2, 2)}
    assert {"W_0_all", "W_1_all"} <= tasks
    calls = [op for op in graph.get_operations() if op.type == "PartitionedCall" and info[op.name].task == "W_1_all"]
    assert len(calls) == 1 and info[calls[0].name].phase == "backward"
