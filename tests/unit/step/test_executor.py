"""The executors behind one interface: the unrolled graph, the loops and replicas, and the choice between them."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.util import cpu_devices
from tfpipe.backward.gradients import add_each, sum_gradients
from tfpipe.partition.cell import Cell
from tfpipe.step import looped, sums
from tfpipe.step.executor import Executor
from tfpipe.step.replicated import Replicated
from tfpipe.step.unrolled import Pipeline


def _cells(k=2):
    keras.utils.set_random_seed(0)
    cells = [Cell(i, [keras.layers.Dense(4, activation="tanh")], d) for i, d in enumerate(cpu_devices(k))]
    spec = keras.KerasTensor((None, 3))
    for cell in cells:
        spec = cell.build(spec)
    return cells


def _step(executor, m=3):
    x = np.arange(6.0 * m, dtype="float32").reshape(2 * m, 3) / 10

    @tf.function(autograph=False)
    def step():
        parts = [tf.constant(x[2 * j : 2 * j + 2]) for j in range(m)]
        result = executor.train(parts, lambda j, y: tf.reduce_mean(y) / m, [tf.constant(1.0 / m)] * m)
        return result.loss, result.gradients

    loss, grads = step()
    return float(loss), [g.numpy() for g in grads]


def test_every_executor_declares_the_interface():
    assert all(Executor in kind.__mro__ for kind in (Pipeline, looped.Looped, Replicated))  # declared, not only alike
    cells = _cells()
    assert isinstance(Pipeline(cells, 2, "always"), Executor) and isinstance(looped.Looped(cells, 2), Executor)


def test_the_looped_executor_on_its_own_matches_the_unrolled_graph():
    cells = _cells()
    loops = looped.Looped(cells, 3)
    assert loops.unroll is False and loops.num_micro_batches == 3
    got_loss, got = _step(loops)
    want_loss, want = _step(Pipeline(cells, 3, "always"))
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_loops_are_chosen_before_a_step_and_a_model_they_cannot_run_is_unrolled_from_then_on():
    pipeline = Pipeline(_cells(), 2, "always", unroll=False)
    assert pipeline.unroll is False
    pipeline._loops.routes = object()  # as for a Functional model: the loops cannot carry routes
    parts = [tf.zeros((1, 3))] * 2
    with pytest.warns(UserWarning, match="cannot run as loops, so it is unrolled: a Functional model"):
        assert pipeline._loop_plan(parts, True) is None
    assert pipeline.unroll is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pipeline._loop_plan(parts, True) is None  # chosen once: no second warning


def test_sum_gradients_keeps_slices_unless_one_is_dense_and_adds_each_pair():
    rows = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    both = sum_gradients([rows, None, rows])
    assert isinstance(both, tf.IndexedSlices) and both.indices.dtype == tf.int64
    np.testing.assert_allclose(tf.convert_to_tensor(both).numpy(), [[0, 0], [2, 2], [0, 0]])
    mixed = sum_gradients([rows, tf.ones((3, 2))])
    np.testing.assert_allclose(mixed.numpy(), [[1, 1], [2, 2], [1, 1]])
    assert sum_gradients([None, None]) is None
    got = add_each([rows, None, tf.ones(2)], [None, tf.ones(2), tf.ones(2)])
    assert got[0] is rows and float(got[1][0]) == 1.0 and float(got[2][0]) == 2.0
    assert float(sums.sum_on_devices([tf.constant(1.0), tf.constant(2.0)])) == 3.0
