"""The loss task: one call per micro-batch of a function traced once per micro-batch shape."""

import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, mlp_layers
from tfpipe.analysis.graph_tasks import LOSS_FUNCTION
from tfpipe.training import MicroBatchLoss


def _loss_calls(model, batch):
    model.compile(optimizer="sgd", loss="mse")
    model.build((None, 8))
    spec = (tf.TensorSpec((batch, 8), tf.float32), tf.TensorSpec((batch, 3), tf.float32))
    graph = tf.function(lambda x, y: model.train_step((x, y))).get_concrete_function(*spec).graph
    calls = [op for op in graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    return [op.get_attr("f").name for op in calls if LOSS_FUNCTION in op.get_attr("f").name]


@pytest.mark.parametrize("unroll", [True, False])
def test_each_micro_batch_calls_a_loss_traced_once_per_micro_batch_shape(unroll):
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=4, unroll=unroll
    )
    calls = _loss_calls(model, 10)  # micro-batches of 3, 3, 2, 2
    assert len(calls) == 4 and len(set(calls)) == 2


def test_an_overridden_compute_loss_is_called_per_micro_batch_untraced():
    class Custom(tfpipe.PipelineModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return tf.reduce_mean(tf.abs(y - y_pred)) + 0.0 * tf.reduce_sum(x)  # reads x: cannot be traced apart

    model = Custom(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=4)
    assert _loss_calls(model, 8) == []


def test_a_loss_of_sparse_targets_is_not_traced():
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    dense = tf.ones((2, 3))
    sparse = tf.sparse.from_dense(dense)
    for y, traced in ((dense, True), (sparse, False)):
        loss = MicroBatchLoss(model, tfpipe.PipelineModel.compute_loss, [None] * 2, [y, y], [None] * 2, [2, 2])
        assert (loss.loss_inputs(0) is not None) == traced
