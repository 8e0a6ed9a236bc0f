"""Functional models whose layers form a chain enter PipelineModel and train exactly like the model itself."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices, max_rel_error


def _vgg_like():
    keras.utils.set_random_seed(3)
    x = inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="tanh")(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs, name="vgg_like")


@pytest.mark.parametrize("m", [1, 3])
def test_a_chain_functional_model_trains_like_itself(m):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((10, 8, 8, 3)).astype("float32"), rng.standard_normal((10, 3)).astype("float32")
    reference, own = _vgg_like(), _vgg_like()
    model = tfpipe.PipelineModel(own, num_partitions=2, devices=cpu_devices(2), num_micro_batches=m)
    assert model.pipeline_layers == own.layers[1:]  # the model's own layers, in call order, without the input
    assert model.balance is not None  # a built Functional model is split by cost at once
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_keras_applications_vgg16_enters():
    vgg = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    model = tfpipe.PipelineModel(vgg, balance=[11, 11], devices=cpu_devices(2))
    assert len(model.pipeline_layers) == 22 and model.pipeline_layers[-1].name == "predictions"


def _residual():
    x = inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="inner")(x)
    outputs = keras.layers.Add(name="skip_add")([x, h])
    return keras.Model(inputs, outputs)


def _with_op():
    x = inputs = keras.Input((4,))
    x = keras.layers.Dense(4)(x)
    return keras.Model(inputs, keras.ops.relu(x))


def _shared():
    dense = keras.layers.Dense(4, name="twice")
    x = inputs = keras.Input((4,))
    return keras.Model(inputs, dense(dense(x)))


def _two_inputs():
    a, b = keras.Input((4,)), keras.Input((4,))
    return keras.Model([a, b], keras.layers.Concatenate()([a, b]))


@pytest.mark.parametrize(
    "make,message",
    [
        (_residual, r"Layer Add 'skip_add' of Functional model .* takes 2 tensors .*skip connection"),
        (_with_op, r"operation Relu 'relu' of Functional model .* is a keras.ops call, not a layer.*Lambda"),
        (_shared, r"Layer Dense 'twice' .* is called 2 times \(a shared layer\)"),
        (_two_inputs, r"has 2 inputs and 1 outputs"),
    ],
)
def test_graphs_that_are_not_chains_are_refused_naming_the_node(make, message):
    with pytest.raises(ValueError, match=message):
        tfpipe.PipelineModel(make(), num_partitions=1)
