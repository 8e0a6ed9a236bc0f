"""schedule="gpipe_batched_w": each cell's weight gradients once over all micro-batches, exactly GPipe's step."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import (
    covering,
    cpu_devices,
    max_rel_error,
    mlp_layers,
    per_layer_error,
    small_unet,
    stateful_layers,
    unet_data,
)
from tfpipe.backward import batched_w, split_vjp
from tfpipe.models.transformer import transformer_lm

BATCHED_W = "gpipe_batched_w"


def _fit(model, x, y, optimizer="sgd", loss="mse"):
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}),
                  loss=loss)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
    return [str(w.message) for w in caught if BATCHED_W in str(w.message)]


@pytest.mark.parametrize(  # uneven micro-batches, M=1
    "k,m,n", covering([(2, 4, 8), (2, 3, 7), (4, 6, 13), (3, 1, 4)], [(4, 6, 13), (3, 1, 4)])
)
def test_batched_weight_gradients_train_like_plain_keras(k, m, n):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m,
                                 remat="never", schedule=BATCHED_W)  # fmt: skip
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _fit(plain, x, y, "adam")
    assert _fit(model, x, y, "adam") == []  # every cell's W ran once over all rows: no fallback
    assert per_layer_error(model.pipeline_layers, plain.layers) < 1e-5


def _regularized_layers(activity_first: bool) -> list[keras.layers.Layer]:
    keras.utils.set_random_seed(0)
    activity = keras.layers.Dense(16, activity_regularizer=keras.regularizers.L1(0.001))
    rest = [keras.layers.LayerNormalization(), keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.02))]
    first = keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2", bias_regularizer=keras.regularizers.L1())
    return [first, activity, *rest] if activity_first else [first, keras.layers.Dense(16), activity, *rest]


@pytest.mark.parametrize("activity_first", covering([False, True], [True]))
def test_regularizers_train_like_plain_keras(activity_first):
    """Weight penalties are taken once beside the batched W (in micro-batch 0's task they would make W differ
    between micro-batches). An activity penalty in the first cell, whose whole backward is W, weighs each
    micro-batch by its share of the batch: that cell's W stays per micro-batch, with a warning."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(9, 8)).astype("float32"), rng.normal(size=(9, 3)).astype("float32")
    plain = keras.Sequential([keras.Input((8,)), *_regularized_layers(activity_first)])
    balance = [2, 2 if activity_first else 3]
    model = tfpipe.PipelineModel(_regularized_layers(activity_first), balance=balance, devices=cpu_devices(2),
                                 num_micro_batches=3, remat="never", schedule=BATCHED_W)  # fmt: skip
    _fit(plain, x, y, "adam")
    caught = _fit(model, x, y, "adam")
    # 1e-4: the last kernel's data gradient and its L2 gradient nearly cancel, and Adam divides by that gradient's
    # root, so float32's rounding shows at 2e-5 there (a penalty taken twice moves the weights by 1e-3 to 1e-2)
    assert per_layer_error(model.pipeline_layers, plain.layers) < 1e-4
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5)
    if activity_first:
        assert len(caught) == 1 and "cell 0 computes its weight gradients once per micro-batch" in caught[0]
    else:
        assert caught == []


@pytest.mark.slow  # batched W on attention and LayerNorm: the keras_hub BERT test
def test_batched_weight_gradients_train_a_transformer_like_gpipe():
    # Embedding gradients are slices (concatenated), attention's are einsums, LayerNorm's sums; Dropout's
    # masks are each micro-batch's own.
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(8, 12))

    def train(schedule):
        keras.utils.set_random_seed(7)
        model = tfpipe.PipelineModel(
            transformer_lm(50, 12, num_blocks=2, dim=16, hidden=32, heads=2, dropout=0.1),
            num_partitions=3,
            devices=cpu_devices(3),
            num_micro_batches=4,
            remat="never",
            schedule=schedule,
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        assert _fit(model, tokens[:, :-1], tokens[:, 1:], "sgd", loss) == []
        return model

    # Per layer: an attention key bias's gradient is zero in exact arithmetic and float noise here.
    assert per_layer_error(train(BATCHED_W).pipeline_layers, train("gpipe").pipeline_layers) < 1e-5


def test_batched_weight_gradients_train_a_functional_unet_like_the_model():
    # Convolutions (filter gradients, input gradients given a shape), pooling, upsampling, skips between cells.
    x, y = unet_data()
    reference = small_unet()
    model = tfpipe.PipelineModel(small_unet(), balance=[3, 3, 3, 3], devices=cpu_devices(4), num_micro_batches=5,
                                 remat="never", schedule=BATCHED_W)  # fmt: skip
    _fit(reference, x, y)
    assert _fit(model, x, y) == []
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_batch_statistics_keep_a_cell_on_per_micro_batch_weight_gradients_with_a_warning():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(9, 8)).astype("float32"), rng.normal(size=(9, 3)).astype("float32")

    def train(schedule):
        keras.utils.set_random_seed(5)
        model = tfpipe.PipelineModel(stateful_layers(), balance=[3, 3], devices=cpu_devices(2), num_micro_batches=3,
                                     remat="never", schedule=schedule)  # fmt: skip
        return model, _fit(model, x, y)

    batched, said = train(BATCHED_W)
    gpipe, _ = train("gpipe")
    # Cell 0 holds BatchNormalization: its scale's gradient reads each micro-batch's own statistics.
    assert len(said) == 1, said
    assert said[0].startswith(f"schedule='{BATCHED_W}': cell 0 computes its weight gradients once per micro-batch")
    assert "because W reads" in said[0] and "neither example by example nor the same" in said[0]
    assert per_layer_error(batched.pipeline_layers, gpipe.pipeline_layers) < 1e-5


def test_a_micro_batch_of_one_row_keeps_w_per_micro_batch_with_a_warning():
    # 5 rows in 4 micro-batches: 2, 1, 1, 1. TensorFlow traces LayerNormalization's gradient for one row without
    # the sum over rows that W runs example by example in the others (this raised a KeyError before).
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 8)).astype("float32"), rng.normal(size=(5, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=4,
                                 remat="never", schedule=BATCHED_W)  # fmt: skip
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _fit(plain, x, y, "adam")
    said = _fit(model, x, y, "adam")
    assert len(said) == 2 and all("a micro-batch shaped (1, " in s and "was traced without" in s for s in said), said
    assert per_layer_error(model.pipeline_layers, plain.layers) < 1e-5


def test_batched_weight_gradients_need_remat_never():
    with pytest.raises(ValueError, match=f"schedule='{BATCHED_W}' holds every micro-batch's activations.*"
                                         "use remat='never' with it, not remat='except_last'"):  # fmt: skip
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), schedule=BATCHED_W)


def _split(layers, batch, wrt_input=True):
    """A SplitVJP of ``layers`` on a batch of ``batch`` rows of 8 features, weights as inputs.

    Without ``wrt_input`` (a first cell) there is no B: the whole backward is W.
    """
    probe = keras.Input((8,))
    for layer in layers:
        probe = layer(probe)
    weights = [w for layer in layers for w in layer.trainable_weights]

    def body(x, *w):
        with keras.StatelessScope(state_mapping=list(zip(weights, w))):
            h = x
            for layer in layers:
                h = layer(h, training=True)
        dy = tf.compat.v1.placeholder(h.dtype, h.shape)
        sources = [x, *w] if wrt_input else list(w)
        grads = tf.gradients([h], sources, grad_ys=[dy], unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return h, [dy], grads[: len(sources) - len(w)], grads[len(sources) - len(w) :]

    specs = [tf.TensorSpec((batch, 8), "float32")] + [tf.TensorSpec(w.shape, w.dtype) for w in weights]
    return split_vjp.SplitVJP(body, specs, lambda fn, s, part: tf.function(fn).get_concrete_function(*s)), len(weights)


def _batched_against_each(layers, m, rows, wrt_input=True):
    """Weight gradients of ``layers`` over m micro-batches of ``rows``: W once over all, and each W summed."""
    small, n_weights = _split(layers, rows, wrt_input)
    big, _ = _split(layers, rows * m, wrt_input)
    weights = [w.value for layer in layers for w in layer.trainable_weights]
    batched = batched_w.BatchedW([small] * m, big, set(small.inputs[len(small.inputs) - n_weights :]))
    rng = np.random.default_rng(0)
    envs, each = [], []
    for _ in range(m):
        x = tf.constant(rng.normal(size=(rows, 8)), tf.float32)
        dy = tf.constant(rng.normal(size=small.dy_specs[0].shape), tf.float32)
        env, alone = (dict(zip(small.inputs, [x, *weights])) for _ in range(2))
        for e, inputs in ((env, batched.inputs_part(small)), (alone, small.part("inputs", False))):
            small.part("forward", False)(e)
            e[small.dys[0]] = dy
            inputs(e)
        small.part("weights", False)(alone)
        envs.append(env)
        each.append(small.weight_gradients(alone))
    return [g.numpy() for g in batched.run(envs)], [sum(gs).numpy() for gs in zip(*each)]


@pytest.mark.parametrize("wrt_input", [True, False])  # False: a first cell, whose whole backward is W
def test_w_once_over_all_micro_batches_sums_each_micro_batchs(wrt_input):
    layers = [keras.layers.Dense(6, activation="tanh"), keras.layers.LayerNormalization(), keras.layers.Dense(4)]
    once, each = _batched_against_each(layers, 3, 5, wrt_input)
    assert len(once) == len(each) == 6
    assert max_rel_error(once, each) < 1e-5


def test_w_that_reads_batch_statistics_is_not_batched():
    layers = [keras.layers.Dense(6), keras.layers.BatchNormalization(), keras.layers.Dense(4)]
    with pytest.raises(batched_w.Unbatchable, match="neither example by example nor the same in every micro-batch"):
        _batched_against_each(layers, 2, 5)


def test_w_that_mixes_examples_is_not_batched():
    # In a first cell W is the whole backward, here through a mean over the batch: its gradient
    # divides by the rows of one micro-batch, not of all.
    layers = [keras.layers.Dense(6), keras.layers.Lambda(lambda t: t - tf.reduce_mean(t, axis=0)),
              keras.layers.Dense(4)]  # fmt: skip
    with pytest.raises(batched_w.Unbatchable, match="W's op .* is not known to batch"):
        _batched_against_each(layers, 2, 5, wrt_input=False)


def test_w_traced_otherwise_at_the_mini_batchs_size_is_not_batched():
    small, n_weights = _split([keras.layers.Dense(4)], 5)
    other, _ = _split([keras.layers.Dense(4), keras.layers.Dense(4)], 10)
    with pytest.raises(batched_w.Unbatchable, match="reads or makes other tensors in W"):
        batched_w.BatchedW([small, small], other, set(small.inputs[1:]))
