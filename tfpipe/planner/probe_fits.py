"""What the planner fits on the model's own probe steps: its layers' times scaled to whole steps, the parallelism and
the cells' speed its devices give it, what recomputing a micro-batch costs, and the replicas' parallelism.

Each probe trains copies of the user's layers with tfpipe's own step (``planner.calibration``); each fitted value is
the one at which ``planning.predict`` gives the probe's measured time. All the probes are timed in the same rounds, in
turn (``calibration.in_rounds``): a fast or slow spell of a shared machine then falls on one round of each, not on
every step of one, so that the values fitted from different probes agree with one another.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfpipe import _compat
from tfpipe import balance as balance_lib
from tfpipe.planner import calibration as calibration_lib
from tfpipe.planning import predict, profile, search
from tfpipe.planning.plans import gib
from tfpipe.planning.predict import Calibration, Config
from tfpipe.planning.progress import Progress

PROBE_MICRO_BATCHES = 8  # the whole-sequence probes' M: enough for their tasks to overlap as a pipeline's do
CUT_HELD_SHARE = 0.25  # the least share of a cut probe's predicted peak in activations that fits a held ratio
SCALE_PROBES = 8  # the most micro-batch sizes whose one-cell steps scale the layers' times
STEPS = 10  # steps a probe is timed for in each round (calibration.ROUNDS)
# Building a probe (tracing its step, warming it up, timing it once) against its layers' own tracing alone
# (``Profile.trace_s``, summed to S): BUILD_FIXED x S whatever its M (its variables, its optimizer's update, Keras'
# step), and BUILD_SCALE x (S x tasks) ** BUILD_POWER for the step's graph, M copies of its layers (more than in
# proportion: on AmoebaNet-D a micro-batch more cost 0.9 S at 1 block and M=4, 1.7 S at 4 blocks and M=8). Fitted on
# the first steps of 12 x Dense(512) (M=1-8), the 4-block Transformer (M=1, 8) and AmoebaNet-D of 1-4 blocks (M=1-8),
# at K=1 and 2 on logical CPUs (2026-12-01): 0.83x-1.36x of each. In unbounded plans on 2 logical CPUs, every probe
# and timed configuration built in 0.56x-1.32x of its prediction (the MLP, a 4-block keras_hub Llama, AmoebaNet-D of 2
# blocks; the Transformer's cut probe 1.10x). Later probes go by how far the ones built were from theirs
# (``Progress.probe_seconds``).
BUILD_FIXED = 3.0
BUILD_SCALE = 0.25
BUILD_POWER = 1.45


@dataclasses.dataclass(frozen=True)
class Shape:
    """One probe step: copies of the layers cut by ``cut`` over the first ``len(cut)`` devices at M=m micro-batches of
    b rows, run in ``schedule``'s order; or (``replicas`` > 1) all of them as one cell replicated on that many
    devices, each b rows at M=1."""

    b: int
    m: int
    cut: tuple[int, ...]
    remat: str = "never"
    replicas: int = 1
    schedule: str = "gpipe"  # "1f1b" where GPipe's M micro-batches at once would not fit the budget (``leaner``)


@dataclasses.dataclass
class Probes:
    """The probes ``fit_model`` times, each as it will run (``ProbeMemory.leaner``), by what it is fitted for."""

    pipeline: Shape | None  # the whole model cut over the devices: the parallelism and the cells' speed
    scale: dict[int, Shape]  # one-cell steps by micro-batch size: the layers' times scaled to whole steps
    held: list[int]  # the sizes whose steps also give the held bytes, nearest the probes' own micro-batch first
    never: dict[int, Shape]  # by K, without and with recomputing every micro-batch: what recomputing costs
    always: dict[int, Shape]
    replicated: Shape | None  # the model replicated over the devices at M=1: the replicas' parallelism

    def shapes(self) -> list[Shape]:
        """Every probe once, in the order they are worth their time where there is time for fewer: the parallelism,
        the sizes whose steps also give the held bytes, what recomputing costs, the replicas', the other sizes."""
        held = [self.scale[b] for b in self.held if b in self.scale]
        every = [self.pipeline, *held, *self.never.values(), *self.always.values(), self.replicated]
        return list(dict.fromkeys(s for s in [*every, *self.scale.values()] if s is not None))


def fit_model(
    measured: profile.Profile,
    layers: Any,  # the planner's units (planning.units)
    data: Any,
    batch_size: int,
    devices: list[str],
    optimizer: Any,
    calibration: Calibration,
    slots: int,
    recompute: bool = True,
    replicas: bool = True,
    progress: Progress | None = None,
    budget: float | None = None,
    repeated_layers: str = "inline",
) -> Calibration:
    """Time every probe the planner fits on (in the same rounds), scale ``measured`` to them, fit its recomputation
    ratios (``recompute``) and return ``calibration`` with the parallelism they measured (``replicas``: theirs too).
    ``progress`` shows the probes as they are built and the rounds as they are timed, and ends the building where its
    time runs out (``Progress.time_left``). ``budget``: bytes per device that no probe may go over
    (``ProbeMemory.groups``); what is not run for either is said in ``measured.not_run`` and fitted without it.
    ``repeated_layers``: each probe's ``PipelineModel(repeated_layers=)``, the planned model's."""
    memory = ProbeMemory(measured, calibration, slots, devices, budget)
    probes = plan_probes(memory, layers, batch_size, recompute, replicas)
    groups = memory.groups(probes.shapes())
    took = time_probes(groups, layers, data, devices, optimizer, progress, measured, repeated_layers)
    for shape, probe in took.items():  # the probes that trained a whole batch as a configuration would
        config = config_of(shape, batch_size)
        if config is not None:
            count = len(shape.cut) * shape.replicas
            measured.steps[(batch_size, config)] = (probe.seconds, calibration_lib.largest_peak(probe, devices, count))
    scaled = {s: took[s] for s in probes.scale.values() if s in took}
    if scaled:
        scale_to_whole_steps(measured, scaled, calibration, devices[0])
    else:
        measured.time_source += "; not scaled to whole steps: no one-cell step was run"
    _fit_held(measured, probes, took, layers, data, devices, optimizer, calibration, slots, repeated_layers)
    if probes.pipeline in took:
        seconds = took[probes.pipeline].seconds
        calibration = model_parallelism(measured, calibration, probes.pipeline, seconds)
    _fit_recompute(measured, probes, took, calibration, batch_size)
    if probes.replicated in took:
        config = Config((len(layers),), probes.replicated.replicas, 1, "never", "gpipe")
        seconds = took[probes.replicated].seconds
        calibration = dataclasses.replace(
            calibration,
            replica_parallelism=parallelism(measured, calibration, batch_size, config, seconds),
            source=calibration.source
            + f"; replicas' parallelism measured with {probes.replicated.replicas} replicas of the model at M=1",
        )
    return calibration


def plan_probes(memory: ProbeMemory, layers: Any, batch_size: int, recompute: bool, replicas: bool) -> Probes:
    """The probes ``fit_model`` times, each in 1F1B's order where GPipe's would go over the budget (``ProbeMemory``)."""
    measured, devices = memory.measured, list(memory.devices)
    n = len(layers)
    held = profile_sizes(sorted(measured.by_batch))  # before the probes' own sizes join the profile
    scale = scale_shapes(measured, batch_size, n)
    cut = splits(layers, devices)
    pipeline = probe_shape(measured, n, batch_size, len(devices)) if cut else None
    # K=2 too on more devices: on four logical CPUs the Transformer's ratio was 0.73-1.08 at K=1 and 0.18-0.26 at
    # K=4, and K=2's, taken between them, put its steps recomputing every micro-batch 14% high
    ks = sorted({1} | ({2, len(devices)} if cut else set())) if recompute else []
    never = {k: probe_shape(measured, n, batch_size, k) for k in ks}
    always = {k: dataclasses.replace(shape, remat="always") for k, shape in never.items()}
    replicated = replica_shape(measured, batch_size, n, devices) if replicas else None
    near = probe_shape(measured, n, batch_size, 1).b
    held = sorted(held, key=lambda b: abs(np.log2(b / near)))
    lean = memory.leaner
    return Probes(
        pipeline=memory.fitting_cut(pipeline) if pipeline is not None else None,
        scale={b: lean(s) for b, s in scale.items()},
        held=held,
        never={k: lean(s) for k, s in never.items()},
        always={k: lean(s) for k, s in always.items()},
        replicated=lean(replicated) if replicated is not None else None,
    )


def _fit_held(
    measured: profile.Profile,
    probes: Probes,
    took: dict[Shape, calibration_lib.Probe],
    layers: Any,
    data: Any,
    devices: list[str],
    optimizer: Any,
    calibration: Calibration,
    slots: int,
    repeated_layers: str,
) -> None:
    """The held ratios from the one-cell steps' peaks (re-run on ``measured.memory_device`` where the layers' bytes
    were read on a stand-in), and from the pipeline probe's own peaks at its size where no step gave one; none where
    the layers' bytes were not read."""
    if measured.memory_device is None:
        return
    steps = {s: took[s] for s in probes.scale.values() if s.b in probes.held and s in took}
    if measured.memory_device != devices[0]:  # bytes read on this process's stand-in: so are the steps' peaks
        on = [measured.memory_device]  # for the peak only: two steps after tracing, without warming up
        with _compat.custom_gradients_forgotten():
            for s in list(steps):
                steps[s] = calibration_lib.split_step(
                    layers, data, s.b, s.m, list(s.cut), on, optimizer, 2, warm=False, schedule=s.schedule,
                    repeated_layers=repeated_layers,
                )  # fmt: skip
    # each device's peaks (or logical CPUs' one allocator's total)
    probe = took.get(probes.pipeline) if probes.pipeline is not None else None
    peaks = probe.device_peaks if probe is not None else None
    if probe is not None and not peaks and probe.peak_bytes is not None:
        peaks = [probe.peak_bytes]
    pipeline = probes.pipeline
    at_cut = held_ratio_of_cut(measured, pipeline, peaks, slots, calibration) if pipeline and peaks else None
    fit_held_ratios(measured, steps, slots, at_cut)


def _fit_recompute(
    measured: profile.Profile,
    probes: Probes,
    took: dict[Shape, calibration_lib.Probe],
    calibration: Calibration,
    batch_size: int,
) -> None:
    """``measured.recompute_ratios`` from the K's whose steps ran both without and with recomputing."""
    ks = [k for k in probes.never if probes.never[k] in took and probes.always[k] in took]
    if not ks:
        return
    seconds = {k: (took[probes.never[k]].seconds, took[probes.always[k]].seconds) for k in ks}
    ran = {k: probes.never[k] for k in ks}
    measured.recompute_ratios = recompute_ratios(measured, calibration, batch_size, ran, seconds)
    fitted = ", ".join(f"x{r:.2f} at K={k}" for k, r in measured.recompute_ratios.items())
    measured.time_source += (
        f"; recomputing a micro-batch {fitted} its forward (fitted to what recomputing all adds to a step)"
    )


def time_probes(
    groups: Sequence[Sequence[Shape]],
    layers: Any,
    data: Any,
    devices: list[str],
    optimizer: Any,
    progress: Progress | None = None,
    measured: profile.Profile | None = None,
    repeated_layers: str = "inline",
) -> dict[Shape, calibration_lib.Probe]:
    """Each group of shapes trained on ``devices`` (copies of ``layers``, built with ``repeated_layers``), its probes
    timed in the same rounds, then let go before the next group is built (``ProbeMemory.groups``).

    Where ``progress`` has a time bound, a probe is built only where the time left allows it (at what ``measured``,
    the layers' profile, predicts it takes: ``build_seconds``), the rounds of those built and what the planner keeps
    for later (``Progress.affords``); ``measured.not_run`` gets each one left out.
    """
    total = sum(len(group) for group in groups)
    probes: dict[Shape, calibration_lib.Probe] = {}
    if progress is not None and total:
        progress.phase(f"stepping {total} probes of the whole model (each traced, then warmed up, then timed)", total)
    elif progress is not None:  # a phase of none would take the time of what follows it
        progress.end()
        progress.say("no probe of the whole model is predicted to fit the budget (see summary()): the layers predict")
    for group in groups:
        with _compat.custom_gradients_forgotten():  # the group's models, let go below, hold no memory then
            probes.update(_time_group(group, layers, data, devices, optimizer, progress, measured, repeated_layers))
        gc.collect()  # the group's models and their optimizer slots go before the next group is built
    return probes


def _time_group(
    group: Sequence[Shape],
    layers: Any,
    data: Any,
    devices: list[str],
    optimizer: Any,
    progress: Progress | None,
    measured: profile.Profile | None,
    repeated_layers: str,
) -> dict[Shape, calibration_lib.Probe]:
    """One group of ``time_probes``: its probes built in turn (while the time allows), then timed in the same rounds;
    their models are let go on return."""
    kept: dict[Any, list] = {}
    built: dict[Shape, calibration_lib.Probe] = {}
    not_run = measured.not_run if measured is not None else []
    for shape in group:
        rounds_s = (calibration_lib.ROUNDS - 1) * STEPS * sum(p.seconds for p in built.values())
        predicted = build_seconds(measured, shape) if measured is not None else None
        if progress is not None and not progress.affords(1, rounds_s, predicted):
            expected = progress.probe_seconds(predicted)
            why = "no time left within max_seconds"
            if predicted is not None and expected is not None:
                left, saved = max(progress.time_left(), 0.0), progress.kept() + rounds_s
                why = f"predicted to take {expected:.0f} s, {left:.0f} s left within max_seconds"
                why += f", {saved:.0f} s kept for the rounds and the shortlist" if saved >= 0.5 else ""
            not_run.append(f"probe {describe(shape)} not run: {why}")
            continue
        began = time.monotonic()
        kept[shape] = []
        try:
            built[shape] = _build(shape, layers, data, devices, optimizer, kept[shape], repeated_layers)
        except tf.errors.ResourceExhaustedError:  # predicted to fit, but a device ran out: fitted without it
            del kept[shape]
            not_run.append(f"probe {describe(shape)} ran out of memory on its devices")
            continue
        if progress is not None:
            progress.probe_took(time.monotonic() - began, predicted)
            progress.step(describe(shape))
    # rounds set the group's probes against the same spells of a shared machine; one alone keeps its first timing (on
    # two workers under a budget the Transformer's cut probe alone: 20 more steps, 4 s of a 45 s plan)
    timed = calibration_lib.in_rounds(built, kept, STEPS) if len(built) > 1 else built
    if progress is not None:
        progress.mark()  # the rounds' peak, every model of the group held at once
    return timed


def _build(
    shape: Shape, layers: Any, data: Any, devices: list[str], optimizer: Any, kept: list, repeated_layers: str
) -> calibration_lib.Probe:
    """One probe traced, warmed up and timed once (its model kept in ``kept`` for the rounds)."""
    if shape.replicas > 1:
        on = devices[: shape.replicas]
        return calibration_lib.replicated_step(
            layers, data, shape.b, on, optimizer, kept=kept, repeated_layers=repeated_layers
        )
    on = devices[: len(shape.cut)]
    cut = list(shape.cut)
    return calibration_lib.split_step(
        layers, data, shape.b, shape.m, cut, on, optimizer, remat=shape.remat, kept=kept, schedule=shape.schedule,
        repeated_layers=repeated_layers,
    )  # fmt: skip


def build_seconds(measured: profile.Profile, shape: Shape) -> float | None:
    """Seconds building ``shape``'s probe is predicted to take: its step traced (from its layers' own tracing,
    ``Profile.trace_s``: ``BUILD_FIXED``, ``BUILD_SCALE``, ``BUILD_POWER``), warmed up and timed once (its layers'
    forward and backward on one device, an upper bound). None where the layers' tracing was not measured."""
    if not measured.trace_s:
        return None
    tasks = shape.m * shape.replicas * (1.5 if shape.remat != "never" else 1.0)  # a recomputed forward traced again
    alone = sum(measured.trace_s)
    traced = BUILD_FIXED * alone + BUILD_SCALE * (alone * tasks) ** BUILD_POWER
    sizes = sorted(measured.by_batch)
    near = min(sizes, key=lambda size: abs(np.log2(size / shape.b)))
    costs = measured.by_batch[near]
    step_s = (sum(costs.forward_s) + sum(costs.backward_s)) * shape.b / near * shape.m * shape.replicas
    # two steps with the tracing, up to PROBE_WARM_STEPS more for at most PROBE_WARM_SECONDS, then STEPS timed
    warm_s = min(calibration_lib.PROBE_WARM_SECONDS, calibration_lib.PROBE_WARM_STEPS * step_s)
    return traced + (2 + STEPS) * step_s + warm_s


def shape_of(config: Config, batch_size: int) -> Shape:
    """A configuration as a probe's shape, for ``build_seconds``: what it traces and runs (any recomputation as
    recomputing every micro-batch)."""
    m, r = config.num_micro_batches, config.num_replicas
    remat = "never" if config.remat == "never" else "always"
    return Shape(max(batch_size // (m * r), 1), m, tuple(config.balance), remat, r, config.schedule)


def config_of(shape: Shape, batch_size: int) -> Config | None:
    """The configuration whose step a probe of ``shape`` trains, where it trains ``batch_size`` rows (else None)."""
    if shape.b * shape.m * shape.replicas != batch_size:
        return None
    return Config(shape.cut, shape.replicas, shape.m, shape.remat, shape.schedule)


def step_key(config: Config) -> Config:
    """``config`` as the step it trains: at M=1 ``except_last`` recomputes nothing, as ``never``."""
    if config.remat == "except_last" and config.num_micro_batches == 1:
        return dataclasses.replace(config, remat="never")
    return config


def describe(shape: Shape) -> str:
    """One probe in a few words: rows, M, devices, recomputation."""
    remat = f", remat {shape.remat!r}" if shape.remat != "never" else ""
    if shape.replicas > 1:
        return f"{shape.replicas} replicas of {shape.b} rows at M=1"
    schedule = f", {shape.schedule}" if shape.schedule != "gpipe" else ""
    return f"{shape.b} rows x M={shape.m} on {len(shape.cut)} device(s){remat}{schedule}"


@dataclasses.dataclass(frozen=True, eq=False)
class ProbeMemory:
    """What the probes' memory is predicted from (the layers measured alone, the calibration, the optimizer's slots,
    the devices) and the bytes per device they keep to (``budget``; None: no budget)."""

    measured: profile.Profile
    calibration: Calibration
    slots: int
    devices: Sequence[str]
    budget: float | None

    def bytes(self, shape: Shape) -> tuple[dict[str, float], dict[str, float]]:
        """A probe's predicted peak on each of its devices, and what its model keeps there between steps."""
        measured, calibration = self.measured, self.calibration
        config = Config(shape.cut, shape.replicas, shape.m, shape.remat, shape.schedule)
        batch = shape.b * shape.m * shape.replicas
        peaks = predict.peak_bytes(
            measured, batch, config, self.slots, calibration.noinline_tasks, calibration.across_processes
        )  # replica by replica, cell by cell: the probe's devices in order
        keeps = []
        for replica in range(shape.replicas):
            for i, (lo, hi) in enumerate(predict.bounds(shape.cut)):
                weights, owned, _ = measured.cell_weights(lo, hi)
                data = shape.m * shape.b * measured.input_bytes if i == 0 and replica == 0 else 0.0
                keeps.append(weights + (self.slots * owned if replica == 0 else 0.0) + data)
        on: dict[str, float] = {}
        kept: dict[str, float] = {}
        for device, peak, keep in zip(self.devices, peaks, keeps):
            on[device], kept[device] = on.get(device, 0.0) + peak, kept.get(device, 0.0) + keep
        return on, kept

    @property
    def room(self) -> float | None:
        """The bytes per device a probe is predicted to keep within: the budget less the headroom the shortlist keeps
        too (``search.TIMED_HEADROOM``), since a prediction may be 15% short (12 x Dense(1024) on two workers under
        147 MiB: a cut probe predicted within it held 159)."""
        return None if self.budget is None else search.TIMED_HEADROOM * self.budget

    def fits(self, shape: Shape) -> bool:
        """Whether ``shape``'s predicted peak is within ``room`` on every one of its devices (always, without one)."""
        return self.room is None or max(self.bytes(shape)[0].values()) <= self.room

    def leaner(self, shape: Shape) -> Shape:
        """``shape``, run under 1F1B where GPipe's order is predicted over the budget on one of its devices.

        1F1B does a step's work in a different order, holding at most K micro-batches where GPipe holds M, and the fits
        predict each probe under its own schedule. GPipe stays where it fits: the most micro-batches held at once, the
        most each probe says of what a micro-batch holds.
        """
        if shape.replicas > 1 or shape.m == 1 or self.fits(shape):
            return shape
        return dataclasses.replace(shape, schedule="1f1b")

    def fitting_cut(self, shape: Shape) -> Shape:
        """The probe cut over the devices as ``leaner`` runs it, or where that is predicted over the budget, the first
        that fits of: recomputing every micro-batch (in 1F1B's order), then the same two at each smaller micro-batch
        size.

        A deep model under a tight budget fits no probe at the planned sizes; without one, a step's held bytes are the
        layers' own, measured alone: inlined they hold less, called blocks (``repeated_layers="call"``) more. A
        24-block keras_hub Llama at 32 x 512 tokens on two workers under 400 MiB each, planned so, peaked at 425 MiB;
        with this probe (1 row x M=8, recomputing: x1.10 the layers' bytes) its plan peaked at 199 (predicted 306).
        This probe's peaks then give the held bytes (``held_ratio_of_cut``) and its time the parallelism.
        """
        if self.budget is None:
            return shape
        tried = []
        for b in sorted({shape.b} | {b for b in self.measured.by_batch if b < shape.b}, reverse=True):
            smaller = dataclasses.replace(shape, b=b)
            tried += [self.leaner(smaller), dataclasses.replace(smaller, remat="always", schedule="1f1b")]
        return next((s for s in tried if self.fits(s)), tried[0])  # none fits: the first, which groups leaves out

    def groups(self, shapes: Sequence[Shape]) -> list[list[Shape]]:
        """``shapes`` in groups to build and time together, without going over the budget on any device; one group
        where there is no budget.

        A probe predicted to peak over ``room`` on a device is not run (``measured.not_run`` says so). The rest are
        grouped in order while what the group's models keep between steps (weights, optimizer slots, the batch) and
        the largest of their steps' own bytes fit every device together. Predicted from the layers measured alone
        (before a step's held bytes are fitted): an inlined step holds less than that (docs/benchmarks.md#planning).
        """
        room = self.room
        if room is None:
            return [list(shapes)] if shapes else []
        groups: list[list[Shape]] = []
        kept: dict[str, float] = {}
        stepping: dict[str, float] = {}
        for shape in shapes:
            peaks, keeps = self.bytes(shape)
            fullest = max(peaks, key=lambda d: peaks[d])
            if peaks[fullest] > room:
                over = "over the budget" if peaks[fullest] > (self.budget or 0.0) else search.NEAR_BUDGET
                self.measured.not_run.append(
                    f"probe {describe(shape)} not run: predicted to peak at {gib(peaks[fullest])} on {fullest}, {over}"
                )
                continue
            together = {d: kept.get(d, 0.0) + keeps[d] for d in peaks}
            most = {d: max(stepping.get(d, 0.0), peaks[d] - keeps[d]) for d in peaks}
            if groups and all(together[d] + most[d] <= room for d in peaks):
                groups[-1].append(shape)
                kept.update(together)
                stepping.update(most)
            else:
                groups.append([shape])
                kept, stepping = dict(keeps), {d: peaks[d] - keeps[d] for d in peaks}
        return groups


def profile_sizes(sizes: Sequence[int]) -> list[int]:
    """The sizes the planner runs the layers alone at: the smallest, the middle and the largest of the sorted ``sizes``
    the search uses (the rest interpolated)."""
    return sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})


def scale_shapes(measured: profile.Profile, batch_size: int, num_layers: int) -> dict[int, Shape]:
    """Per micro-batch size the search uses (up to ``SCALE_PROBES``, spread in log(size), and the layers' own three):
    its one-cell step, M <= 8.

    A step's time per sample is not linear in log(size) between far sizes: on the MLP of docs/benchmarks.md, steps at
    32 and 256 samples put 64's 17% above its own step (its M=4 rows were predicted +17-22%).
    """
    every = sorted(measured.by_batch)
    sizes = sorted(set(spread(every, SCALE_PROBES)) | set(profile_sizes(every)))  # the latter's peaks give held bytes
    return {b: Shape(b, min(max(batch_size // b, 1), PROBE_MICRO_BATCHES), (num_layers,)) for b in sizes}


def scale_to_whole_steps(
    measured: profile.Profile, steps: dict[Shape, calibration_lib.Probe], calibration: Calibration, device: str
) -> None:
    """Scale the layers' times at each micro-batch size to ``steps`` of all of them as one cell on ``device``.

    Between the sizes stepped, the ratio of step to layers is interpolated in log(size).
    """
    update_s = sum(measured.trainable_bytes) * calibration.update_s_per_byte
    timed, ratios = [], []
    for shape in sorted(steps, key=lambda s: s.b):
        costs = measured.costs(shape.b)
        alone = sum(costs.forward_s) + sum(costs.backward_s)
        per_micro_batch = (steps[shape].seconds - calibration.step_s - update_s) / shape.m - 2 * calibration.task_s
        timed.append(shape.b)
        ratios.append(per_micro_batch / alone if per_micro_batch > 0 and alone > 0 else 1.0)
    for b in sorted(measured.by_batch):
        ratio = float(np.interp(np.log2(b), np.log2(timed), ratios))
        costs = measured.costs(b)
        profile.rescale(measured, b, ratio * (sum(costs.forward_s) + sum(costs.backward_s)))
    measured.time_source = (
        f"each layer run alone, scaled to add up to a step of all the layers as one cell on {device} (measured at "
        f"{timed} samples with M <= {PROBE_MICRO_BATCHES}, less its fixed, task and update costs)"
    )


def spread(sizes: Sequence[int], count: int) -> list[int]:
    """Up to ``count`` of the sorted ``sizes``, the first and the last among them, the rest spread in log(size)."""
    if len(sizes) <= count:
        return list(sizes)
    logs = np.log2(sizes)
    wanted = np.linspace(logs[0], logs[-1], count)
    return sorted({sizes[int(np.argmin(np.abs(logs - w)))] for w in wanted})


def fit_held_ratios(
    measured: profile.Profile,
    steps: dict[Shape, calibration_lib.Probe],
    slots: int,
    cut: tuple[int, float] | None = None,
) -> None:
    """``Profile.held_ratios`` from one-cell ``steps``' peaks: per (b, M), the step's activations (its peak less the
    rest predicted, ``slots`` optimizer slots per weight) over the layers' bytes; and ``cut`` (b, ratio:
    ``held_ratio_of_cut``) where no one-cell step ran at that b."""
    found: tuple[list[int], list[float]] = ([], [])
    for shape in sorted(steps, key=lambda s: s.b):
        b, m, peak = shape.b, shape.m, steps[shape].peak_bytes
        in_flight, kept, _ = predict.holding(measured, b, 1, m, shape.schedule, "never")
        activations = kept[0] * sum(measured.costs(b).held_bytes)
        if peak is None or activations <= 0:
            continue
        rest = predict.cell_peak(measured, b, 0, len(measured.weight_bytes), True, in_flight[0], kept[0], slots, m, 0.0)
        found[0].append(b)
        found[1].append(_held_ratio(peak - rest, activations))
    cut_at = cut[0] if cut is not None and cut[0] not in found[0] else None
    if cut is not None and cut_at is not None:
        at = int(np.searchsorted(found[0], cut_at))
        found[0].insert(at, cut_at)
        found[1].insert(at, cut[1])
    # A step that does not inline its cells' calls (from Calibration.noinline_tasks tasks on) holds what each layer
    # measured alone held, a call TensorFlow did not inline either: the ratio stays 1 there (measured: the
    # Transformer of docs/benchmarks.md at K=2, M=16 held 481 MiB, its layers' bytes predict 494)
    measured.held_ratios = {True: found}
    if not found[0]:
        measured.memory_source += "; a step's held bytes not fitted (no one-cell step was run): the layers' own"
        return
    held_by = "steps of all the layers as one cell" + (f" (at {cut_at}: the step cut over devices)" if cut_at else "")
    measured.memory_source += (
        f"; where a step inlines its cells, a micro-batch's activations scaled to what {held_by} held "
        f"(x{'/'.join(f'{r:.2f}' for r in found[1])} at {found[0]} samples)"
    )


def held_ratio_of_cut(
    measured: profile.Profile, shape: Shape, peaks: Sequence[float], slots: int, calibration: Calibration
) -> tuple[int, float] | None:
    """(b, ratio): what a micro-batch's activations held in the probe cut over devices (``shape``), against the
    layers' bytes, from its ``peaks`` read on each device (or one, the total of devices that share an allocator);
    None where its step does not inline its cells (the ratio stays 1 there), or where its activations are under
    ``CUT_HELD_SHARE`` of its predicted peak: 12 x Dense(1024) at 256 rows x M=8 in 1F1B's order held 12% in
    activations, and a rest (weights, gradients, slots, the batch) predicted 3% high put the ratio at its floor.

    Under a tight budget the one-cell steps may not fit where the cut one does: its peaks alone then give the held
    bytes (the Transformer of docs/benchmarks.md under 79 MiB a worker: its peaks predicted 60% high without them).
    """
    k, m, b = len(shape.cut), shape.m, shape.b
    if not predict.inlined(k, m, calibration.noinline_tasks):
        return None
    in_flight, kept, _ = predict.holding(measured, b, k, m, shape.schedule, shape.remat, calibration.noinline_tasks)
    summed = predict.holds_running_sums(m, shape.schedule, calibration.across_processes)
    held = rest = 0.0
    for i, (lo, hi) in enumerate(predict.bounds(shape.cut)):
        args = (measured, b, lo, hi, i == 0, in_flight[i], kept[i], slots, m)
        without = predict.cell_peak(*args, 0.0, True, summed)  # the cell's peak holding no activations
        rest += without
        held += predict.cell_peak(*args, 1.0, True, summed) - without
    if held < CUT_HELD_SHARE * (held + rest):  # the rest's own error would be read as the activations'
        return None
    return b, _held_ratio(sum(peaks[:k]) - rest, held)


def _held_ratio(held: float, activations: float) -> float:
    """What a step's activations ``held`` against the layers' measured ``activations``, within [0.05, 4]."""
    return min(max(held / activations, 0.05), 4.0)


def model_parallelism(measured: profile.Profile, calibration: Calibration, shape: Shape, took: float) -> Calibration:
    """The calibration with the parallelism this model gets: its layers cut evenly over every device, at M=8
    (``shape``: its rows, recomputation and order), the step taking ``took`` seconds.

    Devices that share compute (logical devices on one CPU) run some models side by side and not others (a
    product wide enough to use every core alone gains nothing from a second device), so it is measured on the
    model itself: the step's work against its measured time.
    """
    batch_size = shape.b * shape.m  # the probe's own rows (a batch that M does not divide is rounded up)
    config = Config(shape.cut, 1, shape.m, shape.remat, shape.schedule)
    calibration = dataclasses.replace(
        calibration,
        parallelism=parallelism(measured, calibration, batch_size, config, took),
        source=calibration.source
        + f"; parallelism measured with this model's layers cut over the {len(shape.cut)} devices at M={shape.m}",
    )
    # Faster than its tasks can run even with every device busy: the cells' layers run faster cut than whole
    speed = fit(
        lambda x: predict.step_seconds(measured, at_speed(calibration, x), batch_size, config).step_s, took, 3.0, 1.0
    )
    return at_speed(calibration, speed)


def splits(layers: Any, devices: Sequence[str]) -> bool:
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


def probe_shape(measured: profile.Profile, num_layers: int, batch_size: int, k: int) -> Shape:
    """The probes' micro-batch size, M (up to 8) and cut of the layers into ``k`` cells of even time."""
    m = min(PROBE_MICRO_BATCHES, batch_size)
    b = -(-batch_size // m)
    if b not in measured.by_batch:
        profile.fill(measured, [b])
    costs = measured.costs(b)
    cut = (
        balance_lib.partition([f + x for f, x in zip(costs.forward_s, costs.backward_s)], k) if k > 1 else [num_layers]
    )
    return Shape(b, m, tuple(cut))


def recompute_ratios(
    measured: profile.Profile,
    calibration: Calibration,
    batch_size: int,
    shapes: dict[int, Shape],
    seconds: dict[int, tuple[float, float]],
) -> dict[int, float]:
    """What recomputing a micro-batch costs against its forward task, per K probed (``shapes``): the ratio that predicts
    what a step recomputing every micro-batch took beyond the same step recomputing none (``seconds``: per K, the two
    steps' times, timed in the same rounds).

    A recomputation runs in the call of the backward that reads it; on devices that share a CPU it can also fill
    another device's wait (the fitted ratios: docs/benchmarks.md#planning). Fitted to a step recomputing all, timed
    alone, a fast spell put the Transformer's ratio on two workers at the fit's bound (0.10) and its recomputing rows
    23-34% low.
    """
    ratios = {}
    for k, shape in shapes.items():
        config = Config(shape.cut, 1, shape.m, "never", shape.schedule)
        never = predict.step_seconds(measured, calibration, batch_size, config)
        config = dataclasses.replace(config, remat="always")

        def predicted(ratio: float, k: int = k, config: Config = config) -> float:
            profiled = dataclasses.replace(measured, recompute_ratios={k: ratio})
            return predict.step_seconds(profiled, calibration, batch_size, config).step_s

        ratios[k] = fit(predicted, never.step_s + seconds[k][1] - seconds[k][0], 0.1, 1.5)
    return ratios


def replica_shape(measured: profile.Profile, batch_size: int, num_layers: int, devices: Sequence[str]) -> Shape | None:
    """One replica of all the layers on every device at M=1; None where the devices or the batch do not allow it.

    Whole steps side by side contend for a shared CPU's caches and memory more than a pipeline's micro-batch tasks
    (the planning benchmark's Transformer on two one-thread workers: 1.78 devices, its K=2 pipeline 2.00).
    """
    r = len(devices)
    if len(set(devices)) < 2 or batch_size % r:
        return None
    if batch_size // r not in measured.by_batch:
        profile.fill(measured, [batch_size // r])
    return Shape(batch_size // r, 1, (num_layers,), replicas=r)


def parallelism(
    measured: profile.Profile, calibration: Calibration, batch_size: int, config: Config, took: float
) -> float:
    """The devices' worth of compute that makes ``config``'s predicted step take ``took`` seconds (1 to its devices).

    Fitted on the whole step, the optimizer's update included (the devices share it too): a parallelism taken from the
    pipeline's part alone, with the update as free devices run it, left the step predicted slower than measured, and
    the cells' split speed, fitted next, made up for it where it then also sped up steps without overlap (K=2, M=1).
    """
    devices = float(config.num_partitions * config.num_replicas)
    replicas = config.num_replicas > 1 and config.num_partitions == 1  # fit replica_parallelism, else parallelism

    def predicted(value: float) -> float:
        if replicas:
            trial = dataclasses.replace(calibration, replica_parallelism=value)
        else:
            trial = dataclasses.replace(calibration, parallelism=value)
        return predict.step_seconds(measured, trial, batch_size, config).step_s

    return fit(predicted, took, 1.0, devices)
