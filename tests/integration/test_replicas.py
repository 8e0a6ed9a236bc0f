"""Data-parallel replicas of the pipeline: R x K cells train as one pipeline over the whole batch."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import covering, max_rel_error, mlp_layers, per_layer_error, small_unet, stateful_layers, unet_data

GRID = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]  # R=2 replicas of K=2 cells


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _fit(net, n, optimizer="adam", epochs=2):
    x, y = _data(n)
    net.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}), loss="mse"
    )
    net.fit(x, y, batch_size=n, epochs=epochs, shuffle=False, verbose=0)
    return net


@pytest.mark.parametrize(
    "schedule,m,n,remat",
    covering(
        [(s, *shape) for s in ("gpipe", "1f1b", "zero_bubble") for shape in [(1, 8, "never"), (3, 13, "except_last")]]
        + [(s, 2, 7, "always") for s in ("gpipe", "1f1b", "zero_bubble")],
        [("gpipe", 1, 8, "never"), ("1f1b", 3, 13, "except_last"), ("zero_bubble", 2, 7, "always")],
    ),
)
def test_replicas_train_like_plain_keras_on_the_whole_batch(schedule, m, n, remat):  # uneven N across replicas
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=m, remat=remat, schedule=schedule
    )
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _fit(plain, n)
    _fit(model, n)
    assert model.num_replicas == 2 and model.devices == GRID
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_replicas_batch_their_own_weight_gradients_like_plain_keras():
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=3, remat="never",
                                 schedule="gpipe_batched_w")  # fmt: skip
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _fit(plain, 13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, 13)
    assert [str(w.message) for w in caught if "gpipe_batched_w" in str(w.message)] == []  # no cell fell back
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_replicas_of_loops_train_like_plain_keras():  # unroll=False: each replica's step is two loops
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=3, remat="always", unroll=False
    )
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _fit(plain, 13)
    _fit(model, 13)
    assert model.unrolled is False
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


@pytest.mark.parametrize(
    "options",
    [{"schedule": "gpipe"}, {"schedule": "gpipe_batched_w", "remat": "never"}, {"unroll": False, "remat": "always"}],
    ids=["gpipe", "gpipe_batched_w", "loops"],
)
def test_replicas_count_weight_penalties_once_per_step(options):
    """Each replica used to add every cell's weight penalty in its own first micro-batch: R times in all."""

    def layers():
        keras.utils.set_random_seed(0)
        return [
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(3, bias_regularizer="l1"),
        ]

    x, y = _data(12)
    histories = []
    plain = keras.Sequential([keras.Input((8,)), *layers()])
    for net in (plain, tfpipe.PipelineModel(layers(), balance=[1, 1], devices=GRID, num_micro_batches=2, **options)):
        net.compile(optimizer="sgd", loss="mse")
        histories.append((net.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history["loss"], net))
    (expected, _), (losses, model) = histories
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_replica_cells_run_on_their_devices_and_the_variables_live_once_on_replica_0s():
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=2)
    model.build((None, 8))
    pipelines = model._pipeline.pipelines
    assert [[c.device for c in p.cells] for p in pipelines] == GRID
    assert [c.layers for c in pipelines[0].cells] == [c.layers for c in pipelines[1].cells]  # the same layers
    for cell in model.cells:
        for v in cell.trainable_variables + cell.non_trainable_variables:
            assert v.value.device.endswith(cell.device.replace("/CPU", "device:CPU")), (v.path, v.value.device)

    x, y = _data(8)
    model.compile(optimizer="sgd", loss="mse")
    step = tf.function(lambda x, y: model.train_step((x, y)))
    graph = step.get_concrete_function(tf.TensorSpec((8, 8)), tf.TensorSpec((8, 3))).graph
    forwards = [op for op in graph.get_operations() if op.name.startswith("F_") or "/F_" in op.name]
    used = {op.device for op in forwards + [op for op in graph.get_operations() if "tfpipe_cell" in op.name]}
    for row in GRID:
        for device in row:
            assert any(d.endswith(device.replace("/CPU", "device:CPU")) for d in used), (device, used)


@pytest.mark.parametrize("remat", covering(["always", "never"], ["always"]))
def test_replicas_are_one_pipeline_over_r_x_m_micro_batches_with_dropout_and_batchnorm(remat):
    # Replica r's micro-batch j is micro-batch rM + j of one pipeline with R x M: the same Dropout masks, and
    # BatchNorm's moving statistics merged from all of them. SGD keeps a bias that feeds only BatchNorm at noise.
    def make(devices, m):
        keras.utils.set_random_seed(5)  # the same weights and seed states
        model = tfpipe.PipelineModel(
            stateful_layers(), balance=[3, 3], devices=devices, num_micro_batches=m, remat=remat
        )
        model.build((None, 8))
        return model

    one, replicated = make(GRID[0], 4), make(GRID, 2)
    dropout = [layer for layer in replicated.pipeline_layers if isinstance(layer, keras.layers.Dropout)][0]
    before = np.asarray(dropout.seed_generator.state.value).copy()
    _fit(one, 14, "sgd", epochs=3)
    _fit(replicated, 14, "sgd", epochs=3)
    assert per_layer_error(replicated.pipeline_layers, one.pipeline_layers) < 1e-5
    bn = [layer for layer in replicated.pipeline_layers if isinstance(layer, keras.layers.BatchNormalization)][0]
    assert not np.allclose(bn.moving_variance.numpy(), 1.0)  # the statistics moved
    after = [np.asarray(m.pipeline_layers[3].seed_generator.state.value) for m in (replicated, one)]
    assert not np.array_equal(after[0], before) and np.array_equal(*after)  # advanced once per step, as in `one`


def test_replicas_of_a_functional_graph_with_skips_train_like_it():
    plain = small_unet()
    model = tfpipe.PipelineModel(small_unet(), balance=[6, 6], devices=GRID, num_micro_batches=2, remat="never")
    x, y = unet_data()
    for net in (plain, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_replicas_predict_and_evaluate_the_whole_batch_in_order():
    keras.utils.set_random_seed(2)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=2)
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    x, y = _data(11)
    np.testing.assert_allclose(model.predict(x, batch_size=11, verbose=0), plain.predict(x, verbose=0), atol=1e-5)
    for net in (plain, model):
        net.compile(loss="mse")
    assert model.evaluate(x, y, batch_size=11, verbose=0) == pytest.approx(plain.evaluate(x, y, verbose=0), rel=1e-5)


def test_replicas_are_saved_and_loaded_and_shown(tmp_path):
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=2)
    _fit(model, 8)
    path = str(tmp_path / "replicas.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.devices == GRID and loaded.num_replicas == 2
    assert max_rel_error(loaded.get_weights(), model.get_weights()) == 0.0
    x, _ = _data(8)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    lines = []
    model.summary(print_fn=lines.append)
    assert "2 replicas x 2 cells" in lines[0]
    rows = [line for line in lines if line.startswith(("0 ", "1 "))]
    assert len(rows) == 2 and "/CPU:0, /CPU:2" in rows[0] and "/CPU:1, /CPU:3" in rows[1]


def test_a_checkpoint_resumes_under_another_number_of_replicas(tmp_path):
    # BackupAndRestore saves the variables, which exist once for any R: stop after epoch 2 with R=2, resume
    # with R=1 (M doubled, so the micro-batches are the same), and end where an uninterrupted R=2 run ends.
    x, y = _data(16)

    def make(devices, m):
        keras.utils.set_random_seed(3)
        model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=devices, num_micro_batches=m)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    straight = make(GRID, 2)
    straight.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0)

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        make(GRID, 2).fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Stop()])
    resumed = make(GRID[0], 4)
    resumed.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    assert max_rel_error(resumed.get_weights(), straight.get_weights()) < 1e-5


def test_bad_replica_devices_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="mixes device strings and lists"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=["/CPU:0", ["/CPU:1", "/CPU:2"]])
    with pytest.raises(ValueError, match="2 cells but only 1 devices"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=[["/CPU:0", "/CPU:1"], ["/CPU:2"]])
    with pytest.raises(ValueError, match="Unknown device '/CPU:9'"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=[["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:9"]])
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=GRID, num_micro_batches=3)
    model.compile(loss="mse")
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"smaller than 2 replicas x 3 = 6 micro-batches"):
        model.fit(x, y, batch_size=4, verbose=0)
