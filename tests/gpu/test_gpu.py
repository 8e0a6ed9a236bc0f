"""On a machine with an NVIDIA GPU: cells on GPUs train like plain Keras on the GPU (skipped elsewhere).

Each test runs in a fresh process that sees the GPUs conftest.py hides from the rest of the suite,
splits the first GPU into two logical GPUs (one per cell) and turns TensorFloat-32 off, so that
both sides compute in float32.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.util import run_fresh


def _count_gpus() -> int:
    """NVIDIA GPUs on this machine, without starting TensorFlow (this process hides them from it)."""
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def _gpus() -> str | None:
    """CUDA_VISIBLE_DEVICES as the suite was started with, or None where there is no GPU to use."""
    original = os.environ.get("TFPIPE_TEST_CUDA_VISIBLE_DEVICES", "unset")
    count = _count_gpus() if original != "" else 0
    if not count:
        return None
    return original if original != "unset" else ",".join(str(i) for i in range(count))


_VISIBLE = _gpus()
pytestmark = pytest.mark.skipif(_VISIBLE is None, reason="no NVIDIA GPU on this machine")

_SETUP = """
import json
import numpy as np
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)
import keras
import tfpipe
from tests.util import max_rel_error
DEVICES = ["/GPU:0", "/GPU:1"]
"""

_ONE_STEP = """
def one_step(make_layers, shape, n=8, jit_compile=False, **options):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    with tf.device("/GPU:0"):
        reference = keras.Sequential([keras.Input(shape)] + make_layers())
        start = reference.get_weights()
        model = tfpipe.PipelineModel(make_layers(), num_partitions=2, devices=DEVICES, num_micro_batches=4, **options)
        model.build((None, *shape))
        model.set_weights(start)
        for net in (reference, model):
            net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
            net.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0)
    devices = [tf.DeviceSpec.from_string(v.value.device) for v in model.weights]
    return {
        "changed": max_rel_error(start, reference.get_weights()),
        "error": max_rel_error(model.get_weights(), reference.get_weights()),
        "devices": sorted({f"{d.device_type}:{d.device_index}" for d in devices}),
    }
"""


def _run(code: str) -> dict:
    proc = run_fresh(_SETUP + code, env={"CUDA_VISIBLE_DEVICES": _VISIBLE}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dense_cells_on_two_gpus_train_like_keras_on_the_gpu():
    result = _run(
        _ONE_STEP
        + """
from tests.util import mlp_layers
print(json.dumps(one_step(lambda: mlp_layers(), (5,))))
"""
    )
    assert result["devices"] == ["GPU:0", "GPU:1"]
    assert result["changed"] > 1e-3 and result["error"] < 1e-5


def test_convolution_cells_on_two_gpus_train_like_keras_on_the_gpu():
    result = _run(
        _ONE_STEP
        + """
def conv_layers():
    return [
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3),
    ]
print(json.dumps(one_step(conv_layers, (12, 12, 3))))
"""
    )
    assert result["devices"] == ["GPU:0", "GPU:1"]
    assert result["changed"] > 1e-3 and result["error"] < 1e-5


def test_cells_compiled_by_xla_on_two_gpus_train_like_keras_with_xla_on_the_gpu():
    # compile(jit_compile=True): each cell's tasks are XLA calls on its GPU; plain Keras is one XLA step.
    result = _run(
        _ONE_STEP
        + """
from tests.util import mlp_layers
def conv_layers():
    return [keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]
dense = one_step(lambda: mlp_layers(), (5,), jit_compile=True, remat="except_last")
conv = one_step(conv_layers, (12, 12, 3), jit_compile=True, remat="never")
print(json.dumps({"dense": dense, "conv": conv}))
"""
    )
    for case in result.values():
        assert case["devices"] == ["GPU:0", "GPU:1"]
        assert case["changed"] > 1e-3 and case["error"] < 1e-5


@pytest.mark.parametrize(
    "options",
    [
        {"schedule": "1f1b", "remat": "never"},
        {"schedule": "zero_bubble", "remat": "except_last"},
        {"schedule": "gpipe_batched_w", "remat": "never"},
        {"unroll": False, "remat": "always"},
    ],
    ids=["1f1b", "zero_bubble", "gpipe_batched_w", "loops"],
)
def test_schedules_and_loops_on_two_gpus_train_like_keras_on_the_gpu(options):
    # Each takes its own path on the GPUs: split backwards, weight gradients over all micro-batches, while loops.
    result = _run(
        _ONE_STEP
        + f"""
from tests.util import mlp_layers
print(json.dumps(one_step(lambda: mlp_layers(), (5,), **{options!r})))
"""
    )
    assert result["devices"] == ["GPU:0", "GPU:1"]
    assert result["changed"] > 1e-3 and result["error"] < 1e-5


def test_an_embedding_tied_to_the_output_across_two_gpus_trains_like_keras_on_the_gpu():
    # The table lives on GPU:0; GPU:1 reads it for the logits and sends its gradient back to be added.
    result = _run(
        """
from tfpipe.models.transformer import transformer_lm_tied
rng = np.random.default_rng(0)
x, y = rng.integers(0, 11, (8, 6)).astype("int32"), rng.integers(0, 11, (8, 6)).astype("int32")
with tf.device("/GPU:0"):
    keras.utils.set_random_seed(4)
    reference = transformer_lm_tied(11, 6, 2, 8, 16, 2)
    keras.utils.set_random_seed(4)
    model = tfpipe.PipelineModel(transformer_lm_tied(11, 6, 2, 8, 16, 2), balance=[3, 3], devices=DEVICES,
                                 num_micro_batches=2)
    for net in (reference, model):
        net.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=False,
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
# Relative to each weight's scale, floored: the attention's key biases get only rounding noise (no gradient).
error = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-2))
            for a, b in zip(model.get_weights(), reference.get_weights()))
table = tf.DeviceSpec.from_string(model.get_layer("tokens").embeddings.value.device)
print(json.dumps({"error": error, "table": f"{table.device_type}:{table.device_index}"}))
"""
    )
    assert result["table"] == "GPU:0" and result["error"] < 1e-5


def test_models_sharing_the_cells_weights_predict_under_keras_defaults():
    # On a GPU, Keras' jit_compile="auto" is XLA, which cannot read the variables of a second device.
    result = _run(
        """
inputs = keras.Input((5,))
own = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4, activation="tanh")(inputs)))
model = tfpipe.PipelineModel(own, num_partitions=2, devices=DEVICES, num_micro_batches=2)
x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
mine, theirs = model.predict(x, verbose=0), own.predict(x, verbose=0)
print(json.dumps({"difference": float(np.max(np.abs(mine - theirs)))}))
"""
    )
    assert result["difference"] < 1e-6
