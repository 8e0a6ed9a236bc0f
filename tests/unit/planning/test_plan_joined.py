"""What one W over all micro-batches joins, per layer: the bytes per sample the step's W concatenates."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe.backward import batched_w
from tfpipe.planning import joined


def test_a_dense_layer_joins_its_input_and_the_gradient_at_its_product():
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    x = np.ones((4, 5), "float32")
    # kernel gradient = input^T x (gradient at the product); the bias's sum each B takes itself
    assert joined.bytes_per_sample(layers, x, "/CPU:0") == [(5 + 8) * 4, (8 + 3) * 4]


def test_layers_without_weights_or_whose_w_cannot_run_once_join_nothing():
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Dense(6),
        keras.layers.Activation("relu"),  # no weights: no W
        keras.layers.BatchNormalization(),  # batch statistics: W runs per micro-batch
        keras.layers.Dense(2),
    ]
    found = joined.bytes_per_sample(layers, np.ones((4, 3), "float32"), "/CPU:0")
    assert found == [(3 + 6) * 4, 0.0, 0.0, (6 + 2) * 4]


def test_alike_layers_are_traced_once(monkeypatch):
    keras.utils.set_random_seed(0)
    traced, real = [], joined._layer_bytes

    def layer_bytes(copy, *args):
        traced.append(copy.units)
        return real(copy, *args)

    monkeypatch.setattr(joined, "_layer_bytes", layer_bytes)
    layers = [keras.layers.Dense(8, activation="tanh") for _ in range(3)] + [keras.layers.Dense(3)]
    found = joined.bytes_per_sample(layers, np.ones((4, 8), "float32"), "/CPU:0")
    assert traced == [8, 3]  # the three alike Dense(8) once
    assert found == [(8 + 8) * 4] * 3 + [(8 + 3) * 4]


def test_the_step_joins_what_the_planner_counts():
    """The bytes are the step's own: a pipeline's W over all micro-batches concatenates them (BatchedW.run)."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).standard_normal((8, 12)).astype("float32")
    counted = joined.bytes_per_sample([keras.layers.Dense(16, activation="tanh") for _ in range(3)], x, "/CPU:0")
    seen = []
    run = batched_w.BatchedW.run

    def spy(self, envs):
        seen.append(self.joined_bytes())
        return run(self, envs)

    batched_w.BatchedW.run = spy
    try:
        model = tfpipe.PipelineModel(
            [keras.layers.Dense(16, activation="tanh") for _ in range(3)],
            balance=[3],
            devices=["/CPU:0"],
            num_micro_batches=2,
            remat="never",
            schedule="gpipe_batched_w",
        )
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, np.ones((8, 16), "float32"), batch_size=8, verbose=0)
    finally:
        batched_w.BatchedW.run = run
    # traced with 2 x 4 rows: BatchedW's "big" holds the rows of both micro-batches
    assert seen and seen[0] == pytest.approx(sum(counted) * 8)
