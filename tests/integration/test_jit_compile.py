"""compile(jit_compile=True): each cell's tasks compiled by XLA on its device, training as plain Keras with XLA."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, max_rel_error, mlp_layers, per_layer_error, stateful_layers


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _train(net, n, jit_compile, optimizer="adam"):
    x, y = _data(n)
    net.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}),
        loss="mse",
        jit_compile=jit_compile,
    )
    net.fit(x, y, batch_size=n, epochs=2, shuffle=False, verbose=0)
    return net


@pytest.mark.parametrize(
    "k,m,n,remat,schedule,unroll",
    [
        pytest.param(2, 4, 10, "never", "gpipe", True, marks=pytest.mark.slow),  # the cases below hold each part
        pytest.param(2, 3, 7, "except_last", "zero_bubble", True, marks=pytest.mark.slow),
        (2, 4, 9, "always", "gpipe", False),  # loops calling the compiled cells
        (4, 16, 32, "never", "gpipe_batched_w", True),  # 128 tasks: calls TensorFlow does not inline
    ],
)
def test_compiled_cells_train_like_plain_keras_with_xla(k, m, n, remat, schedule, unroll):
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(
        mlp_layers(),
        num_partitions=k,
        devices=cpu_devices(k),
        num_micro_batches=m,
        remat=remat,
        schedule=schedule,
        unroll=unroll,
    )
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _train(plain, n, True)
    _train(model, n, True)
    assert model.cells_jit_compile and all(cell.jit_compile for cell in model.cells)
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_compiled_cells_draw_the_dropout_masks_of_plain_keras_with_xla():
    # XLA draws other random numbers than TensorFlow's kernels from the same seeds (plain Keras' weights
    # differ by about 1e-2 with and without it): compiled cells draw XLA's, as plain Keras with XLA does.
    def trained(net, jit_compile):
        keras.utils.set_random_seed(5)
        return _train(net(), 9, jit_compile, "sgd")

    def pipelined():
        model = tfpipe.PipelineModel(stateful_layers(), num_partitions=3, devices=cpu_devices(3), num_micro_batches=1)
        model.build((None, 8))
        return model

    plain = trained(lambda: keras.Sequential([keras.Input((8,)), *stateful_layers()]), True)
    model = trained(pipelined, True)
    assert per_layer_error(model.pipeline_layers, plain.layers) < 1e-6
    uncompiled = trained(pipelined, False)
    assert per_layer_error(uncompiled.pipeline_layers, plain.layers) > 1e-3


@pytest.mark.parametrize("m", [2, 32])  # inlined calls, and calls TensorFlow does not inline
def test_jit_compile_compiles_each_cell_and_only_with_it(m):
    # tf.numpy_function runs Python, which XLA cannot compile: the cell that holds it fails only when compiled.
    def layers():
        identity = keras.layers.Lambda(
            lambda t: tf.ensure_shape(tf.numpy_function(lambda a: a, [t], tf.float32, stateful=False), [None, 4]),
            output_shape=(4,),
        )
        return [keras.layers.Dense(4), identity, keras.layers.Dense(3)]

    x, _ = _data(40)
    for jit_compile in (False, True):
        model = tfpipe.PipelineModel(layers(), balance=[1, 2], devices=cpu_devices(2), num_micro_batches=m)
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
        if not jit_compile:
            assert model.predict(x, batch_size=40, verbose=0).shape == (40, 3)
            continue
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"tf2xla conversion failed"):
            model.predict(x, batch_size=40, verbose=0)


def test_jit_compile_reaches_every_replica_and_stays_in_the_compile_config():
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2, devices=[cpu_devices(2), ["/CPU:2", "/CPU:3"]], num_micro_batches=2
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.build((None, 8))
    cells = [cell for pipeline in model._pipeline.pipelines for cell in pipeline.cells]
    assert len(cells) == 4 and all(cell.jit_compile for cell in cells)
    assert model.jit_compile is False  # the step itself: one XLA cluster would ignore the cells' devices
    assert model.get_compile_config()["jit_compile"] is True
    again = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    again.compile_from_config(model.get_compile_config())
    assert again.cells_jit_compile and again.jit_compile is False
    again.compile(optimizer="sgd", loss="mse")  # Keras' default "auto" leaves the cells uncompiled
    assert not again.cells_jit_compile and not any(cell.jit_compile for cell in again.cells)


def test_cells_made_after_compile_are_compiled():
    # num_partitions without a built input: the cells are made when the model is built, after compile.
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    assert model.cells == []
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.build((None, 8))
    assert model.cells and all(cell.jit_compile for cell in model.cells)


def test_run_eagerly_leaves_the_cells_uncompiled_with_a_warning():
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    with pytest.warns(
        UserWarning, match=r"run_eagerly=True runs the cells' layers eagerly: jit_compile=True is ignored"
    ):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True, run_eagerly=True)
    assert not model.cells_jit_compile
