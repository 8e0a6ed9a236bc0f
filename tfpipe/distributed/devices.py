"""Resolve the device of each cell: GPUs, logical CPU devices, devices of remote workers, TPU logical cores."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, ContextManager

import tensorflow as tf

from tfpipe import _compat
from tfpipe._args import user_stacklevel


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
    if not local and (
        spec.job != have.job or (spec.task or 0) != (have.task or 0) or (spec.replica or 0) != (have.replica or 0)
    ):
        return False
    if spec.device_type is None:
        return False
    return (
        spec.device_type.upper() == (have.device_type or "").upper() and (spec.device_index or 0) == have.device_index
    )


def check(device: object) -> str:
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


TPU_CORE = "/device:TPU_REPLICATED_CORE:{}"  # logical core k of the replica a TPU computation runs on


def tpu_core(device: str) -> int | None:
    """The logical core k of a ``TPU_CORE`` device string, else None."""
    core = re.fullmatch(r"/device:TPU_REPLICATED_CORE:(\d+)", device)
    return int(core.group(1)) if core else None


def matches(actual: str, wanted: str) -> bool:
    """Whether the full device name ``actual`` is ``wanted`` in every field that ``wanted`` names."""
    a, w = tf.DeviceSpec.from_string(actual), tf.DeviceSpec.from_string(wanted)
    fields = ("job", "replica", "task", "device_type", "device_index")
    return all(getattr(w, f) is None or getattr(w, f) == getattr(a, f) for f in fields)


def scope(device: str, strategy: Any = None) -> ContextManager:
    """Where a cell's variables and ops go: ``tf.device(device)``, or a TPU replica's logical core.

    Under TPUStrategy a logical core is entered through the strategy, which also
    places the variables created there on that core of every replica.
    """
    core = tpu_core(device)
    strategy = tf.distribute.get_strategy() if strategy is None else strategy
    if core is not None and _kind(strategy) == "tpu":
        return strategy.extended.experimental_logical_device(core)
    return tf.device(device)


def resolve(devices: Sequence[str] | None, num_cells: int, strategy: Any = None) -> list[str]:
    """One device string per cell; ``None`` picks the machine's devices (see ``available``).

    Under a ``tf.distribute`` strategy (default: the current one) the strategy decides
    (see ``for_strategy``).
    """
    strategy = tf.distribute.get_strategy() if strategy is None else strategy
    if _kind(strategy) != "default":
        return for_strategy(strategy, devices, num_cells)
    if devices is None:
        found = available()
        if len(found) == 1:
            if num_cells > 1:
                warnings.warn(share_warning(num_cells, found[0]), stacklevel=user_stacklevel())
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


LOGICAL_CPUS = (
    "tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], "
    "[tf.config.LogicalDeviceConfiguration()] * K)"
)


def share_warning(num_cells: int, device: str) -> str:
    """Why ``num_cells`` cells on one default device gain nothing from pipelining, and the fix."""
    return (
        f"All {num_cells} cells (0-{num_cells - 1}) go to {device}, the only device TensorFlow sees here: they "
        "run one after another and pipelining gains nothing. Pass devices=[...], or split the CPU into K logical "
        f"devices before TensorFlow starts: {LOGICAL_CPUS}."
    )


def is_replicated(devices: Any) -> bool:
    """Whether ``devices`` is a list of R lists of cell devices (replicas), not one flat list."""
    if devices is None or isinstance(devices, str) or not hasattr(devices, "__iter__"):
        return False
    rows = [isinstance(d, (list, tuple)) for d in devices]
    if any(rows) and not all(rows):
        raise TypeError(
            f"devices mixes device strings and lists: {devices!r}. Give one device per cell, or R lists of "
            "one device per cell (R data-parallel replicas of the pipeline)."
        )
    return bool(rows) and all(rows)


def resolve_replicas(devices: Any, num_cells: int, strategy: Any = None) -> list[list[str]]:
    """The cells' devices of each replica: R lists for R lists given, else one (see ``resolve``)."""
    if not is_replicated(devices):
        return [resolve(devices, num_cells, strategy)]
    strategy = tf.distribute.get_strategy() if strategy is None else strategy
    if _kind(strategy) != "default":
        raise ValueError(
            f"Replicas of the pipeline (devices as {len(devices)} lists) run outside tf.distribute strategies; "
            f"under {type(strategy).__name__} give one device per cell, or leave devices unset."
        )
    return [resolve(list(row), num_cells, strategy) for row in devices]


def restore(saved: Any, num_cells: int) -> tuple[list[str] | list[list[str]], str | None]:
    """Devices for a loaded model: the saved ones if this machine has them all, else the machine's own.

    Saved replicas (R lists) are kept when every device is here, else become one replica.

    When the machine has fewer devices than cells, neighbouring cells share one
    (cell k goes to device k * D // K), so a model trained on 8 devices still
    loads on 1. Returns the devices and, when they differ from ``saved``, why.
    """
    if is_replicated(saved):
        missing = [d for row in saved for d in row if not _exists(d)]
        if not missing:
            return [list(row[:num_cells]) for row in saved], None
        chosen, _ = restore([], num_cells)
        return chosen, (
            f"the saved replicas' devices {[list(r) for r in saved]} are not all on this machine (missing "
            f"{missing}); one replica's {num_cells} cells go to {chosen} instead"
        )
    missing = [d for d in saved if not _exists(d)]
    if not missing and len(saved) >= num_cells:
        return list(saved[:num_cells]), None
    found = available()
    chosen = [found[k * len(found) // num_cells] for k in range(num_cells)]
    return chosen, (
        f"the saved devices {list(saved)} are not all on this machine (missing {missing}); "
        f"the {num_cells} cells go to {chosen} instead"
    )


def _exists(device: str) -> bool:
    try:
        check(device)
    except (TypeError, ValueError):
        return False
    return True


def _kind(strategy: Any) -> str:
    if isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)):
        return "tpu"
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return "one_device"
    if _compat.is_default_strategy(strategy):
        return "default"
    return "unsupported"


def for_strategy(strategy: tf.distribute.Strategy, devices: Sequence[str] | None, num_cells: int) -> list[str]:
    """The cells' devices under a strategy, or a ValueError for a strategy tfpipe cannot run under.

    - ``OneDeviceStrategy`` puts every variable on its device, so every cell goes there.
    - ``TPUStrategy``: cell k goes to logical core k of the replica; the strategy's
      device assignment must give each replica at least K cores.
    - Data-parallel strategies (Mirrored, MultiWorkerMirrored, ParameterServer, ...)
      would replicate the pipeline's variables and steps in ways tfpipe does not control.
    """
    kind = _kind(strategy)
    if kind == "one_device":
        device = strategy.extended.worker_devices[0]
        wanted = tf.DeviceSpec.from_string(device)
        if devices is not None and any(
            not _same_device(tf.DeviceSpec.from_string(check(d)), wanted) for d in devices[:num_cells]
        ):
            raise ValueError(
                f"Under OneDeviceStrategy({_short_name(device)!r}) every variable lives on {_short_name(device)}, "
                f"so cells cannot go to {list(devices)}; leave devices unset, or create the model outside "
                "strategy.scope() to spread the cells over devices."
            )
        return [_short_name(device)] * num_cells
    if kind == "tpu":
        cores = _compat.tpu_cores_per_replica(strategy)
        if num_cells > cores:
            raise ValueError(
                f"{num_cells} cells but each TPU replica has {cores} logical core(s). Create the TPUStrategy with "
                "experimental_device_assignment=tf.tpu.experimental.DeviceAssignment.build(topology, "
                f"computation_shape=[1, 1, 1, {num_cells}], num_replicas=...), or use at most {cores} cells."
            )
        if devices is not None:
            raise ValueError(
                f"Under TPUStrategy the cells go to the replica's logical cores; leave devices unset "
                f"(got {list(devices)})."
            )
        return [TPU_CORE.format(k) for k in range(num_cells)]
    raise ValueError(
        f"tfpipe does not run under {type(strategy).__name__}: a pipeline places its own cells on devices and "
        "takes one synchronous step, and a data-parallel strategy would replicate it in ways tfpipe does not "
        "control. Create the PipelineModel outside strategy.scope() (or under OneDeviceStrategy / TPUStrategy)."
    )


def _same_device(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
    return ((a.device_type or "").upper(), a.device_index or 0) == (
        (b.device_type or "").upper(),
        b.device_index or 0,
    ) and (a.job in (None, "localhost")) == (b.job in (None, "localhost"))
