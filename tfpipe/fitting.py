"""What the planner fits on the model's own probe steps: its layers' times scaled to whole steps, the parallelism and
the cells' speed its devices give it, and what recomputing a micro-batch costs.

Each probe trains copies of the user's layers with tfpipe's own step (``tfpipe.calibration``); each fitted value is
the one at which ``planning.predict`` gives the probe's measured time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from tfpipe import calibration as calibration_lib
from tfpipe.planning import balance as balance_lib
from tfpipe.planning import predict, profile
from tfpipe.planning.predict import Calibration, Config

PROBE_MICRO_BATCHES = 8  # the whole-sequence probes' M: enough for their tasks to overlap as a pipeline's do
SCALE_PROBES = 8  # the most micro-batch sizes whose one-cell steps scale the layers' times


def scale_to_whole_steps(
    measured: profile.Profile,
    layers: list[keras.layers.Layer],
    data: Any,
    batch_size: int,
    device: str,
    optimizer: Any,
    calibration: Calibration,
    slots: int,
) -> None:
    """Scale the layers' times and held bytes at each micro-batch size to real steps of all of them as one cell.

    Steps are measured at every size the search uses (up to ``SCALE_PROBES`` of them, spread in log(size)); between
    them the ratio of step to layers is interpolated in log(size). Where the allocator counts bytes, what a micro-batch
    held in the steps at the sizes the layers were measured at gives ``Profile.held_ratios`` (``slots``: the
    optimizer's per weight).
    """
    every = sorted(measured.by_batch)
    probed = sorted({every[0], every[len(every) // 2], every[-1]})  # the sizes profile.measure ran
    # a step's time per sample is not linear in log(size) between far sizes: on the MLP of docs/benchmarks.md, steps
    # at 32 and 256 samples put 64's 17% above its own step (M=4 rows predicted +17-22%)
    timed = spread(every, SCALE_PROBES)
    sizes = {b: min(max(batch_size // b, 1), PROBE_MICRO_BATCHES) for b in timed}
    steps = calibration_lib.whole_steps(layers, data, list(sizes.items()), device, optimizer)  # M <= 8: inlined
    update_s = sum(measured.trainable_bytes) * calibration.update_s_per_byte
    ratios = []
    for b, m in sizes.items():
        costs = measured.costs(b)
        alone = sum(costs.forward_s) + sum(costs.backward_s)
        per_micro_batch = (steps[b].seconds - calibration.step_s - update_s) / m - 2 * calibration.task_s
        ratios.append(per_micro_batch / alone if per_micro_batch > 0 and alone > 0 else 1.0)
    for b in every:
        ratio = float(np.interp(np.log2(b), np.log2(timed), ratios))
        costs = measured.costs(b)
        profile.rescale(measured, b, ratio * (sum(costs.forward_s) + sum(costs.backward_s)))
    measured.time_source = (
        f"each layer run alone, scaled to add up to a step of all the layers as one cell on {device} (measured at "
        f"{timed} samples with M <= {PROBE_MICRO_BATCHES}, less its fixed, task and update costs)"
    )
    if measured.memory_device is None:
        return
    held_sizes = [(b, sizes[b]) for b in probed]
    if measured.memory_device != device:  # bytes read on this process's stand-in: so are the steps' peaks
        steps = calibration_lib.whole_steps(layers, data, held_sizes, measured.memory_device, optimizer, 2, warm=False)
    # A step that does not inline its cells' calls (from Calibration.noinline_tasks tasks on) holds what each layer
    # measured alone held, a call TensorFlow did not inline either: the ratio stays 1 there (measured: the
    # Transformer of docs/benchmarks.md at K=2, M=16 held 481 MiB, its layers' bytes predict 494)
    inlined = held_ratios(measured, steps, held_sizes, slots)
    measured.held_ratios = {True: inlined}
    measured.memory_source += (
        f"; where a step inlines its cells, a micro-batch's activations scaled to what steps of all the layers as "
        f"one cell held (x{'/'.join(f'{r:.2f}' for r in inlined[1])} at {inlined[0]} samples)"
    )


def spread(sizes: Sequence[int], count: int) -> list[int]:
    """Up to ``count`` of the sorted ``sizes``, the first and the last among them, the rest spread in log(size)."""
    if len(sizes) <= count:
        return list(sizes)
    logs = np.log2(sizes)
    wanted = np.linspace(logs[0], logs[-1], count)
    return sorted({sizes[int(np.argmin(np.abs(logs - w)))] for w in wanted})


def held_ratios(
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


def model_parallelism(
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
    if not splits(layers, devices):
        return calibration
    b, m, cut = probe_cut(measured, len(layers), batch_size, len(devices))
    took = calibration_lib.split_step(layers, data, b, m, cut, devices, optimizer).seconds
    config = Config(tuple(cut), 1, m, "never", "gpipe")
    calibration = dataclasses.replace(
        calibration,
        parallelism=parallelism(measured, calibration, batch_size, config, took),
        source=calibration.source
        + f"; parallelism measured with this model's layers cut over the {len(devices)} devices at M={m}",
    )
    # Faster than its tasks can run even with every device busy: the cells' layers run faster cut than whole
    speed = fit(
        lambda x: predict.step_seconds(measured, at_speed(calibration, x), batch_size, config).step_s, took, 3.0, 1.0
    )
    return at_speed(calibration, speed)


def splits(layers: Sequence[keras.layers.Layer], devices: Sequence[str]) -> bool:
    """Whether the probes cut the model over ``devices``: two distinct devices or more, a layer for each."""
    return len(set(devices)) > 1 and len(layers) >= len(devices)


def at_speed(calibration: Calibration, split_speed: float) -> Calibration:
    """``calibration`` with the cells' layers ``split_speed`` times as fast cut as whole."""
    return dataclasses.replace(calibration, split_speed=split_speed)


def fit(predicted: Any, took: float, low: float, high: float) -> float:
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


def probe_cut(measured: profile.Profile, num_layers: int, batch_size: int, k: int) -> tuple[int, int, list[int]]:
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


def recompute_ratios(
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
    ks = {1} | ({2, len(devices)} if splits(layers, devices) else set())
    ratios = {}
    for k in sorted(ks):
        b, m, cut = probe_cut(measured, len(layers), batch_size, k)
        took = calibration_lib.split_step(layers, data, b, m, cut, devices[:k], optimizer, remat="always").seconds
        config = Config(tuple(cut), 1, m, "always", "gpipe")

        def predicted(ratio: float, k: int = k, config: Config = config) -> float:
            profiled = dataclasses.replace(measured, recompute_ratios={k: ratio})
            return predict.step_seconds(profiled, calibration, batch_size, config).step_s

        ratios[k] = fit(predicted, took, 0.1, 1.5)
    return ratios


def replica_parallelism(
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
        replica_parallelism=parallelism(measured, calibration, batch_size, config, took),
        source=calibration.source + f"; replicas' parallelism measured with {k} replicas of the model at M=1",
    )


def parallelism(
    measured: profile.Profile, calibration: Calibration, batch_size: int, config: Config, took: float
) -> float:
    """The devices' worth of compute that makes ``config``'s predicted step take ``took`` seconds (1 to its devices).

    Fitted on the whole step, the optimizer's update included (the devices share it too): a parallelism taken from the
    pipeline's part alone, with the update as free devices run it, left the step predicted slower than measured, and
    the cells' split speed, fitted next, made up for it where it then also sped up steps without overlap (K=2, M=1).
    """
    devices = float(config.num_partitions * config.num_replicas)
    field = "replica_parallelism" if config.num_replicas > 1 and config.num_partitions == 1 else "parallelism"

    def predicted(value: float) -> float:
        trial = dataclasses.replace(calibration, **{field: value})
        return predict.step_seconds(measured, trial, batch_size, config).step_s

    return fit(predicted, took, 1.0, devices)
