"""PipelineModel as a keras.Model: fit/evaluate/predict, datasets, callbacks, weights, placement, summary."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import covering, cpu_devices, mlp_layers


def _classification(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    return x, y


def _classifier(**kwargs):
    layers = [
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(2),
    ]
    kwargs.setdefault("num_partitions", 3)
    kwargs.setdefault("num_micro_batches", 4)
    return tfpipe.PipelineModel(layers, **kwargs)


def test_fit_evaluate_predict_with_metrics_and_dataset():
    x, y = _classification()
    model = _classifier()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    history = model.fit(dataset, epochs=8, verbose=0)
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    assert history.history["accuracy"][-1] > 0.9
    loss, accuracy = model.evaluate(x, y, batch_size=16, verbose=0)
    assert accuracy > 0.9
    logits = model.predict(x, batch_size=10, verbose=0)  # last batch of 4 = M
    assert logits.shape == (64, 2)
    reference = keras.Sequential([keras.Input((8,))] + model.pipeline_layers)
    np.testing.assert_allclose(logits, reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # inference accepts batches smaller than M
    np.testing.assert_allclose(model.predict(x[:3], verbose=0), logits[:3], rtol=1e-5, atol=1e-6)


def test_callbacks_history_and_early_stopping():
    x, y = _classification()
    model = _classifier()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    history = model.fit(x, y, batch_size=16, epochs=20, callbacks=[stop], verbose=0)
    assert len(history.history["loss"]) == 2  # no improvement of 10.0 after the first epoch


def test_progress_bar_is_shown(capsys):
    x, y = _classification(32)
    model = _classifier()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=1)
    assert "4/4" in capsys.readouterr().out


def test_weights_are_ordered_as_in_sequential():
    layers = [keras.layers.Dense(5), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    model = tfpipe.PipelineModel(layers, balance=[2, 1], num_micro_batches=2)
    model.build((None, 3))
    reference = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(5), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    )
    assert [w.shape for w in model.get_weights()] == [w.shape for w in reference.get_weights()]
    reference.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5)


def test_variables_and_optimizer_slots_live_on_their_cells_device():
    model = _classifier(devices=["/CPU:1", "/CPU:2", "/CPU:3"])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _classification(16)
    model.fit(x, y, batch_size=8, verbose=0)
    for cell in model.cells:
        for variable in cell.trainable_variables:
            assert variable.value.device.endswith(cell.device.replace("/", "device:")), variable.path
    optimizer = model.optimizer
    for variable, m, v in zip(optimizer._trainable_variables, optimizer._momentums, optimizer._velocities):
        assert m.value.device == v.value.device == variable.value.device, variable.path


def test_nested_inputs_flow_between_cells():
    class Pair(keras.layers.Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.a, self.b = keras.layers.Dense(units), keras.layers.Dense(units)

        def call(self, inputs):
            left, right = inputs
            return self.a(left) + self.b(right), left

    class Merge(keras.layers.Layer):
        def call(self, inputs):
            return inputs[0]

    def layers():
        return [Pair(4), Pair(4), Merge(), keras.layers.Dense(1)]

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 4)).astype("float32"))
    y = rng.normal(size=(8, 1)).astype("float32")
    model = tfpipe.PipelineModel(layers(), balance=[1, 1, 2], num_micro_batches=2)
    model.build(((None, 4), (None, 4)))
    reference = keras.Sequential(layers())
    reference(x)
    reference.set_weights(model.get_weights())
    for net in (model, reference):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_dict_inputs_and_integer_tokens():
    class Pick(keras.layers.Layer):
        def call(self, inputs):
            return inputs["tokens"]

    model = tfpipe.PipelineModel(
        [Pick(), keras.layers.Embedding(10, 4), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)],
        balance=[2, 2],
        num_micro_batches=2,
    )
    x = {"tokens": np.random.default_rng(0).integers(0, 10, size=(8, 5))}
    y = np.arange(8) % 2
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()] if model.built else None
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert before is None and model.built


def test_summary_lists_cells_devices_layers_and_params():
    model = _classifier(devices=["/CPU:0", "/CPU:2", "/CPU:3"])
    model.build((None, 8))
    lines = []
    model.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "3 cells" in text and "num_micro_batches=4" in text and "remat='except_last'" in text
    for cell in model.cells:
        row = next(line for line in lines if line.startswith(f"{cell.index} "))
        assert cell.device in row and cell.layers[0].name in row and f"{cell.count_params():,}" in row
    assert f"Total params: {model.count_params():,}" in text


def test_summary_cuts_long_layer_names_to_their_column_and_keeps_the_count():
    layers = [keras.layers.Dense(4, name=f"a_rather_long_layer_name_{k}") for k in range(6)]
    model = tfpipe.PipelineModel(layers, balance=[5, 1], devices=cpu_devices(2))
    model.build((None, 3))
    lines = []
    model.summary(print_fn=lines.append)
    row = next(line for line in lines if line.startswith("0 "))
    assert "a_rather_long_layer_name_0 .. a_rather_lon\u2026 (5 layers)" not in row  # only what its column allows
    assert re.search(r"a_rather_long_\S*\u2026 \(5 layers\) +\d", row), row
    assert model.cells[0].describe() == "a_rather_long_layer_name_0 .. a_rather_long_layer_name_4 (5 layers)"
    assert model.cells[0].describe(20) == "a_rather\u2026 (5 layers)"  # 20 characters


def test_read_only_attributes():
    model = _classifier(devices=["/CPU:0", "/CPU:1", "/CPU:2"], remat="never")
    assert model.balance == [1, 1, 1] and model.devices == ["/CPU:0", "/CPU:1", "/CPU:2"]
    assert model.num_micro_batches == 4 and model.remat == "never"
    model.balance.append(9)
    assert model.balance == [1, 1, 1]
    with pytest.raises(AttributeError):
        model.num_micro_batches = 2


def test_accepts_a_sequential_and_keeps_jit_off():
    sequential = keras.Sequential(mlp_layers(depth=2))
    model = tfpipe.PipelineModel(sequential, num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    assert model.pipeline_layers == sequential.layers
    model.compile(optimizer="sgd", loss="mse")
    assert model.jit_compile is False


def test_validation_split_with_small_validation_batches():
    x, y = _classification(42)
    model = _classifier()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=8, validation_split=0.05, epochs=1, verbose=0)  # 3 validation samples < M
    assert np.isfinite(history.history["val_loss"]).all()


class CountingTraces(tfpipe.PipelineModel):
    """Counts how often Keras traces the train and test steps."""

    traces = {"train": 0, "test": 0}

    def train_step(self, data):
        self.traces["train"] += 1
        return super().train_step(data)

    def test_step(self, data):
        self.traces["test"] += 1
        return super().test_step(data)


@pytest.mark.parametrize("as_dataset", [False, True])
def test_each_step_is_traced_once(as_dataset):
    x, y = _classification(32)
    model = CountingTraces(mlp_layers(out=2), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    model.traces = {"train": 0, "test": 0}
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(8),) if as_dataset else (x, y)
    batch = {} if as_dataset else {"batch_size": 8}
    model.evaluate(*data, verbose=0, **batch)  # before any training: metric variables exist already
    model.fit(*data, epochs=2, verbose=0, **batch)
    assert model.traces == {"train": 1, "test": 1}
    assert model.balance == [4, 6]  # balanced by FLOPs when the first call built it from the data's shapes
    for cell in model.cells:  # ... on the cells' devices
        assert all(v.value.device.endswith(cell.device.replace("/", "device:")) for v in cell.trainable_variables)


def test_train_on_batch_traces_its_step_once():
    x, y = _classification(16)
    model = CountingTraces(mlp_layers(out=2), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    model.traces = {"train": 0, "test": 0}
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    first = model.train_on_batch(x, y)
    second = model.train_on_batch(x, y)
    model.test_on_batch(x, y)
    model.test_on_batch(x, y)
    assert model.traces == {"train": 1, "test": 1}
    assert second < first


@pytest.mark.parametrize("m", covering([2, 16], [16]))
def test_steps_per_execution_trains_as_one_step_per_call(m):
    """Keras runs 3 steps per call in a loop (the last call 1): weights, losses and Dropout's masks as with 1."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)

    def trained(steps_per_execution):
        keras.utils.set_random_seed(0)
        layers = mlp_layers(out=3)
        layers.insert(2, keras.layers.Dropout(0.3))
        model = tfpipe.PipelineModel(layers, num_partitions=2, devices=cpu_devices(2), num_micro_batches=m)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
        calls = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: begun.append(batch))
        begun: list[int] = []
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[calls])
        return history.history["loss"], model.get_weights(), begun

    losses, weights, begun = trained(1)
    looped_losses, looped_weights, looped_begun = trained(3)
    assert (begun, looped_begun) == ([0, 1, 2, 3] * 2, [0, 3] * 2)  # 4 steps an epoch: calls of 3 and 1 steps
    np.testing.assert_allclose(looped_losses, losses, rtol=1e-6)
    for a, b in zip(looped_weights, weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _function_optimization() -> int:
    """RewriterConfig.OFF (2) for the call options made by tfpipe._compat.fewer_rewrites, else the default (0)."""
    from tensorflow.core.protobuf import config_pb2

    from tfpipe import _compat

    rewrites = config_pb2.ConfigProto.FromString(_compat.call_options()).graph_options.rewrite_options
    assert rewrites.disable_tfg_optimizer == (rewrites.function_optimization == 2)  # the two go together
    return rewrites.function_optimization


class SeeingCallOptions(tfpipe.PipelineModel):
    """Records, as each step is traced, whether its calls carry Grappler's function optimizer (and TFG's)."""

    def train_step(self, data):
        self.seen.append(("train", _function_optimization()))
        return super().train_step(data)

    def test_step(self, data):
        self.seen.append(("test", _function_optimization()))
        return super().test_step(data)

    def predict_step(self, data):
        self.seen.append(("predict", _function_optimization()))
        return super().predict_step(data)


@pytest.mark.parametrize("m, off", [(16, True), (2, False)])
def test_steps_calling_their_cells_run_with_fewer_grappler_passes_and_only_they(m, off):
    """K=2, M=16 (64 tasks): cells are calls TensorFlow keeps, and the steps turn the optimizer off; M=2: not."""
    x, y = _classification(32)
    model = SeeingCallOptions(mlp_layers(out=2), num_partitions=2, devices=cpu_devices(2), num_micro_batches=m)
    model.seen = []
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[_SeenInCallbacks(model)])
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    step = 2 if off else 0  # RewriterConfig.OFF, else the default
    assert sorted(set(model.seen)) == [("predict", step), ("test", step), ("train", step), ("user", 0)]
    assert _function_optimization() == 0


class _SeenInCallbacks(keras.callbacks.Callback):
    def __init__(self, model):
        super().__init__()
        self.watched = model

    def on_train_batch_end(self, batch, logs=None):  # user code between steps keeps the user's options
        self.watched.seen.append(("user", _function_optimization()))


def test_the_symbolic_build_before_fit_reuses_the_output_spec_that_build_found():
    calls = []

    class Counted(keras.layers.Layer):  # no compute_output_shape: Keras runs call on symbolic inputs
        def call(self, x):
            calls.append(tuple(x.shape)[1:])
            return x * 2.0

    model = tfpipe.PipelineModel(
        [Counted(), keras.layers.Dense(3)], num_partitions=2, devices=cpu_devices(2), num_micro_batches=2
    )
    model.build((None, 8))
    assert calls == [(8,)]  # build runs the layers once
    spec = model.compute_output_spec(keras.KerasTensor((5, 8)))
    assert (spec.shape, spec.dtype, calls) == ((5, 3), "float32", [(8,)])  # not again
    model.compute_output_spec(keras.KerasTensor((5, 8), dtype="float16"))  # other inputs: the layers run
    assert len(calls) == 2
