"""Saving and loading: .keras round trips, weights that do not depend on the partitioning, conversions."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, mlp_layers, stateful_layers


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _devices_of(variables):
    return [tf.DeviceSpec.from_string(v.value.device).device_index for v in variables]


def _trained(layers, **kwargs):
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(layers, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def _assert_same_weights(a, b, atol=0.0):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=0, atol=atol)


def test_keras_file_round_trip_keeps_everything(tmp_path):
    model = _trained(stateful_layers(), num_partitions=3, devices=cpu_devices(3), num_micro_batches=2, remat="always")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    assert isinstance(loaded, tfpipe.PipelineModel)
    assert (loaded.balance, loaded.devices, loaded.num_micro_batches, loaded.remat, loaded.cost) == (
        model.balance,
        model.devices,
        2,
        "always",
        "flops",
    )
    x, y = _data(seed=1)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # variables and optimizer state come back on their cells' devices, with their values
    assert _devices_of(loaded.weights) == _devices_of(model.weights)
    assert _devices_of(loaded.optimizer.variables) == _devices_of(model.optimizer.variables)
    _assert_same_weights(
        [v.numpy() for v in loaded.optimizer.variables], [v.numpy() for v in model.optimizer.variables]
    )
    assert loaded.get_compile_config() == model.get_compile_config()
    # the next step (Dropout masks, BatchNorm statistics, Adam moments) is the same step
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(loaded.get_weights(), model.get_weights())


def test_weights_do_not_depend_on_the_partitioning(tmp_path):
    """K=4 -> K=2 -> K=1 -> keras.Sequential, through weight files: the same predictions everywhere."""
    model = _trained(stateful_layers(), balance=[1, 2, 2, 1], devices=cpu_devices(4), num_micro_batches=4)
    x, _ = _data(seed=2)
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / "k4.weights.h5")
    model.save_weights(path)

    two = tfpipe.PipelineModel(stateful_layers(), balance=[4, 2], devices=cpu_devices(2), num_micro_batches=2)
    two.build((None, 5))
    two.load_weights(path)
    np.testing.assert_allclose(two.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    path2 = str(tmp_path / "k2.weights.h5")
    two.save_weights(path2)

    one = tfpipe.PipelineModel(stateful_layers(), num_partitions=1)
    one.build((None, 5))
    one.load_weights(path2)
    np.testing.assert_allclose(one.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)

    plain = keras.Sequential([keras.Input((5,)), *stateful_layers()])
    plain.load_weights(path)  # the extra group of seed states is ignored
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)

    path3 = str(tmp_path / "plain.weights.h5")  # and back: a file without seed states
    plain.save_weights(path3)
    back = tfpipe.PipelineModel(stateful_layers(), num_partitions=3, devices=cpu_devices(3))
    back.build((None, 5))
    back.load_weights(path3)
    np.testing.assert_allclose(back.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)


def test_a_saved_model_loads_where_its_devices_do_not_exist():
    model = tfpipe.PipelineModel(mlp_layers(), balance=[4, 3, 3], devices=cpu_devices(3))
    config = model.get_config()
    config["devices"] = ["/GPU:0", "/GPU:1", "/GPU:2"]  # trained on a machine with GPUs
    with pytest.warns(UserWarning, match=r"not all on this machine.*missing \['/GPU:0'.*cells go to"):
        restored = tfpipe.PipelineModel.from_config(config)
    assert restored.devices == ["/CPU:0", "/CPU:1", "/CPU:2"]
    assert restored.balance == [4, 3, 3]


def test_a_saved_v_loads_where_its_devices_do_not_exist_laid_out_as_its_schedule_places_cells():
    model = tfpipe.PipelineModel(mlp_layers(), balance=[3, 2, 2, 3], devices=cpu_devices(2), schedule="zbv")
    config = model.get_config()
    config["devices"] = ["/GPU:0", "/GPU:1", "/GPU:1", "/GPU:0"]
    with pytest.warns(UserWarning, match=r"missing \['/GPU:0'.*as schedule 'zbv' places them"):
        restored = tfpipe.PipelineModel.from_config(config)
    assert restored.devices == ["/CPU:0", "/CPU:1", "/CPU:1", "/CPU:0"] and restored.num_devices == 2


def test_config_round_trip_before_the_split_is_known():
    model = tfpipe.PipelineModel(
        mlp_layers(),
        num_partitions=2,
        cost="params",
        devices=cpu_devices(2),
        num_micro_batches=3,
        remat="never",
        name="net",
    )
    config = model.get_config()
    assert config["num_partitions"] == 2 and "balance" not in config and config["cost"] == "params"
    again = tfpipe.PipelineModel.from_config(config)
    assert (again.name, again.balance, again.cost, again.num_micro_batches, again.remat) == (
        "net",
        None,
        "params",
        3,
        "never",
    )
    again.build((None, 5))
    model.build((None, 5))
    assert again.balance == model.balance
    assert again.get_config() == model.get_config()


def test_tf_train_checkpoint_restores_model_and_optimizer(tmp_path):
    model = _trained(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    other = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    other.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    other.build((None, 5))
    other.optimizer.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(path).assert_existing_objects_matched()
    _assert_same_weights(other.get_weights(), model.get_weights())
    _assert_same_weights([v.numpy() for v in other.optimizer.variables], [v.numpy() for v in model.optimizer.variables])


def test_from_sequential_copies_by_default_and_shares_on_request():
    keras.utils.set_random_seed(0)
    sequential = keras.Sequential([keras.Input((5,)), *mlp_layers()])
    x, _ = _data(seed=3)
    expected = sequential.predict(x, verbose=0)

    copied = tfpipe.PipelineModel.from_sequential(sequential, num_partitions=2, devices=cpu_devices(2))
    assert copied.built and copied.balance is not None
    np.testing.assert_allclose(copied.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    assert _devices_of(copied.pipeline_layers[-1].weights) == [1, 1]  # created on the last cell's device
    copied.pipeline_layers[-1].bias.assign(np.ones(3))
    np.testing.assert_allclose(sequential.predict(x, verbose=0), expected)  # the Sequential is untouched

    shared = tfpipe.PipelineModel.from_sequential(sequential, copy=False, num_partitions=2, devices=cpu_devices(2))
    assert shared.pipeline_layers[0] is sequential.layers[0]

    with pytest.raises(TypeError, match=r"from_sequential takes a keras.Sequential, got list.*PipelineModel\(layers"):
        tfpipe.PipelineModel.from_sequential(mlp_layers(), num_partitions=2)


def test_to_sequential_shares_by_default_and_copies_on_request():
    model = _trained(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    x, _ = _data(seed=4)
    expected = model.predict(x, verbose=0)

    shared = model.to_sequential()
    np.testing.assert_allclose(shared.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    assert shared.layers[0] is model.pipeline_layers[0]

    copied = model.to_sequential(copy=True)
    np.testing.assert_allclose(copied.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    copied.layers[-1].bias.assign(np.ones(3))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected)

    unbuilt = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2))
    assert not unbuilt.to_sequential().built


def test_models_sharing_weights_on_several_devices_predict_where_keras_would_pick_xla(monkeypatch):
    # On a machine with a GPU, Keras' jit_compile="auto" means XLA, which cannot read a variable on another device.
    monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self: True)
    keras.utils.set_random_seed(0)
    x, _ = _data(seed=5)
    sequential = keras.Sequential(mlp_layers())  # unbuilt: the pipeline builds its layers on the cells' devices
    inputs = keras.Input((5,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4, activation="tanh")(inputs)))
    one_device = keras.Sequential([keras.Input((5,)), *mlp_layers()])
    assert sequential.jit_compile and functional.jit_compile  # the default on a GPU machine, as patched

    pipelines = [
        tfpipe.PipelineModel.from_sequential(sequential, copy=False, num_partitions=2, devices=cpu_devices(2)),
        tfpipe.PipelineModel(functional, num_partitions=2, devices=cpu_devices(2)),
    ]
    want = [pipelined.predict(x, verbose=0) for pipelined in pipelines]
    for own, expected in zip([sequential, functional, pipelines[0].to_sequential()], want + want[:1]):
        assert len({v.value.device for v in own.weights}) == 2 and own.jit_compile is False
        np.testing.assert_allclose(own.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)

    tfpipe.PipelineModel.from_sequential(one_device, copy=False, num_partitions=2, devices=["/CPU:0", "/CPU:0"])
    assert one_device.jit_compile is True  # all its weights on one device: XLA can have them
