"""Predicted step time and peak memory of one configuration, from a layer profile and a cluster calibration.

Time: each cell's forward and backward are the sums of its layers' measured times at the
micro-batch size, plus the calibrated cost of a task and of moving the boundary tensor;
the schedule is simulated as data (``schedule.simulate``; one W over all micro-batches runs at the
replica's whole batch, ``batched_w_costs``); devices that share compute
(logical devices on one CPU) cannot together run more than the calibrated parallelism;
then the optimizer's update and the step's fixed cost are added.

Memory, per device: the cell's weights, one gradient per trainable weight, the
optimizer's slots (replica 0 only), across processes part of another copy of the gradients where a cell sums
M > 1 micro-batches' (``RUNNING_SUM``), the micro-batches in flight that the schedule holds
(``schedule.in_flight``), each holding the cell's input, and of those every layer's saved
activations for the micro-batches not recomputed and for one being recomputed
(``activations_at_once``; one recomputed within a backward call that frees as it goes counts as an inlined
step's); and the largest working set of a backward. The first cell
also holds the batch. What a micro-batch's activations hold is the layers' measured
bytes scaled to what real steps held (``Profile.held_ratio``): a step that calls its
cells without inlining them (from ``Calibration.noinline_tasks`` tasks on) keeps every
intermediate of each call, one that inlines them keeps what the backward reads. With v cells a device
(``Config.cells_per_device``) the schedule runs on K/v devices and a device holds its cells' bytes together, with
the largest of their working sets.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from tfpipe import schedule as schedule_lib
from tfpipe.backward import remat as remat_lib
from tfpipe.planning.profile import Profile
from tfpipe.step.unrolled import NOINLINE_TASKS

# Where a step calls its cells without inlining them, each cell holds this many more copies of its weights'
# gradients (their running sums go into each call and new ones come out; measured on 12 x Dense at K=2, M=16
# against M=8: 1.57x the weights at width 256, 1.70x at 512, growing with the weights, not the activations)
NOINLINE_GRADIENTS = 1.6
# Where cells run in other processes and a step adds M > 1 micro-batches' weight gradients to running sums, a cell's
# backward holds the sums it was given beside the new ones for part of its run: this share of one more copy of its
# weights' gradients (measured on two workers, 12 x Dense(512) cut 6-6, against M=1 with the same activations:
# 0.64 with SGD, 0.56-1.36 with Adam; fitted over both models' worker grids of docs/benchmarks.md). The grids on
# logical devices of one process showed no such copy (what one holds there, the held ratios fitted in it absorb).
RUNNING_SUM = 0.5
# The share of a layer's backward that computes its weight gradients (W), where it has trainable weights: for a
# Dense or a projection, dW and dX are products of the same size; layers without weights have no W
WEIGHT_GRADIENT_SHARE = 0.5
# Optimizer slots per trainable weight (Keras' built-in optimizers)
SLOTS = {"sgd": 0, "sgd_momentum": 1, "rmsprop": 1, "adagrad": 1, "adam": 2, "adamw": 2, "lamb": 2, "nadam": 2}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a step costs on these devices beyond the layers' own time, measured once per set of devices."""

    task_s: float  # one forward or backward task: its launch, its transfer's latency, its wait
    step_s: float  # one step's fixed cost: calling the step, the client's work before and after
    bandwidth: float  # bytes per second from one device to the next
    parallelism: float  # how many devices' worth of compute run at once (logical devices share a CPU's cores)
    update_s_per_byte: float  # the optimizer's update, per byte of trainable weights
    source: str = "measured"  # how these were found, for Plan.summary
    noinline_task_s: float | None = None  # a task where the step calls its cells without inlining them
    # replicas' parallelism: whole one-cell steps side by side contend for a shared CPU's caches and memory more than
    # a pipeline's micro-batch tasks do (measured on two workers: a Transformer's replicas 1.78, its pipeline 2.00);
    # None: ``parallelism``
    replica_parallelism: float | None = None
    # from how many tasks a step on these devices calls its cells without inlining them (``unrolled.noinline_tasks``)
    noinline_tasks: int = NOINLINE_TASKS
    # how much faster a cell's layers run where the model is cut over several devices than measured on one device
    # (logical devices of one CPU: one device alone leaves some of its cores idle); fitted on the model (planner)
    split_speed: float = 1.0
    # whether the devices are in other processes, where what one device sends another arrives as a copy held beside
    # the original: the first replica then holds every other replica's gradients at once before summing them
    # (measured on two workers: 12 x Dense(512), two replicas, the first worker held one more copy of the weights)
    across_processes: bool = False
    # concatenating tensors on a device, per byte: one W over all micro-batches joins what each B left it first
    copy_s_per_byte: float = 0.0

    def parallelism_of(self, num_replicas: int, num_partitions: int = 1) -> float:
        """How many devices' worth of compute R replicas of K cells get: replicas of one cell run whole steps side by
        side (``replica_parallelism``); replicas of a pipeline run micro-batch tasks, as the pipeline probe did."""
        if num_replicas > 1 and num_partitions == 1 and self.replica_parallelism is not None:
            return self.replica_parallelism
        return self.parallelism

    def task_seconds(self, inline: bool) -> float:
        """A task's cost in a step that inlines its cells' calls, or does not (``task_s`` where not measured)."""
        return self.task_s if inline or self.noinline_task_s is None else self.noinline_task_s


@dataclasses.dataclass(frozen=True)
class Config:
    """One candidate: R replicas of K cells cut by ``balance``, M micro-batches, remat and schedule; with one of
    ``schedule.SHARED_SCHEDULES``, v cells on each of K / v devices (``cells_per_device``)."""

    balance: tuple[int, ...]
    num_replicas: int
    num_micro_batches: int
    remat: str
    schedule: str
    cells_per_device: int = 1

    @property
    def num_partitions(self) -> int:
        """K, the number of cells."""
        return len(self.balance)

    @property
    def num_devices(self) -> int:
        """The devices one replica's cells are laid out over: K / v."""
        return self.num_partitions // self.cells_per_device

    def placement(self) -> list[int]:
        """The device (of one replica's ``num_devices``) of each cell (``schedule.placement``)."""
        return schedule_lib.placement(self.schedule, self.num_partitions, self.num_devices)

    def describe(self) -> str:
        """One line: K, R, M, remat, schedule and the balance."""
        replicas = f" x {self.num_replicas} replicas" if self.num_replicas > 1 else ""
        shared = f" on {self.num_devices} devices" if self.cells_per_device > 1 else ""
        return (
            f"K={self.num_partitions}{shared}{replicas}, M={self.num_micro_batches}, remat={self.remat!r}, "
            f"schedule={self.schedule!r}, balance={list(self.balance)}"
        )


@dataclasses.dataclass
class Prediction:
    """A configuration's predicted step seconds (and its parts) and peak bytes per device."""

    step_s: float
    pipeline_s: float  # the simulated schedule (with the parallelism bound)
    update_s: float
    fixed_s: float
    peak_bytes: list[float]  # per device, replica by replica, cell by cell
    work_s: float = 0.0  # every task's time added up: what the devices must run, side by side or not


def bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """The layer range [lo, hi) of each cell."""
    out, lo = [], 0
    for n in balance:
        out.append((lo, lo + n))
        lo += n
    return out


def micro_batch_size(batch_size: int, config: Config) -> int:
    """Samples per micro-batch: the batch split over R replicas, then over M micro-batches (rounded up)."""
    return split_size(batch_size, config.num_replicas, config.num_micro_batches)


def split_size(batch_size: int, num_replicas: int, num_micro_batches: int) -> int:
    """The largest micro-batch of a batch split over ``num_replicas``, then ``num_micro_batches``."""
    per_replica = -(-batch_size // num_replicas)
    return -(-per_replica // num_micro_batches)


def step_seconds(profile: Profile, calibration: Calibration, batch_size: int, config: Config) -> Prediction:
    """The predicted time of one training step of ``config`` (the same for every replica)."""
    k, cells = config.num_devices, bounds(config.balance)
    simulated = timeline(profile, calibration, batch_size, config)
    span = max(end for _, _, end in simulated)
    devices = k * config.num_replicas
    work = config.num_replicas * sum(end - start for _, start, end in simulated)
    pipeline_s = max(span, work / min(calibration.parallelism_of(config.num_replicas, k), devices))
    trainable = by_device([profile.cell_weights(lo, hi)[1] for lo, hi in cells], config)
    # each device updates its own cells' weights; devices that share compute share the work
    updating = max(max(trainable), sum(trainable) / min(calibration.parallelism, k))
    update_s = updating * calibration.update_s_per_byte
    if config.num_replicas > 1:  # weights out to the replicas, their gradient sums back
        update_s += 2 * sum(trainable) * (config.num_replicas - 1) / calibration.bandwidth
    fixed_s = calibration.step_s
    return Prediction(pipeline_s + update_s + fixed_s, pipeline_s, update_s, fixed_s, [], work_s=work)


def by_device(per_cell: Sequence[float], config: Config) -> list[float]:
    """Per-cell values added up on each of one replica's devices (several cells a device: ``cells_per_device``)."""
    out = [0.0] * config.num_devices
    for value, device in zip(per_cell, config.placement()):
        out[device] += value
    return out


def timeline(
    profile: Profile, calibration: Calibration, batch_size: int, config: Config
) -> list[tuple[schedule_lib.Task, float, float]]:
    """(task, start, end) of every task of one replica's step of ``config``, simulated from the measured costs."""
    b = micro_batch_size(batch_size, config)
    costs = profile.costs(b)
    k, m = config.num_partitions, config.num_micro_batches
    cells = bounds(config.balance)
    speed = calibration.split_speed if config.num_devices > 1 else 1.0
    fwd = [sum(costs.forward_s[lo:hi]) / speed for lo, hi in cells]
    bwd = [sum(costs.backward_s[lo:hi]) / speed for lo, hi in cells]
    # a boundary tensor goes forward after cell i and its gradient comes back: charge the receivers (where the next
    # cell is on another device: a V's turn stays on its device)
    where = config.placement()
    moved = [
        profile.output_bytes[hi - 1] * b / calibration.bandwidth if i < k - 1 and where[i] != where[i + 1] else 0.0
        for i, (_, hi) in enumerate(cells)
    ]
    inline = inlined(k, m, calibration.noinline_tasks)  # a whole backward then sends its input gradients first
    task_s = calibration.task_seconds(inline)
    f_cost = [f + task_s + (moved[i - 1] if i else 0.0) for i, f in enumerate(fwd)]
    b_cost = [x + task_s + moved[i] for i, x in enumerate(bwd)]
    w_cost = None
    if schedule_lib.batches_weights(config.schedule):
        b_cost, w_cost = batched_w_costs(profile, calibration, batch_size, config, b_cost, speed)
    r_cost = [f * profile.recompute_ratio(config.num_devices) for f in fwd]
    return schedule_lib.simulate(
        k, m, f_cost, b_cost, config.schedule, w_cost=w_cost, r_cost=r_cost,
        recomputed=recomputed_micro_batches(config), num_devices=config.num_devices, inputs_first=inline,
    )  # fmt: skip


def recomputed_micro_batches(config: Config) -> list[int]:
    """The micro-batches whose forward ``config``'s remat recomputes in their backward."""
    m = config.num_micro_batches
    return [j for j in range(m) if remat_lib.recomputes(config.remat, j, m)]


def batched_w_costs(
    profile: Profile,
    calibration: Calibration,
    batch_size: int,
    config: Config,
    b_cost: Sequence[float],
    speed: float = 1.0,
) -> tuple[list[float], list[float]]:
    """Per cell, (b_cost, w_cost) for ``schedule.simulate`` where one W runs over all M micro-batches' rows.

    That W is one product over a replica's whole batch, which runs at the batch's efficiency, not M micro-batches'
    (``tfpipe.backward.batched_w``): each B task is the backward at the micro-batch size less its W, and the W task
    (``simulate`` runs M times ``w_cost``) is the W at the replica's batch size, and the copy that joins the
    micro-batches' rows for it first (``Profile.joined_bytes``). Where that size was not profiled, M micro-batches' W.
    """
    b = micro_batch_size(batch_size, config)
    rows = split_size(batch_size, config.num_replicas, 1)
    small = profile.costs(b).backward_s
    large = profile.by_batch.get(rows, profile.costs(b)).backward_s
    scale = 1.0 if rows in profile.by_batch else config.num_micro_batches
    m, out_b, out_w = config.num_micro_batches, [], []
    for cost, (lo, hi) in zip(b_cost, bounds(config.balance)):
        weighted = [i for i in range(lo, hi) if profile.trainable_bytes[i] > 0]
        w_small = WEIGHT_GRADIENT_SHARE * sum(small[i] for i in weighted) / speed
        w_all = WEIGHT_GRADIENT_SHARE * scale * sum(large[i] for i in weighted) / speed
        w_all += sum(profile.joined_bytes[lo:hi]) * rows * calibration.copy_s_per_byte
        out_b.append(cost - w_small + w_all / m)
        out_w.append(w_all / m)
    return out_b, out_w


def inlined(num_partitions: int, num_micro_batches: int, noinline_tasks: int = NOINLINE_TASKS) -> bool:
    """Whether a step of K cells and M micro-batches inlines its cells' calls (the step's own rule)."""
    return 2 * num_partitions * num_micro_batches < noinline_tasks


def holds_running_sums(num_micro_batches: int, schedule: str, across_processes: bool) -> bool:
    """Whether a cell holds part of another copy of its gradients beside their running sums (``RUNNING_SUM``): its
    cells are in other processes, M > 1, and a W per micro-batch adds to the sums."""
    return across_processes and num_micro_batches > 1 and not schedule_lib.batches_weights(schedule)


def peak_bytes(
    profile: Profile,
    batch_size: int,
    config: Config,
    slots: int,
    noinline_tasks: int = NOINLINE_TASKS,
    across_processes: bool = False,
) -> list[float]:
    """The predicted peak bytes of each device: replica 0's cells, then each other replica's.

    ``across_processes``: the other replicas' gradients arrive on replica 0's devices as copies (``Calibration``).
    """
    b = micro_batch_size(batch_size, config)
    k, m, r = config.num_partitions, config.num_micro_batches, config.num_replicas
    held_at_once, kept, ratio = holding(
        profile, b, k, m, config.schedule, config.remat, noinline_tasks, config.num_devices
    )
    inline = inlined(k, m, noinline_tasks)
    summed = holds_running_sums(m, config.schedule, across_processes)
    out: list[float] = []
    for replica in range(r):
        held, working = [0.0] * config.num_devices, [0.0] * config.num_devices
        for i, ((lo, hi), device) in enumerate(zip(bounds(config.balance), config.placement())):
            slots_here = slots if replica == 0 else 0
            parts = cell_bytes(profile, b, lo, hi, i == 0, slots_here, m, ratio, inline, summed)
            held[device] += parts.static + held_at_once[i] * parts.cell_input + kept[i] * parts.activations
            # a device runs one of its cells' backwards at a time: the largest working set, not their sum
            working[device] = max(working[device], parts.working)
            if replica == 0 and across_processes:
                held[device] += (r - 1) * sum(profile.trainable_bytes[lo:hi])
        out.extend(h + w for h, w in zip(held, working))
    return out


def holding(
    profile: Profile,
    b: int,
    k: int,
    m: int,
    schedule: str,
    remat: str,
    noinline_tasks: int = NOINLINE_TASKS,
    num_devices: int | None = None,
) -> tuple[list[int], list[float], float]:
    """What each of K cells (on ``num_devices``, default K) holds at M micro-batches of b rows: ``cell_peak``'s
    in_flight, kept and held_ratio."""
    order = schedule_lib.steps(schedule, k, m, num_devices=num_devices)
    inline = inlined(k, m, noinline_tasks)
    kept = activations_at_once(order, k, remat, m, recomputing_share(profile, b, inline))
    return schedule_lib.in_flight(order, k), kept, held_share(profile, b, inline, schedule)


def held_share(profile: Profile, b: int, inline: bool, schedule: str) -> float:
    """What a micro-batch's activations hold in a step of ``schedule``, against the layers' measured bytes.

    A step that calls its cells without inlining them keeps every intermediate of a forward call; a split
    backward's forward call returns only what its B and W read, as an inlined step keeps, yet such steps held
    about halfway between the two (Transformer, K=4 on 2 logical CPUs, M=8: ZB-V, interleaved zero bubble and
    DualPipeV within 4% of the halfway share, zero bubble at K=2, M=16 within 1%; at either end they were 18-30%
    off, docs/benchmarks.md#planning), so the planner takes the mean.
    """
    if inline or not schedule_lib.splits_backward(schedule):
        return profile.held_ratio(b, inline)
    return (profile.held_ratio(b, True) + profile.held_ratio(b, False)) / 2


def recomputing_share(profile: Profile, b: int, inline: bool) -> float:
    """What a micro-batch recomputed within its backward call holds against one held from its forward call: a
    backward call frees its intermediates as it goes, as an inlined step does (1 where the step inlines)."""
    ratio = profile.held_ratio(b, inline)
    return 1.0 if inline or ratio <= 0 else profile.held_ratio(b, True) / ratio


def activations_at_once(
    order: Sequence[schedule_lib.Task], num_cells: int, remat: str, m: int, recomputing: float = 1.0
) -> list[float]:
    """Per cell, the most micro-batches' activations held at once under ``remat``, in micro-batches held from a forward.

    A micro-batch that is not recomputed holds them from its forward; a recomputed one from its B, where it is
    recomputed; either until its cell's last backward task (W where the order has W tasks). So 1F1B with
    ``"except_last"`` holds two: the last micro-batch's, kept, while an earlier one is recomputed. ``recomputing``:
    what one being recomputed within its B holds against one held from its forward (a step that does not inline its
    cells keeps every intermediate of a forward call for the backward call, while the backward call that recomputes
    frees them as it goes); where the order has W tasks the B hands them to W, as a forward call does.
    """
    split = {task.cell for task in order if task.kind == "W"}
    held: list[dict[int, float]] = [{} for _ in range(num_cells)]
    peak = [0.0] * num_cells
    for task in order:
        cell, j = task.cell, task.micro_batch
        if j == schedule_lib.ALL:  # W over every micro-batch at once: all are released
            held[cell].clear()
            continue
        recomputed = remat_lib.recomputes(remat, j, m)
        if task.kind == "F" and not recomputed:
            held[cell][j] = 1.0
        elif task.kind == "B" and recomputed:
            held[cell][j] = 1.0 if cell in split else recomputing
        peak[cell] = max(peak[cell], sum(held[cell].values()))
        if task.kind == ("W" if cell in split else "B"):
            held[cell].pop(j, None)
    return peak


def cell_peak(
    profile: Profile,
    b: int,
    lo: int,
    hi: int,
    first: bool,
    in_flight: int,
    kept: float,
    slots: int,
    m: int,
    held_ratio: float = 1.0,
    inline: bool = True,
    summed: bool = False,
) -> float:
    """One cell's predicted peak: layers [lo, hi) at micro-batch size ``b``.

    ``in_flight`` micro-batches hold the cell's input, ``kept`` hold every activation at once
    (``activations_at_once``). ``slots``: optimizer slots per trainable weight on this device (0 on replicas
    other than the first). ``held_ratio``: what a micro-batch's activations hold in a step, against the layers'
    measured bytes. ``inline``: whether the step inlines its cells' calls (``inlined``). ``summed``: whether the
    cell holds part of another copy of its gradients beside their running sums (``holds_running_sums``).
    """
    parts = cell_bytes(profile, b, lo, hi, first, slots, m, held_ratio, inline, summed)
    return parts.static + in_flight * parts.cell_input + kept * parts.activations + parts.working


@dataclasses.dataclass(frozen=True)
class CellBytes:
    """What one cell's device holds: all step long, per micro-batch in flight, per micro-batch's activations kept,
    and during a backward."""

    static: float  # weights, gradients, optimizer slots, and on the first cell the batch
    cell_input: float
    activations: float
    working: float
    gradients: float  # of ``static``: the weights' gradients, with their copies in and out of a call
    called: float  # of ``gradients``: the copies held only while a backward call runs (cells not inlined)


def cell_bytes(
    profile: Profile,
    b: int,
    lo: int,
    hi: int,
    first: bool,
    slots: int,
    m: int,
    held_ratio: float = 1.0,
    inline: bool = True,
    summed: bool = False,
) -> CellBytes:
    """The parts of ``cell_peak`` for layers [lo, hi) at micro-batch size ``b`` (its arguments' meanings)."""
    costs = profile.costs(b)
    weights, trainable, borrowed = profile.cell_weights(lo, hi)
    gradients = gradient_copies(inline, summed)
    batch = 2 * m * b * profile.input_bytes if first else 0.0
    return CellBytes(
        static=weights + (gradients + slots) * trainable + gradients * borrowed + batch,
        cell_input=b * (profile.input_bytes if first else profile.output_bytes[lo - 1]),
        activations=held_ratio * sum(costs.held_bytes[lo:hi]),
        working=max(costs.working_bytes[lo:hi]),
        gradients=gradients * (trainable + borrowed),
        called=0.0 if inline else NOINLINE_GRADIENTS * (trainable + borrowed),
    )


def gradient_copies(inline: bool, summed: bool) -> float:
    """The copies of its weights' gradients a cell holds: one, with part of another beside running sums across
    processes (``summed``), or the copies in and out of a call where the step does not inline its cells."""
    return (1.0 + (RUNNING_SUM if summed else 0.0)) if inline else 1.0 + NOINLINE_GRADIENTS


def cell_bytes_table(
    profile: Profile,
    b: int,
    first: bool,
    slots: int,
    m: int,
    held_ratio: float = 1.0,
    inline: bool = True,
    summed: bool = False,
) -> CellBytesTable:
    """``cell_bytes`` of every cell at once: each field an array whose [lo, hi] entry is that of layers [lo, hi)
    (``cell_input`` a column, by lo), from prefix sums. What ``search.memory_balance`` weighs every cut with: one
    cell at a time cost its dynamic program O(k L^3) (3.1 min of a 339-layer plan's search)."""
    n = len(profile.output_bytes)
    costs = profile.costs(b)
    lo, hi = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]

    def ranged(values: Sequence[float]) -> np.ndarray:  # the sum over [lo, hi)
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
        return prefix[None, :] - prefix[:, None]

    weights, owned = ranged(profile.weight_bytes), ranged(profile.trainable_bytes)
    by_owner: dict[int, list] = defaultdict(list)
    for tie in profile.tied:
        by_owner[tie.owner].append(tie)
    borrowed = np.zeros((n + 1, n + 1))
    for owner, ties in by_owner.items():  # held once a cell however often read, where the cell does not own it
        reads = np.zeros((n + 1, n + 1), dtype=bool)
        for tie in ties:
            reads |= (lo <= tie.reader) & (tie.reader < hi)
        reads &= ~((lo <= owner) & (owner < hi))
        weights = weights + reads * ties[-1].weight_bytes
        borrowed = borrowed + reads * ties[-1].trainable_bytes
    gradients = gradient_copies(inline, summed)
    batch = 2 * m * b * profile.input_bytes if first else 0.0
    # the largest working set over [lo, hi): each row's running maximum from lo on
    working = np.asarray(costs.working_bytes, dtype=float)
    running = np.maximum.accumulate(np.where(np.arange(n)[None, :] >= lo, working[None, :], -np.inf), axis=1)
    largest = np.concatenate([np.full((n + 1, 1), -np.inf), running], axis=1)
    outputs = np.asarray(profile.output_bytes, dtype=float)[np.arange(n + 1) - 1]  # after layer lo - 1
    return CellBytesTable(
        static=weights + (gradients + slots) * owned + gradients * borrowed + batch,
        cell_input=b * (np.full((n + 1, 1), profile.input_bytes) if first else outputs[:, None]),
        activations=held_ratio * ranged(costs.held_bytes),
        working=largest,
    )


@dataclasses.dataclass(frozen=True)
class CellBytesTable:
    """``CellBytes``' parts of ``cell_peak`` for every cell [lo, hi) (``cell_bytes_table``)."""

    static: np.ndarray
    cell_input: np.ndarray
    activations: np.ndarray
    working: np.ndarray

    def peaks(self, in_flight: int, kept: float) -> np.ndarray:
        """``cell_peak`` of every cell: entry [lo, hi]; +inf where hi <= lo (no cell)."""
        found = self.static + in_flight * self.cell_input + kept * self.activations + self.working
        return np.where(np.isfinite(self.working), found, np.inf)


# Devices that share one allocator (logical devices of one CPU) -----------------------------------
def shared_peak_bytes(profile: Profile, calibration: Calibration, batch_size: int, config: Config, slots: int) -> float:
    """The most bytes all of ``config``'s devices hold at one moment of a step, predicted.

    Each device's own peak (``peak_bytes``) takes the most inputs in flight and the most activations kept at once
    together; where one allocator serves every device (logical devices of one CPU), what it counts at its peak is
    the sum over the devices at one moment, and the cells reach their own peaks at different moments (a 1F1B cell
    i holds its most micro-batches while cell i + 1 holds fewer). So the simulated schedule (``timeline``) is
    followed task by task: a micro-batch holds its cell's input from its forward on, its activations from its
    forward (or, recomputed, from its backward) on, both until its cell's last backward task; a backward holds its
    working set while it runs. A cell's gradients are held from its first backward task on, and where its calls are
    not inlined, their copies in and out of a call while a backward runs (looped BFS on an MLP, whose first cells
    start their backwards after the last cells' activations are gone: +23% with every gradient held all step, +2% so).
    """
    b = micro_batch_size(batch_size, config)
    k, m = config.num_partitions, config.num_micro_batches
    inline = inlined(k, m, calibration.noinline_tasks)
    ratio = held_share(profile, b, inline, config.schedule)
    summed = holds_running_sums(m, config.schedule, calibration.across_processes)
    simulated = timeline(profile, calibration, batch_size, config)
    split = schedule_lib.splits_backward(config.schedule)
    # one recomputed within a backward call (``activations_at_once``); a split backward hands it to W whole
    recomputing = 1.0 if split else recomputing_share(profile, b, inline)
    again = set(recomputed_micro_batches(config))
    released = {
        (task.cell, task.micro_batch): end for task, _, end in simulated if task.kind == ("W" if split else "B")
    }
    cells = bounds(config.balance)
    parts = [
        cell_bytes(profile, b, lo, hi, i == 0, slots, m, ratio, inline, summed) for i, (lo, hi) in enumerate(cells)
    ]
    # every replica runs the same timeline and holds the same but its optimizer slots (the first replica's only);
    # a cell's gradients from its first backward task on, their copies in and out of a call while one runs
    r = config.num_replicas
    static = sum(p.static - p.gradients for p in parts) + (r - 1) * sum(
        cell_bytes(profile, b, lo, hi, i == 0, 0, m, ratio, inline, summed).static - parts[i].gradients
        for i, (lo, hi) in enumerate(cells)
    )
    changes: dict[float, float] = defaultdict(float)
    for cell_index, start in first_backwards(simulated).items():
        changes[start] += r * (parts[cell_index].gradients - parts[cell_index].called)
    for task, start, end in simulated:
        cell, j = parts[task.cell], task.micro_batch
        if task.kind in "BW":
            _hold(changes, start, end, r * (cell.working + cell.called))
        if task.kind == "W" or j == schedule_lib.ALL:
            continue
        free = released.get((task.cell, j), released.get((task.cell, schedule_lib.ALL)))
        assert free is not None  # every micro-batch's is let go by its cell's last backward task
        if task.kind == "F":
            _hold(changes, start, free, r * cell.cell_input)
        if (task.kind == "F") != (j in again):
            _hold(changes, start, free, r * cell.activations * (recomputing if task.kind == "B" else 1.0))
    total = peak = static
    for moment in sorted(changes):  # what starts and ends at one moment changes the bytes together
        total += changes[moment]
        peak = max(peak, total)
    return peak


def _hold(changes: dict[float, float], start: float, end: float, nbytes: float) -> None:
    """Bytes held from ``start`` to ``end`` of a step, as changes to what is held at those moments."""
    changes[start] += nbytes
    changes[end] -= nbytes


def first_backwards(simulated: Sequence[tuple[schedule_lib.Task, float, float]]) -> dict[int, float]:
    """When each cell's first backward task (B or W) starts in a ``timeline``: its gradients exist from then on."""
    first: dict[int, float] = {}
    for task, start, _ in simulated:
        if task.kind in "BW":
            first[task.cell] = min(first.get(task.cell, start), start)
    return first
