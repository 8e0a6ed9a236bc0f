"""What a measured timeline says (scripts/timeline.py): rows per step, device, task and phase, the summary, the
ideal schedule's costs, the drawing."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from tfpipe import schedule
from tfpipe.analysis.graph_tasks import PHASES, TRANSFER_TYPES, parse_task_name

COLORS = {
    "forward": "#4C72B0",
    "loss": "#8172B2",
    "recompute": "#DD8452",
    "backward": "#C44E52",
    "accumulate": "#937860",
    "transfer": "#8C8C8C",
    "optimizer": "#222222",
    "other": "#CCCCCC",
}


@dataclasses.dataclass
class Event:
    """One executed op: device index, attribution, absolute start and end in ns."""

    device: int
    task: str
    phase: str
    start: int
    end: int
    op: str = ""  # the op's name, its task's scope first
    op_type: str = ""


# Phases whose kernels are the model's own arithmetic: the same op of the same layer runs once a micro-batch
COMPUTE_PHASES = ("forward", "recompute", "backward")
STRETCH_RUNS = 4  # an op's runs from which its lower quartile stands for what it costs undisturbed
MOVES = ("Send", "Recv", *TRANSFER_TYPES)  # tfpipe's explicit transfers across processes, and TensorFlow's own


def task_rows(events: list[Event], windows: list[tuple[int, int]], device_names: list[str]) -> list[dict]:
    """One row per (step, device, task, phase): first start, last end, busy time and op count, ms from step start."""
    rows: dict[tuple, dict] = {}
    for ev in events:
        step = _step_of(ev, windows)
        if step is None:
            continue
        t0 = windows[step][0]
        key = (step, ev.device, ev.task, ev.phase)
        row = rows.get(key)
        if row is None:
            task = parse_task_name(ev.task) if ev.task else None
            kind, cell, mb = (
                (task.kind, task.cell, schedule.micro_batch_name(task.micro_batch)) if task else ("", "", "")
            )
            row = rows[key] = {
                "step": step,
                "device": device_names[ev.device],
                "task": ev.task,
                "kind": kind,
                "cell": cell,
                "micro_batch": mb,
                "phase": ev.phase,
                "start_ms": 1e300,
                "end_ms": -1e300,
                "busy_ms": 0.0,
                "ops": 0,
            }
        row["start_ms"] = min(row["start_ms"], (ev.start - t0) / 1e6)
        row["end_ms"] = max(row["end_ms"], (ev.end - t0) / 1e6)
        row["busy_ms"] += (ev.end - ev.start) / 1e6
        row["ops"] += 1
    return sorted(rows.values(), key=lambda r: (r["step"], r["device"], r["start_ms"]))


def _step_of(ev: Event, windows: list[tuple[int, int]]) -> int | None:
    """The profiled step whose client-side window holds the event's start, or None."""
    for step, (begin, end) in enumerate(windows):
        if begin <= ev.start <= end:
            return step
    return None


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, last_end = 0.0, -1e300
    for begin, end in sorted(intervals):
        if end > last_end:
            total += end - max(begin, last_end)
            last_end = end
    return total


def summarize(events: list[Event], windows: list[tuple[int, int]], device_names: list[str], ideal_bubble: float) -> str:
    """Per device: busy fraction and time per phase; bubble measured vs ideal, over the profiled steps.

    ``ideal_bubble`` is the idle share of the ideal schedule (``schedule.idle_fraction``).
    """
    wall = sum(end - begin for begin, end in windows) / 1e6
    lines = [
        f"{len(windows)} step(s), median {statistics.median((e - b) / 1e6 for b, e in windows):.1f} ms "
        f"(client wall time); ideal bubble of the schedule {ideal_bubble:.3f}"
    ]
    header = f"{'device':<34} {'busy':>6} " + " ".join(f"{p[:9]:>9}" for p in PHASES) + f" {'idle':>9} {'2+ ops':>9}"
    lines += [header + "   (ms over all profiled steps; 2+ ops: op time beyond one op at a time)"]
    busy_all = []  # per device: its ops' union over the profiled steps
    for d, name in enumerate(device_names):
        mine = [e for e in events if e.device == d and _step_of(e, windows) is not None]
        busy = _union([(e.start / 1e6, e.end / 1e6) for e in mine])
        busy_all.append(busy)
        per = {p: _union([(e.start / 1e6, e.end / 1e6) for e in mine if e.phase == p]) for p in PHASES}
        overlap = sum(e.end - e.start for e in mine) / 1e6 - busy  # > 0: ops ran concurrently on one device
        lines.append(
            f"{name:<34} {busy / wall:6.1%} "
            + " ".join(f"{per[p]:9.1f}" for p in PHASES)
            + f" {wall - busy:9.1f} {overlap:9.1f}"
        )
    measured = 1 - sum(busy_all) / len(busy_all) / wall
    lines.append(
        f"bubble (idle share of the step, mean over devices): measured {measured:.3f} vs ideal {ideal_bubble:.3f}"
    )
    shares = step_shares(events, windows, len(device_names))
    if len(shares) > 1:  # one step's slow spell moves the whole's share: each step's, to tell it from the rest
        lines.append(
            f"  each step's: min {min(shares):.3f}, median {statistics.median(shares):.3f}, max {max(shares):.3f}"
        )
    trips = round_trips(events, windows, len(device_names))
    if trips:
        before, after, inside = (statistics.median(t[i] for t in trips) for i in range(3))
        lines.append(
            f"  the call's round trip (medians): the first op {before:.2f} ms after the call, the call back "
            f"{after:.2f} ms after the last op; idle share from the first op to the last {inside:.3f}"
        )
    return "\n".join(lines)


def round_trips(events: list[Event], windows: list[tuple[int, int]], devices: int) -> list[tuple[float, float, float]]:
    """Per profiled step: ms from the client's call to the first op on any device, ms from the last op's end to the
    call's return, and the idle share between the two (the devices' mean busy time over that span).

    The client's dispatch and the return of the step's outputs are idle on every device whatever the schedule; the
    share without them is what the schedule and its crossings leave idle.
    """
    spans = _spans(events, windows)
    trips = []
    for step, (begin, end) in enumerate(windows):
        mine = [spans.get((step, d), []) for d in range(devices)]
        if not all(mine):
            continue
        first = min(b for intervals in mine for b, _ in intervals)
        last = max(e for intervals in mine for _, e in intervals)
        busy = sum(_union(intervals) for intervals in mine) / devices
        trips.append((first - begin / 1e6, end / 1e6 - last, 1 - busy / (last - first)))
    return trips


def step_shares(events: list[Event], windows: list[tuple[int, int]], devices: int) -> list[float]:
    """Each profiled step's idle share: one less the devices' mean busy time (their ops' union) over its window."""
    busy = [[0.0] * devices for _ in windows]
    for (step, device), intervals in _spans(events, windows).items():
        busy[step][device] = _union(intervals)
    return [1 - sum(b) / devices / ((end - begin) / 1e6) for b, (begin, end) in zip(busy, windows)]


def _spans(events: list[Event], windows: list[tuple[int, int]]) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """(step, device) -> the ms intervals of its ops within that step's window."""
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        step = _step_of(e, windows)
        if step is not None:
            spans.setdefault((step, e.device), []).append((e.start / 1e6, e.end / 1e6))
    return spans


def crossings(events: list[Event], windows: list[tuple[int, int]], device_names: list[str]) -> str:
    """Per device: its explicit sends a step and their time, and how much slower its compute kernels ran than they
    can (each op of a layer against its own lower quartile over micro-batches and steps).

    On a one-thread worker a send holds the thread that computes; kernels stretched past their quartile show the
    worker's core taken by something else (another worker, the client, gRPC's threads) or a slow spell of the host.
    """
    steps = max(len(windows), 1)
    lines = [f"{'device':<34} {'sends a step':>12} {'their ms':>9} {'kernels at x their fastest quartile':>36}"]
    for d, name in enumerate(device_names):
        mine = [e for e in events if e.device == d and _step_of(e, windows) is not None]
        sends = [e.end - e.start for e in mine if e.op_type == "Send"]
        runs: dict[str, list[float]] = {}
        for e in mine:
            if _computes(e) and e.task and "/" in e.op:
                runs.setdefault(e.op.split("/", 1)[1], []).append((e.end - e.start) / 1e6)
        took = floor = 0.0
        for times in runs.values():
            if len(times) >= STRETCH_RUNS:
                took += sum(times)
                floor += len(times) * sorted(times)[len(times) // 4]
        stretch = f"{took / floor:.2f}x of {took / steps:.1f} ms a step" if floor > 0 else "-"
        lines.append(f"{name:<34} {len(sends) / steps:12.1f} {sum(sends) / 1e6 / steps:9.2f} {stretch:>36}")
    return "\n".join(lines)


def crossing_latency(events: list[Event], windows: list[tuple[int, int]]) -> tuple[float, int]:
    """The median ms from a send's end to the receiver's next compute op where the receiver waited for it, and the
    count of such crossings; (0.0, 0) where none (one process, or no receiver ever waited).

    A send and its receive are both attributed to the task that produced the tensor (``T/Send``, ``T/Recv``).
    """
    sends: dict[tuple[int, str], Event] = {}
    receives: list[tuple[int, Event]] = []
    for e in events:
        step = _step_of(e, windows)
        if step is not None and e.task and e.op_type in ("Send", "Recv"):
            if e.op_type == "Send":
                sends[(step, e.task)] = e
            else:
                receives.append((step, e))
    compute: dict[int, list[Event]] = {}
    for e in events:
        if _computes(e):
            compute.setdefault(e.device, []).append(e)
    waits = []
    for step, recv in receives:
        send = sends.get((step, recv.task))
        # a receive shows twice: asked for at the step's start, and done once the tensor came: the second
        if send is None or send.device == recv.device or recv.end < send.start:
            continue
        after = [e.start for e in compute.get(recv.device, []) if e.start >= recv.end]
        # it waited: no compute op of its own ran between the send's end and its next one
        if after and not any(e.end > send.end and e.start < min(after) for e in compute[recv.device]):
            waits.append((min(after) - send.end) / 1e6)
    # the send's own time is its task's: a receiver that starts before the send returns waited for nothing more
    return (max(statistics.median(waits), 0.0), len(waits)) if waits else (0.0, 0)


def _computes(e: Event) -> bool:
    """Whether ``e`` is one of the model's own kernels: an op of a compute phase that moves no tensor."""
    return e.phase in COMPUTE_PHASES and e.op_type not in MOVES


def ideal_costs(
    events: list[Event], windows: list[tuple[int, int]], k: int, ratio: float | None, m: int = 1
) -> tuple[list[float], list[float], list[float] | None]:
    """Per-cell F, whole backward and W durations (ms) for the ideal schedule: the mean time a task's ops covered.

    The whole backward is B + W where the step split them (zero bubble); W is None where it did
    not; a W over all ``m`` micro-batches counts an m-th of its time. With ``ratio``: F, r*F and
    None (W half the backward, as ``schedule.simulate`` assumes).
    """
    covered: dict[tuple, list[tuple[float, float]]] = {}
    for e in events:
        step = _step_of(e, windows)
        if e.task and e.phase != "transfer" and step is not None:
            task = parse_task_name(e.task)
            covered.setdefault((task.kind, task.cell, step, e.task), []).append((e.start / 1e6, e.end / 1e6))
    split = any(key[0] == "W" for key in covered)
    f_cost, b_cost, w_cost = [], [], []
    for i in range(k):
        for kind, out in (("F", f_cost), ("B", b_cost), ("W", w_cost)):
            times = [
                _union(iv) / (m if parse_task_name(key[3]).micro_batch == schedule.ALL else 1)
                for key, iv in covered.items()
                if key[:2] == (kind, i)
            ]
            out.append(statistics.mean(times) if times else 1.0 if kind != "W" else 0.0)
    if ratio is not None:
        unit = statistics.mean(f_cost)
        return [unit] * k, [ratio * unit] * k, None
    if not split:
        return f_cost, b_cost, None
    return f_cost, [b + w for b, w in zip(b_cost, w_cost)], w_cost


def draw(
    path: str,
    events: list[Event],
    window: tuple[int, int],
    device_names: list[str],
    ideal: list[tuple[schedule.Task, float, float]],
    where: list[int],
    title: str,
) -> None:
    """The measured timeline of one step (top) above the ideal schedule (bottom), as a PNG; ``where`` is each
    cell's device index (``schedule.placement``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = (window[1] - window[0]) / 1e6
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(16, 2.2 + 1.1 * len(device_names) * 2), sharex=False)
    shared = len(set(where)) < len(where)  # several cells per device: labels name the cell too
    _draw_measured(top, events, window, device_names, shared, title)
    _draw_ideal(bottom, ideal, where, device_names, shared, span)
    fig.legend(
        handles=[Patch(color=COLORS[p], label=p) for p in PHASES], ncol=len(PHASES), fontsize=7, loc="lower center"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_measured(
    top: Any, events: list[Event], window: tuple[int, int], device_names: list[str], shared: bool, title: str
) -> None:
    """The measured step on axes ``top``: a bar per run of a task's phase on each device, the long ones labelled."""
    t0 = window[0]
    span = (window[1] - t0) / 1e6
    for d in range(len(device_names)):
        mine = [e for e in events if e.device == d and t0 <= e.start <= window[1]]
        for (task, phase), begin, end in _runs(mine):
            x0, width = (begin - t0) / 1e6, (end - begin) / 1e6
            top.barh(d, width, left=x0, height=0.8, color=COLORS[phase], edgecolor="none")
            if task and width > span / 60 and phase in ("forward", "recompute", "backward"):
                parsed = parse_task_name(task)
                kind = "R" if phase == "recompute" else parsed.kind
                label = f"{kind}{f'{parsed.cell},' if shared else ''}{schedule.micro_batch_name(parsed.micro_batch)}"
                top.text(x0 + width / 2, d, label, ha="center", va="center", fontsize=6, color="white")
    top.set_yticks(range(len(device_names)), device_names, fontsize=7)
    top.invert_yaxis()
    top.set_xlim(0, span)
    top.set_xlabel("ms since the step was called (measured)")
    top.set_title(title, fontsize=9)


def _draw_ideal(
    bottom: Any,
    ideal: list[tuple[schedule.Task, float, float]],
    where: list[int],
    device_names: list[str],
    shared: bool,
    span: float,
) -> None:
    """The ideal schedule on axes ``bottom``, on the measured step's scale (``span`` ms): a bar per task."""
    ideal_span = max(end for _, _, end in ideal)
    for task, begin, end in ideal:
        phase = "forward" if task.kind == "F" else "backward"  # W tasks too: labelled W
        bottom.barh(
            where[task.cell], end - begin, left=begin, height=0.8, color=COLORS[phase], edgecolor="white", linewidth=0.5
        )
        if end - begin > ideal_span / 80:
            bottom.text(
                (begin + end) / 2,
                where[task.cell],
                f"{task.kind}{f'{task.cell},' if shared else ''}{schedule.micro_batch_name(task.micro_batch)}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    cells = [", ".join(str(c) for c in range(len(where)) if where[c] == d) for d in range(len(device_names))]
    bottom.set_yticks(range(len(device_names)), [f"cell {c}" for c in cells], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlim(0, span)  # the same scale as the measured step
    bottom.set_xlabel("ms (ideal schedule: same task order and costs, no transfers, no waiting)")


def _runs(events: list[Event]) -> list[tuple[tuple[str, str], int, int]]:
    """Consecutive events of the same task and phase merged into one bar (gaps inside a run included)."""
    runs: list[list] = []
    for ev in sorted(events, key=lambda e: e.start):
        key = (ev.task, ev.phase)
        if runs and runs[-1][0] == key:
            runs[-1][2] = max(runs[-1][2], ev.end)
        else:
            runs.append([key, ev.start, ev.end])
    return [(key, begin, end) for key, begin, end in runs]
