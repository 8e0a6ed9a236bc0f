"""Models built under tfpipe.deferred_weights(): no weight exists until PipelineModel makes it on its cell's device."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices, max_rel_error, run_fresh
from tfpipe.partition import deferred


def _functional(width: int = 8, normalize: bool = False) -> keras.Model:
    """A skip across the cut; with ``normalize``, a BatchNormalization and a Dropout (state and a seed to place)."""
    inputs = keras.Input((width,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    skip = keras.layers.Dense(16)(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    if normalize:
        h = keras.layers.Dropout(0.1)(keras.layers.BatchNormalization()(h))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Add()([h, skip])))


def _data(n: int = 10, width: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, width)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def test_functional_weights_wait_then_are_made_on_their_cells_devices():
    keras.utils.set_random_seed(3)
    reference = _functional(normalize=True)
    keras.utils.set_random_seed(3)
    with tfpipe.deferred_weights():
        model = _functional(normalize=True)
    assert all(deferred.waiting(v) for v in model.variables)
    pipelined = tfpipe.PipelineModel(model, balance=[3, 4], devices=cpu_devices(2), num_micro_batches=3)
    assert not any(deferred.waiting(v) for v in model.variables)
    for cell in pipelined._pipeline.cells:
        for layer in cell.layers:
            for variable in layer.variables:  # the Dropout's seed state too
                assert variable.value.device.endswith(cell.device.split("/")[-1]), (variable.path, cell.device)
    # made from the same initializers as an eager build: the same values, whatever device computed them
    assert max_rel_error(model.get_weights(), reference.get_weights()) == 0.0


def test_deferred_functional_model_trains_exactly_as_keras():
    keras.utils.set_random_seed(4)
    reference = _functional()
    with tfpipe.deferred_weights():
        model = _functional()
    pipelined = tfpipe.PipelineModel(model, num_partitions=2, devices=cpu_devices(2), num_micro_batches=3)
    pipelined.set_weights(reference.get_weights())
    x, y = _data()
    for m in (reference, pipelined):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
    assert max_rel_error(pipelined.get_weights(), reference.get_weights()) < 1e-5


def test_deferred_sequential_is_placed_per_cell():
    with tfpipe.deferred_weights():
        sequential = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(4)])
    assert all(deferred.waiting(v) for v in sequential.weights)
    model = tfpipe.PipelineModel(sequential, num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    x, _ = _data()
    model.fit(x, x, batch_size=10, verbose=0)
    devices = [v.value.device[-5:] for v in sequential.weights]
    assert devices == ["CPU:0"] * 4 + ["CPU:1"] * 4


def test_load_weights_inside_the_block_runs_once_the_weights_are_placed(tmp_path):
    keras.utils.set_random_seed(5)
    saved = _functional()
    path = str(tmp_path / "saved.weights.h5")
    saved.save_weights(path)
    with tfpipe.deferred_weights():
        model = _functional()
        model.load_weights(path)  # recorded: the weights have no value to load into yet
    assert all(deferred.waiting(v) for v in model.weights)
    tfpipe.PipelineModel(model, num_partitions=2, devices=cpu_devices(2))
    assert max_rel_error(model.get_weights(), saved.get_weights()) == 0.0


def test_the_block_restores_keras_on_exit_even_after_an_error():
    with pytest.raises(RuntimeError, match="inside"):
        with tfpipe.deferred_weights():
            raise RuntimeError("inside")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert not deferred.waiting(layer.kernel) and layer.kernel.numpy().shape == (3, 2)


def test_keras_hub_from_preset_inside_the_block_loads_onto_the_cells(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    from tfpipe.models import hub

    task = hub.task("llama", vocabulary_size=64, num_layers=2, hidden_dim=16, sequence_length=8)
    preset = str(tmp_path / "preset")
    task.save_to_preset(preset)
    with tfpipe.deferred_weights():
        loaded = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    assert all(deferred.waiting(v) for v in loaded.backbone.weights)
    model = tfpipe.PipelineModel(loaded, num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    assert max_rel_error(loaded.get_weights(), task.get_weights()) == 0.0
    assert {v.value.device[-5:] for v in loaded.backbone.weights} == {"CPU:0", "CPU:1"}
    x = hub.inputs(task, 4, 8, 64)
    np.testing.assert_allclose(model.predict(x, verbose=0), task.predict(x, verbose=0), rtol=1e-5, atol=1e-5)


CLIENT_PEAK = """
import json, keras, numpy as np, tensorflow as tf, tfpipe

def build():
    inputs = keras.Input((512,))
    h = inputs
    for _ in range(6):
        h = keras.layers.Dense(512, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))

with tfpipe.cluster.LocalCluster(num_workers=2, threads_per_worker=1) as cluster:
    with tfpipe.deferred_weights():
        model = build()
    pipelined = tfpipe.PipelineModel(model, num_partitions=2, devices=cluster.devices, num_micro_batches=2)
    pipelined.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.rand(32, 512).astype("float32")
    pipelined.fit(x, np.arange(32) % 10, batch_size=16, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    # a layer list cut by FLOPs: each kind of layer is copied to count it, on the first worker, not here
    tf.config.experimental.reset_memory_stats("CPU:0")
    block = lambda: keras.Sequential([keras.layers.Dense(1024, activation="tanh") for _ in range(4)])
    layers = [keras.layers.Dense(1024)] + [block() for _ in range(4)] + [keras.layers.Dense(10)]
    listed = tfpipe.PipelineModel(layers, num_partitions=2, devices=cluster.devices, num_micro_batches=2)
    listed.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    listed.fit(x, np.arange(32) % 10, batch_size=16, verbose=0)
    listed_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"peak": peak, "adam_state": 4 * 4 * model.count_params(), "listed_peak": listed_peak,
                      "listed_adam_state": 4 * 4 * listed.count_params()}))
"""


@pytest.mark.heavy(seconds=30)
def test_the_client_holds_no_weights_of_a_deferred_model_on_workers():
    """The training process's allocator peak stays under 10% of the model's Adam state (weights, gradients, two
    slots): every weight is made on its worker (built eagerly, the client's peak is above the weights alone); and
    of a layer list's."""
    done = run_fresh(CLIENT_PEAK, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < found["peak"] < 0.1 * found["adam_state"], found
    # a layer list's cells are built on their workers, and the copies that count its FLOPs (a 16 MiB block) made on
    # the first: the client holds at most a variable in transit (a 4 MiB kernel)
    assert 0 < found["listed_peak"] < 0.04 * found["listed_adam_state"], found
