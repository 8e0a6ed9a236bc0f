"""The predicted peak of devices that share one allocator (logical devices of one CPU): their bytes added up in time.

Each device's own peak (``predict.peak_bytes``) takes the most inputs in flight and the most activations kept at
once together; where one allocator serves every device, what it counts at its peak is the sum over the devices at
one moment, and the cells reach their own peaks at different moments (a 1F1B cell i holds its most micro-batches
while cell i + 1 holds fewer). So the simulated schedule (``predict.timeline``) is followed task by task: a
micro-batch holds its cell's input from its forward on, its activations from its forward (or, recomputed, from its
backward) on, both until its cell's last backward task; a backward holds its working set while it runs.
"""

from __future__ import annotations

from collections import defaultdict

from tfpipe import schedule as schedule_lib
from tfpipe.planning import predict
from tfpipe.planning.predict import Calibration, Config
from tfpipe.planning.profile import Profile


def shared_peak_bytes(profile: Profile, calibration: Calibration, batch_size: int, config: Config, slots: int) -> float:
    """The most bytes all of ``config``'s devices hold at one moment of a step, predicted."""
    b = predict.micro_batch_size(batch_size, config)
    k, m = config.num_partitions, config.num_micro_batches
    inline = predict.inlined(k, m, calibration.noinline_tasks)
    ratio = profile.held_ratio(b, inline)
    summed = predict.holds_running_sums(m, config.schedule, calibration.across_processes)
    simulated = predict.timeline(profile, calibration, batch_size, config)
    split = schedule_lib.splits_backward(config.schedule)
    # one recomputed within a backward call (``predict.activations_at_once``); a split backward hands it to W whole
    recomputing = 1.0 if split else predict.recomputing_share(profile, b, inline)
    again = set(predict.recomputed_micro_batches(config))
    released = {
        (task.cell, task.micro_batch): end for task, _, end in simulated if task.kind == ("W" if split else "B")
    }
    cells = predict.bounds(config.balance)
    parts = [
        predict.cell_bytes(profile, b, lo, hi, i == 0, slots, m, ratio, inline, summed)
        for i, (lo, hi) in enumerate(cells)
    ]
    # every replica runs the same timeline and holds the same but its optimizer slots (the first replica's only)
    r = config.num_replicas
    static = sum(p.static for p in parts) + (r - 1) * sum(
        predict.cell_bytes(profile, b, lo, hi, i == 0, 0, m, ratio, inline, summed).static
        for i, (lo, hi) in enumerate(cells)
    )
    changes: dict[float, float] = defaultdict(float)
    for task, start, end in simulated:
        cell, j = parts[task.cell], task.micro_batch
        if task.kind in "BW":
            changes[start] += r * cell.working
            changes[end] -= r * cell.working
        if task.kind == "W" or j == schedule_lib.ALL:
            continue
        free = released.get((task.cell, j), released.get((task.cell, schedule_lib.ALL)))
        if task.kind == "F":
            assert free is not None  # every forward's micro-batch is let go by its cell's last backward task
            changes[start] += r * cell.cell_input
            changes[free] -= r * cell.cell_input
        if (task.kind == "F") != (j in again):
            assert free is not None  # as above
            held = r * cell.activations * (recomputing if task.kind == "B" else 1.0)
            changes[start] += held
            changes[free] -= held
    total = peak = static
    for moment in sorted(changes):  # what starts and ends at one moment changes the bytes together
        total += changes[moment]
        peak = max(peak, total)
    return peak
