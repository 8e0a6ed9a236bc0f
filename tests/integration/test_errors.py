"""Bad input gets a clear error naming the value and the fix, before any graph runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe


def _layers(n=3):
    return [keras.layers.Dense(4) for _ in range(n)]


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(balance=[1, 1]), ValueError, r"balance=\[1, 1\] sums to 2 but there are 3 layers"),
        (dict(balance=[3, 0]), ValueError, r"at least one layer; balance=\[3, 0\]"),
        (dict(balance=[1, 1, 1], devices=["/CPU:0", "/CPU:1"]), ValueError, r"3 cells but only 2 devices"),
        (dict(num_partitions=2, num_micro_batches=0), ValueError, r"num_micro_batches must be an integer >= 1, got 0"),
        (
            dict(num_partitions=2, num_micro_batches=2.5),
            ValueError,
            r"num_micro_batches must be an integer >= 1, got 2.5",
        ),
        (dict(num_partitions=2, num_micro_batches=True), ValueError, r"num_micro_batches must be an integer >= 1"),
        (dict(num_partitions=2.5), ValueError, r"num_partitions must be an integer >= 1, got 2.5"),
        (dict(num_partitions=2, remat="sometimes"), ValueError, r"Unknown remat='sometimes'; use one of 'always'"),
        (dict(num_partitions=2, devices=["/CPU:0", "/GPU:7"]), ValueError, r"Unknown device '/GPU:7'"),
        (dict(balance=[1, 2], num_partitions=2), ValueError, r"exactly one of balance=.* or num_partitions"),
        (dict(), ValueError, r"exactly one of balance=.* or num_partitions"),
        (dict(num_partitions=4), ValueError, r"num_partitions=4 is more than the 3 layers"),
    ],
)
def test_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        tfpipe.PipelineModel(_layers(), **kwargs)


def test_layer_list_errors():
    dense = keras.layers.Dense(2, name="twice")
    with pytest.raises(ValueError, match=r"Layer 'twice' appears twice in layers \(positions 0 and 2\)"):
        tfpipe.PipelineModel([dense, keras.layers.Dense(2), dense], num_partitions=1)
    with pytest.raises(TypeError, match=r"layers\[1\] is a function .*not a keras.layers.Layer"):
        tfpipe.PipelineModel([keras.layers.Dense(2), tf.nn.relu], num_partitions=1)
    with pytest.raises(TypeError, match="got the single layer 'solo'; wrap it in a list"):
        tfpipe.PipelineModel(keras.layers.Dense(2, name="solo"), num_partitions=1)
    with pytest.raises(ValueError, match="layers is empty"):
        tfpipe.PipelineModel([], num_partitions=1)


def _compiled(m=4):
    model = tfpipe.PipelineModel(_layers(2), num_partitions=2, num_micro_batches=m)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_batch_smaller_than_micro_batches():
    x, y = np.ones((16, 4), "float32"), np.ones((16, 4), "float32")
    with pytest.raises(ValueError, match=r"batch_size=2 is smaller than num_micro_batches=4"):
        _compiled().fit(x, y, batch_size=2, verbose=0)
    with pytest.raises(ValueError, match=r"leave a last batch of 2, smaller than num_micro_batches=4"):
        _compiled().fit(x[:10], y[:10], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"8 samples in batches of 6 leave a last batch of 2"):
        _compiled().fit(x[:10], y[:10], batch_size=6, validation_split=0.2, verbose=0)
    with pytest.raises(ValueError, match=r"A batch of 3 samples cannot be split into num_micro_batches=4"):
        _compiled().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(3, drop_remainder=True), verbose=0)


def test_dataset_remainder_smaller_than_micro_batches_fails_before_training_with_the_fix():
    x, y = np.ones((1667, 4), "float32"), np.ones((1667, 4), "float32")
    model = tfpipe.PipelineModel(_layers(2), num_partitions=2, num_micro_batches=8)
    model.compile(optimizer="sgd", loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2000).batch(128).prefetch(2)  # last batch: 3 < 8
    started = []
    with pytest.raises(
        ValueError,
        match=r"The dataset's 1667 samples in batches of 128 leave a last batch of 3, "
        r"smaller than num_micro_batches=8 micro-batches. Batch with drop_remainder=True",
    ):
        model.fit(dataset, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_begin=started.append)])
    assert not started  # refused before the first step, not after an epoch
    fixed = tf.data.Dataset.from_tensor_slices((x[:300], y[:300])).batch(128, drop_remainder=True)
    model.fit(fixed, verbose=0)  # what the message says works


def test_a_short_batch_found_in_the_step_is_one_short_error():
    x, y = np.ones((10, 4), "float32"), np.ones((10, 4), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).filter(lambda a, b: True)  # batching unknown
    with pytest.raises(ValueError) as caught:
        _compiled().fit(dataset, verbose=0)
    message = str(caught.value)
    assert message.startswith("tfpipe: a training batch is smaller than num_micro_batches=4; use a larger batch")
    assert "drop_remainder=True" in message and len(message.splitlines()) == 1 and message.count("tfpipe:") == 1


def test_jit_compile_other_than_a_bool_or_auto_is_refused():
    model = tfpipe.PipelineModel(_layers(2), num_partitions=2)
    with pytest.raises(ValueError, match=r"jit_compile must be True, False or 'auto', got 'yes'"):
        model.compile(optimizer="sgd", loss="mse", jit_compile="yes")


def test_unsupported_mixed_reductions():
    model = tfpipe.PipelineModel([keras.layers.Dense(2), keras.layers.Dense(2)], num_partitions=2, num_micro_batches=2)
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"))
    with pytest.raises(ValueError, match=r"reduction=.none. into micro-batches"):
        model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)
