"""``tfpipe.plan``: measure the layers and the devices, predict every configuration, return the fastest that fits.

What the plan rests on (``Plan.summary`` prints it): each layer's forward and backward
time and held bytes, measured on copies on the first device (``planning.profile``), the
times scaled to real one-cell steps of all the layers; the cost of a task, of a step, of
moving a tensor and of the optimizer's update, measured once per set of devices, and how
many devices' worth of compute this model gets from them (``calibration``); and the
schedule simulated as data (``planning.predict``, ``planning.search``). The few configurations
predicted near the fastest are then timed on the devices, and the fastest measured is chosen
(``verify``; predictions are within 10-20%, so near-equal ones are for a measurement to order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import auto_plan
from tfpipe import calibration as calibration_lib
from tfpipe._args import positive_int
from tfpipe.backward.remat import REMAT_MODES, check_mode
from tfpipe.distributed import devices as devices_lib
from tfpipe.partition import functional
from tfpipe.partition.sequence import layer_list
from tfpipe.planning import balance as balance_lib
from tfpipe.planning import joined, plans, predict, profile, search
from tfpipe.planning.plans import Plan
from tfpipe.planning.predict import SLOTS, Calibration, Config
from tfpipe.step import schedule as schedule_lib

__all__ = ["Plan", "plan"]
PROBE_MICRO_BATCHES = 8  # the whole-sequence probes' M: enough for their tasks to overlap as a pipeline's do


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
    verify: int = 3,
) -> Plan:
    """The configuration (K, balance, R, M, remat, schedule) fastest on ``devices`` whose peak fits ``memory_budget``.

    ``layers``: a list of Keras layers or a ``keras.Sequential``. ``devices``: the devices to
    use (default: this machine's GPUs, else its CPU devices). ``memory_budget``: bytes per
    device (an int or a string such as "12GiB"); None: no limit. ``sample`` or
    ``input_shape`` give the input when the layers do not know it. ``optimizer``: its name
    or instance, for its slots' memory and its update's time. ``num_micro_batches``,
    ``schedules``, ``remats`` and ``replicas`` narrow the search. ``calibration``: reuse one
    (``plan.calibration``) instead of measuring. ``verify``: time this many configurations predicted
    near the fastest that fit (one per K, R and schedule) on the devices and choose the fastest measured; 0 chooses by
    prediction alone. A ValueError names the smallest budget that would fit when none does.
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
    if calibration is None:
        calibration = calibration_lib.calibrate(device_list, optimizer)
    elif not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a tfpipe Calibration (plan.calibration), got {calibration!r}.")
    # each layer alone at three sizes (the smallest, the middle, the largest), the rest interpolated
    probed = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    measured = profile.measure(layer_seq, data, probed, device_list[0], repeats=positive_int("repeats", repeats))
    profile.fill(measured, sizes)
    _scale_to_whole_steps(measured, layer_seq, data, batch_size, device_list[0], optimizer, calibration)
    calibration = _model_parallelism(measured, layer_seq, data, batch_size, device_list, optimizer, calibration)
    if set(space.remats) != {"never"}:  # what recomputing costs, where the search may recompute
        measured.recompute_ratios = _recompute_ratios(
            measured, layer_seq, data, batch_size, device_list, optimizer, calibration
        )
        fitted = ", ".join(f"x{r:.2f} at K={k}" for k, r in measured.recompute_ratios.items())
        measured.time_source += f"; recomputing a micro-batch {fitted} its forward (fitted to steps recomputing all)"
    if any(schedule_lib.batches_weights(s) for s in space.schedules):  # what one W over all micro-batches joins
        measured.joined_bytes = joined.bytes_per_sample(layer_seq, data, device_list[0])
        measured.time_source += "; one W over all micro-batches also copies the rows it joins (traced per layer)"
    if space.replicas:
        calibration = _replica_parallelism(measured, layer_seq, data, batch_size, device_list, optimizer, calibration)
    candidates = search.run(measured, calibration, batch_size, space, budget, slots)
    candidates = verified(candidates, layer_seq, data, batch_size, device_list, optimizer, verify, budget)
    return plans.from_candidates(candidates, device_list, batch_size, budget, measured, calibration, slots)


def verified(
    candidates: list[search.Candidate],
    layers: Sequence[keras.layers.Layer],
    sample: Any,
    batch_size: int,
    devices: Sequence[str],
    optimizer: Any,
    count: int,
    budget: float | None = None,
) -> list[search.Candidate]:
    """``candidates`` with the ``count`` worth timing trained on ``devices`` (copies of ``layers``), fastest first.

    Where the devices' peaks can be read (GPUs, a running LocalCluster's workers, logical CPUs counted by one
    allocator), one over ``budget`` goes last, and candidates predicted over it by at most ``search.MEMORY_SLACK``
    are timed too: one that runs within it may be chosen.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"verify={count!r}: give how many configurations to time, or 0 to choose by prediction alone.")
    readable = calibration_lib.peaks_readable(devices)

    def time_step(config: Config) -> tuple[float, float | None]:
        try:
            probe = calibration_lib.configured_step(layers, sample, batch_size, config, devices, optimizer)
        except tf.errors.ResourceExhaustedError:  # predicted to fit, but a device ran out of memory: last
            return float("inf"), None
        if probe.device_peaks:
            return probe.seconds, max(probe.device_peaks)
        if readable and probe.peak_bytes is not None:  # one allocator for all: the total, per device used
            return probe.seconds, probe.peak_bytes / (config.num_partitions * config.num_replicas)
        return probe.seconds, None

    slack = search.MEMORY_SLACK if readable else 0.0
    return search.by_measured(candidates, count, time_step, budget, slack)


def _scale_to_whole_steps(
    measured: profile.Profile,
    layers: list[keras.layers.Layer],
    data: Any,
    batch_size: int,
    device: str,
    optimizer: Any,
    calibration: Calibration,
) -> None:
    """Scale the layers' times and held bytes at each micro-batch size to real steps of all of them as one cell.

    Steps are measured at the smallest, the middle and the largest size; between them the ratio of step to layers
    is interpolated in log(size). Where the allocator counts bytes, what a micro-batch held in those steps gives
    ``Profile.held_ratios``.
    """
    every = sorted(measured.by_batch)
    probed = sorted({every[0], every[len(every) // 2], every[-1]})  # the sizes profile.measure ran
    sizes = [(b, min(max(batch_size // b, 1), PROBE_MICRO_BATCHES)) for b in probed]
    steps = calibration_lib.whole_steps(layers, data, sizes, device, optimizer)  # M <= 8: cells inlined
    update_s = sum(measured.trainable_bytes) * calibration.update_s_per_byte
    ratios = []
    for b, m in sizes:
        costs = measured.costs(b)
        alone = sum(costs.forward_s) + sum(costs.backward_s)
        per_micro_batch = (steps[b].seconds - calibration.step_s - update_s) / m - 2 * calibration.task_s
        ratios.append(per_micro_batch / alone if per_micro_batch > 0 and alone > 0 else 1.0)
    for b in every:
        ratio = float(np.interp(np.log2(b), np.log2(probed), ratios))
        costs = measured.costs(b)
        profile.rescale(measured, b, ratio * (sum(costs.forward_s) + sum(costs.backward_s)))
    measured.time_source = (
        f"each layer run alone, scaled to add up to a step of all the layers as one cell on {device} (measured at "
        f"{probed} samples with M <= {PROBE_MICRO_BATCHES}, less its fixed, task and update costs)"
    )
    if measured.memory_device is None:
        return
    if measured.memory_device != device:  # bytes read on this process's stand-in: so are the steps' peaks
        steps = calibration_lib.whole_steps(layers, data, sizes, measured.memory_device, optimizer, 2, warm=False)
    # A step that does not inline its cells' calls (from Calibration.noinline_tasks tasks on) holds what each layer
    # measured alone held, a call TensorFlow did not inline either: the ratio stays 1 there (measured: the
    # Transformer of docs/benchmarks.md at K=2, M=16 held 481 MiB, its layers' bytes predict 494)
    inlined = _held_ratios(measured, steps, sizes, optimizer_slots(optimizer))
    measured.held_ratios = {True: inlined}
    measured.memory_source += (
        f"; where a step inlines its cells, a micro-batch's activations scaled to what steps of all the layers as "
        f"one cell held (x{'/'.join(f'{r:.2f}' for r in inlined[1])} at {inlined[0]} samples)"
    )


def _held_ratios(
    measured: profile.Profile, probes: dict[int, calibration_lib.Probe], sizes: list[tuple[int, int]], slots: int
) -> tuple[list[int], list[float]]:
    """Per probed (b, M): a one-cell step's activations (its peak less the rest predicted) over the layers' bytes."""
    found: tuple[list[int], list[float]] = ([], [])
    for b, m in sizes:
        peak = probes[b].peak_bytes
        activations = m * sum(measured.costs(b).held_bytes)
        if peak is None or activations <= 0:
            continue
        rest = predict.cell_peak(measured, b, 0, len(measured.weight_bytes), True, m, m, slots, m, 0.0)
        found[0].append(b)
        found[1].append(min(max((peak - rest) / activations, 0.05), 4.0))
    return found


def _model_parallelism(
    measured: profile.Profile,
    layers: list[keras.layers.Layer],
    data: Any,
    batch_size: int,
    devices: list[str],
    optimizer: Any,
    calibration: Calibration,
) -> Calibration:
    """The calibration with the parallelism this model gets: its layers cut evenly over every device, at M=8.

    Devices that share compute (logical devices on one CPU) run some models side by side and not others (a
    product wide enough to use every core alone gains nothing from a second device), so it is measured on the
    model itself: the step's work against its measured time.
    """
    if not _splits(layers, devices):
        return calibration
    b, m, cut = _probe_cut(measured, len(layers), batch_size, len(devices))
    took = calibration_lib.split_step(layers, data, b, m, cut, devices, optimizer).seconds
    config = Config(tuple(cut), 1, m, "never", "gpipe")
    calibration = dataclasses.replace(
        calibration,
        parallelism=_parallelism(measured, calibration, batch_size, config, took),
        source=calibration.source
        + f"; parallelism measured with this model's layers cut over the {len(devices)} devices at M={m}",
    )
    # Faster than its tasks can run even with every device busy: the cells' layers run faster cut than whole
    speed = _fit(
        lambda x: predict.step_seconds(measured, _at(calibration, x), batch_size, config).step_s, took, 3.0, 1.0
    )
    return _at(calibration, speed)


def _splits(layers: Sequence[keras.layers.Layer], devices: Sequence[str]) -> bool:
    """Whether the probes cut the model over ``devices``: two distinct devices or more, a layer for each."""
    return len(set(devices)) > 1 and len(layers) >= len(devices)


def _at(calibration: Calibration, split_speed: float) -> Calibration:
    return dataclasses.replace(calibration, split_speed=split_speed)


def _fit(predicted: Any, took: float, low: float, high: float) -> float:
    """The value in [low, high] (either order) at which ``predicted``, monotone in it, gives ``took`` (bisection)."""
    off_low, off_high = predicted(low) - took, predicted(high) - took  # each prediction simulates a schedule: once
    if off_low * off_high > 0:  # out of reach: the nearer end
        return low if abs(off_low) < abs(off_high) else high
    for _ in range(20):
        middle = (low + high) / 2
        off_middle = predicted(middle) - took
        if off_middle * off_low > 0:
            low, off_low = middle, off_middle
        else:
            high = middle
    return (low + high) / 2


def _probe_cut(measured: profile.Profile, num_layers: int, batch_size: int, k: int) -> tuple[int, int, list[int]]:
    """The probes' micro-batch size, M (up to 8) and cut of the layers into ``k`` cells of even time."""
    m = min(PROBE_MICRO_BATCHES, batch_size)
    b = -(-batch_size // m)
    if b not in measured.by_batch:
        profile.fill(measured, [b])
    costs = measured.costs(b)
    cut = (
        balance_lib.partition([f + x for f, x in zip(costs.forward_s, costs.backward_s)], k) if k > 1 else [num_layers]
    )
    return b, m, cut


def _recompute_ratios(
    measured: profile.Profile,
    layers: list[keras.layers.Layer],
    data: Any,
    batch_size: int,
    devices: list[str],
    optimizer: Any,
    calibration: Calibration,
) -> dict[int, float]:
    """What recomputing a micro-batch costs against its forward task, at one cell, two, and one per device: the ratio
    that predicts a step recomputing every micro-batch (the probes' cut and M, as ``_model_parallelism``'s).

    A recomputation runs in the call of the backward that reads it; on devices that share a CPU it can also fill
    another device's wait (the fitted ratios: docs/benchmarks.md#planning).
    """
    # K=2 too on more devices: on four logical CPUs the Transformer's ratio was 0.73-1.08 at K=1 and 0.18-0.26 at
    # K=4, and K=2's, taken between them, put its steps recomputing every micro-batch 14% high
    ks = {1} | ({2, len(devices)} if _splits(layers, devices) else set())
    ratios = {}
    for k in sorted(ks):
        b, m, cut = _probe_cut(measured, len(layers), batch_size, k)
        took = calibration_lib.split_step(layers, data, b, m, cut, devices[:k], optimizer, remat="always").seconds
        config = Config(tuple(cut), 1, m, "always", "gpipe")

        def predicted(ratio: float, k: int = k, config: Config = config) -> float:
            profiled = dataclasses.replace(measured, recompute_ratios={k: ratio})
            return predict.step_seconds(profiled, calibration, batch_size, config).step_s

        ratios[k] = _fit(predicted, took, 0.1, 1.5)
    return ratios


def _replica_parallelism(
    measured: profile.Profile,
    layers: list[keras.layers.Layer],
    data: Any,
    batch_size: int,
    devices: list[str],
    optimizer: Any,
    calibration: Calibration,
) -> Calibration:
    """The calibration with the parallelism replicas get: one replica of all the layers on every device, at M=1.

    Whole steps side by side contend for a shared CPU's caches and memory more than a pipeline's micro-batch tasks
    (the planning benchmark's Transformer on two one-thread workers: 1.78 devices, its K=2 pipeline 2.00).
    """
    k = len(devices)
    if len(set(devices)) < 2 or batch_size % k:
        return calibration
    b = batch_size // k
    if b not in measured.by_batch:
        profile.fill(measured, [b])
    took = calibration_lib.replicated_step(layers, data, b, devices, optimizer).seconds
    config = Config((len(layers),), k, 1, "never", "gpipe")
    return dataclasses.replace(
        calibration,
        replica_parallelism=_parallelism(measured, calibration, batch_size, config, took),
        source=calibration.source + f"; replicas' parallelism measured with {k} replicas of the model at M=1",
    )


def _parallelism(
    measured: profile.Profile, calibration: Calibration, batch_size: int, config: Config, took: float
) -> float:
    """The devices' worth of compute that makes ``config``'s predicted step take ``took`` seconds (1 to its devices)."""
    devices = float(config.num_partitions * config.num_replicas)
    free = dataclasses.replace(calibration, parallelism=devices, replica_parallelism=devices)
    predicted = predict.step_seconds(measured, free, batch_size, config)
    pipeline_s = took - predicted.update_s - predicted.fixed_s
    if pipeline_s <= predicted.pipeline_s:
        return devices
    return min(max(predicted.work_s / pipeline_s, 1.0), devices)


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


auto_plan.PLANNER.append(plan)  # PipelineModel(plan="auto") plans with it at the first fit
