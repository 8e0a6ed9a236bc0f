"""The step as loops over clock cycles (unroll=False): the same results as the unrolled graph and plain Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.integration.test_transparency import _one_step_each
from tests.unit.partition.test_state import _noisy_layers
from tests.util import covering, cpu_devices, max_rel_error, mlp_layers
from tfpipe.analysis.graph_tasks import LOSS_FUNCTION


@pytest.mark.parametrize("k,m,n", covering([(1, 4, 10), (2, 4, 8), (3, 3, 10), (4, 5, 12)], [(2, 4, 8), (4, 5, 12)]))
def test_loops_match_sequential(k, m, n):
    got, want = _one_step_each(mlp_layers, k, m, "adam", n=n, remat="always", unroll=False)
    assert max_rel_error(got, want) < 1e-5


def _fit(unroll, make_layers, k=3, m=3, steps=3, **kwargs):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(30, 8)).astype("float32"), rng.normal(size=(30, 3)).astype("float32")
    keras.utils.set_random_seed(3)
    model = tfpipe.PipelineModel(
        make_layers(), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m, unroll=unroll, **kwargs
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0).history
    return model, history, x


def test_dropout_and_batchnorm_in_loops_match_the_unrolled_step():
    """Same masks per micro-batch, BatchNorm statistics merged once per step, the same reported loss."""
    unrolled, history_u, x = _fit(True, _noisy_layers, remat="always")
    looped, history_l, _ = _fit(False, _noisy_layers, remat="always")
    assert (unrolled.unrolled, looped.unrolled) == (True, False)
    assert max_rel_error(looped.get_weights(), unrolled.get_weights()) < 1e-5  # moving statistics included
    np.testing.assert_allclose(history_l["loss"], history_u["loss"], rtol=1e-5)
    np.testing.assert_allclose(history_l["mae"], history_u["mae"], rtol=1e-5)
    np.testing.assert_allclose(looped.predict(x, verbose=0), unrolled.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # an embedding's sparse gradient in loops: test_transparency.py
def test_embedding_gradients_in_loops_match_the_unrolled_step():
    """An LM with an Embedding (sparse gradients) and int token inputs, uneven micro-batches."""
    from scripts.data import random_lm

    def make(unroll):
        keras.utils.set_random_seed(0)
        layers, x, y = random_lm(11, 8, 2, 32)
        model = tfpipe.PipelineModel(
            layers, num_partitions=2, devices=cpu_devices(2), num_micro_batches=4, remat="always", unroll=unroll
        )
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(True))
        losses = [model.train_on_batch(x, y) for _ in range(2)]
        return model, losses

    unrolled, want = make(True)
    looped, got = make(False)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(looped.get_weights(), unrolled.get_weights()):  # absolute: attention's key bias gets ~1e-10
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_loops_predict_batches_smaller_than_m():
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=4, unroll=False
    )
    model.build((None, 8))
    reference = keras.Sequential([keras.Input((8,))] + model.pipeline_layers)
    x = np.random.default_rng(0).normal(size=(7, 8)).astype("float32")
    for batch in (7, 3):  # 3 < M: empty micro-batches
        np.testing.assert_allclose(model.predict(x, batch_size=batch, verbose=0), reference(x), rtol=1e-5, atol=1e-6)


def _step_graph(m, unroll):
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=m, remat="always", unroll=unroll
    )
    model.compile(optimizer="sgd", loss="mse")
    model.build((None, 8))
    spec = (tf.TensorSpec((4 * m, 8), tf.float32), tf.TensorSpec((4 * m, 3), tf.float32))
    graph = tf.function(lambda x, y: model.train_step((x, y))).get_concrete_function(*spec).graph
    calls = ("PartitionedCall", "StatefulPartitionedCall")
    return [f"{op.type}:{op.get_attr('f').name}" if op.type in calls else op.type for op in graph.get_operations()]


def test_the_looped_step_holds_one_forward_and_one_backward_loop_whatever_m():
    small, large = _step_graph(4, False), _step_graph(16, False)
    loops = ("While", "StatelessWhile")
    assert sum(small.count(c) for c in loops) == sum(large.count(c) for c in loops) == 2

    def calls(ops, loss):  # the loss of each micro-batch is one call of one function (tfpipe/step/loss.py)
        return [op for op in ops if "PartitionedCall:" in op and (LOSS_FUNCTION in op) == loss]

    assert len(calls(small, False)) == len(calls(large, False))
    assert len(calls(small, True)) == 4 and len(calls(large, True)) == 16 and len(set(calls(large, True))) == 1
    unrolled = _step_graph(16, True)
    assert len(calls(unrolled, False)) >= 2 * 2 * 16  # one call per task, at least


def test_steps_are_unrolled_unless_asked_and_a_cell_that_cannot_be_traced_unrolls(monkeypatch):
    from tfpipe.partition.cell import Cell

    def model(unroll=True):
        return tfpipe.PipelineModel(
            mlp_layers(), balance=[5, 5], devices=cpu_devices(2), num_micro_batches=16, remat="always", unroll=unroll
        )

    assert model().unrolled is True and model(unroll=False).unrolled is False
    monkeypatch.setattr(Cell, "_trace", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("not traceable")))
    looped = model(unroll=False)
    looped.compile(optimizer="sgd", loss="mse")
    x = np.zeros((16, 8), "float32")
    with pytest.warns(UserWarning, match="cannot be traced as a function"):
        looped.train_on_batch(x, np.zeros((16, 3), "float32"))
    assert looped.unroll is False and looped.unrolled is True


def test_unroll_is_checked_and_saved():
    with pytest.raises(TypeError, match="unroll must be True .* or False .*; got 'no'"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=1, unroll="no")
    with pytest.raises(TypeError, match="got None"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=1, unroll=None)
    with pytest.raises(ValueError, match="unroll=False.*remat='never'.*use remat='always'"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=1, remat="never", unroll=False)
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), unroll=False)
    config = model.get_config()
    assert config["unroll"] is False
    assert tfpipe.PipelineModel.from_config(config).unroll is False


@pytest.mark.parametrize("k,m", [(1, 3), (2, 4), (4, 3), (3, 8)])
def test_the_loops_run_gpipes_clock_cycles(k, m):
    """Forward cycle t and backward iteration s (cycle M+K-2-s) run exactly schedule.gpipe's tasks."""
    from tfpipe import schedule
    from tfpipe.step import looped

    cycles = schedule.gpipe(k, m)
    for t in range(m + k - 1):
        ran = {("F", i, looped.micro_batch_at(t, i)) for i in range(k) if 0 <= looped.micro_batch_at(t, i) < m}
        assert ran == {(task.kind, task.cell, task.micro_batch) for task in cycles[t]}
    for s in range(m + k - 1):
        t = m + k - 2 - s
        ran = {("B", i, looped.micro_batch_at(t, i)) for i in range(k) if 0 <= looped.micro_batch_at(t, i) < m}
        assert ran == {(task.kind, task.cell, task.micro_batch) for task in cycles[m + k - 1 + s]}
