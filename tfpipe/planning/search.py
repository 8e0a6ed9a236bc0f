"""The planner's search: every configuration that can run, its predicted time and memory, the fastest that fits.

A configuration is R replicas of K cells (R x K devices at most), M micro-batches, a
re-materialization mode and a schedule; a schedule that shares devices lays v x K cells over K devices. Its
cells are cut so that their measured times are
even (``balance.partition``); when that cut overflows the memory budget on some device, the
cut that evens the times among those whose every cell fits (``memory_balance``) is tried instead.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from tfpipe import balance as balance_lib
from tfpipe import schedule as schedule_lib
from tfpipe.backward.remat import REMAT_MODES
from tfpipe.planning import predict
from tfpipe.planning.predict import Calibration, Config, Prediction
from tfpipe.planning.profile import Profile

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# v, the cells each device holds, that the search tries for the schedules that share devices (Megatron-LM's
# interleaved runs take v = 2 to 4 of a few dozen layers a device)
CELLS_PER_DEVICE = (2, 4)
# Predictions are within 10-20% of measured steps (docs/benchmarks.md#planning): among candidates predicted within this
# fraction of the fastest, which one runs fastest is for a measurement to say.
SHORTLIST_BAND = 0.25
# Peak memory is predicted within 15% (docs/benchmarks.md#planning): a configuration is timed (run by the planner
# itself, which keeps to the budget) only where predicted at most this share of the budget; one nearer it is
# chosen by its prediction where fewer than two others are timed (12 x Dense(1024) on two workers: a shortlisted step
# predicted to fit 166 MiB held 168)
TIMED_HEADROOM = 0.87
NEAR_BUDGET = f"within {1 - TIMED_HEADROOM:.0%} of the budget"  # what the summary says of one left out so


@dataclasses.dataclass
class Candidate:
    """A configuration with its prediction, and whether it fits the budget: every device's predicted peak does."""

    config: Config
    prediction: Prediction
    fits: bool
    memory_cut: bool = False  # cut by memory_balance because the time-even cut did not fit
    measured_s: float | None = None  # its step timed on the devices (``by_measured``), where it was shortlisted
    measured_peak: float | None = None  # its largest device peak when timed, where each device's allocator was read

    def ran_over(self, budget: float | None) -> bool:
        """Whether its peak when timed was over ``budget``."""
        return budget is not None and self.measured_peak is not None and self.measured_peak > budget


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search may choose from."""

    num_devices: int
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    schedules: tuple[str, ...] = schedule_lib.ALL_SCHEDULES
    remats: tuple[str, ...] = REMAT_MODES
    replicas: bool = True  # whether fewer cells with replicas may be chosen
    # v, the cells on each device, for the schedules that share devices (``schedule.SHARED_SCHEDULES``; ZB-V's V
    # holds two); the others hold one
    cells_per_device: tuple[int, ...] = CELLS_PER_DEVICE


def cells_per_device(schedule: str, k: int, num_layers: int, space: Space) -> list[int]:
    """The values of v to try for ``schedule`` over ``k`` devices: 1 for a schedule of one cell per device, else
    those of ``space`` above 1 (2 for a V) that leave every cell a layer, on two devices or more."""
    if not schedule_lib.shares_devices(schedule):
        return [1]
    if k < 2:
        return []  # several cells on one device: one cell's step with more tasks
    allowed = [2] if schedule in schedule_lib.V_SCHEDULES else space.cells_per_device
    return [v for v in allowed if v > 1 and v * k <= num_layers]


def shapes(batch_size: int, num_layers: int, space: Space) -> list[tuple[int, int, int]]:
    """Every (R, K, M) to try: R x K devices at most, K at most the layers, M at most a replica's batch."""
    out: list[tuple[int, int, int]] = []
    for r in range(1, (space.num_devices if space.replicas else 1) + 1):
        if batch_size % r:
            continue  # replicas take equal shares of every batch
        per_replica = batch_size // r
        for k in range(1, min(space.num_devices // r, num_layers) + 1):
            out.extend((r, k, m) for m in space.micro_batches if m <= per_replica)
    return out


def most_tasks(batch_size: int, num_layers: int, space: Space) -> int:
    """The most forward and backward tasks one replica's step of ``shapes`` runs (2 x K x M, K the cells)."""
    found = shapes(batch_size, num_layers, space)
    return max(
        (
            2 * k * v * m
            for _, k, m in found
            for s in space.schedules
            for v in cells_per_device(s, k, num_layers, space)
        ),
        default=0,
    )


def micro_batch_sizes(batch_size: int, num_layers: int, space: Space) -> list[int]:
    """The micro-batch sizes the profile must hold for ``shapes``."""
    found = shapes(batch_size, num_layers, space)
    sizes = {predict.split_size(batch_size, r, m) for r, _, m in found}
    if any(schedule_lib.batches_weights(name) for name in space.schedules):  # its W runs on a replica's whole batch
        sizes |= {predict.split_size(batch_size, r, 1) for r, _, _ in found}
    return sorted(sizes)


def run(
    profile: Profile,
    calibration: Calibration,
    batch_size: int,
    space: Space,
    budget: float | None,
    slots: int,
) -> list[Candidate]:
    """Every configuration in ``space``, predicted; fastest first, those that fit before those that do not."""
    num_layers = len(profile.output_bytes)
    out: list[Candidate] = []
    cuts: dict[tuple[int, int], list[int]] = {}  # (micro-batch size, cells) -> the time-even cut
    for (r, k, m), schedule, remat in itertools.product(
        shapes(batch_size, num_layers, space), space.schedules, space.remats
    ):
        if schedule_lib.batches_weights(schedule) and remat != "never":
            continue  # it holds every activation until W: recomputation cannot save any (step.unrolled.check_remat)
        if k == 1 and schedule != "gpipe":
            continue  # one cell: every schedule is GPipe's order
        if m < schedule_lib.least_micro_batches(schedule, k):
            continue  # DualPipeV's phases need 2K - 1
        b = predict.split_size(batch_size, r, m)
        costs = profile.costs(b)
        times = [f + x for f, x in zip(costs.forward_s, costs.backward_s)]
        for v in cells_per_device(schedule, k, num_layers, space):
            if (b, k * v) not in cuts:  # the same for every schedule and remat
                one = [num_layers]
                cuts[b, k * v] = balance_lib.partition(times, k * v, profile.output_bytes) if k * v > 1 else one
            shape = Config(tuple(cuts[b, k * v]), r, m, remat, schedule, v)
            out.append(_candidate(profile, calibration, batch_size, times, shape, budget, slots))
    # ties (M=1 runs every remat and schedule alike) go to fewer devices, then to less memory
    out.sort(
        key=lambda c: (
            not c.fits,
            round(c.prediction.step_s, 9),
            c.config.num_devices * c.config.num_replicas,
            max(c.prediction.peak_bytes),
        )
    )
    return out


def _candidate(
    profile: Profile,
    calibration: Calibration,
    batch_size: int,
    times: Sequence[float],
    shape: Config,
    budget: float | None,
    slots: int,
) -> Candidate:
    """``shape``, cut so that its cells' times are even; where that does not fit ``budget`` (one cell a device), cut
    by ``memory_balance`` instead."""
    k, r, m, remat, schedule = (
        shape.num_devices, shape.num_replicas, shape.num_micro_batches, shape.remat, shape.schedule
    )  # fmt: skip
    b = predict.split_size(batch_size, r, m)
    candidate = _evaluate(profile, calibration, batch_size, shape, budget, slots)
    if not candidate.fits and k > 1 and shape.cells_per_device == 1:
        cut = memory_balance(
            profile,
            times,
            b,
            k,
            m,
            remat,
            schedule,
            slots,
            budget,
            calibration.noinline_tasks,
            calibration.across_processes,
        )
        if cut is not None:
            candidate = _evaluate(
                profile, calibration, batch_size, Config(tuple(cut), r, m, remat, schedule), budget, slots
            )
            candidate.memory_cut = True
    return candidate


def _evaluate(
    profile: Profile, calibration: Calibration, batch_size: int, config: Config, budget: float | None, slots: int
) -> Candidate:
    prediction = predict.step_seconds(profile, calibration, batch_size, config)
    prediction.peak_bytes = predict.peak_bytes(
        profile, batch_size, config, slots, calibration.noinline_tasks, calibration.across_processes
    )
    return Candidate(config, prediction, budget is None or max(prediction.peak_bytes) <= budget)


def memory_balance(
    profile: Profile,
    times: Sequence[float],
    b: int,
    k: int,
    m: int,
    remat: str,
    schedule: str,
    slots: int,
    budget: float | None,
    noinline_tasks: int = predict.NOINLINE_TASKS,
    across_processes: bool = False,
) -> list[int] | None:
    """The cut into ``k`` cells with the least largest cell time among those whose every cell's peak fits ``budget``.

    None if no cut fits. Dynamic programming over (cells, layers), every cell's peak read from one table
    (``predict.cell_bytes_table``): O(k L^2) array work.
    """
    if budget is None:
        return None
    num_layers = len(times)
    held_at_once, kept, ratio = predict.holding(profile, b, k, m, schedule, remat, noinline_tasks)
    summed = predict.holds_running_sums(m, schedule, across_processes)
    inline = predict.inlined(k, m, noinline_tasks)
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    span = prefix[None, :] - prefix[:, None]  # [lo, hi]: the time of layers [lo, hi)
    tables = {
        first: predict.cell_bytes_table(profile, b, first, slots, m, ratio, inline, summed) for first in (True, False)
    }
    best = np.full((k + 1, num_layers + 1), np.inf)
    choice = np.zeros((k + 1, num_layers + 1), dtype=int)
    best[0, 0] = 0.0
    ends = np.arange(num_layers + 1)
    for c in range(1, k + 1):  # every hi at once: cell c is layers [lo, hi), after c - 1 cells over [0, lo)
        fits = tables[c == 1].peaks(held_at_once[c - 1], kept[c - 1]) <= budget
        value = np.where(fits, np.maximum(best[c - 1][:, None], span), np.inf)
        reachable = (ends >= c) & (ends <= num_layers - (k - c))  # leaves a layer to each cell after it
        best[c] = np.where(reachable, value.min(axis=0), np.inf)
        choice[c] = value.argmin(axis=0)  # the first lo of the least time, as a scan upward keeps
    if not np.isfinite(best[k, num_layers]):
        return None
    cut, hi = [], num_layers
    for c in range(k, 0, -1):
        lo = int(choice[c, hi])
        cut.append(hi - lo)
        hi = lo
    return cut[::-1]


def shortlist(candidates: Sequence[Candidate], count: int, budget: float | None = None) -> list[Candidate]:
    """Up to ``count`` candidates worth timing: the fastest predicted of each (K, R, schedule), in order,
    predicted within SHORTLIST_BAND of the fastest (near-identical variants of one shape would tell nothing new; at
    M=1 the schedules are one shape). Only those predicted to fit, within ``TIMED_HEADROOM`` of ``budget`` where one
    is given: timing one keeps to the budget (a GPU's memory)."""
    room = None if budget is None else TIMED_HEADROOM * budget
    # stable: among equal times the search's order (fewer devices, less memory) stays
    fitting = sorted(
        (c for c in candidates if c.fits and (room is None or max(c.prediction.peak_bytes) <= room)),
        key=lambda c: round(c.prediction.step_s, 9),
    )
    out: list[Candidate] = []
    seen = set()
    for candidate in fitting:
        if len(out) == count or candidate.prediction.step_s > fitting[0].prediction.step_s * (1 + SHORTLIST_BAND):
            break
        config = candidate.config
        # at M=1 every schedule runs each cell's forward then its backward: one shape, timed once
        shape = (config.num_devices, config.num_replicas, config.schedule if config.num_micro_batches > 1 else "")
        if shape not in seen:
            seen.add(shape)
            out.append(candidate)
    return out


def by_measured(
    candidates: Sequence[Candidate],
    count: int,
    time_step: Callable[[Config], tuple[float, float | None]],
    budget: float | None = None,
) -> list[Candidate]:
    """``candidates`` with their shortlist timed by ``time_step`` (seconds, largest device peak or None) and put first,
    fastest measured first; one whose measured peak is over ``budget`` goes last among them.

    The rest follow in their predicted order. With fewer than two to time, nothing is timed; where none ran within
    the budget (or at all: ``time_step`` gave inf, out of memory), the predicted order stays.
    """
    listed = shortlist(candidates, count, budget)
    if len(listed) < 2:
        return list(candidates)

    def timed_one(candidate: Candidate) -> Candidate:
        seconds, peak = time_step(candidate.config)
        return dataclasses.replace(candidate, measured_s=float(seconds), measured_peak=peak)

    def over(candidate: Candidate) -> bool:
        return not candidate.fits or candidate.ran_over(budget)

    timed = sorted((timed_one(c) for c in listed), key=lambda c: (over(c), c.measured_s))
    if over(timed[0]) or timed[0].measured_s == float("inf"):
        return list(candidates)
    chosen = {id(c) for c in listed}
    return timed + [c for c in candidates if id(c) not in chosen]
