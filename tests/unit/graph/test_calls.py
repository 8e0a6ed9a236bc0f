"""tfpipe.graph.calls: a call op made without TensorFlow's shape walk runs the function as TensorFlow's call does."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.graph import calls

_NOINLINE = {"_noinline": True}  # how tfpipe marks the functions of cells it does not inline


def _function(attributes=_NOINLINE):
    weight = tf.Variable([[2.0, 0.0], [1.0, 1.0]])  # captured: reaches the body as an extra input

    @tf.function(experimental_attributes=attributes)
    def f(x, y):
        return [tf.matmul(x, weight) + y, tf.reduce_sum(x, axis=1)]

    return f.get_concrete_function(tf.TensorSpec([None, 2]), tf.TensorSpec([2])), weight  # the caller keeps weight


def test_call_gives_the_results_and_shapes_of_a_plain_call_and_skips_the_shape_walk():
    function, _weight = _function()
    x, y = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "float32"), np.array([0.5, -0.5], "float32")

    @tf.function
    def both(x, y):
        made = calls.call(function, [x, y])
        call_ops = [op for op in tf.compat.v1.get_default_graph().get_operations() if "PartitionedCall" in op.type]
        assert [op.get_attr("_disable_call_shape_inference") for op in call_ops] == [True]
        assert [t.shape.as_list() for t in made] == [[None, 2], [None]]
        return made, function(x, y)

    made, plain = both(x, y)
    for a, b in zip(made, plain):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(made[0].numpy(), x @ np.array([[2.0, 0.0], [1.0, 1.0]]) + y)


def test_a_stateful_body_gets_a_stateful_call_that_runs_every_time():
    counter = tf.Variable(0.0)

    @tf.function(experimental_attributes=_NOINLINE)
    def bump(x):
        counter.assign_add(1.0)
        return [x * 2.0]

    function = bump.get_concrete_function(tf.TensorSpec([]))

    @tf.function
    def twice(x):
        first = calls.call(function, [x])
        graph = tf.compat.v1.get_default_graph()
        assert {op.type for op in graph.get_operations() if "PartitionedCall" in op.type} == {"StatefulPartitionedCall"}
        with tf.control_dependencies(first):
            return calls.call(function, [x])

    (doubled,) = twice(tf.constant(3.0))
    assert float(doubled) == 6.0
    assert float(counter.numpy()) == 2.0


def test_a_function_tensorflow_inlines_gets_the_usual_call_op():
    function, _weight = _function(attributes=None)

    @tf.function
    def call(x, y):
        made = calls.call(function, [x, y])
        call_ops = [op for op in tf.compat.v1.get_default_graph().get_operations() if "PartitionedCall" in op.type]
        assert len(call_ops) == 1
        assert "_disable_call_shape_inference" not in call_ops[0].node_def.attr
        return made

    np.testing.assert_allclose(call(tf.ones([1, 2]), tf.zeros([2]))[0].numpy(), [[3.0, 1.0]])


def test_eagerly_it_is_a_plain_call():
    function, _weight = _function()
    made = calls.call(function, [tf.ones([1, 2]), tf.zeros([2])])
    np.testing.assert_allclose(made[0].numpy(), [[3.0, 1.0]])
    np.testing.assert_allclose(made[1].numpy(), [2.0])


def _checked(attributes):
    """A function whose body checks its input's run-time size: an Assert, stateful, touching no variable."""

    @tf.function(experimental_attributes=attributes)
    def checked(x):
        with tf.control_dependencies([tf.debugging.assert_positive(tf.shape(x)[0], message="empty batch")]):
            return [x * 2.0]

    return checked.get_concrete_function(tf.TensorSpec([None]))


def _calls_in(step, *args):
    graph = step.get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"]


@pytest.mark.parametrize("attributes", [_NOINLINE, None], ids=["noinline", "inlined"])
def test_a_stateful_call_that_touches_no_variable_is_not_chained_after_the_calls_made_before_it(attributes):
    function = _checked(attributes)

    def step(x):
        with tf.device("/CPU:0"):
            first = calls.call(function, [x])
        with tf.device("/CPU:0"):  # a second replica's call: it needs nothing of the first
            second = calls.call(function, [x + 1.0])
        return first[0] + second[0]

    made = tf.function(step)
    first, second = _calls_in(made, tf.TensorSpec([None]))
    assert first not in second.control_inputs and second.get_attr("_independent_side_effects")
    # TensorFlow's own calls are chained in the order made: what the step's replicas waited on
    plain = tf.function(lambda x: function(x)[0] + function(x + 1.0)[0])
    first, second = _calls_in(plain, tf.TensorSpec([None]))
    assert first in second.control_inputs
    # unchained, each still runs (its check with it) before the step returns
    np.testing.assert_array_equal(made(tf.constant([1.0, 2.0])).numpy(), [6.0, 10.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty batch"):
        made(tf.zeros([0]))
