"""tf.distribute strategies: default and OneDeviceStrategy work, data-parallel ones are refused, TPU cores resolve."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, max_rel_error, mlp_layers
from tfpipe.distributed import devices as devices_lib


def _one_step(strategy=None, **kwargs):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 5)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, num_micro_batches=4, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


def test_one_device_strategy_puts_every_cell_on_its_device_and_trains_as_usual():
    strategy = tf.distribute.OneDeviceStrategy("/CPU:1")
    model = _one_step(strategy)
    assert model.devices == ["/CPU:1", "/CPU:1"]
    assert {
        tf.DeviceSpec.from_string(v.value.device).device_index for v in model.weights + model.optimizer.variables
    } == {1}
    reference = _one_step(devices=cpu_devices(2))  # no strategy
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_one_device_strategy_refuses_other_devices():
    with tf.distribute.OneDeviceStrategy("/CPU:1").scope():
        with pytest.raises(ValueError, match=r"OneDeviceStrategy\('/CPU:1'\).*cannot go to \['/CPU:2', '/CPU:3'\]"):
            tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=["/CPU:2", "/CPU:3"])


def test_data_parallel_strategies_are_refused_with_the_reason():
    strategy = tf.distribute.MirroredStrategy(cpu_devices(2))
    with strategy.scope():
        with pytest.raises(ValueError, match=r"does not run under MirroredStrategy.*outside strategy.scope\(\)"):
            tfpipe.PipelineModel(mlp_layers(), num_partitions=2)


def _fake_tpu_strategy(cores_per_replica):
    """A TPUStrategy object without a TPU: only the device assignment that the resolution reads."""
    strategy = object.__new__(tf.distribute.TPUStrategy)
    assignment = types.SimpleNamespace(num_cores_per_replica=cores_per_replica)
    strategy._extended = types.SimpleNamespace(_device_assignment=assignment)
    return strategy


def test_tpu_cells_go_to_the_logical_cores_of_a_replica():
    strategy = _fake_tpu_strategy(4)
    assert devices_lib.resolve(None, 3, strategy=strategy) == [
        "/device:TPU_REPLICATED_CORE:0",
        "/device:TPU_REPLICATED_CORE:1",
        "/device:TPU_REPLICATED_CORE:2",
    ]
    with pytest.raises(
        ValueError,
        match=r"5 cells but each TPU replica has 4 logical core\(s\).*"
        r"computation_shape=\[1, 1, 1, 5\]",
    ):
        devices_lib.resolve(None, 5, strategy=strategy)
    with pytest.raises(ValueError, match=r"leave devices unset"):
        devices_lib.resolve(["/CPU:0", "/CPU:1"], 2, strategy=strategy)
    with pytest.raises(ValueError, match=r"2 cells but each TPU replica has 1 logical core"):
        devices_lib.resolve(None, 2, strategy=_fake_tpu_strategy(1))


def test_cells_enter_a_tpu_core_through_the_strategy_and_other_devices_through_tf_device():
    entered = []

    class Extended:
        _device_assignment = types.SimpleNamespace(num_cores_per_replica=2)

        @staticmethod
        def experimental_logical_device(core):
            entered.append(core)
            return tf.name_scope(f"core_{core}")

    strategy = object.__new__(tf.distribute.TPUStrategy)
    strategy._extended = Extended()
    with devices_lib.scope("/device:TPU_REPLICATED_CORE:1", strategy=strategy):
        pass
    assert entered == [1]
    with devices_lib.scope("/CPU:1", strategy=strategy):
        placed = tf.constant(1.0) + 1.0
    assert placed.device.endswith("CPU:1") and entered == [1]
