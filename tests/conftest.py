"""Test setup: hide GPUs, and split the CPU into 4 logical devices before TensorFlow initializes.

The tests put cells on logical CPU devices and compare them with plain Keras references. On a
machine with a GPU, TensorFlow would run every op not pinned to a cell (the references) on the
GPU, and the tests would compare CPU arithmetic with GPU arithmetic. So the suite, and every
process it starts, sees no GPU; tests/gpu/test_gpu.py gives them back to its own processes.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TFPIPE_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import tensorflow as tf  # noqa: E402

NUM_DEVICES = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
)


def pytest_collection_modifyitems(config, items):
    """Tests under tests/scripts/ run the scripts and benchmarks end to end: marked ``smoke`` (-m "not smoke")."""
    import pytest

    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts") + os.sep
    for item in items:
        if str(item.path).startswith(scripts):
            item.add_marker(pytest.mark.smoke)
