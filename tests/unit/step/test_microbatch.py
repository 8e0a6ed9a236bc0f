"""Splitting nested batches into micro-batches and weighting their losses exactly."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.step import microbatch


def test_split_sizes_differ_by_at_most_one():
    assert microbatch.split_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.split_sizes(8, 4) == [2, 2, 2, 2]
    assert microbatch.split_sizes(3, 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot be split into num_micro_batches=4"):
        microbatch.split_sizes(3, 4)


def test_split_nested_structures_and_merge_back():
    x = {"a": tf.reshape(tf.range(20.0), (10, 2)), "b": (tf.range(10), None)}
    sizes = microbatch.sizes(x, 3)
    assert sizes == [4, 3, 3]
    parts = microbatch.split(x, sizes)
    assert [p["a"].shape[0] for p in parts] == [4, 3, 3]
    assert all(p["b"][1] is None for p in parts)
    np.testing.assert_array_equal(parts[1]["b"][0].numpy(), [4, 5, 6])
    merged = microbatch.merge(parts)
    np.testing.assert_array_equal(merged["a"].numpy(), x["a"].numpy())
    np.testing.assert_array_equal(merged["b"][0].numpy(), x["b"][0].numpy())


def test_split_none_structure():
    assert microbatch.split(None, [2, 2]) == [None, None]


def test_dynamic_batch_size_in_graph():
    @tf.function(input_signature=[tf.TensorSpec([None, 2])])
    def f(x):
        parts = microbatch.split(x, microbatch.sizes(x, 4))
        return [tf.shape(p)[0] for p in parts]

    assert [int(n) for n in f(tf.zeros((10, 2)))] == [3, 3, 2, 2]
    with pytest.raises(tf.errors.InvalidArgumentError, match="smaller than num_micro_batches=4"):
        f(tf.zeros((3, 2)))


def test_inference_allows_empty_micro_batches():
    assert microbatch.sizes(tf.zeros((2, 1)), 4, allow_empty=True) == [1, 1, 0, 0]


def test_batch_size_errors():
    with pytest.raises(ValueError, match="holds no tensors"):
        microbatch.batch_size((None,))
    with pytest.raises(ValueError, match="need a batch dimension"):
        microbatch.batch_size(tf.constant(1.0))


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_weighted_micro_batch_losses_equal_full_batch_loss(reduction, with_weights):
    rng = np.random.default_rng(0)
    y_true = tf.constant(rng.normal(size=(10, 5, 3)), tf.float32)
    y_pred = tf.constant(rng.normal(size=(10, 5, 3)), tf.float32)
    sw = tf.constant(rng.uniform(0.1, 2.0, size=(10, 5)), tf.float32) if with_weights else None
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    full = float(loss(y_true, y_pred, sw))
    sizes = microbatch.sizes(y_true, 4)
    yt, yp, sws = (microbatch.split(t, sizes) for t in (y_true, y_pred, sw))
    weights = microbatch.loss_weights(reduction, sizes, sws)
    total = sum(float(w) * float(loss(a, b, c)) for w, a, b, c in zip(weights, yt, yp, sws))
    assert total == pytest.approx(full, rel=1e-6)


def test_unsupported_reduction():
    with pytest.raises(ValueError, match="reduction='median'"):
        microbatch.loss_weights("median", [2, 2], [None, None])
