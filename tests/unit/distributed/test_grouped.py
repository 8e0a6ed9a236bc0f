"""tfpipe.distributed.grouped: a remote device's stateful work traced as one call, a local device's in place."""

import tensorflow as tf

from tfpipe.distributed import grouped

REMOTE = "/job:worker/replica:0/task:1/device:CPU:0"
LOCAL = "/job:localhost/replica:0/task:0/device:CPU:0"


def _work(variable: tf.Variable):
    def work() -> tf.Tensor:
        variable.assign_add([1.0, 1.0])
        return variable.read_value() * 2.0

    return work


def _traced_ops(device: str) -> list[tf.Operation]:
    work = _work(tf.Variable([1.0, 2.0]))
    return tf.function(lambda: grouped.run_on(device, work)).get_concrete_function().graph.get_operations()


def test_work_for_another_process_is_one_call_on_its_device():
    ops = _traced_ops(REMOTE)
    calls = [op for op in ops if op.type in ("StatefulPartitionedCall", "PartitionedCall")]
    assert len(calls) == 1 and calls[0].device == REMOTE
    assert not [op for op in ops if op.type in ("AssignAddVariableOp", "ReadVariableOp")]  # inside the call


def test_work_for_this_process_stays_in_the_step_and_both_compute_the_same():
    ops = _traced_ops(LOCAL)
    assert not [op for op in ops if op.type.endswith("PartitionedCall")]
    assert [op.device for op in ops if op.type == "AssignAddVariableOp"] == [LOCAL]
    variable = tf.Variable([1.0, 2.0])
    # run as a call (a remote device's way) on this process's CPU: the same numbers, the update applied once
    step = tf.function(lambda: tf.function(_work(variable), autograph=False)())
    assert step().numpy().tolist() == [4.0, 6.0] and variable.numpy().tolist() == [2.0, 3.0]


def test_only_devices_of_other_processes_outside_a_strategy_are_grouped():
    assert grouped.elsewhere(REMOTE) and not grouped.elsewhere(LOCAL) and not grouped.elsewhere("/CPU:0")
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert not grouped.elsewhere(REMOTE)  # a strategy places and groups its own updates
    assert grouped.run_on(LOCAL, lambda: tf.constant(3.0)).numpy() == 3.0  # eagerly: run as it is
