"""The built graph realizes the schedule: each device's tasks are chained in clock-cycle order."""

import json

import keras
import pytest
import tensorflow as tf

import tfpipe
from tests.util import covering, cpu_devices, mlp_layers, run_fresh
from tfpipe import schedule
from tfpipe.analysis.graph_tasks import assign_tasks, task_scope_name


def _train_graph(model, batch=4, optimizer="sgd"):
    """The graph of one training step of ``model`` (inputs of width 8, targets of width 3)."""
    model.compile(optimizer=optimizer, loss="mse")
    model.build((None, 8))
    model.optimizer.build(model.trainable_variables)
    x, y = tf.ones((batch, 8)), tf.ones((batch, 3))
    return tf.function(model.train_step).get_concrete_function((x, y)).graph


def _task_ops(graph):
    """Ops of each task, its start marker included, by creation order (tfpipe.analysis.graph_tasks.assign_tasks)."""
    ops = graph.get_operations()
    found = {}
    for op, task in zip(ops, assign_tasks([op.name for op in ops])):
        if task:
            found.setdefault(task, []).append(op)
    return found


def _ancestors(op):
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("k,m,devices", [(2, 3, None), (3, 2, ["/CPU:0", "/CPU:1", "/CPU:0"])])
def test_each_device_runs_its_tasks_in_schedule_order(k, m, devices):
    devices = devices or cpu_devices(k)
    model = tfpipe.PipelineModel(
        mlp_layers(depth=3), num_partitions=k, devices=devices, num_micro_batches=m, remat="except_last"
    )
    tasks = _task_ops(_train_graph(model, batch=6))
    order = schedule.device_order(schedule.gpipe(k, m), devices)
    assert sum(len(v) for v in order.values()) == 2 * k * m
    for device_tasks in order.values():
        names = [task_scope_name(t) for t in device_tasks]
        for earlier, later in zip(names, names[1:]):
            earlier_ops = {op.name for op in tasks[earlier]}
            for op in tasks[later]:
                assert _ancestors(op) & earlier_ops, f"{op.name} of {later} can start before {earlier} ends"


@pytest.mark.parametrize("name,remat", [("1f1b", "except_last"), ("zero_bubble", "except_last"),
                                        ("gpipe", "never"), ("1f1b", "never"), ("zero_bubble", "never")])  # fmt: skip
@pytest.mark.parametrize("k,m", [(2, 4), (3, 5)])
def test_each_device_runs_its_tasks_in_its_schedules_order(name, remat, k, m):
    model = tfpipe.PipelineModel(
        mlp_layers(depth=3), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m, schedule=name,
        remat=remat,
    )  # fmt: skip
    tasks = _task_ops(_train_graph(model, batch=m))
    if name == "zero_bubble":
        assert {t[0] for t in tasks} == {"F", "B", "W"}
    for cell_order in schedule.cell_orders(name, k, m):
        names = [task_scope_name(t) for t in cell_order]
        if name != "gpipe":
            assert names[: min(k - cell_order[0].cell, m) + 1][-1].startswith("B")  # the warm-up, then a backward
        for earlier, later in zip(names, names[1:]):
            earlier_ops = {op.name for op in tasks[earlier]}
            for op in tasks[later]:
                assert _ancestors(op) & earlier_ops, f"{op.name} of {later} can start before {earlier} ends"


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_a_device_with_two_cells_runs_their_tasks_in_its_schedules_order(name):
    model = tfpipe.PipelineModel(
        mlp_layers(depth=3), num_partitions=4, devices=cpu_devices(2), num_micro_batches=3, schedule=name
    )
    tasks = _task_ops(_train_graph(model, batch=3))
    for device_order in schedule.device_orders(name, 4, 3, 2):
        names = [task_scope_name(t) for t in device_order]
        assert len({t.cell for t in device_order}) == 2
        for earlier, later in zip(names, names[1:]):
            earlier_ops = {op.name for op in tasks[earlier]}
            for op in tasks[later]:
                assert _ancestors(op) & earlier_ops, f"{op.name} of {later} can start before {earlier} ends"


def test_a_cells_gradients_wait_for_the_last_its_device_sends():
    """Interleaved 1F1B's cell 3 ends its backward before cell 1 (on the same device) sends its last input
    gradient, which the other device waits for: cell 3's gradients reach the optimizer after that send, so its
    update does not run between that backward's ops (on a one-thread worker Adam's math there holds it back)."""
    name = "interleaved_1f1b"  # ZB-V's last tasks are W, after its last sends: nothing waits there
    model = tfpipe.PipelineModel(
        mlp_layers(depth=3), num_partitions=4, devices=cpu_devices(2), num_micro_batches=3, schedule=name
    )
    graph = _train_graph(model, batch=3)
    order = schedule.device_orders(name, 4, 3, 2)[1]
    assert {t.cell for t in order} == {1, 3} and task_scope_name(order[-1]) == "B_1_2"  # after cell 3's last B
    ends = {op.name for op in _task_ops(graph)["B_1_2"]}
    inside = {id(outer): inner for outer, inner in graph.captures}
    for variable in model.cells[3].trainable_variables:
        (update,) = [o for o in inside[id(variable.value.handle)].consumers() if o.type == "AssignSubVariableOp"]
        gradient = _step_gradient(update.inputs[1].op)
        assert _ancestors(gradient.op) & ends, variable.path


@pytest.mark.parametrize("name,k,remat", [("1f1b", 2, "never"), ("interleaved_1f1b", 4, "except_last")])
def test_a_whole_backward_sends_its_input_gradients_before_it_computes_its_weights(name, k, remat):
    """A backward whose input gradients go to another device runs cut: its weights' part waits for the input
    gradients' part, and the backward that reads those gradients does not wait for the weights' part."""
    model = tfpipe.PipelineModel(
        mlp_layers(depth=3), num_partitions=k, devices=cpu_devices(2), num_micro_batches=2, schedule=name,
        remat=remat,
    )  # fmt: skip
    tasks = _task_ops(_train_graph(model))

    def call(task, part):
        (op,) = [o for o in tasks[task] if o.type in CALLS and o.get_attr("f").name.count(f"_{part}_")]
        return op

    for i in range(1, k):
        for j in range(2):
            inputs, weights = call(f"B_{i}_{j}", "inputs"), call(f"B_{i}_{j}", "weights")
            assert inputs.name in _ancestors(weights)
            assert not any(weights.name in _ancestors(op) for op in tasks[f"B_{i - 1}_{j}"])


def _step_gradient(update_value):
    """The gradient as the step gave it to the optimizer: SGD's value ``rate * gradient``'s gradient, before the
    optimizer's sum over replicas (an ``IdentityN`` of each device's gradients, which would join them all)."""
    for tensor in update_value.inputs:
        if tensor.op.type == "IdentityN":
            return tensor.op.inputs[tensor.value_index]
    raise AssertionError(f"no gradient found among the inputs of {update_value.name}")


def test_task_ops_are_placed_on_their_cells_device():
    model = tfpipe.PipelineModel(
        mlp_layers(depth=2), num_partitions=2, devices=["/CPU:2", "/CPU:3"], num_micro_batches=2
    )
    tasks = _task_ops(_train_graph(model))
    for name, ops in tasks.items():
        cell = int(name.split("_")[1])
        want = tf.DeviceSpec.from_string(model.devices[cell])
        for op in ops:
            got = tf.DeviceSpec.from_string(op.device)
            assert (got.device_type, got.device_index) == (want.device_type, want.device_index), op.name


CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _functions(graph):
    """The graph's function library by name."""
    return {f.signature.name: f for f in graph.as_graph_def().library.function}


def _forward_matmuls(op, functions):
    """Forward MatMuls that ``op`` runs: itself, or those in the body of the cell function it calls.

    Gradient MatMuls are named under "gradient_tape/" in the step's graph, and under
    "gradients/" in the gradient functions TensorFlow generates and where a traced backward
    replays one ("backward/gradients/", tfpipe/backward/replay.py).
    """

    def forward(name):
        return not {"gradients", "gradient_tape"} & set(name.split("/"))

    if op.type == "MatMul" and forward(op.name):
        return 1
    if op.type in CALLS:
        body = functions[op.get_attr("f").name].node_def
        return sum(1 for node in body if node.op == "MatMul" and forward(node.name))
    return 0


def test_recomputation_runs_in_the_backward_task_and_only_when_asked():
    def matmuls_in_backward(remat):
        model = tfpipe.PipelineModel(
            [keras.layers.Dense(4), keras.layers.Dense(3)], num_partitions=2, num_micro_batches=2, remat=remat
        )
        graph = _train_graph(model)
        functions = _functions(graph)
        return {
            name: sum(_forward_matmuls(op, functions) for op in ops)
            for name, ops in _task_ops(graph).items()
            if name.startswith("B")
        }

    assert matmuls_in_backward("never") == {"B_0_0": 0, "B_0_1": 0, "B_1_0": 0, "B_1_1": 0}
    assert matmuls_in_backward("except_last") == {"B_0_0": 1, "B_0_1": 0, "B_1_0": 1, "B_1_1": 0}
    assert matmuls_in_backward("always") == {"B_0_0": 1, "B_0_1": 1, "B_1_0": 1, "B_1_1": 1}


def test_cell_functions_run_on_their_cells_device():
    """Ops inside a called cell function are on the cell's device, or unplaced and so on the call op's."""
    model = tfpipe.PipelineModel(
        mlp_layers(depth=2), num_partitions=2, devices=["/CPU:2", "/CPU:3"], num_micro_batches=2, remat="except_last"
    )
    graph = _train_graph(model)
    functions = _functions(graph)
    calls = 0
    for name, ops in _task_ops(graph).items():
        want = tf.DeviceSpec.from_string(model.devices[int(name.split("_")[1])])
        for op in ops:
            if op.type not in CALLS:
                continue
            calls += 1
            for node in functions[op.get_attr("f").name].node_def:
                got = tf.DeviceSpec.from_string(node.device or op.device)
                assert (got.device_type, got.device_index) == (want.device_type, want.device_index), node.name
    assert calls >= 8  # every F and B task calls its cell's function


def test_each_cell_is_traced_once_forward_and_once_backward_whatever_the_number_of_micro_batches():
    def traces(m):
        model = tfpipe.PipelineModel(
            mlp_layers(depth=3), num_partitions=3, devices=cpu_devices(3), num_micro_batches=m, remat="always"
        )
        _train_graph(model, batch=8)
        return [cell.num_traces for cell in model.cells]

    # The layers run once per cell: the recompute-and-VJP function replays the forward and its backward.
    assert traces(1) == traces(8) == [1, 1, 1]


def test_weight_updates_run_on_each_cells_device():
    model = tfpipe.PipelineModel(
        mlp_layers(depth=2), num_partitions=2, devices=["/CPU:2", "/CPU:3"], num_micro_batches=2
    )
    graph = _train_graph(model, optimizer="adam")
    inside = {id(outer): inner for outer, inner in graph.captures}
    for cell in model.cells:
        for variable in cell.trainable_variables:
            handle = inside[id(variable.value.handle)]
            updates = [op for op in handle.consumers() if op.type == "AssignSubVariableOp"]
            assert updates, variable.path
            for op in updates:
                assert tf.DeviceSpec.from_string(op.device).device_index == int(cell.device[-1]), op.name


def test_what_crosses_between_the_client_and_the_cells_devices():
    """Gradients never go to the client (/CPU:0 here); from it, each cell's device receives its data whole.

    Keras' cross-replica sum (an identity without a strategy) and a LossScaleOptimizer's
    finite check and unscaling name no device: TensorFlow ran them on the client, and
    every gradient crossed there and back (64 MB a step for a 16 x Dense(1024) MLP).
    Split on the client, each micro-batch was its own transfer, and the learning rate
    was read once per variable, as was Adam's step counter. Each micro-batch's share, loss
    and added losses crossed on their own too (K x M scalars from the client, (K + 1) x M
    to it): now each device reads the shares as one vector and adds up its terms of the
    loss first. A fresh process: a shared one's run metadata can hold other tests' functions.
    """
    proc = run_fresh("""
        import json, keras, tensorflow as tf
        import tests.conftest
        import tfpipe
        from tests.util import mlp_layers
        from tfpipe import _compat

        for optimizer in ["sgd", keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())]:
            model = tfpipe.PipelineModel(
                mlp_layers(depth=2), num_partitions=2, devices=["/CPU:2", "/CPU:3"], num_micro_batches=4
            )
            model.compile(optimizer=optimizer, loss="mse")
            model.build((None, 8))
            model.optimizer.build(model.trainable_variables)
            graphs = _compat.partition_graphs(tf.function(model.train_step), (tf.ones((8, 8)), tf.ones((8, 3))))
            sends = [node for graph in graphs for node in graph.node if node.op == "_Send"]
            print("RESULT", json.dumps({
                "to": [n.input[0] for n in sends if n.attr["recv_device"].s.decode().endswith("/device:CPU:0")],
                "from": [n.input[0] for n in sends if n.attr["send_device"].s.decode().endswith("/device:CPU:0")],
                "variables": len(model.trainable_variables),
            }))
    """)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, proc.stdout
    for sends in results:
        assert sends["to"]  # the loss and the outputs, for the metrics
        # A backward task's output is a gradient; "Func/" names what a lowered cond's branches capture.
        assert [name for name in sends["to"] if name.startswith(("B_", "Func/"))] == []
        assert [name for name in sends["from"] if name.startswith(("split", "unstack"))] == []
        assert [name for name in sends["to"] if name.startswith("F_")] == []  # a task's loss or added losses
    learning_rate_reads = [name for name in results[0]["from"] if name.startswith("sgd/")]
    assert len(learning_rate_reads) == 2 < results[0]["variables"], learning_rate_reads  # once per device
    adam_reads = [name for name in results[1]["from"] if "/adam/" in name]  # read in every update before
    assert len(adam_reads) == 4, adam_reads  # the learning rate and the step counter, once per device


@pytest.mark.parametrize(
    "schedule_name", covering([s for s in schedule.SCHEDULES if not schedule.batches_weights(s)], ["zero_bubble"])
)
def test_a_recomputed_forward_is_not_merged_into_the_forward_it_repeats(schedule_name):
    """After Grappler, each forward task keeps its own MatMuls and each backward recomputes them.

    A cell's traced VJP, inlined into the step, recomputes the forward's ops on the forward's
    inputs; Grappler's common-subexpression elimination merged the two, so the forward's
    activations lived until the backward and remat saved no memory (a K=1, M=8 Transformer's
    step: 2,129 MiB with remat="always" against 2,128 MiB with "never"). A fresh process:
    a shared one's run metadata can hold other tests' functions.
    """
    proc = run_fresh(f"""
        import collections, json, keras, tensorflow as tf
        import tests.conftest
        import tfpipe
        from tfpipe import _compat

        layers = [keras.layers.Dense(16, activation="tanh") for _ in range(3)] + [keras.layers.Dense(4)]
        model = tfpipe.PipelineModel(
            layers, num_partitions=1, devices=["/CPU:2"], num_micro_batches=2, remat="always",
            schedule={schedule_name!r},
        )
        model.compile(optimizer="sgd", loss="mse")
        model.build((None, 8))
        model.optimizer.build(model.trainable_variables)
        graphs = _compat.partition_graphs(tf.function(model.train_step), (tf.ones((8, 8)), tf.ones((8, 4))))
        count = collections.Counter(
            node.name.split("/")[0] for graph in graphs for node in graph.node
            if "MatMul" in node.op and "grad" not in node.name
        )
        print("RESULT", json.dumps(count))
    """)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    count = json.loads(line[len("RESULT ") :])
    for j in range(2):
        assert count.get(f"F_0_{j}") == 4, count  # the forward, whole
        assert count.get(f"B_0_{j}") == 3, count  # its recomputation (the last layer's product is not needed)
