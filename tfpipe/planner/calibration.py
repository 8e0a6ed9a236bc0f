"""What a step costs on a set of devices beyond its layers, and what the whole layer sequence costs as one cell.

Both are measured with tfpipe's own step, on probes: ``calibrate`` runs a pipeline of one
tiny layer per device (the cost of a task and of a step), copies a tensor between the first two
devices (bandwidth) and times one optimizer update. ``split_step`` trains copies of the user's
layers cut over devices (as one cell at each micro-batch size: a layer timed alone misses what a step's graph does with
many micro-batches, tasks overlapping, kernels settled) and ``replicated_step`` as one replica on each device: what
``tfpipe.planner.probe_fits`` fits the planner's predictions to, timed together in rounds (``in_rounds``);
``configured_step`` trains them as one configuration the planner shortlisted, to time it. Each probe is built with the
planned model's ``repeated_layers``: a called attention block holds more than an inlined one (up to 1.6x a worker's
peak, docs/guide/limitations.md), so a probe built otherwise would mislead the budget.
"""

from __future__ import annotations

import dataclasses
import gc
import timeit
from collections.abc import Sequence
from typing import Any, cast

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat, messages
from tfpipe import cluster as cluster_lib
from tfpipe import schedule as schedule_lib
from tfpipe.distributed.sendrecv import any_remote
from tfpipe.model import PipelineModel
from tfpipe.planning import units as units_lib
from tfpipe.planning.predict import Calibration, Config
from tfpipe.planning.profile import median_difference, memory_name
from tfpipe.step.unrolled import noinline_tasks

_CALIBRATIONS: dict[tuple[Any, ...], Calibration] = {}  # one per set of devices and optimizer, per process


WARM_STEPS = 100  # TensorFlow's executor runs a kernel inline only once its cost estimate settles, ~90 runs
# A whole step of the model's own layers, after tracing, ran as fast in its first 10 steps as in its 140th (2026-11-29:
# the Transformer at 240 ms and MLPs at 2.5-60 ms a step, on workers and on logical CPUs, medians of 10 within noise
# with no trend): its probes warm up this many steps, where warming up to WARM_STEPS took a third of a probe's time,
# and for at most PROBE_WARM_SECONDS after tracing: the Transformer's cut probe on two workers (200 ms a step) timed
# right after tracing gave medians of 189-206 ms against 193-200 warmed 10 steps (three each, 2026-11-30), 2.3 s sooner
PROBE_WARM_STEPS = 10
PROBE_WARM_SECONDS = 0.5
# Probes compared with one another are timed in this many rounds, in turn: a slow spell of a shared machine then slows
# one round of each, not every step of one (docs/guide/planning.md#where-the-predictions-come-from)
ROUNDS = 3
# The calibration's step that calls its cells without inlining them (2K x 32 tasks on two workers) gave the same task
# cost warmed up 20 steps as 100 (2026-11-30, six calibrations each: 0.111-0.129 ms against 0.115-0.133), 1 s sooner
NOINLINE_WARM_STEPS = 20
# The device's fixed costs per byte (a transfer, an update, a copy) are the difference of a large and a tiny run,
# timed in this many pairs
PAIRS = 9
PROBE_SIZE = 16 * 2**20  # bytes of each tensor the calibration moves, joins and updates (without a budget)


def calibrate(
    devices: Sequence[str],
    optimizer: Any = "adam",
    steps: int = 30,
    budget: float | None = None,
    most_tasks: int | None = None,
) -> Calibration:
    """Measure what a step costs on ``devices`` beyond its layers (cached per devices and optimizer in this process).

    ``budget``: bytes per device its probes keep to (the optimizer's update is timed on fewer weights under it).
    ``most_tasks``: the most tasks a step the caller predicts has; where that is under the count from which a step
    stops inlining its cells, such a step is not measured (a third of the calibration's time on two workers), and
    ``noinline_task_s`` is None. None: measured.
    """
    device_list = list(devices)
    size = probe_size(budget)
    noinline = most_tasks is None or most_tasks >= noinline_tasks(device_list)
    key = (*device_list, optimizer if isinstance(optimizer, str) else repr(optimizer.get_config()), size, noinline)
    if key in _CALIBRATIONS:
        return _CALIBRATIONS[key]
    with _compat.custom_gradients_forgotten():  # its probes, once let go, hold no memory
        result = _calibrate(device_list, optimizer, steps, size, noinline)
    # now, not at some later collection: the update's weights and slots (half the budget on the first device, in
    # reference cycles of its functions) would otherwise sit under what the layers are measured with next
    gc.collect()
    _CALIBRATIONS[key] = result
    return result


def probe_size(budget: float | None) -> int:
    """The bytes of each tensor the calibration moves, joins and updates: 16 MiB, or under ``budget`` an eighth of
    it (a power of two, at least 1 MiB), so that the update's weights, gradient and two slots take half of it."""
    if budget is None:
        return PROBE_SIZE
    return int(min(PROBE_SIZE, max(2**20, 2 ** np.floor(np.log2(max(budget / 8, 1.0))))))


def _calibrate(device_list: list[str], optimizer: Any, steps: int, size: int, noinline: bool) -> Calibration:
    k = len(device_list)
    x = np.ones((64, 4), "float32")
    # The most micro-batches whose step still inlines its cells, and the fewest whose step does not
    threshold = noinline_tasks(device_list)
    noinline_m: int | None
    inline_m, noinline_m = min(8, (threshold - 1) // (2 * k)), -(-threshold // (2 * k))
    if inline_m < 2:  # 32 devices or more: one micro-batch already calls its cells
        inline_m, noinline_m = 8, None
    if not noinline:
        noinline_m = None
    ms = sorted({1, inline_m} | ({noinline_m} if noinline_m else set()))
    kept: dict[Any, list] = {m: [] for m in ms}  # each probe its own tiny layers, so that all stay alive to re-time
    probes = {
        m: _probe(
            [keras.layers.Dense(4) for _ in device_list],
            [1] * k,
            device_list,
            m,
            x,
            x,
            "sgd",
            steps,
            kept=kept[m],
            warm_steps=NOINLINE_WARM_STEPS if m == noinline_m else WARM_STEPS,
            warm_seconds=None,
        )
        for m in ms
    }
    timed = {m: probe.seconds for m, probe in in_rounds(probes, kept, steps).items()}
    units = {m: max(end for _, _, end in schedule_lib.simulate(k, m, [1.0] * k, [1.0] * k)) for m in timed}
    task_s = max((timed[inline_m] - timed[1]) / (units[inline_m] - units[1]), 0.0)
    step_s = max(timed[1] - task_s * units[1], 0.0)
    noinline_s = max((timed[noinline_m] - step_s) / units[noinline_m], 0.0) if noinline_m else None
    result = Calibration(
        task_s=task_s,
        step_s=step_s,
        bandwidth=_bandwidth(device_list, size),
        # each device its own compute until measured otherwise: tfpipe.plan measures it on the model (planner)
        parallelism=float(len(set(device_list))),
        update_s_per_byte=_update_seconds_per_byte(device_list[0], optimizer, size // 4096),
        source=f"measured on {k} device(s) with a tiny pipeline",
        noinline_task_s=noinline_s,
        noinline_tasks=threshold,
        across_processes=any_remote(device_list),
        copy_s_per_byte=_copy_seconds_per_byte(device_list[0], size // 4096),
    )
    return result


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe pipeline's median step and its peak bytes (None where the device's allocator counts none)."""

    seconds: float
    peak_bytes: float | None  # the step's peak above what the process held before the probe's model was made
    device_peaks: list[float] | None = None  # per device, where each has an allocator of its own (_own_allocators)


def split_step(
    layers: Any,  # the planner's units (planning.units)
    sample: Any,
    b: int,
    m: int,
    balance: list[int],
    devices: list[str],
    optimizer: Any,
    steps: int = 10,
    warm: bool = True,
    remat: str = "never",
    kept: list | None = None,
    schedule: str = "gpipe",
    repeated_layers: str = "inline",
) -> Probe:
    """Copies of ``layers`` cut by ``balance`` over ``devices`` trained at M=m micro-batches of b rows in ``schedule``'s
    order (``kept``, ``repeated_layers``: as ``_probe``'s)."""
    copies = units_lib.fresh(layers, "to time it", "pass calibration=... or plan by hand")
    x = tf.nest.map_structure(lambda t, n=b * m: _tiled(t, n), sample)
    y = _targets(copies, b * m)
    optimizer = _fresh(optimizer)
    return _probe(
        copies, balance, devices, m, x, y, optimizer, steps, _mean, warm, remat, schedule, per_device=True, kept=kept,
        repeated_layers=repeated_layers,
    )  # fmt: skip


def configured_step(
    layers: Any,  # the planner's units (planning.units)
    sample: Any,
    batch_size: int,
    config: Config,
    devices: Sequence[str],
    optimizer: Any,
    steps: int = 10,
    repeated_layers: str = "inline",
) -> Probe:
    """Copies of ``layers`` trained as the planner's ``config`` (cut, replicas, M, remat, schedule) on ``devices``
    (``repeated_layers``: as ``_probe``'s)."""
    copies = units_lib.fresh(layers, "to time it", "pass verify=0 to choose by prediction alone")
    k, r = config.num_devices, config.num_replicas
    rows = [list(devices[i * k : (i + 1) * k]) for i in range(r)]
    x = tf.nest.map_structure(lambda t: _tiled(t, batch_size), sample)
    y = _targets(copies, batch_size)
    on = rows if r > 1 else rows[0]
    m, remat = config.num_micro_batches, config.remat
    probe_args = (copies, list(config.balance), on, m, x, y, _fresh(optimizer), steps, _mean, True, remat)
    with _compat.custom_gradients_forgotten():  # let go once timed: its memory with it
        return _probe(*probe_args, config.schedule, per_device=True, repeated_layers=repeated_layers)


def replicated_step(
    layers: Any,  # the planner's units (planning.units)
    sample: Any,
    b: int,
    devices: list[str],
    optimizer: Any,
    steps: int = 10,
    kept: list | None = None,
    repeated_layers: str = "inline",
) -> Probe:
    """Copies of ``layers`` as one cell replicated on every one of ``devices``, each replica b rows at M=1 (``kept``,
    ``repeated_layers``: as ``_probe``'s)."""
    copies = units_lib.fresh(layers, "to time it", "pass calibration=... or plan by hand")
    rows = b * len(devices)
    x = tf.nest.map_structure(lambda t: _tiled(t, rows), sample)
    y = _targets(copies, rows)
    replicas = [[d] for d in devices]
    n = len(units_lib.of(layers))
    optimizer = _fresh(optimizer)
    return _probe(
        copies, [n], replicas, 1, x, y, optimizer, steps, _mean, per_device=True, kept=kept,
        repeated_layers=repeated_layers,
    )  # fmt: skip


def largest_peak(probe: Probe, devices: Sequence[str], count: int) -> float | None:
    """The largest of a probe's device peaks: each device's own, or where the ``count`` devices it ran on share one
    allocator (logical CPUs), its total per device; None where neither can be read."""
    if probe.device_peaks:
        return max(probe.device_peaks)
    if probe.peak_bytes is not None and peaks_readable(devices):
        return probe.peak_bytes / count
    return None


def _fresh(optimizer: Any) -> keras.optimizers.Optimizer:
    """A new optimizer like ``optimizer`` (a name or an instance), its variables its own."""
    if isinstance(optimizer, str):
        return keras.optimizers.get(optimizer)
    return optimizer.__class__.from_config(optimizer.get_config())


def _targets(model: Any, rows: int) -> Any:
    """Targets the probes' loss ignores: one per output of a Functional model, else one."""
    outputs = model.output if isinstance(model, keras.Model) else None
    return tf.nest.map_structure(lambda _: np.zeros((rows, 1), "float32"), outputs if outputs is not None else 0)


def _mean(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.mean(keras.ops.cast(y_pred, "float32"))


def _tiled(t: Any, rows: int) -> np.ndarray:
    array = np.asarray(t)
    return np.concatenate([array] * -(-rows // array.shape[0]))[:rows]


def _probe(
    layers: list[Any],
    balance: list[int],
    devices: list[str] | list[list[str]],
    m: int,
    x: Any,
    y: Any,
    optimizer: Any,
    steps: int,
    loss: Any = "mse",
    warm: bool = True,
    remat: str = "never",
    schedule: str = "gpipe",
    per_device: bool = False,
    kept: list | None = None,
    warm_steps: int = PROBE_WARM_STEPS,
    warm_seconds: float | None = PROBE_WARM_SECONDS,
    repeated_layers: str = "inline",
) -> Probe:
    """A probe pipeline trained on one batch (x, y): its median step and its peak, after ``warm_up`` (``warm``).

    ``devices``: one pipeline's, or a list of replicas' (the peak is the first replica's first device's).
    ``per_device``: also each device's peak, where each has an allocator of its own. ``kept``: a list that gets the
    model, its data and its step times, to time it again (``in_rounds``). ``repeated_layers``: as the planned model's.
    """
    # a list of several inputs as a tuple: tf.data takes a list for one tensor
    x = tuple(x) if isinstance(x, list) else x
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    first = devices[0]
    memory = memory_name(first[0] if isinstance(first, list) else first)
    gc.collect()  # an earlier probe's model freed during this one's steps would hide bytes of this one's peak
    base = tf.config.experimental.get_memory_info(memory)["current"] if memory else 0
    # replicas' rows, or one pipeline's devices (a type checker cannot tell that from the first)
    flat = [d for row in devices for d in row] if isinstance(first, list) else cast("list[str]", list(devices))
    own = _own_allocators(flat) if per_device else None
    bases = [info["current"] for info in own.read()] if own else []
    model = PipelineModel(
        layers,
        balance=balance,
        devices=devices,
        num_micro_batches=m,
        remat=remat,
        schedule=schedule,
        repeated_layers=repeated_layers,
        name=f"tfpipe_probe_{m}",
    )
    model.compile(optimizer=optimizer, loss=loss)
    with messages.quiet():  # the probes' "building the step" lines are not the user's
        warm_up(model, data, warm_seconds if warm else 0.0, warm_steps)
        if memory:
            tf.config.experimental.reset_memory_stats(memory)
        if own:
            own.reset()
        times = step_times(model, data, steps)
    if kept is not None:
        kept.extend([model, data, times])
    seconds = float(np.median(times))
    peak = float(tf.config.experimental.get_memory_info(memory)["peak"] - base) if memory else None
    device_peaks = [float(info["peak"] - b) for info, b in zip(own.read(), bases)] if own else None
    return Probe(seconds, peak, device_peaks)


def in_rounds(probes: dict[Any, Probe], kept: dict[Any, list], steps: int) -> dict[Any, Probe]:
    """``probes`` timed ``ROUNDS - 1`` more times, in turn (their ``kept`` models), each the median of all its steps."""
    with messages.quiet():
        for _ in range(ROUNDS - 1):
            for model, data, times in kept.values():
                times.extend(step_times(model, data, steps))
    return {key: dataclasses.replace(probe, seconds=float(np.median(kept[key][2]))) for key, probe in probes.items()}


class _OwnAllocators:
    """The allocators of devices that each have one of their own: a GPU of this process, a running LocalCluster's
    worker (its counts over a pipe, one round trip per cluster for all its workers)."""

    def __init__(self, sources: list[tuple[Any, Any]]):
        self.sources = sources  # per device: (None, a GPU's memory name) or (its LocalCluster, the worker's index)

    def read(self) -> list[dict[str, int]]:
        """Each device's counts, as ``get_memory_info`` gives them."""
        clusters = {id(c): c.memory_info() for c, _ in self.sources if c is not None}
        return [tf.config.experimental.get_memory_info(i) if c is None else clusters[id(c)][i] for c, i in self.sources]

    def reset(self) -> None:
        """Start every device's peak count again, each cluster's workers at once."""
        for cluster in {id(c): c for c, _ in self.sources if c is not None}.values():
            cluster.reset_memory_stats()
        for cluster, name in self.sources:
            if cluster is None:
                tf.config.experimental.reset_memory_stats(name)


class PeakWatch:
    """The most bytes held on each device beyond what it held when the watch began (its peak count started again
    there), read at each ``read``.

    Devices with allocators of their own (GPUs, a running LocalCluster's workers) are read each; logical CPUs of this
    process, counted by one allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``), as one total. A read takes the allocator's
    peak since its count was last started again: probes start it before their timed steps, which hold what their
    warm-up did. ``peaks`` is None where nothing can be read (``connect()`` workers, CPUs without the BFC allocator).
    """

    def __init__(self, devices: Sequence[str]):
        unique = list(dict.fromkeys(devices))
        self._own = _own_allocators(unique)
        self._shared: str | None = None
        self.peaks: dict[str, float] | None = None
        if self._own is not None:
            self._own.reset()  # a peak from before planning is not planning's
            self._names = unique
            self._bases = [float(info["current"]) for info in self._own.read()]
        elif peaks_readable(unique):
            self._shared = memory_name(unique[0])
            tf.config.experimental.reset_memory_stats(self._shared)
            self._names = [f"{len(unique)} logical devices' one allocator" if len(unique) > 1 else unique[0]]
            self._bases = [float(tf.config.experimental.get_memory_info(self._shared)["current"])]
        if self._own is not None or self._shared is not None:
            self.peaks = dict.fromkeys(self._names, 0.0)

    def read(self) -> None:
        """Take each device's peak since its count last started into ``peaks``."""
        if self.peaks is None:
            return
        if self._own is not None:
            infos = self._own.read()
        else:
            infos = [tf.config.experimental.get_memory_info(self._shared)]
        for name, base, info in zip(self._names, self._bases, infos):
            self.peaks[name] = max(self.peaks[name], float(info["peak"]) - base)


def peaks_readable(devices: Sequence[str]) -> bool:
    """Whether a probe on ``devices`` reads their peaks: each its own allocator's, or (logical CPUs of this process,
    counted with ``TF_CPU_ALLOCATOR_USE_BFC=true``) their one allocator's total."""
    if _own_allocators(devices) is not None:
        return True
    names = [memory_name(device) for device in devices]
    return all(name is not None and name.startswith("CPU") for name in names)


def _own_allocators(devices: Sequence[str]) -> _OwnAllocators | None:
    """The devices' own allocators; None where a device has none of its own (logical CPUs of one process share one),
    its allocator cannot be read (``connect``), or a device is named twice."""
    if len(set(devices)) != len(devices):
        return None
    sources: list[tuple[cluster_lib.LocalCluster | None, str | int]] = []
    for device in devices:
        name = memory_name(device)
        if name is not None and name.startswith("GPU"):
            sources.append((None, name))
        elif (owner := cluster_lib.running_worker(device)) is not None:
            sources.append(owner)
        else:
            return None
    return _OwnAllocators(sources)


def warm_up(model: keras.Model, data: tf.data.Dataset, seconds: float | None = None, steps: int = WARM_STEPS) -> None:
    """Trace ``model``'s step on ``data`` (a repeated dataset), then train up to ``steps`` steps in all or for
    ``seconds`` after tracing.

    Default ``seconds``: as long as tracing took, and one more (a large model settles sooner than it traces).
    """
    began = timeit.default_timer()
    model.fit(data, steps_per_epoch=2, verbose=0)  # traces
    traced = timeit.default_timer()
    limit = traced - began + 1.0 if seconds is None else seconds
    warm, step_s = 2, 0.0
    while warm < steps and (left := limit - (timeit.default_timer() - traced)) > 0:
        # a step first, to learn its time; then as many as the time left holds, ten at a time at most
        more = min(10, steps - warm, 1 if warm == 2 else max(1, int(left / max(step_s, 1e-6))))
        before = timeit.default_timer()
        model.fit(data, steps_per_epoch=more, verbose=0)
        step_s = (timeit.default_timer() - before) / more
        warm += more


def step_times(model: keras.Model, data: tf.data.Dataset, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps of ``model`` on ``data``, timed from Keras' batch callbacks."""
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.began = timeit.default_timer()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            times.append(timeit.default_timer() - self.began)

    model.fit(data, steps_per_epoch=steps, verbose=0, callbacks=[Timer()])
    return times


def _bandwidth(devices: list[str], size: int = PROBE_SIZE) -> float:
    """Bytes per second from the first device to the second (a copy of ``size`` bytes); inf with one, or
    unmeasurable."""
    if len(devices) < 2 or devices[0] == devices[1]:
        return float("inf")
    with tf.device(devices[0]):
        x = tf.random.uniform([4, size // 16])

    @tf.function
    def move(t: tf.Tensor) -> tf.Tensor:
        with tf.device(devices[1]):
            return tf.reduce_sum(t[:1, :1] * 0 + t)  # reads every byte on the second device

    # sliced once, before timing: a slice made in each call is one more op (on a worker, one more round trip)
    # timed in the empty call only; between two workers the difference came out negative (15 PiB/s)
    one = x[:1, :1]
    seconds = median_difference(lambda: move(x), lambda: move(one), PAIRS)
    # within a call's noise (two logical GPUs of one card copy 16 MiB in microseconds): too fast to count
    return float(x.shape.num_elements() * 4 / seconds) if seconds > 1e-6 else float("inf")


def _update_seconds_per_byte(device: str, optimizer: Any, rows: int = 4096) -> float:
    """The optimizer's update time per byte of weights: one update of ``rows`` x 1024 floats less one of 16 x 1024, on
    ``device``, in turn (``median_difference``)."""

    def update(rows: int) -> Any:
        opt = _fresh(optimizer)
        with tf.device(device):  # made there: a value sent from here would pass through a worker's own heap
            variable = keras.Variable(tf.zeros((rows, 1024)))
            gradient = tf.ones((rows, 1024))
            opt.build([variable])
            return tf.function(lambda: opt.apply([gradient], [variable]))

    return max(median_difference(update(rows), update(16), PAIRS), 0.0) / ((rows - 16) * 1024 * 4)


def _copy_seconds_per_byte(device: str, rows: int = 4096) -> float:
    """Concatenating tensors on ``device``, per byte: four pieces of ``rows`` x 256 floats (4 MiB) joined, less four
    of 1 KiB, in turn (``median_difference``)."""
    join = tf.function(lambda *p: tf.reduce_sum(tf.concat(p, 0)[:1]))  # reads one row: the copy is the cost
    with tf.device(device):
        pieces, small = [tf.ones((rows, 256)) for _ in range(4)], [tf.ones((1, 256)) for _ in range(4)]
        seconds = median_difference(lambda: join(*pieces), lambda: join(*small), PAIRS)
    return max(seconds, 0.0) / (4 * (rows - 1) * 256 * 4)
