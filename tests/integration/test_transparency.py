"""GPipe's promise: the same training result whatever the number of cells and micro-batches."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error, mlp_layers, per_layer_error

OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _one_step_each(make_layers, k, m, optimizer, n, remat="except_last", loss="mse", unroll=True, **fit_kwargs):
    """Weights after one fit step of a PipelineModel and of a Sequential from the same initial weights."""
    x, y = _data(n)
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((8,))] + make_layers())
    start = reference.get_weights()
    model = tfpipe.PipelineModel(
        make_layers(), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m, remat=remat, unroll=unroll
    )
    model.build((None, 8))
    assert model.unrolled is unroll
    model.set_weights(start)
    for net in (reference, model):
        net.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss)
        net.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    assert max_rel_error(start, reference.get_weights()) > 1e-3  # the step did change the weights
    return model.get_weights(), reference.get_weights()


@pytest.mark.parametrize(
    "k,m,optimizer",
    covering(
        [(k, m, o) for k in (1, 2, 4) for m in (1, 2, 4) for o in ("sgd", "adam")],
        [(1, 1, "sgd"), (2, 2, "sgd"), (4, 4, "sgd"), (1, 4, "adam"), (2, 1, "adam"), (4, 2, "adam")],  # a Latin square
    ),
)
def test_one_step_matches_sequential(k, m, optimizer):
    got, want = _one_step_each(mlp_layers, k, m, optimizer, n=8)
    assert max_rel_error(got, want) < 1e-5


@pytest.mark.parametrize("m", covering([3, 4], [3]))
def test_uneven_micro_batches_match_sequential(m):
    got, want = _one_step_each(mlp_layers, 2, m, "adam", n=10)
    assert max_rel_error(got, want) < 1e-5


@pytest.mark.parametrize("k,unroll", [(4, True), (3, False)])  # unroll=False: tfpipe/step/looped.py
def test_sample_weights_and_regularizers_match_sequential(k, unroll):
    def layers():
        return [
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(16, activity_regularizer=keras.regularizers.L1(0.001)),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(3),
        ]

    weights = np.linspace(0.2, 2.0, 10).astype("float32")
    got, want = _one_step_each(layers, k, 3, "sgd", n=10, unroll=unroll, sample_weight=weights)
    assert max_rel_error(got, want) < 1e-5


def test_reported_loss_and_metrics_match_sequential():
    x, y = _data(12)
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((8,))] + mlp_layers())
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, num_micro_batches=4)
    model.build((None, 8))
    model.set_weights(reference.get_weights())
    histories = []
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        histories.append(net.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-5)


class _AddsLoss(keras.layers.Layer):
    """Adds the mean square of its input as a loss, in training and in inference (as Keras' activity penalties)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


@pytest.mark.parametrize("devices,unroll", [(2, True), (2, False), ([2, 2], True)])  # [2, 2]: replicas
def test_evaluate_adds_the_layers_losses_as_keras_does(devices, unroll):
    def layers():
        return [
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(8, activity_regularizer=keras.regularizers.L1(0.01)),
            _AddsLoss(),
            keras.layers.Dense(3),
        ]

    x, y = _data(10)
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((8,))] + layers())
    placed = cpu_devices(2) if devices == 2 else [cpu_devices(4)[:2], cpu_devices(4)[2:]]
    model = tfpipe.PipelineModel(layers(), balance=[2, 2], devices=placed, num_micro_batches=3, unroll=unroll)
    model.build((None, 8))
    model.set_weights(reference.get_weights())
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
    plain_mse = float(np.mean((reference.predict(x, verbose=0) - y) ** 2))
    expected = reference.evaluate(x, y, batch_size=10, verbose=0)
    assert expected > plain_mse + 1e-3  # the losses count
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=10, verbose=0), expected, rtol=1e-5)


@pytest.mark.parametrize(
    "options", [{"schedule": "gpipe_batched_w", "remat": "never"}, {"unroll": False, "remat": "always"}], ids=str
)
def test_an_embedding_beside_weight_penalties_keeps_its_sparse_gradient(options):
    """Where the penalties are added after the micro-batches (batched W, loops), an embedding's rows must stay
    rows: Adam moves only the rows a batch has, and a densified gradient moved every row."""

    def layers():
        keras.utils.set_random_seed(0)
        return [
            keras.layers.Embedding(9, 6),
            keras.layers.Dense(6, activation="tanh", kernel_regularizer="l2"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]

    rng = np.random.default_rng(0)
    x, y = rng.integers(1, 5, (14, 7)).astype("int32"), rng.integers(0, 2, 14)  # rows 5-8 never looked up
    reference = keras.Sequential([keras.Input((7,), dtype="int32")] + layers())
    model = tfpipe.PipelineModel(layers(), balance=[2, 2], devices=cpu_devices(2), num_micro_batches=2, **options)
    for net in (reference, model):
        net.compile(optimizer=OPTIMIZERS["adam"](), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        net.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_cells_that_cannot_be_traced_as_functions_run_inline_with_the_same_result(monkeypatch):
    from tfpipe.partition.cell import Cell

    def untraceable(self, *args, **kwargs):
        raise TypeError("not traceable")

    monkeypatch.setattr(Cell, "_trace", untraceable)
    with pytest.warns(UserWarning, match="cannot be traced as a function.*not traceable"):
        got, want = _one_step_each(mlp_layers, 2, 3, "adam", n=10)
    assert max_rel_error(got, want) < 1e-5


@pytest.mark.parametrize("remat", covering(["always", "except_last", "never"], ["always"]))
def test_cells_called_as_functions_that_are_not_inlined_are_exact(remat):
    """From pipeline.NOINLINE_TASKS tasks on (here K=2, M=16: 64) cells are calls TensorFlow keeps."""
    from tfpipe.step.unrolled import NOINLINE_TASKS

    assert 2 * 2 * 16 >= NOINLINE_TASKS > 2 * 4 * 4
    got, want = _one_step_each(mlp_layers, 2, 16, "adam", n=36, remat=remat)  # uneven: 4x3 + 12x2
    assert max_rel_error(got, want) < 1e-5


def test_only_large_pipelines_keep_their_cell_calls():
    small = tfpipe.PipelineModel(mlp_layers(), num_partitions=4, devices=cpu_devices(4), num_micro_batches=4)
    large = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=16)
    small.build((None, 8)), large.build((None, 8))
    assert [c.noinline for c in small.cells] == [False] * 4 and [c.noinline for c in large.cells] == [True] * 2


def _masked_layers():
    keras.utils.set_random_seed(2)
    return [
        keras.layers.Embedding(10, 4, mask_zero=True),  # the mask of the padding (token 0) crosses both cuts
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.GlobalAveragePooling1D(),  # averages over the unmasked steps only
        keras.layers.Dense(2),
    ]


@pytest.mark.parametrize("unroll", [True, False])
def test_a_keras_mask_crosses_the_cuts_of_a_layer_list(unroll):
    tokens = np.array([[3, 5, 0, 0], [7, 0, 0, 0], [1, 2, 3, 0], [4, 4, 4, 4], [9, 0, 0, 0]], "int32")
    y = np.random.default_rng(0).normal(size=(5, 2)).astype("float32")
    reference = keras.Sequential([keras.Input((4,), dtype="int32"), *_masked_layers()])
    model = tfpipe.PipelineModel(
        _masked_layers(), balance=[1, 1, 2], devices=cpu_devices(3), num_micro_batches=2, unroll=unroll
    )
    model.build((None, 4))
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.predict(tokens, verbose=0), reference.predict(tokens, verbose=0), rtol=1e-6)
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(tokens, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def _softmax_classifier():
    return [
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(),  # large logits: the softmax saturates
        keras.layers.Dense(5, activation="softmax"),
    ]


def test_softmax_logits_cross_the_last_cut_so_the_cross_entropy_is_exact():
    # Keras' cross-entropy of a softmax output reads the logits hung on it; without them the
    # saturated probabilities are clipped at 1e-7 and give other gradients.
    x = np.random.default_rng(1).normal(size=(6, 8)).astype("float32") * 5
    y = np.arange(6) % 5
    keras.utils.set_random_seed(6)
    reference = keras.Sequential([keras.Input((8,)), *_softmax_classifier()])
    # M=1, so that BatchNorm normalizes with the statistics of the whole batch, as plain Keras does.
    model = tfpipe.PipelineModel(_softmax_classifier(), balance=[2, 1], devices=cpu_devices(2))
    model.build((None, 8))
    model.set_weights(reference.get_weights())
    for net in (reference, model):
        net.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=6, epochs=3, shuffle=False, verbose=0)
    # Per layer: the first Dense's bias feeds only BatchNorm, so its gradient is zero in exact arithmetic and
    # both models leave it at float noise (6e-9) that differs with the order of the sums.
    assert per_layer_error(model.pipeline_layers, reference.layers) < 1e-5


def test_adam_accumulating_gradients_matches_sequential():
    """Adam's bias correction reads the step counter divided by the accumulation steps, in every update.

    tfpipe hands each device one read of the counter itself (not of ``iterations``, already divided).
    """
    x, y = _data(32)
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((8,))] + mlp_layers())
    start = reference.get_weights()
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    model.build((None, 8))
    model.set_weights(start)
    for net in (reference, model):
        net.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), loss="mse")
        net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 4 steps, 2 updates
    assert max_rel_error(start, reference.get_weights()) > 1e-3
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
