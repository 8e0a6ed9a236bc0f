"""Measured per-device timeline of pipelined training steps, drawn above the ideal version of their schedule.

Runs a few training steps of a small model under the TensorFlow profiler (on the
worker processes themselves for ``local:N``: every TensorFlow server also serves
the profiler), attributes each executed op to its task by the graph (each task's
ops follow its ``F_i_j/task_start`` / ``B_i_j/task_start`` / ``W_i_j/task_start`` marker) and to a phase
(forward, loss, recompute, backward, accumulate, transfer, optimizer, other) with
``tfpipe.analysis.graph_tasks``, and writes OUT.csv (one row per step, device, task and phase),
OUT.png (the measured timeline above the ideal one, ``tfpipe.schedule.simulate``;
needs matplotlib) and a summary.

    python scripts/timeline.py --devices=local:2 --micro_batches=8 --out=docs/results/timeline_local2_m8
    python scripts/timeline.py --devices=cpu:2 --blocks=1 --dim=32 --steps=1 --out=/tmp/tl   # smallest
    python scripts/timeline.py --nopng ...        # CSV and summary only, without matplotlib
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import glob
import re
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts.report import write_table  # noqa: E402
from scripts.timeline_analysis import Event, crossing_latency, crossings, draw, ideal_costs, summarize, task_rows  # noqa: E402
from tfpipe import schedule  # noqa: E402
from tfpipe.analysis.graph_tasks import TRANSFER_TYPES, OpInfo, attribute, lookup, parse_task_name  # noqa: E402
from tfpipe.planning.predict import inlined  # noqa: E402
from tfpipe.step.unrolled import noinline_tasks  # noqa: E402

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
flags.DEFINE_enum("remat", "except_last", ["always", "except_last", "never"], "Re-materialization mode.")
flags.DEFINE_enum(
    "schedule",
    "gpipe",
    list(schedule.ALL_SCHEDULES),
    "Task order (tfpipe.schedule); the ideal drawn follows it.",
)
flags.DEFINE_integer(
    "cells_per_device",
    1,
    "v: cells on each device, for the schedules that share devices (interleaved_1f1b, looped_bfs, "
    "interleaved_zero_bubble: any v; zbv, dualpipev: 2).",
    lower_bound=1,
)
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "Optimizer (SGD 1e-3, Adam 1e-4).")
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
                    events.append(Event(device, task, phase, begin, begin + ev.duration_ps // 1000, op, op_type))
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


# Running ---------------------------------------------------------------------------------------------------------
def _layers_and_data():
    """The model's layers and one global batch (x, y) as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = FLAGS.batch_size
    if FLAGS.model == "transformer":
        from scripts.data import random_lm

        return random_lm(n, FLAGS.seq_len, FLAGS.blocks, FLAGS.dim)
    import keras

    layers = [keras.layers.Dense(FLAGS.dim, activation="tanh") for _ in range(FLAGS.blocks)] + [keras.layers.Dense(10)]
    return layers, rng.normal(size=(n, FLAGS.dim)).astype("float32"), rng.integers(0, 10, size=n)


def profile_steps(devices: list[str], addresses: list[str] | None, logdir: str):
    """Build, warm up and profile the steps; return (graph op info, step windows in ns)."""
    import tensorflow as tf

    model, x, y = _compiled_model(devices)
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
    return info, _profile_workers(run_one, addresses, logdir, step_s)


def _compiled_model(devices: list[str]) -> tuple[Any, Any, Any]:
    """The seeded PipelineModel over ``devices``, compiled and built with its optimizer, and one batch (x, y)."""
    import keras

    import tfpipe

    keras.utils.set_random_seed(0)
    layers, x, y = _layers_and_data()
    model = tfpipe.PipelineModel(
        layers,
        num_partitions=FLAGS.cells_per_device * len(devices),
        devices=devices,
        num_micro_batches=FLAGS.micro_batches,
        remat=FLAGS.remat,
        schedule=FLAGS.schedule,
    )
    optimizer = keras.optimizers.SGD(1e-3) if FLAGS.optimizer == "sgd" else keras.optimizers.Adam(1e-4)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.build((None,) + x.shape[1:])
    model.optimizer.build(model.trainable_variables)
    return model, x, y


def _profile_workers(
    run_one: Callable[[], tuple[int, int]], addresses: list[str], logdir: str, step_s: float
) -> list[tuple[int, int]]:
    """The profiled steps' windows, the workers at ``addresses`` traced into ``logdir`` while they run."""
    import tensorflow as tf

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
    return windows


def main(argv: list[str]) -> None:
    """Check the flags, profile the steps, write the CSV and PNG, print the summary."""
    del argv
    kind, k, ratio = _check_flags()
    have_plot = FLAGS.png
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    devices, events, windows = _profile(kind, k)
    rows = task_rows(events, windows, devices)
    write_table(
        FLAGS.out,
        rows,
        None,
        ["step", "device", "task", "kind", "cell", "micro_batch", "phase", "start_ms", "end_ms", "busy_ms", "ops"],
    )
    m, n = FLAGS.micro_batches, FLAGS.cells_per_device * k
    f_cost, b_cost, w_cost = ideal_costs(events, windows, n, ratio, m)
    first = inlined(n, m, noinline_tasks(devices))  # a whole backward sends its input gradients first (inlined step)
    ideal = schedule.simulate(n, m, f_cost, b_cost, FLAGS.schedule, w_cost=w_cost, num_devices=k, inputs_first=first)
    print(summarize(events, windows, devices, schedule.idle_fraction(ideal, k)))
    print(crossings(events, windows, devices))
    ideal_ms = max(end for _, _, end in ideal)
    w_text = "" if w_cost is None else f", of which W {', '.join(f'{c:.2f}' for c in w_cost)}"
    print(
        f"ideal step from the measured task costs: {ideal_ms:.1f} ms (F per cell "
        f"{', '.join(f'{c:.2f}' for c in f_cost)} ms; backward {', '.join(f'{c:.2f}' for c in b_cost)} ms{w_text})"
    )
    print(_with_crossings(events, windows, n, m, f_cost, b_cost, w_cost, k, first))
    print(f"wrote {FLAGS.out}.csv" + (f" and {FLAGS.out}.png" if have_plot else ""))
    if have_plot:
        last = windows[-1]
        draw(
            FLAGS.out + ".png",
            events,
            last,
            devices,
            ideal,
            schedule.placement(FLAGS.schedule, n, k),
            f"{FLAGS.model}, K={n} on {k} {kind}, M={m}, batch {FLAGS.batch_size}, remat {FLAGS.remat}: last profiled "
            f"step {(last[1] - last[0]) / 1e6:.1f} ms measured vs {ideal_ms:.1f} ms ideal",
        )


def _with_crossings(
    events: list[Event],
    windows: list[tuple[int, int]],
    n: int,
    m: int,
    f_cost: list[float],
    b_cost: list[float],
    w_cost: list[float] | None,
    k: int,
    inputs_first: bool,
) -> str:
    """The ideal again with each crossing's measured latency, where a receiver ever waited for one."""
    latency, waited = crossing_latency(events, windows)
    if not waited:
        return "ideal with crossings: no receiver waited for a send (one process, or none crossed)"
    crossed = schedule.simulate(
        n, m, f_cost, b_cost, FLAGS.schedule, w_cost=w_cost, num_devices=k, crossing=latency, inputs_first=inputs_first
    )
    return (
        f"ideal with each crossing {latency:.2f} ms (a send's end to the waiting receiver's next op, median of "
        f"{waited}): bubble {schedule.idle_fraction(crossed, k):.3f}, step {max(e for _, _, e in crossed):.1f} ms"
    )


def _check_flags() -> tuple[str, int, float | None]:
    """Reject flags that cannot work (and --png without matplotlib); the device kind, their count, the B/F ratio."""
    kind, k = _parse_devices(FLAGS.devices)
    ratio = _ideal_costs(FLAGS.ideal_costs)
    if FLAGS.batch_size < FLAGS.micro_batches:
        raise app.UsageError(
            f"--batch_size={FLAGS.batch_size} is smaller than --micro_batches="
            f"{FLAGS.micro_batches}; every micro-batch needs an example."
        )
    if FLAGS.cells_per_device > 1 and not schedule.shares_devices(FLAGS.schedule):
        raise app.UsageError(
            f"--cells_per_device={FLAGS.cells_per_device} needs a schedule that shares devices "
            f"({', '.join(schedule.SHARED_SCHEDULES)}); --schedule={FLAGS.schedule} puts one cell on each."
        )
    if FLAGS.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit('timeline.py needs matplotlib for the PNG: pip install -e ".[timeline]" (or pass --nopng).')
    return kind, k, ratio


def _profile(kind: str, k: int) -> tuple[list[str], list[Event], list[tuple[int, int]]]:
    """Profile the steps on ``k`` devices of ``kind`` (cpu or local); the devices, the ops run, the step windows."""
    import tensorflow as tf

    logdir = tempfile.mkdtemp(prefix="tfpipe_timeline_")
    if kind == "cpu":
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * k
        )
        devices = [f"/CPU:{i}" for i in range(k)]
        info, windows = profile_steps(devices, None, logdir)  # cells placed on them by the schedule
        host_device: dict[str, int] = {}
    else:
        from tfpipe.cluster import LocalCluster

        with LocalCluster(k, threads_per_worker=1) as cluster:
            devices = cluster.devices
            info, windows = profile_steps(devices, cluster.addresses, logdir)
            host_device = {a.replace(":", "_"): i for i, a in enumerate(cluster.addresses)}
    events = read_trace(logdir, host_device, info, {d: i for i, d in enumerate(devices)})
    return devices, events, windows


if __name__ == "__main__":
    app.run(main)
