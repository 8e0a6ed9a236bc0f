"""Measured per-device timeline of pipelined training steps, drawn above the ideal version of their schedule.

Runs a few training steps of a small model under the TensorFlow profiler (on the
worker processes themselves for ``local:N``: every TensorFlow server also serves
the profiler), attributes each executed op to its task by the graph (each task's
ops follow its ``F_i_j/task_start`` / ``B_i_j/task_start`` / ``W_i_j/task_start`` marker) and to a phase
(forward, loss, recompute, backward, accumulate, transfer, optimizer, other) with
``tfpipe.analysis.tasks``, and writes OUT.csv (one row per step, device, task and phase),
OUT.png (the measured timeline above the ideal one, ``tfpipe.schedule.simulate``;
needs matplotlib) and a summary.

    python scripts/timeline.py --devices=local:2 --micro_batches=8 --out=docs/results/timeline_local2_m8
    python scripts/timeline.py --devices=cpu:2 --blocks=1 --dim=32 --steps=1 --out=/tmp/tl   # smallest
    python scripts/timeline.py --nopng ...        # CSV and summary only, without matplotlib
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from tfpipe.analysis.tasks import PHASES, TRANSFER_TYPES, OpInfo, attribute, lookup, parse_task_name  # noqa: E402
from tfpipe.scripts.report import write_table  # noqa: E402
from tfpipe.step import schedule  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "devices",
    "local:2",
    "cpu:N (N logical CPU devices in this process, one shared thread pool) "
    "or local:N (N single-thread worker processes).",
)
flags.DEFINE_enum("model", "transformer", ["transformer", "mlp"], "Model to trace.")
flags.DEFINE_integer("micro_batches", 8, "M, micro-batches per step.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Global batch.", lower_bound=1)
flags.DEFINE_integer("blocks", 8, "Transformer blocks / MLP hidden layers.", lower_bound=1)
flags.DEFINE_integer("dim", 256, "Transformer model dimension / MLP width.", lower_bound=8)
flags.DEFINE_integer("seq_len", 32, "Transformer sequence length.", lower_bound=2)
flags.DEFINE_string("remat", "except_last", "Re-materialization mode.")
flags.DEFINE_enum(
    "schedule",
    "gpipe",
    ["gpipe", "1f1b", "zero_bubble", "gpipe_batched_w"],
    "Task order (tfpipe.schedule); the ideal drawn follows it.",
)
flags.DEFINE_integer("steps", 2, "Profiled steps.", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Steps before profiling (the first one traces).", lower_bound=1)
flags.DEFINE_string(
    "ideal_costs",
    "measured",
    "Task durations of the ideal schedule: 'measured' (each cell's "
    "mean measured F and B busy time) or a number r (F = the mean measured F, B = r * F).",
)
flags.DEFINE_bool(
    "png",
    True,
    'Draw OUT.png (needs matplotlib: pip install -e ".[timeline]"); --nopng writes only the CSV and the summary.',
)
flags.DEFINE_string("out", "timeline", "Write OUT.csv and OUT.png.")

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


def _parse_devices(value: str) -> tuple[str, int]:
    """'cpu:N' or 'local:N' -> (kind, N), with an error naming the fix."""
    found = re.fullmatch(r"(cpu|local):(\d+)", value.strip())
    if not found or int(found.group(2)) < 1:
        raise app.UsageError(
            f"--devices={value!r}: write cpu:N (logical CPU devices) or local:N (worker "
            "processes) with N >= 1, e.g. --devices=local:2."
        )
    return found.group(1), int(found.group(2))


def _ideal_costs(value: str) -> float | None:
    """None for 'measured', else the backward/forward ratio."""
    if value == "measured":
        return None
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not ratio > 0:
        raise app.UsageError(f"--ideal_costs={value!r}: use 'measured' or a positive number such as 2.")
    return ratio


# Profile --------------------------------------------------------------------------------------------------
def _stats(plane: Any, event: Any) -> dict[str, Any]:
    """An event's stats by name; references resolve to their string."""
    out = {}
    for s in event.stats:
        key = plane.stat_metadata[s.metadata_id].name
        which = s.WhichOneof("value")
        out[key] = plane.stat_metadata[s.ref_value].name if which == "ref_value" else getattr(s, which)
    return out


def read_trace(
    logdir: str, host_device: dict[str, int], info: dict[str, OpInfo], device_index: dict[str, int]
) -> list[Event]:
    """Executed ops from every ``*.xplane.pb`` under logdir, in absolute ns, attributed to tasks.

    ``host_device`` maps a trace file's host ("localhost_PORT") to a device index, or
    is empty when all devices are in one process (then the graph's op device decides).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    events: list[Event] = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        host = os.path.basename(path)[: -len(".xplane.pb")]
        if host_device and host not in host_device:
            continue
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        start_ns = 0
        for plane in space.planes:
            for s in plane.stats:
                if plane.stat_metadata[s.metadata_id].name == "profile_start_time":
                    start_ns = s.uint64_value or s.int64_value
        for plane in space.planes:
            if not plane.name.startswith("/host:"):
                continue
            for line in plane.lines:
                base_ps = (start_ns + line.timestamp_ns) * 1000  # line times are relative to the session start
                for ev in line.events:
                    name = plane.event_metadata[ev.metadata_id].name
                    if name.startswith("ExecutorState::ProcessAsync"):  # an asynchronous kernel: a Recv
                        name = f"{_stats(plane, ev).get('name', '')}:{_stats(plane, ev).get('kernel_type', '')}"
                    op, _, op_type = name.rpartition(":")
                    if not op or "::" in name:
                        continue
                    found = lookup(info, op)
                    if found is None and op_type not in TRANSFER_TYPES:
                        continue  # not an op of the step (e.g. the eager service's own work)
                    task = found.task if found else ""
                    phase = "transfer" if op_type in TRANSFER_TYPES else (found.phase if found else "other")
                    if host_device:
                        device = host_device[host]
                    else:
                        device = _device_of(found, task, device_index)
                        if device is None:
                            continue
                    begin = (base_ps + ev.offset_ps) // 1000
                    events.append(Event(device, task, phase, begin, begin + ev.duration_ps // 1000))
    return sorted(events, key=lambda e: (e.device, e.start))


def _device_of(found: OpInfo | None, task: str, device_index: dict[str, int]) -> int | None:
    """The device index of an op in a one-process trace: its graph device, else its task's cell."""
    if found is not None:
        spec = _short(found.device)
        if spec in device_index:
            return device_index[spec]
    cell = parse_task_name(task).cell if task else None
    return cell if cell is not None and cell < len(device_index) else None


def _short(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/CPU:1'."""
    found = re.search(r"device:([A-Z]+):(\d+)", device) or re.search(r"/([A-Z]+):(\d+)$", device)
    return f"/{found.group(1)}:{found.group(2)}" if found else device


# Analysis ---------------------------------------------------------------------------------------------------
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
    for d, name in enumerate(device_names):
        mine = [e for e in events if e.device == d and _step_of(e, windows) is not None]
        busy = _union([(e.start / 1e6, e.end / 1e6) for e in mine])
        per = {p: _union([(e.start / 1e6, e.end / 1e6) for e in mine if e.phase == p]) for p in PHASES}
        overlap = sum(e.end - e.start for e in mine) / 1e6 - busy  # > 0: ops ran concurrently on one device
        lines.append(
            f"{name:<34} {busy / wall:6.1%} "
            + " ".join(f"{per[p]:9.1f}" for p in PHASES)
            + f" {wall - busy:9.1f} {overlap:9.1f}"
        )
    busy_all = [
        _union([(e.start / 1e6, e.end / 1e6) for e in events if e.device == d and _step_of(e, windows) is not None])
        for d in range(len(device_names))
    ]
    measured = 1 - sum(busy_all) / len(busy_all) / wall
    lines.append(
        f"bubble (idle share of the step, mean over devices): measured {measured:.3f} vs ideal {ideal_bubble:.3f}"
    )
    return "\n".join(lines)


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
    title: str,
) -> None:
    """The measured timeline of one step (top) above the ideal schedule (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = window[0]
    span = (window[1] - t0) / 1e6
    ideal_span = max(end for _, _, end in ideal)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(16, 2.2 + 1.1 * len(device_names) * 2), sharex=False)
    for d in range(len(device_names)):
        mine = [e for e in events if e.device == d and t0 <= e.start <= window[1]]
        for (task, phase), begin, end in _runs(mine):
            x0, width = (begin - t0) / 1e6, (end - begin) / 1e6
            top.barh(d, width, left=x0, height=0.8, color=COLORS[phase], edgecolor="none")
            if task and width > span / 60 and phase in ("forward", "recompute", "backward"):
                parsed = parse_task_name(task)
                label = f"{'R' if phase == 'recompute' else parsed.kind}{schedule.micro_batch_name(parsed.micro_batch)}"
                top.text(x0 + width / 2, d, label, ha="center", va="center", fontsize=6, color="white")
    top.set_yticks(range(len(device_names)), device_names, fontsize=7)
    top.invert_yaxis()
    top.set_xlim(0, span)
    top.set_xlabel("ms since the step was called (measured)")
    top.set_title(title, fontsize=9)
    for task, begin, end in ideal:
        phase = "forward" if task.kind == "F" else "backward"  # W tasks too: labelled W
        bottom.barh(
            task.cell, end - begin, left=begin, height=0.8, color=COLORS[phase], edgecolor="white", linewidth=0.5
        )
        if end - begin > ideal_span / 80:
            bottom.text(
                (begin + end) / 2,
                task.cell,
                f"{task.kind}{schedule.micro_batch_name(task.micro_batch)}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    bottom.set_yticks(range(len(device_names)), [f"cell {i}" for i in range(len(device_names))], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlim(0, span)  # the same scale as the measured step
    bottom.set_xlabel("ms (ideal schedule: same task order and costs, no transfers, no waiting)")
    fig.legend(
        handles=[Patch(color=COLORS[p], label=p) for p in PHASES], ncol=len(PHASES), fontsize=7, loc="lower center"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


# Running ---------------------------------------------------------------------------------------------------------
def _layers_and_data():
    """The model's layers and one global batch (x, y) as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = FLAGS.batch_size
    if FLAGS.model == "transformer":
        from tfpipe.scripts.data import random_lm

        return random_lm(n, FLAGS.seq_len, FLAGS.blocks, FLAGS.dim)
    import keras

    layers = [keras.layers.Dense(FLAGS.dim, activation="tanh") for _ in range(FLAGS.blocks)] + [keras.layers.Dense(10)]
    return layers, rng.normal(size=(n, FLAGS.dim)).astype("float32"), rng.integers(0, 10, size=n)


def profile_steps(devices: list[str], addresses: list[str] | None, logdir: str):
    """Build, warm up and profile the steps; return (graph op info, step windows in ns)."""
    import keras
    import tensorflow as tf

    import tfpipe

    keras.utils.set_random_seed(0)
    layers, x, y = _layers_and_data()
    model = tfpipe.PipelineModel(
        layers,
        num_partitions=len(devices),
        devices=devices,
        num_micro_batches=FLAGS.micro_batches,
        remat=FLAGS.remat,
        schedule=FLAGS.schedule,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.build((None,) + x.shape[1:])
    model.optimizer.build(model.trainable_variables)
    data = (tf.constant(x), tf.constant(y))
    model._before_tracing(x, y, None)  # noqa: SLF001 - what fit does before tracing: the explicit sends
    began = time.perf_counter()
    step = tf.function(model.train_step).get_concrete_function(data)
    print(f"traced in {time.perf_counter() - began:.1f} s", flush=True)
    info = attribute(step.graph)

    def run_one() -> tuple[int, int]:
        """One step, waited for; its (begin, end) in ns since the epoch, the clock of the traces."""
        begin = time.time_ns()
        for value in tf.nest.flatten(step(data)):
            value.numpy()
        return begin, time.time_ns()

    warm = [run_one() for _ in range(FLAGS.warmup)]
    step_s = (warm[-1][1] - warm[-1][0]) / 1e9
    windows: list[tuple[int, int]] = []
    if addresses is None:
        tf.profiler.experimental.start(logdir)
        windows = [run_one() for _ in range(FLAGS.steps)]
        tf.profiler.experimental.stop()
        return info, windows
    # The workers' servers also serve the profiler: trace them from a thread while this one runs the steps.
    lead = 1.5  # seconds for the trace to start on every worker before the steps run
    duration_ms = int(1000 * (lead + 1.0 + 2.0 * step_s * FLAGS.steps))
    failure: list[BaseException] = []

    def trace() -> None:
        """Trace every worker for ``duration_ms``; keep a failure for the main thread."""
        try:
            tf.profiler.experimental.client.trace(",".join("grpc://" + a for a in addresses), logdir, duration_ms)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            failure.append(err)

    tracer = threading.Thread(target=trace)
    tracer.start()
    time.sleep(lead)
    windows = [run_one() for _ in range(FLAGS.steps)]
    tracer.join()
    if failure:
        raise RuntimeError(f"Profiling the workers failed: {failure[0]}")
    return info, windows


def main(argv: list[str]) -> None:
    """Check the flags, profile the steps, write the CSV and PNG, print the summary."""
    del argv
    kind, k = _parse_devices(FLAGS.devices)
    ratio = _ideal_costs(FLAGS.ideal_costs)
    if FLAGS.batch_size < FLAGS.micro_batches:
        raise app.UsageError(
            f"--batch_size={FLAGS.batch_size} is smaller than --micro_batches="
            f"{FLAGS.micro_batches}; every micro-batch needs an example."
        )
    have_plot = FLAGS.png
    if have_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit('timeline.py needs matplotlib for the PNG: pip install -e ".[timeline]" (or pass --nopng).')
    from tfpipe.backward import remat

    try:
        remat.check_mode(FLAGS.remat)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)

    import tensorflow as tf

    logdir = tempfile.mkdtemp(prefix="tfpipe_timeline_")
    if kind == "cpu":
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * k
        )
        devices = [f"/CPU:{i}" for i in range(k)]
        info, windows = profile_steps(devices, None, logdir)
        host_device: dict[str, int] = {}
    else:
        from tfpipe.distributed.cluster import LocalCluster

        with LocalCluster(k, threads_per_worker=1) as cluster:
            devices = cluster.devices
            info, windows = profile_steps(devices, cluster.addresses, logdir)
            host_device = {a.replace(":", "_"): i for i, a in enumerate(cluster.addresses)}
    events = read_trace(logdir, host_device, info, {d: i for i, d in enumerate(devices)})
    rows = task_rows(events, windows, devices)
    write_table(
        FLAGS.out,
        rows,
        None,
        ["step", "device", "task", "kind", "cell", "micro_batch", "phase", "start_ms", "end_ms", "busy_ms", "ops"],
    )
    m = FLAGS.micro_batches
    f_cost, b_cost, w_cost = ideal_costs(events, windows, k, ratio, m)
    ideal = schedule.simulate(k, m, f_cost, b_cost, FLAGS.schedule, w_cost=w_cost)
    print(summarize(events, windows, devices, schedule.idle_fraction(ideal, k)))
    ideal_ms = max(end for _, _, end in ideal)
    w_text = "" if w_cost is None else f", of which W {', '.join(f'{c:.2f}' for c in w_cost)}"
    print(
        f"ideal step from the measured task costs: {ideal_ms:.1f} ms (F per cell "
        f"{', '.join(f'{c:.2f}' for c in f_cost)} ms; backward {', '.join(f'{c:.2f}' for c in b_cost)} ms{w_text})"
    )
    print(f"wrote {FLAGS.out}.csv" + (f" and {FLAGS.out}.png" if have_plot else ""))
    if have_plot:
        last = windows[-1]
        draw(
            FLAGS.out + ".png",
            events,
            last,
            devices,
            ideal,
            f"{FLAGS.model}, K={k} on {kind}, M={m}, batch {FLAGS.batch_size}, remat {FLAGS.remat}: last profiled "
            f"step {(last[1] - last[0]) / 1e6:.1f} ms measured vs {ideal_ms:.1f} ms ideal",
        )


if __name__ == "__main__":
    app.run(main)
