"""Every private TensorFlow internal in tfpipe/_compat/tensorflow.py still exists and behaves as tfpipe expects.

If one of these fails after upgrading TensorFlow, the internal it names changed:
fix tfpipe/_compat/tensorflow.py, do not loosen the test.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import _compat


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


def _op_types_run(attributes):
    inner = tf.function(lambda x: x * 2.0 + 1.0, autograph=False, experimental_attributes=attributes)
    inner = inner.get_concrete_function(tf.TensorSpec([], tf.float32))

    @tf.function(autograph=False)
    def outer(x):
        return inner(x) * 3.0

    return inner, {node.op for graph in _compat.partition_graphs(outer, tf.constant(1.0)) for node in graph.node}


def test_noinline_functions_stay_call_ops_where_others_are_inlined():
    marked, ran = _op_types_run(_compat.noinline())
    assert _compat.is_noinline(marked) and "PartitionedCall" in ran
    plain, ran = _op_types_run(None)
    assert not _compat.is_noinline(plain) and "PartitionedCall" not in ran and "AddV2" in ran
    assert _compat.noinline() is not _compat.noinline()  # a fresh dict for each tf.function


@pytest.mark.parametrize("jit_compile", [None, True])
def test_call_op_is_tensorflows_call_op_without_the_shape_walk(jit_compile):
    function = tf.function(lambda x: [tf.tanh(x) * 2.0], autograph=False, jit_compile=jit_compile)
    function = function.get_concrete_function(tf.TensorSpec([3], tf.float32))

    @tf.function(autograph=False)
    def both(x):
        graph = tf.compat.v1.get_default_graph()
        function.add_to_graph(graph)
        op = _compat.call_op(graph, function, [x], [tf.float32], stateful=False)
        assert op.outputs[0].shape.rank is None  # TensorFlow did not walk the body for shapes
        (own,) = function(x)
        ours, theirs = set(op.node_def.attr), set(own.op.node_def.attr)
        assert {a for a in ours if not a.startswith("_")} <= theirs and "_disable_call_shape_inference" in ours
        assert (_compat.XLA_ATTRIBUTE in theirs, _compat.XLA_ATTRIBUTE in ours) == (bool(jit_compile),) * 2
        return op.outputs[0], own

    x = tf.constant([0.5, -1.0, 2.0])
    made, own = both(x)
    np.testing.assert_array_equal(made.numpy(), own.numpy())


def test_send_and_recv_move_a_tensor_between_the_devices_tensorflow_names():
    @tf.function(autograph=False)
    def move(x):
        with tf.device("/CPU:0"):
            y = x + 1.0
        with tf.device("/CPU:1"):
            return y * 2.0

    # Run metadata is process-wide: a function another thread instantiates meanwhile adds its sends (seen once in CI).
    sends = {
        s for s in _compat.inserted_sends(move, tf.constant(1.0)) if s[0].endswith("CPU:0") and s[1].endswith("CPU:1")
    }
    ((send_device, recv_device, incarnation),) = sends
    assert incarnation != 0

    @tf.function(autograph=False)
    def explicit(x):
        with tf.device("/CPU:0"):
            sent = _compat.send(x * 3.0, "t0", send_device, incarnation, recv_device)
        with tf.device("/CPU:1"):
            received = _compat.recv(tf.float32, "t0", send_device, incarnation, recv_device)
        with tf.control_dependencies([sent]):
            return tf.identity(received)

    assert float(explicit(tf.constant(2.0))) == 6.0
    ran = {(node.op, node.device[-5:]) for g in _compat.partition_graphs(explicit, tf.constant(2.0)) for node in g.node}
    assert {("Send", "CPU:0"), ("Recv", "CPU:1")} <= ran  # each where its scope put it


def test_wrap_function_keeps_placeholders_made_inside_to_be_fed_when_imported():
    made = {}

    def body(x):
        y = tf.tanh(x)
        made["dy"] = _compat.placeholder(tf.float32, [2])
        (made["dx"],) = tf.gradients(y, [x], grad_ys=made["dy"])
        return [y, made["dx"]]

    wrapped = _compat.wrap_function(body, [tf.TensorSpec([2], tf.float32)])
    assert len(wrapped.inputs) == 1 and made["dy"].op.type == "Placeholder"
    graph_def = wrapped.graph.as_graph_def()

    @tf.function(autograph=False)
    def fed(x, dy):
        feeds = {wrapped.inputs[0].name: x, made["dy"].name: dy}
        return tf.graph_util.import_graph_def(graph_def, input_map=feeds, return_elements=[made["dx"].name])[0]

    x, dy = np.array([0.5, -1.0], "float32"), np.array([2.0, 3.0], "float32")
    np.testing.assert_allclose(fed(x, dy).numpy(), (1 - np.tanh(x) ** 2) * dy, rtol=1e-6)


def test_own_address_is_none_before_this_process_connects_to_a_cluster():
    # After connecting, LocalCluster's start names the port (tests/integration/test_cluster_lifecycle.py), and
    # reconnect() gives it a new one (tests/integration/test_recovery.py): both need a fresh process.
    assert _compat.own_address() is None


def test_wait_for_ops_returns_once_async_ops_ran_and_raises_their_errors():
    reached = []
    with pytest.raises(tf.errors.InvalidArgumentError, match="not finite"):
        with tf.experimental.async_scope():  # ops return before they run, as ops sent to a worker do
            tf.debugging.check_numerics(tf.constant(float("inf")), "not finite")
            _compat.wait_for_ops()
            reached.append(True)
    assert not reached
    tf.experimental.async_clear_error()


def test_run_independently_takes_an_op_out_of_the_chain_of_stateful_ops_that_touch_no_variable():
    def step(exempt):
        first = tf.raw_ops.Timestamp()  # stateful, no inputs: tf.function chains such ops in the order made
        second = tf.raw_ops.Timestamp()
        if exempt:
            _compat.run_independently(second.op)
        return first + second

    for exempt in (False, True):
        graph = tf.function(lambda e=exempt: step(e)).get_concrete_function().graph
        first, second = [op for op in graph.get_operations() if op.type == "Timestamp"]
        assert (first in second.control_inputs) == (not exempt)
    with tf.Graph().as_default():  # outside a tf.function there is no chain: nothing changes
        op = tf.raw_ops.Timestamp().op
        _compat.run_independently(op)
        assert "_independent_side_effects" not in op.node_def.attr


def test_custom_gradients_forgotten_removes_what_tf_custom_gradient_registered_meanwhile():
    from tensorflow.python.framework import ops

    @tf.custom_gradient
    def doubled(x):
        return 2.0 * x, lambda dy: 2.0 * dy

    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = doubled(x)
        return tape.gradient(y, x)

    registry = ops._gradient_registry._registry
    tf.function(gradient)(tf.constant(1.0))  # registered before the block: stays
    before = set(registry)
    with _compat.custom_gradients_forgotten():
        assert float(tf.function(gradient)(tf.constant(3.0))) == 2.0
        added = set(registry) - before
        assert added and all(name.startswith("CustomGradient-") for name in added)  # one per traced call
    assert set(registry) == before
