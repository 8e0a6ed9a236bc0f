"""Shared helpers for the tests: reference models, weight comparison, running a snippet in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def covering(cases: list, kept: list) -> list:
    """``cases`` as pytest parameters, those not in ``kept`` marked slow: the default suite runs ``kept`` (a sample in
    which each value of each argument appears, where the matrix allows one) and ``pytest -m slow`` the rest (the
    suite's time on two cores is spent on TensorFlow tracing each case's steps)."""
    missing = [case for case in kept if case not in cases]
    if missing:
        raise ValueError(f"covering: kept cases {missing} are not among the cases")
    to_tuple = lambda case: case if isinstance(case, tuple) else (case,)
    return [pytest.param(*to_tuple(case), marks=() if case in kept else pytest.mark.slow) for case in cases]


def cpu_devices(k: int) -> list[str]:
    """The first k logical CPU devices."""
    return [f"/CPU:{i}" for i in range(k)]


def mlp_layers(width: int = 16, out: int = 3, depth: int = 4) -> list[keras.layers.Layer]:
    """Batch-independent layers: Dense, LayerNormalization and activations, ``depth`` Dense blocks."""
    layers: list[keras.layers.Layer] = []
    for _ in range(depth - 1):
        layers += [keras.layers.Dense(width), keras.layers.LayerNormalization(), keras.layers.Activation("tanh")]
    layers.append(keras.layers.Dense(out))
    return layers


def small_unet() -> keras.Model:
    """A Functional U-Net on 16 x 16 x 3 images (two levels, skips, no BatchNorm), the same weights every call."""
    from tfpipe.models.unet import unet

    keras.utils.set_random_seed(3)
    return unet((16, 16, 3), output_channels=2, depth=2, num_convs=1, base_channels=4, batch_norm=False)


def unet_data(n: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random images and targets for ``small_unet``."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 16, 16, 3)).astype("float32"), rng.normal(size=(n, 16, 16, 2)).astype("float32")


def unet_error(devices: list[str], num_micro_batches: int, schedule: str) -> float:
    """``small_unet`` cut into four cells of three nodes on ``devices`` under ``schedule``, and the model itself, both
    trained two SGD epochs on ``unet_data``: the largest relative difference of their weights."""
    import tfpipe

    x, y = unet_data()
    reference = small_unet()
    model = tfpipe.PipelineModel(
        small_unet(), balance=[3, 3, 3, 3], devices=devices, num_micro_batches=num_micro_batches, schedule=schedule
    )
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    return max_rel_error(model.get_weights(), reference.get_weights())


def stateful_layers() -> list[keras.layers.Layer]:
    """Dense, BatchNormalization (moving statistics) and Dropout (seed state): every kind of state."""
    return [
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(),
        keras.layers.Activation("relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ]


def max_rel_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest relative difference between two weight lists (relative to each tensor's scale)."""
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(float(np.max(np.abs(y))), 1e-12)
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst


def per_layer_error(mine: list[keras.layers.Layer], theirs: list[keras.layers.Layer]) -> float:
    """The largest difference of a layer's weights, relative to that layer's largest weight.

    Per layer, not per weight: a bias or beta whose output reaches only a BatchNormalization
    has a gradient that is zero in exact arithmetic; both models leave it at float noise,
    and noise relative to noise is not an error.
    """
    assert len(mine) == len(theirs)  # the same layers in the same order (auto names differ)
    worst = 0.0
    for a, b in zip(mine, theirs):
        if b.weights:
            scale = max(float(np.max(np.abs(w))) for w in b.get_weights()) or 1.0
            diffs = [float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights())]
            worst = max(worst, max(diffs) / scale)
    return worst


def run_fresh(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process (TensorFlow's device setup happens once per process)."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def run_script(name: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``scripts/<name>``, or ``benchmarks/<name>`` for a benchmark, with ``flags`` in a fresh process,
    TensorFlow's C++ logging off."""
    folder = "benchmarks" if os.path.exists(os.path.join(REPO, "benchmarks", name)) else "scripts"
    return subprocess.run(
        [sys.executable, os.path.join(REPO, folder, name), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
