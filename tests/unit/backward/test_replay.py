"""tfpipe.backward.replay: a function's forward and TensorFlow's backward of it, as ops, give what a taped call does."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import _compat
from tfpipe.backward import replay
from tfpipe.graph import calls, slim

rng = np.random.default_rng(0)
TABLE = rng.standard_normal((7, 3)).astype("float32")
W = rng.standard_normal((3, 4)).astype("float32")
IDS = rng.integers(0, 7, size=5).astype("int32")
DY = rng.standard_normal((5, 4)).astype("float32")


def _cell(attributes=None):
    """An embedding, a product and an integer output: sparse, dense and no gradients."""

    def body(ids, table, w):
        h = tf.gather(table, ids)
        return [tf.tanh(h @ w), tf.reduce_sum(h, axis=1), tf.shape(ids)[0]]

    specs = [tf.TensorSpec([5], tf.int32), tf.TensorSpec([7, 3]), tf.TensorSpec([3, 4])]
    return tf.function(body, autograph=False, experimental_attributes=attributes).get_concrete_function(*specs)


def _vjp(run):
    """Outputs, and the gradients of the table and weights for DY on the first output, of ``run(ids, table, w)``."""

    @tf.function(autograph=False)
    def step(ids, table, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([table, w])
            outputs = run(ids, table, w)
            target = tf.reduce_sum(outputs[0] * dy) + 2.0 * tf.reduce_sum(outputs[1])
        d_table, d_w = tape.gradient(target, [table, w])
        return outputs, tf.convert_to_tensor(d_table), d_w, isinstance(d_table, tf.IndexedSlices)

    return step(IDS, TABLE, W, DY)


@pytest.mark.parametrize("attributes", [None, {"_noinline": True}], ids=["inlined", "noinline"])
def test_replayed_call_gives_the_outputs_and_gradients_of_a_taped_call(attributes):
    function = _cell(attributes)
    want_out, want_table, want_w, _ = _vjp(lambda *a: function(*a))
    got_out, got_table, got_w, sparse = _vjp(lambda *a: replay.call(function, list(a)))
    for got, want in zip(got_out, want_out):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_allclose(got_table.numpy(), want_table.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got_w.numpy(), want_w.numpy(), rtol=1e-6)
    assert sparse  # the embedding's gradient stays IndexedSlices, as the tape's
    expected_w = TABLE[IDS].T @ (DY * (1 - np.tanh(TABLE[IDS] @ W) ** 2))
    np.testing.assert_allclose(got_w.numpy(), expected_w, rtol=1e-5, atol=1e-6)


def test_the_function_is_differentiated_once_for_the_replay_and_the_taped_call():
    function = _cell({"_noinline": True})
    built = []
    construct = type(function._delayed_rewrite_functions)._construct_forward_backward  # noqa: SLF001

    def counted(self, num_doutputs):
        built.append(num_doutputs)
        return construct(self, num_doutputs)

    type(function._delayed_rewrite_functions)._construct_forward_backward = counted  # noqa: SLF001
    try:
        _vjp(lambda *a: replay.call(function, list(a)))
        _vjp(lambda *a: function(*a))
    finally:
        type(function._delayed_rewrite_functions)._construct_forward_backward = construct  # noqa: SLF001
    assert len(built) == 1


def test_a_call_op_made_after_the_replay_has_the_functions_own_outputs():
    """TensorFlow appends the backward's intermediates to the function's graph outputs; a call returns the three."""
    function = _cell({"_noinline": True})
    _compat.backward_function(function)
    assert len(function.graph.outputs) > 3

    @tf.function(autograph=False)
    def run(ids, table, w):
        return calls.call(function, [ids, table, w])

    outputs = run(IDS, TABLE, W)
    assert len(outputs) == 3
    np.testing.assert_allclose(outputs[0].numpy(), np.tanh(TABLE[IDS] @ W), rtol=1e-6)


def test_a_body_that_captures_a_tensor_is_not_replayed():
    weight = tf.Variable(W)
    function = tf.function(lambda h: [h @ weight], autograph=False).get_concrete_function(tf.TensorSpec([5, 3]))

    @tf.function(autograph=False)
    def run(h):
        return replay.call(function, [h])

    assert run(TABLE[IDS]) is None


def test_slimming_a_replayed_body_drops_the_placeholders_the_import_left():
    """Imported graphs keep their mapped placeholders; the cleaned body keeps only its own inputs."""
    function = _cell({"_noinline": True})

    def body(ids, table, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([table, w])
            outputs = replay.call(function, [ids, table, w])
        return tape.gradient(outputs[0], [w], output_gradients=[dy])

    specs = [tf.TensorSpec([5], tf.int32), tf.TensorSpec([7, 3]), tf.TensorSpec([3, 4]), tf.TensorSpec([5, 4])]
    traced = tf.function(body, autograph=False).get_concrete_function(*specs)
    made = slim.slimmed(traced, "tfpipe_test_replayed", {"experimental_attributes": {"_noinline": True}})
    placeholders = [n for n in made.graph.as_graph_def().node if n.op == "Placeholder"]
    assert len(placeholders) == 4  # its arguments
    np.testing.assert_allclose(made(IDS, TABLE, W, DY)[0].numpy(), traced(IDS, TABLE, W, DY)[0].numpy(), rtol=1e-6)
