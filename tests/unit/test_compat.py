"""Every private Keras/TensorFlow internal in tfpipe/_compat.py still exists and behaves as tfpipe expects.

If one of these fails after upgrading Keras or TensorFlow, the internal it names
changed: fix tfpipe/_compat.py, do not loosen the test.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import _compat


def test_in_stateless_scope():
    assert not _compat.in_stateless_scope()
    with keras.StatelessScope():
        assert _compat.in_stateless_scope()


def _compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_compiled_loss_is_the_compiled_loss_without_model_losses():
    model = _compiled_model()
    y, y_pred = np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")
    assert float(_compat.compiled_loss(model)(y, y_pred, None)) == pytest.approx(1.0)
    unlossed = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    unlossed.compile(optimizer="sgd")
    assert _compat.compiled_loss(unlossed) is None


def test_loss_tracker_reports_fits_loss():
    model = _compiled_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"
    assert tracker in model.metrics


def test_symbolic_build_creates_metric_and_optimizer_variables():
    model = _compiled_model()
    batch = (keras.KerasTensor((None, 3)), keras.KerasTensor((None, 2)), None)
    assert not model.optimizer.built
    before = len(model.metrics_variables)
    _compat.symbolic_build(model, batch)
    assert model.optimizer.built and len(model.metrics_variables) > before


def test_gradient_all_reduce_is_called_before_every_update_and_can_be_replaced():
    optimizer = keras.optimizers.SGD(0.5)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    reduce, seen = _compat.gradient_all_reduce(optimizer), []

    def doubled(grads_and_vars):
        seen.append(len(grads_and_vars))
        return [(2.0 * g, v) for g, v in reduce(grads_and_vars)]

    _compat.set_gradient_all_reduce(optimizer, doubled)
    optimizer.apply_gradients([(tf.ones(2), variable)])
    assert seen == [1]
    np.testing.assert_allclose(variable.numpy(), [0.0, 0.0])  # 1 - 0.5 * (2 * 1)


def test_step_counter_as_is_what_an_update_reads_and_is_restored():
    optimizer = keras.optimizers.Adam(0.1)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    counter = _compat.step_counter(optimizer)
    assert counter is optimizer.iterations  # no gradient accumulation
    with _compat.step_counter_as(optimizer, tf.constant(9, counter.dtype)):  # Adam's bias correction at step 10
        optimizer.update_step(tf.ones(2), variable, 0.1)
    assert _compat.step_counter(optimizer) is counter
    m, v = 0.1, 0.001  # after one update from zero slots with gradient 1
    alpha = 0.1 * np.sqrt(1 - 0.999**10) / (1 - 0.9**10)
    np.testing.assert_allclose(variable.numpy(), 1 - m * alpha / (np.sqrt(v) + 1e-7), rtol=1e-5)  # step 1: 1 - 0.1


def test_flatten_layers_reaches_nested_layers():
    inner = keras.Sequential([keras.layers.Dense(2, name="deep")])
    outer = keras.Sequential([keras.Input((3,)), inner])
    names = [layer.name for layer in _compat.flatten_layers(outer)]
    assert names[0] == outer.name and inner.name in names and "deep" in names


def test_function_graph_finds_a_called_function():
    inner = tf.function(lambda x: x * 2.0, autograph=False).get_concrete_function(tf.TensorSpec([], tf.float32))

    @tf.function(autograph=False)
    def outer(x):
        return inner(x)

    graph = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    calls = [op for op in graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert calls
    found = _compat.function_graph(graph, calls[0].get_attr("f").name)
    assert found is not None and any(op.type == "Mul" for op in found.get_operations())
    assert _compat.function_graph(graph, "no_such_function") is None


def test_eager_thread_settings_are_set_and_restored():
    from tensorflow.python.eager import context

    ctx = context.context()
    before = ctx._intra_op_parallelism_threads, ctx._inter_op_parallelism_threads
    with _compat.eager_thread_settings(3):
        assert (ctx._intra_op_parallelism_threads, ctx._inter_op_parallelism_threads) == (3, 3)
        assert ctx.config.intra_op_parallelism_threads == 3  # what a connecting client sends
    assert (ctx._intra_op_parallelism_threads, ctx._inter_op_parallelism_threads) == before


def test_tpu_strategy_keeps_its_device_assignment_privately():
    # No TPU here: check that TPUStrategy's extended object still stores the assignment under this name.
    from tensorflow.python.distribute import tpu_strategy

    assert "self._device_assignment = device_assignment" in inspect.getsource(tpu_strategy.TPUExtended.__init__)

    class Assignment:
        num_cores_per_replica = 4

    class Extended:
        _device_assignment = Assignment()

    class Strategy:
        extended = Extended()

    assert _compat.tpu_cores_per_replica(Strategy()) == 4


def test_default_strategy_is_recognized():
    assert _compat.is_default_strategy(tf.distribute.get_strategy())
    assert not _compat.is_default_strategy(tf.distribute.OneDeviceStrategy("/CPU:0"))


def test_functional_execution_order_is_by_depth_without_input_nodes():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(3, name="d")
    outputs = keras.layers.Add(name="add")([dense(inputs), inputs])
    model = keras.Model(inputs, outputs)
    nodes = _compat.execution_order(model)
    assert [n.operation.name for n in nodes] == ["d", "add"]
    assert list(nodes[1].arguments.keras_tensors)[1] is inputs


def test_partition_graphs_show_the_transfers_tensorflow_makes():
    @tf.function(autograph=False)
    def move(x):
        with tf.device("/CPU:0"):
            y = x + 1.0
        with tf.device("/CPU:1"):
            return y * 2.0

    graphs = _compat.partition_graphs(move, tf.constant(1.0))
    sends = [n for g in graphs for n in g.node if n.op == "_Send"]
    assert any(n.attr["send_device"].s.decode().endswith("/device:CPU:0") for n in sends)
    assert all(n.attr["send_device_incarnation"].i != 0 for n in sends)


def test_dataset_batching_reads_the_batch_behind_batch_keeping_steps():
    x = np.zeros((1667, 2), "float32")
    sliced = tf.data.Dataset.from_tensor_slices(x)
    batched = sliced.shuffle(2000).batch(128).map(lambda a: a).prefetch(2).repeat(2)
    assert _compat.dataset_batching(batched) == (1667, 128, False)
    assert _compat.dataset_batching(sliced.batch(100, drop_remainder=True).cache()) == (1667, 100, True)
    assert _compat.dataset_batching(sliced.batch(10, num_parallel_calls=2)) == (1667, 10, False)
    assert _compat.dataset_batching(sliced.batch(8).take(3)) is None  # take may drop the remainder: unknown
    assert _compat.dataset_batching(sliced.filter(lambda a: True).batch(8)) is None  # unknown sample count
    assert _compat.dataset_batching(sliced) is None  # not batched


def _config_tensorflow_puts_on_a_call_op() -> bytes:
    """The ``config_proto`` of the call op TensorFlow makes for a tf.function called in a graph here."""

    @tf.function
    def inner(x):
        return x + 1.0

    concrete = inner.get_concrete_function(tf.TensorSpec([2]))
    graph = tf.Graph()
    with graph.as_default():
        concrete(tf.ones([2]))
    (made,) = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    return made.get_attr("config_proto")


def test_call_options_are_what_tensorflow_puts_on_its_call_ops():
    assert _config_tensorflow_puts_on_a_call_op() == _compat.call_options()


def _rewrites():
    from tensorflow.core.protobuf import config_pb2

    return config_pb2.ConfigProto.FromString(_compat.call_options()).graph_options.rewrite_options


def test_fewer_rewrites_turns_off_two_optimizers_alone_for_calls_and_puts_the_options_back():
    off = 2  # RewriterConfig.OFF
    tf.config.optimizer.set_experimental_options({"constant_folding": False})  # a user's setting
    try:
        with _compat.fewer_rewrites():
            assert (_rewrites().function_optimization, _rewrites().constant_folding) == (off, off)
            assert _rewrites().disable_tfg_optimizer
            assert _config_tensorflow_puts_on_a_call_op() == _compat.call_options()  # its own call ops carry it
        assert (_rewrites().function_optimization, _rewrites().constant_folding) == (0, off)  # put back
        assert not _rewrites().disable_tfg_optimizer
    finally:
        tf.config.optimizer.set_experimental_options({"constant_folding": True})


def test_grappler_optimize_removes_duplicates_and_keeps_the_fetched_nodes():
    @tf.function
    def twice(x):
        return tf.reshape(x, tf.shape(x)) + tf.reshape(x, tf.shape(x))

    graph = twice.get_concrete_function(tf.TensorSpec([None, 3])).graph
    fetches = [t.op.name for t in graph.outputs]
    before = graph.as_graph_def()
    after = _compat.grappler_optimize(before, fetches, ["common_subgraph_elimination"])
    count = lambda graph_def, op: sum(node.op == op for node in graph_def.node)  # noqa: E731
    assert (count(before, "Shape"), count(after, "Shape")) == (2, 1)
    assert set(fetches) <= {node.name for node in after.node}


def test_backward_function_is_the_one_the_tapes_gradient_of_a_call_uses():
    """Built once and cached: its inputs are the output gradients, then intermediates the graph now outputs."""
    function = tf.function(lambda x, w: [tf.tanh(x @ w), tf.shape(x)], autograph=False).get_concrete_function(
        tf.TensorSpec([2, 3]), tf.TensorSpec([3, 3])
    )
    backward = _compat.backward_function(function)
    assert _compat.backward_function(function) is backward
    assert len(function.graph.outputs) > 2  # the intermediates the backward reads
    assert {id(t) for t in backward.captured_inputs} <= {id(t) for t in function.graph.outputs}
    assert len(backward.graph.inputs) == 1 + len(backward.captured_inputs)  # the float output's gradient first
    pairs = function._delayed_rewrite_functions._cached_function_pairs  # noqa: SLF001

    @tf.function(autograph=False)
    def taped(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = function(x, w)[0]
        return tape.gradient(y, w)

    taped(tf.ones([2, 3]), tf.eye(3))
    assert [pair[1] for pair in pairs.values()] == [backward]  # the tape reused it


def test_is_trainable_takes_floats_not_integers():
    assert _compat.is_trainable(tf.constant(1.0)) and not _compat.is_trainable(tf.constant(1))


def test_tensorflow_gradient_is_the_registered_gradient_tf_gradients_uses():
    x = tf.constant([[[1.0, 2.0]]])
    w = tf.constant([[3.0], [4.0]])

    @tf.function(autograph=False)
    def run():
        y = tf.linalg.matmul(x, w)
        op = y.op
        return _compat.tensorflow_gradient("BatchMatMulV2")(op, tf.ones_like(y)), tf.gradients(y, [x, w])

    ours, theirs = run()
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy())
