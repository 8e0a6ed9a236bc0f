"""``tfpipe.plan``: measure the layers and the devices, predict every configuration, return the fastest that fits.

What the plan rests on (``Plan.summary`` prints it): each layer's forward and backward
time and held bytes, measured on copies on the first device (``planning.profile``), the
times scaled to real one-cell steps of all the layers; the cost of a task, of a step, of
moving a tensor and of the optimizer's update, measured once per set of devices, and how
many devices' worth of compute this model gets from them (``calibration``, fitted in ``probe_fits``); and the
schedule simulated as data (``planning.predict``, ``planning.search``). The few configurations
predicted near the fastest are then timed on the devices, and the fastest measured is chosen
(``verify``; predictions are within 10-20%, so near-equal ones are for a measurement to order).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat
from tfpipe import schedule as schedule_lib
from tfpipe._args import positive_int
from tfpipe.backward.remat import REMAT_MODES, check_mode
from tfpipe.distributed import devices as devices_lib
from tfpipe.partition import repeats as repeats_lib
from tfpipe.planner import calibration as calibration_lib
from tfpipe.planner import probe_fits
from tfpipe.planning import budget as budget_lib
from tfpipe.planning import joined, plans, search
from tfpipe.planning import profile as profile_lib
from tfpipe.planning import units as units_lib
from tfpipe.planning.plans import NothingFits, Plan, gib
from tfpipe.planning.predict import SLOTS, Calibration, Config
from tfpipe.planning.progress import Progress

__all__ = ["NothingFits", "Plan", "plan"]

# max_seconds="auto": planning takes at most as long as this many steps of the fastest configuration predicted from
# the layers alone (what a user gives up to planning on a run of thousands), and at least AUTO_MIN_SECONDS: tracing
# one probe takes seconds whatever its step
AUTO_STEPS = 200
AUTO_MIN_SECONDS = 30.0


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
    cells_per_device: Sequence[int] | None = None,
    calibration: Calibration | None = None,
    profile: profile_lib.Profile | None = None,
    repeats: int = 3,
    verify: int = 3,
    max_seconds: Any = "auto",
    repeated_layers: str = "inline",
    verbose: int = 1,
) -> Plan:
    """The configuration (K, balance, R, M, remat, schedule, v) fastest on ``devices`` that fits ``memory_budget``.

    ``layers``: a list of Keras layers, a ``keras.Sequential``, or a Functional model (a keras_hub task included,
    built under ``tfpipe.deferred_weights()`` or not), planned by its nodes. ``devices``: the devices to use (default:
    this machine's GPUs, else its CPU devices). ``memory_budget``: bytes per device (an int or a string such as
    "12GiB"); None: no limit. ``sample`` or ``input_shape`` give the input when the layers do not know it.
    ``optimizer``: its name or instance, for its slots' memory and its update's time. ``num_micro_batches``,
    ``schedules``, ``remats``, ``replicas`` and ``cells_per_device`` (v, the cells each device holds under the
    schedules that share devices; default 2 and 4) narrow the search. ``calibration``: reuse one
    (``plan.calibration``) instead of measuring the devices; with ``profile`` (``plan.profile``) too, the model's
    measurements are reused as well, and nothing is measured before the search (e.g. to plan again under another
    budget). ``verify``: time this many configurations predicted near the fastest that fit (one per K, R and
    schedule) on the devices and choose the fastest measured; 0 chooses by prediction alone. Where none fits,
    ``NothingFits`` (a ValueError) names the smallest budget that would and carries the measurements to plan under it
    without measuring again. ``max_seconds``: how long planning may take; it measures fewer
    whole steps and times fewer configurations to keep to it, and ``Plan.summary`` says what it left out. "auto":
    the time of ``AUTO_STEPS`` steps of the fastest configuration predicted from the layers alone, at least
    ``AUTO_MIN_SECONDS``, and of the fitted predictions' fastest before the shortlist where that is sooner; None: no
    bound. Every probe keeps to ``memory_budget`` on its devices: one predicted past 87%
    of it is not run, and the plan records its probes' largest peaks (``Plan.planning_peaks``). ``repeated_layers``: the
    model's, as its probes are built. ``verbose``: 1 shows each phase, its progress and time left; 0 nothing.
    """
    request = _Request.checked(
        layers, batch_size, devices, memory_budget, sample, input_shape, optimizer, num_micro_batches, schedules,
        remats, replicas, cells_per_device, calibration, profile, repeats, verify, max_seconds, repeated_layers,
    )  # fmt: skip
    watch = calibration_lib.PeakWatch(request.devices)
    progress = _progress(request, verbose, watch)
    measured, fitted = _measured(request, calibration, profile, progress)
    progress.phase("predicting every configuration")
    candidates = search.run(measured, fitted, request.batch_size, request.space, request.budget, request.slots)
    if request.max_seconds == "auto":
        _tightened(progress, candidates)
    candidates = _timed(request, candidates, measured, progress)
    progress.end()
    gc.collect()  # the probes' models (reference cycles) go before the planned model trains beside them
    watch.read()
    return _chosen(request, candidates, measured, fitted, progress, watch.peaks)


def _chosen(
    request: _Request,
    candidates: list[search.Candidate],
    measured: profile_lib.Profile,
    fitted: Calibration,
    progress: Progress,
    peaks: dict[str, float] | None,
) -> Plan:
    """The plan of ``candidates`` (the chosen first), with what planning took: its time, its phases, its peaks."""
    chosen = plans.from_candidates(
        candidates, request.devices, request.batch_size, request.budget, measured, fitted, request.slots, peaks
    )
    chosen.planning_seconds, chosen.planning_peaks = progress.seconds(), peaks
    chosen.planning_bound, chosen.planning_phases = progress.max_seconds, dict(progress.phases)
    return chosen


def _progress(request: _Request, verbose: int, watch: calibration_lib.PeakWatch) -> Progress:
    """Planning's progress, shown as ``verbose`` says and bounded by ``max_seconds`` where it is a number."""
    bound = request.max_seconds
    progress = Progress(verbose, max_seconds=bound if not isinstance(bound, str) else None, on_step=watch.read)
    progress.reserve = request.verify  # the shortlist's timing, kept time for
    return progress


@dataclasses.dataclass
class _Request:
    """``plan``'s arguments, checked: what the planner measures, searches and keeps to."""

    layers: Any  # the planner's units: the layers, or a Functional model's nodes
    data: Any  # a sample input
    batch_size: int
    devices: list[str]
    budget: float | None
    space: search.Space
    optimizer: Any
    slots: int
    sizes: list[int]  # the micro-batch sizes the search may use
    repeats: int
    verify: int
    max_seconds: float | str | None
    repeated_layers: str

    @classmethod
    def checked(
        cls, layers: Any, batch_size: Any, devices: Any, memory_budget: Any, sample: Any, input_shape: Any,
        optimizer: Any, num_micro_batches: Any, schedules: Any, remats: Any, replicas: Any, cells_per_device: Any,
        calibration: Any, profile: Any, repeats: Any, verify: Any, max_seconds: Any, repeated_layers: Any,
    ) -> _Request:  # fmt: skip
        """Check ``plan``'s arguments, each with a message that names it, before anything is measured."""
        units = units_lib.of(layers)
        batch_size = positive_int("batch_size", batch_size)
        device_list = _devices(devices)
        space = search.Space(
            num_devices=len(device_list),
            micro_batches=_choices("num_micro_batches", num_micro_batches, search.MICRO_BATCHES, int),
            schedules=_choices("schedules", schedules, schedule_lib.ALL_SCHEDULES, str, _named_schedule),
            remats=_choices("remats", remats, REMAT_MODES, str, check_mode),
            replicas=bool(replicas),
            cells_per_device=_choices("cells_per_device", cells_per_device, search.CELLS_PER_DEVICE, int),
        )
        if profile is not None and calibration is None:
            raise ValueError(
                "profile=plan.profile is reused with the calibration fitted to it: pass calibration=plan.calibration "
                "too."
            )
        if calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a tfpipe Calibration (plan.calibration), got {calibration!r}.")
        return cls(
            layers=units,
            data=profile_lib.sample_of(layers, sample, input_shape),
            batch_size=batch_size,
            devices=device_list,
            budget=plans.parse_bytes(memory_budget) if memory_budget is not None else None,
            space=space,
            optimizer=optimizer,
            slots=optimizer_slots(optimizer),
            sizes=search.micro_batch_sizes(batch_size, len(units), space),
            repeats=positive_int("repeats", repeats),
            verify=_count("verify", verify),
            max_seconds=_max_seconds(max_seconds),
            repeated_layers=repeats_lib.check(repeated_layers),
        )


def _measured(
    request: _Request, calibration: Calibration | None, profile: profile_lib.Profile | None, progress: Progress
) -> tuple[profile_lib.Profile, Calibration]:
    """The layers' measurements and the devices' calibration fitted to them: measured (the devices, each layer alone
    at three sizes, then whole steps within the time left), or reused from an earlier plan (``profile``)."""
    if calibration is None:
        progress.phase(f"measuring the {len(request.devices)} devices (a task, a step, a transfer, an update)")
        most = search.most_tasks(request.batch_size, len(request.layers), request.space)
        calibration = calibration_lib.calibrate(
            request.devices, request.optimizer, budget=request.budget, most_tasks=most
        )
    if profile is not None:  # measured by an earlier plan of these layers, with this calibration fitted to it
        measured = reused(profile, request.layers)
    else:  # each layer alone at three sizes (the smallest, the middle, the largest), the rest interpolated
        measured = profile_lib.measure(
            request.layers, request.data, probe_fits.profile_sizes(request.sizes), request.devices[0],
            repeats=request.repeats, progress=progress, budget=request.budget, auto_bound=_auto_bound(request),
        )  # fmt: skip
    profile_lib.fill(measured, request.sizes)
    if request.budget is not None and measured.memory_device is None:
        warnings.warn(
            f"tfpipe.plan: memory_budget={gib(request.budget)} a device, but no allocator here counts bytes, so each "
            "layer's memory is estimated from its output sizes, which can be far below what it holds (a 24-block "
            "keras_hub Llama planned so under 256 MiB a worker peaked at 4.4 GiB). Set TF_CPU_ALLOCATOR_USE_BFC=true "
            "before TensorFlow starts to have it read.",
            stacklevel=3,
        )
    if profile is None:
        if request.max_seconds == "auto":  # from the fastest configuration the layers alone predict
            found = search.run(measured, calibration, request.batch_size, request.space, None, request.slots)
            fastest = _fastest_step(found)
            progress.max_seconds = auto_bound(1)(fastest)
            progress.end()
            progress.say(
                f"planning within {progress.max_seconds:.0f} s (max_seconds='auto': {AUTO_STEPS} steps of "
                f"{fastest * 1e3:.1f} ms, the fastest the layers alone predict, at least {AUTO_MIN_SECONDS:.0f} s)"
            )
        recompute = set(request.space.remats) != {"never"}  # what recomputing costs, where the search may recompute
        calibration = probe_fits.fit_model(  # the model's probes built as it will train (repeated_layers)
            measured, request.layers, request.data, request.batch_size, request.devices, request.optimizer,
            calibration, request.slots, recompute, request.space.replicas, progress, request.budget,
            request.repeated_layers,
        )  # fmt: skip
    _joined(request, measured, progress)
    return measured, calibration


def _tightened(progress: Progress, candidates: Sequence[search.Candidate]) -> None:
    """``max_seconds="auto"``'s bound again, where the predictions fitted to whole steps give a faster fastest
    configuration than the layers alone did: the layers run alone at small micro-batches predicted a Transformer's
    step at 549 ms on two workers where its choice ran at 300, and the shortlist then took 53 s of a 99 s plan (339
    steps). Never longer than the first bound; where none was set (a profile reused: nothing measured), none is set."""
    if not candidates:
        return
    fastest = _fastest_step(candidates)
    bound = auto_bound(1)(fastest)
    if progress.max_seconds is not None and bound < progress.max_seconds:
        progress.max_seconds = bound
        progress.end()
        progress.say(
            f"planning within {bound:.0f} s ({AUTO_STEPS} steps of {fastest * 1e3:.1f} ms, the fastest the whole "
            "steps predict)"
        )


def _fastest_step(candidates: Sequence[search.Candidate]) -> float:
    """The fastest predicted step of the ``candidates`` that fit (of all where none does); 0 where there are none."""
    fitting = [c for c in candidates if c.fits] or list(candidates)
    return min((c.prediction.step_s for c in fitting), default=0.0)


def _auto_bound(request: _Request) -> Callable[[float], float] | None:
    """Under ``max_seconds="auto"``, ``auto_bound`` for the request's devices; else None."""
    return auto_bound(len(set(request.devices))) if request.max_seconds == "auto" else None


def auto_bound(devices: int) -> Callable[[float], float]:
    """The bound ``max_seconds="auto"`` gives while the layers are measured, before the search can give the fastest
    configuration: ``AUTO_STEPS`` steps of a one-device step spread over ``devices``, at least ``AUTO_MIN_SECONDS`` (an
    estimate: the bound set after them goes by the search's fastest configuration)."""
    return lambda step: max(AUTO_STEPS * step / devices, AUTO_MIN_SECONDS)


def _joined(request: _Request, measured: profile_lib.Profile, progress: Progress) -> None:
    """Read what one W over all micro-batches joins, where the search has a schedule that batches W; where that
    is predicted past ``max_seconds`` (it traces each kind of layer once: at most the layers' tracing, summed), such
    schedules leave the search instead (unless they are all it has)."""
    batching = [s for s in request.space.schedules if schedule_lib.batches_weights(s)]
    if measured.joined_bytes or not batching:
        return
    predicted, left = sum(measured.trace_s), progress.time_left()
    if left <= predicted and len(batching) < len(request.space.schedules):
        kept = tuple(s for s in request.space.schedules if s not in batching)
        request.space = dataclasses.replace(request.space, schedules=kept)
        measured.not_run.append(
            f"{', '.join(batching)} not searched: reading what one W over all micro-batches joins (each kind of "
            f"layer traced once) is predicted to take up to {predicted:.0f} s, {max(left, 0):.0f} s left within "
            "max_seconds"
        )
        return
    progress.phase("reading the rows one W over all micro-batches joins (each kind of layer traced once)")
    with _compat.custom_gradients_forgotten():  # its traced copies hold no memory once measured
        measured.joined_bytes = joined.bytes_per_sample(request.layers, request.data, request.devices[0])
    measured.time_source += "; one W over all micro-batches also copies the rows it joins (traced per layer)"


def _timed(
    request: _Request,
    candidates: list[search.Candidate],
    measured: profile_lib.Profile,
    progress: Progress,
) -> list[search.Candidate]:
    """``candidates`` with the shortlist timed on the devices (``verify``), where the time left allows."""
    verify = request.verify
    progress.reserve = 0
    if not progress.affords(1) and len(search.shortlist(candidates, verify, request.budget)) >= 2:
        measured.not_run.append("the shortlist not timed: no time left within max_seconds; chosen by prediction alone")
        verify = 0
    return verified(  # timed as the model will train (repeated_layers)
        candidates, request.layers, request.data, request.batch_size, request.devices, request.optimizer, verify,
        request.budget, progress, measured.not_run, request.repeated_layers, measured,
    )  # fmt: skip


def verified(
    candidates: list[search.Candidate],
    layers: Any,
    sample: Any,
    batch_size: int,
    devices: Sequence[str],
    optimizer: Any,
    count: int,
    budget: float | None = None,
    progress: Progress | None = None,
    not_run: list[str] | None = None,
    repeated_layers: str = "inline",
    measured: profile_lib.Profile | None = None,
) -> list[search.Candidate]:
    """``candidates`` with the ``count`` worth timing trained on ``devices`` (copies of ``layers``), fastest first.

    Each is timed while ``progress``'s time bound leaves time for it (``not_run`` is told of the rest), at what
    ``measured`` (the layers' profile) predicts it takes (``probe_fits.build_seconds``), or the first always and the
    rest at the pace of those timed; built as ``repeated_layers`` says. Only candidates predicted to fit ``budget``
    are timed; where the devices' peaks can be read (GPUs, a running LocalCluster's workers, logical CPUs' one
    allocator), one that ran over it goes last.
    """
    count = _count("verify", count)
    listed = search.shortlist(candidates, count, budget)
    fastest = search.shortlist(candidates, 1)  # the headroom aside
    if budget is not None and count and fastest and fastest[0] not in listed and not_run is not None:  # too near it
        peak = gib(max(fastest[0].prediction.peak_bytes))
        not_run.append(f"{fastest[0].config.describe()} not timed: predicted to peak at {peak}, {search.NEAR_BUDGET}")
    if len(listed) < 2:  # one worth timing: nothing to choose between
        return list(candidates)
    if progress is not None:
        progress.phase("timing the shortlist on the devices", len(listed))

    timed: dict[Config, tuple[float, float | None]] = {}
    args = (layers, sample, batch_size, devices, optimizer, repeated_layers)
    for candidate in listed:  # one at a time while max_seconds leaves time for it
        key = (batch_size, probe_fits.step_key(candidate.config))
        stepped = measured.steps.get(key) if measured is not None else None
        if stepped is not None:  # a probe trained this very step: its times
            timed[candidate.config] = stepped
            if progress is not None:
                progress.step(f"{candidate.config.describe()}, timed as a probe")
            continue
        predicted = None
        if measured is not None:
            predicted = probe_fits.build_seconds(measured, probe_fits.shape_of(candidate.config, batch_size))
        if (timed or predicted is not None) and progress is not None and not progress.affords(1, predicted=predicted):
            if not_run is not None:
                chosen = "; chosen by prediction alone" if len(timed) < 2 else ""
                not_run.append(f"{len(listed) - len(timed)} of the shortlist not timed: no time left{chosen}")
            break
        timed[candidate.config] = _time_configured(candidate.config, *args, progress, predicted)
    return search.by_measured(candidates, len(timed), lambda config: timed[config], budget)


def _time_configured(
    config: Config,
    layers: Any,
    sample: Any,
    batch_size: int,
    devices: Sequence[str],
    optimizer: Any,
    repeated_layers: str,
    progress: Progress | None,
    predicted: float | None,
) -> tuple[float, float | None]:
    """``config`` trained on ``devices`` (``verified``): its step's seconds (inf where a device ran out of memory) and
    its largest device peak where the peaks can be read."""
    began = time.monotonic()
    try:
        probe = calibration_lib.configured_step(
            layers, sample, batch_size, config, devices, optimizer, repeated_layers=repeated_layers
        )
    except tf.errors.ResourceExhaustedError:  # predicted to fit, but a device ran out of memory: last
        return float("inf"), None
    finally:
        if progress is not None:
            progress.probe_took(time.monotonic() - began, predicted)
            progress.step(config.describe())
    return probe.seconds, calibration_lib.largest_peak(probe, devices, config.num_devices * config.num_replicas)


def _count(name: str, count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{name}={count!r}: give how many configurations to time, or 0 to choose by prediction alone.")
    return count


def _max_seconds(value: Any) -> float | str | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f'max_seconds={value!r}: give the seconds planning may take (> 0), "auto" or None.')
    return float(value)


def reused(profile: profile_lib.Profile, layers: Any) -> profile_lib.Profile:
    """A copy of ``profile`` (``plan.profile``) to plan ``layers`` (the planner's units) with again, checked against
    them."""
    if not isinstance(profile, profile_lib.Profile):
        raise TypeError(f"profile must be a tfpipe plan's profile (plan.profile), got {type(profile).__name__}.")
    if len(profile.weight_bytes) != len(layers):
        unit = "nodes" if isinstance(layers, units_lib.Nodes) else "layers"
        raise ValueError(
            f"profile=... was measured on {len(profile.weight_bytes)} {unit} but {len(layers)} are planned; pass the "
            "profile of a plan of these layers, or leave profile out to measure them."
        )
    again = copy.deepcopy(profile)  # the search fills sizes in: the earlier plan's profile stays as it was
    again.steps = {}  # timed on the earlier plan's devices and optimizer
    return again


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


def _named_schedule(name: str) -> str:
    """A schedule the search can take: one of ``schedule.ALL_SCHEDULES``, not one written as data."""
    checked = schedule_lib.check_name(name)
    if schedule_lib.is_written(checked):
        raise ValueError(
            f"schedules holds a schedule written as data ({name!r:.60}), which fixes its cells and devices; the "
            f"planner searches the named ones ({', '.join(map(repr, schedule_lib.ALL_SCHEDULES))}): plan with "
            "those, or give the written one to PipelineModel yourself."
        )
    return checked


def optimizer_slots(optimizer: Any) -> int:
    """Slots per trainable weight that ``optimizer`` (a name or a Keras optimizer) keeps: Adam 2, momentum 1, SGD 0."""
    name = budget_lib.optimizer_name(optimizer)
    if name not in SLOTS:
        raise ValueError(f"Unknown optimizer {optimizer!r} for the planner; use one of {sorted(SLOTS)}.")
    return SLOTS[name]
