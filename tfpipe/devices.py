"""Resolve the device of each cell: GPUs, logical CPU devices, or devices of remote workers."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def _short_name(logical_name: str) -> str:
    spec = tf.DeviceSpec.from_string(logical_name)
    if spec.job in (None, "localhost"):
        return f"/{spec.device_type}:{spec.device_index}"
    return spec.to_string()


def available() -> list[str]:
    """The devices cells go to by default: all GPUs, else the logical CPU devices."""
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [_short_name(d.name) for d in gpus]
    return [_short_name(d.name) for d in tf.config.list_logical_devices("CPU")]


def _matches(spec: tf.DeviceSpec, logical_name: str) -> bool:
    have = tf.DeviceSpec.from_string(logical_name)
    local = spec.job is None or spec.job == "localhost"
    if local and have.job not in (None, "localhost"):
        return False
    if not local and (spec.job != have.job or (spec.task or 0) != (have.task or 0) or (spec.replica or 0) != (have.replica or 0)):
        return False
    if spec.device_type is None:
        return False
    return spec.device_type.upper() == (have.device_type or "").upper() and (spec.device_index or 0) == have.device_index


def check(device: str) -> str:
    """Check that TensorFlow knows this device; return it unchanged."""
    if not isinstance(device, str):
        raise TypeError(f"Devices are strings such as '/GPU:0' or '/CPU:1', got {device!r}.")
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError as err:
        raise ValueError(f"Cannot parse device {device!r} ({err}); write it like '/GPU:0' or '/CPU:1'.") from None
    logical = [d.name for d in tf.config.list_logical_devices()]
    if not any(_matches(spec, name) for name in logical):
        known = ", ".join(_short_name(n) for n in logical)
        raise ValueError(
            f"Unknown device {device!r}: TensorFlow sees only [{known}]. Pick one of those, or split the CPU "
            "into logical devices with tf.config.set_logical_device_configuration before TensorFlow starts."
        )
    return device


def resolve(devices: Optional[Sequence[str]], num_cells: int) -> list[str]:
    """One device string per cell; ``None`` picks the machine's devices (see ``available``)."""
    if devices is None:
        found = available()
        if len(found) == 1:
            return found * num_cells
        if len(found) < num_cells:
            raise ValueError(
                f"{num_cells} cells but only {len(found)} devices ({found}); "
                f"use at most {len(found)} cells, or pass devices=[...] explicitly."
            )
        return found[:num_cells]
    if isinstance(devices, str) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices must be a list of device strings, got {devices!r}.")
    devices = [check(d) for d in devices]
    if len(devices) < num_cells:
        raise ValueError(
            f"{num_cells} cells but only {len(devices)} devices ({devices}); "
            f"give at least {num_cells} devices or use fewer cells."
        )
    return devices[:num_cells]
