"""tfpipe.graph.slim: a traced function re-made from its Grappler-cleaned body computes as before, with fewer nodes."""

import numpy as np
import tensorflow as tf

from tfpipe.graph import slim


def _nodes(function) -> int:
    return len(function.graph.as_graph_def().node)


def _duplicated(x, dy):
    # The same shapes and products three times over, as a tape gradient writes them; one survives the cleaning.
    with tf.control_dependencies([dy]):  # waits for dy, as a recomputation waits for its gradients
        x = tf.identity(x)
    total = tf.zeros_like(x)
    for _ in range(3):
        total += tf.reshape(tf.matmul(x, x, transpose_b=True), tf.shape(x)) @ x * dy
    return [total, tf.shape(x)]


def test_a_slimmed_function_gives_the_same_results_from_a_smaller_body():
    specs = [tf.TensorSpec([4, 4]), tf.TensorSpec([4, 4])]
    options = {"experimental_attributes": {"_noinline": True}, "jit_compile": None}
    original = tf.function(_duplicated, autograph=False, **options).get_concrete_function(*specs)
    made = slim.slimmed(original, "tfpipe_test_body", options)
    assert _nodes(made) < _nodes(original)
    assert b"tfpipe_test_body" in made.name
    assert made.function_def.attr["_noinline"].b
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 4)), tf.float32)
    dy = tf.constant(np.random.default_rng(1).normal(size=(4, 4)), tf.float32)
    for got, want in zip(made(x, dy), original(x, dy)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())

    @tf.function
    def step(x, dy):  # called inside a graph, where the control input from dy's placeholder must be fed
        return made(x, dy)

    np.testing.assert_array_equal(step(x, dy)[0].numpy(), original(x, dy)[0].numpy())


def test_a_body_with_effects_or_captures_is_left_as_it_is():
    counter = tf.Variable(0.0)

    def bump(x):
        counter.assign_add(1.0)  # an effect no output depends on: pruning to the outputs would drop it
        return x * 2.0

    function = tf.function(bump, autograph=False).get_concrete_function(tf.TensorSpec([]))
    assert slim.slimmed(function, "bump", {}) is function
