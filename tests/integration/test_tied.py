"""Weights tied across cells: each cell differentiates its use, the gradients are summed where the weight lives."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error
from tfpipe.models.transformer import transformer_lm_tied


class _Transposed(keras.layers.Layer):
    """Multiplies by another Dense layer's kernel, transposed (a tied decoder)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.source.kernel))


def _tied_layers():
    keras.utils.set_random_seed(1)
    encoder = keras.layers.Dense(4, use_bias=False, kernel_regularizer=keras.regularizers.L2(0.1), name="encoder")
    return [encoder, keras.layers.Activation("tanh"), _Transposed(encoder, name="decoder"), keras.layers.Dense(2)]


def _data(n=12):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 3)).astype("float32"), rng.standard_normal((n, 2)).astype("float32")


@pytest.mark.parametrize(
    "schedule,remat,unroll",
    [
        ("gpipe", "except_last", True),
        ("gpipe", "always", False),
        ("1f1b", "never", True),
        ("zero_bubble", "except_last", True),
        ("gpipe_batched_w", "never", True),
    ],
)
def test_a_kernel_used_by_the_first_and_last_cells_trains_like_keras(schedule, remat, unroll):
    x, y = _data()
    reference = keras.Sequential([keras.Input((3,)), *_tied_layers()])
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    expected = reference.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"]
    model = tfpipe.PipelineModel(
        _tied_layers(),
        balance=[1, 1, 2],
        devices=cpu_devices(3),
        num_micro_batches=3,
        remat=remat,
        schedule=schedule,
        unroll=unroll,
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    losses = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)  # the regularizer counts once, as in plain Keras
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    kernel = model.pipeline_layers[0].kernel
    assert [v is kernel for v in model.trainable_variables].count(True) == 1
    assert kernel.value.device.endswith("CPU:0")  # with the first cell that uses it
    assert [cell.count_params() for cell in model.cells] == [12, 0, 8]  # counted once, in cell 0


def test_balance_by_parameters_counts_a_tied_weight_in_its_first_layer():
    layers = _tied_layers()
    keras.Sequential([keras.Input((3,)), *layers])  # builds them
    assert layers[2].count_params() == 12  # Keras counts the encoder's kernel in the decoder that tracks it too
    split, costs = tfpipe.balance.by_params(layers, 2, return_costs=True)
    assert costs == [12.0, 0.0, 0.0, 8.0] and split == [1, 3]


def _lm():
    return transformer_lm_tied(vocab_size=11, max_length=6, num_blocks=2, dim=8, hidden=16, heads=2)


@pytest.mark.parametrize("replicas", covering([1, 2], [2]))
def test_a_reversible_embedding_tied_to_the_output_trains_like_keras(replicas):
    """The embedding's rows (slices) in cell 0 and the projection's dense gradient in cell 1 add up.

    With SGD: the attention's key biases get no gradient (a softmax ignores them) but rounding noise, which Adam
    turns into steps of its learning rate in any model, pipelined or not.
    """
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (8, 6)).astype("int32"), rng.integers(0, 11, (8, 6)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(4)
    reference = _lm()
    keras.utils.set_random_seed(4)
    own = _lm()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    devices = cpu_devices(2) if replicas == 1 else [cpu_devices(4)[:2], cpu_devices(4)[2:]]
    model = tfpipe.PipelineModel(own, balance=[3, 3], devices=devices, num_micro_batches=2)
    assert [layer.name for layer in model.cells[0].layers][0] == "tokens"
    assert [layer.name for layer in model.cells[1].layers][-1] == "tokens"  # its reverse call, in the last cell
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    losses = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-6, err_msg=theirs.path)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-4, atol=1e-5)


def test_tied_weights_show_once_in_summary_and_stay_tied_after_loading(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 11, (8, 6)).astype("int32"), rng.integers(0, 11, (8, 6)).astype("int32")
    model = tfpipe.PipelineModel(_lm(), balance=[3, 3], devices=cpu_devices(2), num_micro_batches=2)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, verbose=0)
    lines = []
    model.summary(print_fn=lines.append)
    assert "Tied weights: cell 1 also uses tokens/embeddings of cell 0" in lines
    assert sum(cell.count_params() for cell in model.cells) == model.count_params()
    path = str(tmp_path / "tied.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    table = [v for v in loaded.cells[0].trainable_variables if v.path == "tokens/embeddings"]
    assert len(table) == 1 and any(v is table[0] for v in loaded.cells[1].trainable_variables)
    after = [net.fit(x, y, batch_size=8, verbose=0, shuffle=False).history["loss"] for net in (model, loaded)]
    np.testing.assert_allclose(after[0], after[1], rtol=1e-6)
    assert max_rel_error(loaded.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("shared", ["batch_norm", "dropout"])
def test_state_that_two_cells_change_is_refused_with_the_fix(shared):
    keras.utils.set_random_seed(2)
    layer = keras.layers.BatchNormalization(name="shared") if shared == "batch_norm" else keras.layers.Dropout(0.5)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(3)(layer(inputs))
    outputs = keras.layers.Dense(2)(layer(h))
    model = tfpipe.PipelineModel(keras.Model(inputs, outputs), balance=[2, 2], devices=cpu_devices(2))
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data(4)
    with pytest.raises(ValueError, match=r"is state that two cells change in training .*Change balance so that the"):
        model.fit(x, y, batch_size=4, verbose=0)
