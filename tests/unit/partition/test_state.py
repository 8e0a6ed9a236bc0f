"""Randomness, BatchNorm statistics and re-materialization across micro-batches."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, max_rel_error


def _noisy_layers():
    return [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(momentum=0.8),
        keras.layers.Dropout(0.3, seed=7),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dropout(0.2, seed=11),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3),
    ]


def _train(remat, k=3, m=3, steps=3, batch=10):
    rng = np.random.default_rng(1)
    n = 3 * batch
    x, y = rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")
    keras.utils.set_random_seed(3)
    model = tfpipe.PipelineModel(
        _noisy_layers(), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m, remat=remat
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
    return model.get_weights()


def test_remat_never_changes_the_result():
    # Same masks, same statistics; only float rounding of differently fused kernels differs.
    always = _train("always")
    assert max_rel_error(always, _train("never")) < 1e-5
    assert max_rel_error(always, _train("except_last")) < 1e-5


def test_remat_never_changes_the_result_when_cells_are_called_not_inlined():
    """K=2, M=16 (4 rows each: BatchNorm of one row is all rounding): recomputations are calls of cleaned VJPs."""
    always = _train("always", k=2, m=16, batch=64)
    assert max_rel_error(always, _train("never", k=2, m=16, batch=64)) < 1e-5
    assert max_rel_error(always, _train("except_last", k=2, m=16, batch=64)) < 1e-5


def test_one_micro_batch_draws_what_plain_keras_draws():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(12, 8)).astype("float32"), rng.normal(size=(12, 3)).astype("float32")
    keras.utils.set_random_seed(5)
    model = tfpipe.PipelineModel(_noisy_layers(), num_partitions=2, num_micro_batches=1, remat="always")
    model.build((None, 8))
    keras.utils.set_random_seed(5)
    reference = keras.Sequential([keras.Input((8,))] + _noisy_layers())
    reference.set_weights(model.get_weights())
    for net in (model, reference):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_micro_batches_draw_different_masks_and_seed_advances_once():
    dropout = keras.layers.Dropout(0.5, seed=1)
    model = tfpipe.PipelineModel([keras.layers.Identity(), dropout], balance=[1, 1], num_micro_batches=4)
    model.build((None, 64))
    seed_state = next(v for v in dropout.variables if "seed" in v.path)
    before = seed_state.numpy().copy()
    out = model(tf.ones((8, 64)), training=True).numpy()
    masks = [tuple((out[2 * j] != 0).astype(int)) for j in range(4)]
    assert len(set(masks)) == 4, "every micro-batch must draw its own mask"
    np.testing.assert_array_equal(seed_state.numpy(), before + [0, 1])
    np.testing.assert_array_equal(model(tf.ones((8, 64)), training=False).numpy(), np.ones((8, 64)))


def test_seed_states_move_to_their_cells_devices_and_draw_as_before():
    """A random layer makes its seed state with itself, on the default device; build moves it to its cell's."""

    def functional():
        inputs = keras.Input((6,))
        hidden = keras.layers.Dropout(0.5, seed=3)(keras.layers.Dense(6)(inputs))
        return keras.Model(inputs, keras.layers.Dense(2)(hidden))

    for layers, balance in (
        ([keras.layers.Dense(6), keras.layers.Dropout(0.5, seed=3)], [1, 1]),
        (functional(), [1, 2]),
    ):
        model = tfpipe.PipelineModel(layers, balance=balance, devices=cpu_devices(2), num_micro_batches=2)
        model.build((None, 6))
        cell = next(c for c in model.cells if any(isinstance(layer, keras.layers.Dropout) for layer in c.layers))
        (seed,) = tfpipe.partition.state.seed_states(cell.layers)
        assert seed.value.device.endswith(f"CPU:{cell.index}")
        before = seed.numpy().copy()
        model(tf.ones((4, 6)), training=True)
        np.testing.assert_array_equal(seed.numpy(), before + [0, 1])  # still the layer's state, advanced once


@pytest.mark.parametrize("m,n", [(4, 12), (3, 10)])
def test_batchnorm_moving_statistics_follow_the_whole_mini_batch(m, n):
    rng = np.random.default_rng(4)
    x, y = rng.normal(2.0, 3.0, size=(n, 6)).astype("float32"), rng.normal(size=(n, 5)).astype("float32")
    dense = keras.layers.Dense(5)
    bn = keras.layers.BatchNormalization(momentum=0.9)
    model = tfpipe.PipelineModel(
        [dense, bn, keras.layers.Dense(5)],
        balance=[1, 1, 1],
        devices=cpu_devices(3),
        num_micro_batches=m,
        remat="always",
    )
    model.build((None, 6))
    model.compile(optimizer="sgd", loss="mse")
    kernel, bias = dense.kernel.numpy(), dense.bias.numpy()
    mean0, var0 = bn.moving_mean.numpy(), bn.moving_variance.numpy()
    model.fit(x, y, batch_size=n, epochs=1, verbose=0)
    h = x @ kernel + bias
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.9 * mean0 + 0.1 * h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 * var0 + 0.1 * h.var(0), rtol=1e-5, atol=1e-6)


def test_batchnorm_normalizes_each_micro_batch_with_its_own_statistics():
    model = tfpipe.PipelineModel(
        [keras.layers.BatchNormalization(center=False, scale=False, epsilon=0.0)], balance=[1], num_micro_batches=2
    )
    x = np.array([[0.0], [2.0], [10.0], [14.0]], "float32")
    out = model(x, training=True).numpy()[:, 0]
    np.testing.assert_allclose(out, [-1, 1, -1, 1], atol=1e-5)


def test_unmergeable_training_state_is_a_clear_error():
    class Counter(keras.layers.Layer):
        def build(self, shape):
            self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")

        def call(self, x, training=False):
            if training:
                self.count.assign(self.count + 1.0)
            return x

    model = tfpipe.PipelineModel([Counter(name="counter"), keras.layers.Dense(2)], balance=[1, 1], num_micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"Layer 'counter' assigns its non-trainable variable"):
        model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)


def test_batchnorm_moving_statistics_of_a_float64_model_merge_in_float64():
    # n_j / N are float32; the float64 statistics are merged with them cast (a TypeError before), so float32's
    # rounding of 3/10 and 4/10 (1e-8) is what remains
    rng = np.random.default_rng(5)
    x, y = rng.normal(2.0, 3.0, size=(10, 6)), rng.normal(size=(10, 5))
    dense = keras.layers.Dense(5, dtype="float64")
    bn = keras.layers.BatchNormalization(momentum=0.9, dtype="float64")
    model = tfpipe.PipelineModel([dense, bn], balance=[1, 1], devices=cpu_devices(2), num_micro_batches=3)
    model.build((None, 6))
    model.compile(optimizer="sgd", loss="mse")
    kernel, bias = dense.kernel.numpy(), dense.bias.numpy()
    mean0, var0 = bn.moving_mean.numpy(), bn.moving_variance.numpy()
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    h = x @ kernel + bias
    assert bn.moving_mean.dtype == "float64"
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.9 * mean0 + 0.1 * h.mean(0), rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 * var0 + 0.1 * h.var(0), rtol=1e-7, atol=1e-7)
