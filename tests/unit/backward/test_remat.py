"""Re-materialization at its own level: a ``Checkpoint``'s VJP against a tape's, kept or recomputed, eager or traced."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.backward import remat
from tfpipe.backward.traced_vjp import TracedVJPs


def _fn(x, w, forward=remat.RECORDED):  # a Checkpoint says which forward runs
    return tf.tanh(tf.matmul(x, w)) * 2.0


def _inputs():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(3, 4)), tf.float32)
    w = tf.constant(rng.normal(size=(4, 2)), tf.float32)
    dy = tf.constant(rng.normal(size=(3, 2)), tf.float32)
    return x, w, dy


def _traced_vjps():
    """A cell's traced VJPs with no device scope, inlined and not compiled (``Cell.function_options``' keys)."""
    return TracedVJPs(contextlib.nullcontext, lambda: {"experimental_attributes": None, "jit_compile": None})


def _reference(x, w, dy):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = _fn(x, w)
    return tape.gradient(y, [x, w], output_gradients=dy)


def test_which_micro_batches_recompute():
    assert [remat.recomputes("always", j, 3) for j in range(3)] == [True, True, True]
    assert [remat.recomputes("except_last", j, 3) for j in range(3)] == [True, True, False]
    assert [remat.recomputes("never", j, 3) for j in range(3)] == [False, False, False]
    with pytest.raises(ValueError, match=r"Unknown remat='sometimes'; use one of 'always', 'except_last', 'never'"):
        remat.check_mode("sometimes")


@pytest.mark.parametrize("recompute", [True, False])
def test_eager_vjp_is_the_tapes(recompute):
    x, w, dy = _inputs()
    record = remat.Checkpoint(_fn, [x, w], recompute=recompute)
    np.testing.assert_allclose(record.outputs, _fn(x, w), rtol=1e-6)
    grads = record.vjp(lambda outputs: [outputs], [dy])
    for got, want in zip(grads, _reference(x, w, dy)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_constant_sources_get_no_gradient_and_running_sums_are_added_to():
    x, w, dy = _inputs()
    running = tf.ones_like(w)
    grads = remat.Checkpoint(_fn, [x, w], recompute=True, constant=1).vjp(lambda o: [o], [dy], accumulate=[running])
    assert grads[0] is None
    np.testing.assert_allclose(grads[1], _reference(x, w, dy)[1] + 1.0, rtol=1e-5, atol=1e-6)


def test_a_recomputed_vjp_in_a_graph_is_one_function_traced_once_per_cell():
    x, w, dy = _inputs()
    traced = _traced_vjps()

    @tf.function
    def step(x, w, dy):
        grads = []
        for _ in range(2):  # two micro-batches of one cell: the second reuses the first's trace
            record = remat.Checkpoint(_fn, [x, w], recompute=True, traced=traced, key="cell 0")
            grads.append(record.vjp(lambda o: [o], [dy]))
        return grads

    for grads in step(x, w, dy):
        for got, want in zip(grads, _reference(x, w, dy)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert traced.num_traces == 1


def test_split_vjp_gives_inputs_at_b_and_weights_at_w():
    x, w, dy = _inputs()
    record = remat.Checkpoint(_fn, [x, w], recompute=False, split=(1, lambda o: [o]))
    inputs = record.input_vjp([dy])
    assert inputs[1] is None
    (weights,) = record.weight_vjp([None])
    want = _reference(x, w, dy)
    np.testing.assert_allclose(inputs[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights, want[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="input_vjp needs a Checkpoint made with split="):
        remat.Checkpoint(_fn, [x, w], recompute=False).input_vjp([dy])


def test_the_function_is_told_which_forward_it_runs():
    # Cell.run_traced is told: a forward no tape records (recomputed later), the VJP's recomputation (replayed),
    # and a forward a tape records (kept, or recomputed eagerly)
    x, w, dy = _inputs()
    seen = []

    def fn(x, w, forward):
        seen.append(forward)
        return _fn(x, w)

    traced = _traced_vjps()

    @tf.function
    def step(x, w, dy):
        return remat.Checkpoint(fn, [x, w], recompute=True, traced=traced, key="cell").vjp(lambda o: [o], [dy])

    step(x, w, dy)
    remat.Checkpoint(fn, [x, w], recompute=False)
    remat.Checkpoint(fn, [x, w], recompute=True).vjp(lambda o: [o], [dy])
    assert seen == [remat.UNRECORDED, remat.REPLAYED, remat.RECORDED, remat.UNRECORDED, remat.RECORDED]
