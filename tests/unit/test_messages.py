"""A pipelined training step announces itself before it is built, once per trace, the way Keras writes messages."""

import logging

import keras
import numpy as np

import tfpipe
from tests.util import cpu_devices, mlp_layers

LINE = "tfpipe: building the pipelined training step"


def _model(k, m):
    layers = mlp_layers(depth=2)  # Dense, LayerNormalization, tanh, Dense
    model = tfpipe.PipelineModel(
        layers, num_partitions=k, cost=lambda layer: 1.0, devices=cpu_devices(k), num_micro_batches=m
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def test_the_first_pipelined_step_says_what_it_builds_once(capsys):
    x, y = _data()
    model = _model(2, 4)
    model.train_on_batch(x, y)
    out = capsys.readouterr().out
    assert out.count(LINE) == 1
    assert f"{model.name!r}: K=2 cells x M=4 micro-batches = 16 tasks (remat='except_last')" in out
    model.train_on_batch(x, y)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # a new train function is traced: announced again
    assert capsys.readouterr().out.count(LINE) == 1


def test_no_line_without_a_pipeline_and_absl_log_without_interactive_logging(capsys, caplog):
    x, y = _data()
    _model(1, 1).train_on_batch(x, y)
    assert LINE not in capsys.readouterr().out
    keras.config.disable_interactive_logging()
    try:
        with caplog.at_level(logging.INFO, logger="absl"):
            _model(2, 2).train_on_batch(x, y)
    finally:
        keras.config.enable_interactive_logging()
    assert LINE not in capsys.readouterr().out
    assert any(LINE in r.getMessage() for r in caplog.records)


def test_eager_steps_say_nothing(capsys):
    x, y = _data()
    model = _model(2, 2)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    model.train_on_batch(x, y)
    assert LINE not in capsys.readouterr().out


def test_a_looped_step_says_so(capsys):
    x, y = _data(16)
    layers = mlp_layers(depth=2)
    model = tfpipe.PipelineModel(layers, balance=[2, 2], devices=cpu_devices(2), num_micro_batches=16, unroll=False)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x, y)
    out = capsys.readouterr().out
    assert (
        "K=2 cells x M=16 micro-batches = 64 tasks (as two loops over 17 clock cycles, recomputing every cell)" in out
    )
