"""``tfpipe.plan``: measure the layers and the devices, predict every configuration, return the fastest that fits.

What the plan rests on (``Plan.summary`` prints it): each layer's forward and backward
time and held bytes, measured on copies on the first device at every micro-batch size
the search needs (``planning.profile``); the cost of a task, of a step, of moving a
tensor and of the optimizer's update, and how many devices' worth of compute run at
once, measured once per set of devices with a tiny pipeline (``calibrate``); and the
schedule simulated as data (``planning.predict``, ``planning.search``).
"""

from __future__ import annotations

import timeit
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe._args import positive_int
from tfpipe.backward.remat import REMAT_MODES, check_mode
from tfpipe.distributed import devices as devices_lib
from tfpipe.model import PipelineModel
from tfpipe.partition import functional
from tfpipe.partition.sequence import layer_list
from tfpipe.planning import plans, profile, search
from tfpipe.planning.plans import Plan
from tfpipe.planning.predict import SLOTS, Calibration
from tfpipe.step import schedule as schedule_lib

__all__ = ["Plan", "calibrate", "plan"]

_CALIBRATIONS: dict[tuple[str, ...], Calibration] = {}  # one per set of devices and optimizer, per process


def plan(
    layers: Any,
    batch_size: int,
    devices: Sequence[str] | None = None,
    memory_budget: Any = None,
    *,
    sample: Any = None,
    input_shape: Any = None,
    optimizer: Any = "adam",
    num_micro_batches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    remats: Sequence[str] | None = None,
    replicas: bool = True,
    calibration: Calibration | None = None,
    repeats: int = 3,
) -> Plan:
    """The configuration (K, balance, R, M, remat, schedule) predicted fastest whose peak fits ``memory_budget``.

    ``layers``: a list of Keras layers or a ``keras.Sequential``. ``devices``: the devices to
    use (default: this machine's GPUs, else its CPU devices). ``memory_budget``: bytes per
    device (an int or a string such as "12GiB"); None: no limit. ``sample`` or
    ``input_shape`` give the input when the layers do not know it. ``optimizer``: its name
    or instance, for its slots' memory and its update's time. ``num_micro_batches``,
    ``schedules``, ``remats`` and ``replicas`` narrow the search. ``calibration``: reuse one
    (``plan.calibration``) instead of measuring. A ValueError names the smallest budget that
    would fit when none does.
    """
    if functional.is_functional(layers):
        raise ValueError(
            "tfpipe.plan takes a list of layers or a keras.Sequential; a Functional model's nodes are not planned "
            "yet. Pass balance=... to PipelineModel for it, or tfpipe.balance.by_time to cut it by measured time."
        )
    layer_seq = layer_list(layers)
    batch_size = positive_int("batch_size", batch_size)
    device_list = _devices(devices)
    budget = plans.parse_bytes(memory_budget) if memory_budget is not None else None
    space = search.Space(
        num_devices=len(device_list),
        micro_batches=_choices("num_micro_batches", num_micro_batches, search.MICRO_BATCHES, int),
        schedules=_choices("schedules", schedules, schedule_lib.SCHEDULES, str, schedule_lib.check_name),
        remats=_choices("remats", remats, REMAT_MODES, str, check_mode),
        replicas=bool(replicas),
    )
    slots = optimizer_slots(optimizer)
    data = profile.sample_of(layers, sample, input_shape)
    sizes = search.micro_batch_sizes(batch_size, len(layer_seq), space)
    measured = profile.measure(layer_seq, data, sizes, device_list[0], repeats=positive_int("repeats", repeats))
    if calibration is None:
        calibration = calibrate(device_list, optimizer)
    elif not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a tfpipe Calibration (plan.calibration), got {calibration!r}.")
    candidates = search.run(measured, calibration, batch_size, space, budget, slots)
    return plans.from_candidates(candidates, device_list, batch_size, budget, measured, calibration, slots)


def _devices(devices: Sequence[str] | None) -> list[str]:
    if devices is None:
        return [d.name for d in tf.config.list_logical_devices("GPU")] or devices_lib.available()
    if isinstance(devices, str) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices must be a list of device strings, got {devices!r}.")
    found = [devices_lib.check(d) for d in devices]
    if not found:
        raise ValueError("devices is empty; give at least one device, e.g. ['/CPU:0'].")
    return found


def _choices(name: str, given: Any, default: Sequence[Any], kind: type, check: Any = None) -> tuple[Any, ...]:
    """The candidates the search may pick for ``name``: ``given`` checked, or ``default``."""
    if given is None:
        return tuple(default)
    if isinstance(given, (str, int)) or not hasattr(given, "__iter__") or not list(given):
        raise ValueError(f"{name} must be a non-empty list of choices, got {given!r}; e.g. {list(default)[:3]}.")
    values = [positive_int(name, v) if kind is int else v for v in given]
    return tuple(check(v) for v in values) if check else tuple(values)


def optimizer_slots(optimizer: Any) -> int:
    """Slots per trainable weight that ``optimizer`` (a name or a Keras optimizer) keeps: Adam 2, momentum 1, SGD 0."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        name = type(optimizer).__name__.lower()
        if name == "sgd" and float(getattr(optimizer, "momentum", 0.0) or 0.0) > 0:
            name = "sgd_momentum"
    else:
        raise TypeError(f"optimizer must be a name such as 'adam' or a keras.optimizers.Optimizer, got {optimizer!r}.")
    if name not in SLOTS:
        raise ValueError(f"Unknown optimizer {optimizer!r} for the planner; use one of {sorted(SLOTS)}.")
    return SLOTS[name]


def calibrate(devices: Sequence[str], optimizer: Any = "adam", steps: int = 30) -> Calibration:
    """Measure what a step costs on ``devices`` beyond its layers (cached per devices and optimizer in this process)."""
    device_list = _devices(devices)
    key = (
        *device_list,
        str(optimizer_slots(optimizer)),
        str(optimizer if isinstance(optimizer, str) else type(optimizer)),
    )
    if key in _CALIBRATIONS:
        return _CALIBRATIONS[key]
    k = len(device_list)
    interactive = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()  # the probes' "building the step" lines are not the user's
    try:
        timed = {m: _tiny_step_seconds(device_list, m, steps) for m in (1, 8)}
    finally:
        if interactive:
            keras.config.enable_interactive_logging()
    units = {m: max(end for _, _, end in schedule_lib.simulate(k, m, [1.0] * k, [1.0] * k)) for m in timed}
    task_s = max((timed[8] - timed[1]) / (units[8] - units[1]), 0.0)
    step_s = max(timed[1] - task_s * units[1], 0.0)
    result = Calibration(
        task_s=task_s,
        step_s=step_s,
        bandwidth=_bandwidth(device_list),
        parallelism=_parallelism(device_list),
        update_s_per_byte=_update_seconds_per_byte(device_list[0], optimizer),
        source=f"measured on {k} device(s) with a tiny pipeline",
    )
    _CALIBRATIONS[key] = result
    return result


def _tiny_step_seconds(devices: list[str], m: int, steps: int) -> float:
    """The median step of a pipeline of one Dense(4) per device at M=m: its tasks cost next to no compute."""
    layers = [keras.layers.Dense(4) for _ in devices]
    model = PipelineModel(
        layers,
        balance=[1] * len(devices),
        devices=devices,
        num_micro_batches=m,
        remat="never",
        name=f"tfpipe_probe_{m}",
    )
    model.compile(optimizer="sgd", loss="mse")
    # TensorFlow's executor runs a kernel inline until its cost estimate settles, about 90 runs: warm up past it
    warm = 100
    x = np.ones((8 * m * (steps + warm), 4), "float32")
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.began = timeit.default_timer()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch >= warm:
                times.append(timeit.default_timer() - self.began)

    model.fit(x, x, batch_size=8 * m, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    return float(np.median(times))


def _median(fn: Any, repeats: int = 7) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        began = timeit.default_timer()
        fn()
        tf.test.experimental.sync_devices()
        times.append(timeit.default_timer() - began)
    return float(np.median(times))


def _bandwidth(devices: list[str]) -> float:
    """Bytes per second from the first device to the second (a copy of 16 MiB); inf with one device."""
    if len(devices) < 2 or devices[0] == devices[1]:
        return float("inf")
    with tf.device(devices[0]):
        x = tf.random.uniform([4, 2**20])

    @tf.function
    def move(t: tf.Tensor) -> tf.Tensor:
        with tf.device(devices[1]):
            return tf.reduce_sum(t[:1, :1] * 0 + t)  # reads every byte on the second device

    empty = _median(lambda: move(x[:1, :1]))
    seconds = max(_median(lambda: move(x)) - empty, 1e-9)
    return float(x.shape.num_elements() * 4 / seconds)


def _parallelism(devices: list[str]) -> float:
    """How many devices' worth of matrix products run at once on ``devices`` (1 to their number)."""
    unique = list(dict.fromkeys(devices))
    if len(unique) < 2:
        return 1.0
    weights = {}
    for d in unique:
        with tf.device(d):
            weights[d] = tf.random.uniform([384, 384]) / 384.0

    def chain(d: str) -> tf.Tensor:
        with tf.device(d):
            a = weights[d]
            for _ in range(16):
                a = tf.tanh(tf.matmul(a, weights[d]))
            return tf.reduce_sum(a)

    alone = _median(tf.function(lambda: chain(unique[0])))
    together = _median(tf.function(lambda: [chain(d) for d in unique]))
    return float(min(max(len(unique) * alone / max(together, 1e-9), 1.0), len(unique)))


def _update_seconds_per_byte(device: str, optimizer: Any) -> float:
    """The optimizer's update time per byte of weights: one update of 16 MiB less one of 64 KiB, on ``device``."""

    def seconds(rows: int) -> float:
        if isinstance(optimizer, str):
            opt = keras.optimizers.get(optimizer)
        else:
            opt = optimizer.__class__.from_config(optimizer.get_config())
        with tf.device(device):
            variable = keras.Variable(np.zeros((rows, 1024), "float32"))
            gradient = tf.ones((rows, 1024))
            opt.build([variable])
            return _median(tf.function(lambda: opt.apply([gradient], [variable])))

    return max(seconds(4096) - seconds(16), 0.0) / ((4096 - 16) * 1024 * 4)
