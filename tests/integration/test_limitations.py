"""Known limitations, each pinned as a strict xfail: the test states what a user would want and fails today.

When a change makes one pass, pytest reports XPASS as a failure: remove the mark and
the limitation from README.
"""

import warnings

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices


def _data(n=16, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype("float32"), rng.standard_normal((n, 1)).astype("float32")


def _fit_two_cells(layers, balance, **options):
    """One epoch of ``fit`` of ``layers`` as 2 cells on 2 devices, 2 micro-batches, on ``_data``."""
    x, y = _data()
    model = tfpipe.PipelineModel(layers, balance=balance, devices=cpu_devices(2), num_micro_batches=2, **options)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="only seed states and BatchNorm statistics are merged "
    "across micro-batches; other assigned state is refused when M > 1",
)
def test_a_layer_assigning_other_state_trains_with_micro_batches():
    _fit_two_cells(
        [keras.layers.Dense(8), keras.layers.BatchNormalization(renorm=True), keras.layers.Dense(1)], balance=[2, 1]
    )


@pytest.mark.xfail(
    strict=True,
    raises=UserWarning,
    reason="BatchNormalization's weight gradients read each micro-batch's own statistics, so a cell "
    "with it takes its weight gradients per micro-batch under schedule='gpipe_batched_w'",
)
def test_a_batchnorm_cell_batches_its_weight_gradients():
    layers = [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gpipe_batched_w.*", category=UserWarning)
        _fit_two_cells(layers, balance=[2, 1], remat="never", schedule="gpipe_batched_w")
