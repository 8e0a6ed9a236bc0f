"""Test setup: split the CPU into 4 logical devices before TensorFlow initializes."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

NUM_DEVICES = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
)
