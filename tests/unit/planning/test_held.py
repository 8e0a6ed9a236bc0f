"""The bytes a backward reads of its forward, counted in the traced graph (``tfpipe.planning.held``)."""

import tensorflow as tf

from tfpipe.planning import held


def _counted(fn, spec):
    """``held.counted`` of ``fn``'s forward and backward traced on ``spec``."""
    found = {}

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y)
        graph = tf.compat.v1.get_default_graph()
        forward_ops = len(graph.get_operations())
        grads = tape.gradient(loss, x)
        found["count"] = held.counted(graph.get_operations(), forward_ops, [y])
        return grads

    step.get_concrete_function(spec)
    return found["count"]


def test_a_tanh_holds_its_output_and_not_its_input():
    per_row, fixed = _counted(tf.tanh, tf.TensorSpec([None, 5]))
    assert per_row == 5 * 4 and fixed < 64  # its output (read by its gradient); the input is the caller's


def test_a_buffer_passed_on_by_a_reshape_is_counted_once():
    per_row, _ = _counted(lambda x: tf.reshape(tf.tanh(x), [-1, 10]), tf.TensorSpec([None, 2, 5]))
    assert per_row == 10 * 4  # the output is the tanh's buffer, read by its gradient too
    per_row, _ = _counted(lambda x: tf.tanh(tf.reshape(tf.exp(x), [-1, 10])), tf.TensorSpec([None, 2, 5]))
    assert per_row == 2 * 10 * 4  # exp's output and tanh's, each read by its gradient


def test_a_held_tensor_of_unknown_shape_beyond_its_rows_is_not_counted():
    assert _counted(tf.tanh, tf.TensorSpec([None, None])) is None
