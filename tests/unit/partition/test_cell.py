"""A cell at its own level: built on its device, run inline or traced once, told which forward it runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.backward import remat
from tfpipe.partition.cell import Cell


def _cell() -> Cell:
    keras.utils.set_random_seed(0)
    cell = Cell(0, [keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)], "/CPU:0")
    cell.build(keras.KerasTensor((None, 3)))
    return cell


def _x() -> tf.Tensor:
    return tf.constant(np.random.default_rng(0).normal(size=(4, 3)), tf.float32)


def test_built_on_its_device_and_counted_once_per_weight():
    cell = _cell()
    assert [tuple(v.shape) for v in cell.trainable_variables] == [(3, 5), (5,), (5, 2), (2,)]
    assert cell.count_params() == 3 * 5 + 5 + 5 * 2 + 2
    assert all(v.value.device.endswith("CPU:0") for v in cell.weights)


def test_traced_forward_equals_the_layers_run_inline_and_traces_once_per_signature():
    cell = _cell()
    x = _x()
    want = cell.layers[1](cell.layers[0](x))
    trainable, non_trainable = cell.read()

    @tf.function
    def step(x):
        return [cell.run_traced(trainable, non_trainable, x, training=True, forward=f)[0] for f in forwards]

    forwards = (remat.RECORDED, remat.UNRECORDED, remat.RECORDED)
    for got in step(x):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert cell.num_traces == 1  # once per graph and signature: the other calls reused the trace
    inline = cell.run_inline(trainable, non_trainable, x, training=True)[0]  # eagerly: the layers themselves
    np.testing.assert_allclose(inline, want, rtol=1e-5, atol=1e-6)


def test_a_replayed_forward_reruns_no_layer_and_gives_the_same_values():
    cell = _cell()
    x = _x()
    trainable, non_trainable = cell.read()

    @tf.function
    def step(x):
        first = cell.run_traced(trainable, non_trainable, x, training=True)[0]
        again = cell.run_traced(trainable, non_trainable, x, training=True, forward=remat.REPLAYED)[0]
        return first, again

    first, again = step(x)
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-6)
    assert cell.num_traces == 1


def test_an_unknown_forward_is_refused_by_name():
    cell = _cell()
    trainable, non_trainable = cell.read()

    @tf.function
    def step(x):
        return cell.run_traced(trainable, non_trainable, x, training=True, forward="twice")[0]

    with pytest.raises(ValueError, match=r"forward='twice'; use one of \('recorded', 'unrecorded', 'replayed'\)"):
        step(_x())
