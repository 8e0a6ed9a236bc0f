"""What the benchmark scripts share: timing the steps of a fit, and writing a table as CSV and Markdown."""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """What the timed steps of one fit took: the median step, and the CPU of the processes that ran them."""

    median_s: float
    cpu_s: float  # CPU time per step, every thread of the watched processes (nan if not on Linux)
    waiting_s: float  # per step, the time their threads were ready to run but had no core
    cores_busy: float  # CPU time over wall time while the timed steps ran
    steps: int = 0  # how many steps were timed
    # per step, (CPU, wait for a core) of each 'role:thread name' (timed_fit's by_thread; see thread_seconds)
    threads: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def median_step_seconds(model: Any, x: Any, y: Any, batch_size: int, warmup: int) -> float:
    """Median seconds per training step over one ``fit`` of (x, y), the first ``warmup`` steps excluded."""
    return timed_fit(model, x, y, batch_size, warmup).median_s


def timed_fit(
    model: Any,
    x: Any,
    y: Any,
    batch_size: int,
    warmup: int,
    pids: Sequence[int] = (),
    by_thread: bool = False,
) -> StepTimes:
    """Time one ``fit`` of (x, y) step by step, the first ``warmup`` steps excluded; watch the CPU of ``pids``.

    A step is timed from Keras' batch-begin to its batch-end callback; with ``steps_per_execution``
    S > 1 a call runs S steps between the two, and each of them counts as the call's time over S.
    The CPU and the wait for a core are read from Linux's per-thread scheduler statistics of this
    process and ``pids`` (the workers), from the first timed step's begin to the last one's end;
    with ``by_thread`` also per thread name, this process as 'client' and ``pids`` as 'worker0', ...
    """
    import keras

    times: list[float] = []  # per step, one entry per timed call
    steps = 0  # steps timed
    last = -(-len(x) // batch_size) - 1
    marks: list[tuple[float, float, float]] = []
    named: list[dict[str, tuple[float, float]]] = []  # thread_seconds at the two marks
    mark = _cpu_marker(pids, by_thread, marks, named)

    class Timer(keras.callbacks.Callback):
        """Times each call of the train function from its begin to its end callback."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            """Start the clock (and the CPU count at the first timed step)."""
            self.first = batch
            if batch >= warmup and not marks:
                mark()
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            """Stop the clock (and read the CPU count after the last step)."""
            nonlocal steps
            took, ran = time.perf_counter() - self.began, batch - self.first + 1
            if marks:
                times.append(took / ran)
                steps += ran
            if marks and batch == last:
                mark()

    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    if len(marks) < 2:
        raise ValueError(f"no step of the fit came after the {warmup} warm-up steps: give it more data")
    return _step_times(times, steps, marks, named)


def _cpu_marker(
    pids: Sequence[int],
    by_thread: bool,
    marks: list[tuple[float, float, float]],
    named: list[dict[str, tuple[float, float]]],
) -> Callable[[], None]:
    """A function that appends (now, CPU, wait for a core) of this process and ``pids`` to ``marks``, and with
    ``by_thread`` each thread name's reading to ``named``."""
    watched = [os.getpid(), *pids]
    roles = {"client": os.getpid(), **{f"worker{i}": pid for i, pid in enumerate(pids)}}

    def mark() -> None:
        now = time.perf_counter()
        if not by_thread:
            marks.append((now, *scheduler_seconds(watched)))
            return
        named.append(thread_seconds(roles))  # one reading, so that the names add up to the total
        marks.append((now, sum(run for run, _ in named[-1].values()), sum(wait for _, wait in named[-1].values())))

    return mark


def _step_times(
    times: list[float],
    steps: int,
    marks: list[tuple[float, float, float]],
    named: list[dict[str, tuple[float, float]]],
) -> StepTimes:
    """The timed steps' median and, per step, the CPU and wait for a core between the two marks (per thread name
    where ``named`` has its readings)."""
    import numpy as np

    (t0, cpu0, wait0), (t1, cpu1, wait1) = marks
    cpu, wait = (cpu1 - cpu0) / steps, (wait1 - wait0) / steps
    threads: dict[str, tuple[float, float]] = {}
    if named:
        before, after = named
        for key, (run, waited) in after.items():  # a thread started in between counts from zero
            run0, waited0 = before.get(key, (0.0, 0.0))
            threads[key] = ((run - run0) / steps, (waited - waited0) / steps)
    return StepTimes(float(np.median(times)), cpu, wait, (cpu1 - cpu0) / (t1 - t0), steps, threads)


def warm_up(model: Any, x: Any, y: Any, batch_size: int, seconds: float, max_steps: int = 100) -> int:
    """Run untimed training steps on the first batch of (x, y): the first one, then more for ``seconds``.

    At most ``max_steps`` in all; returns how many ran. TensorFlow's executor hands a kernel
    to its thread pool until the kernel's cost estimate has decayed, which takes about 90
    runs, so a small model needs about that many steps before it is timed (docs/benchmarks.md,
    thirteenth pass).
    """
    import keras
    import numpy as np

    class StopAfter(keras.callbacks.Callback):
        """Counts the steps and ends the fit once ``seconds`` have passed since the first call."""

        steps = 0
        since = 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            """Start the clock after the first call (of steps_per_execution steps); stop when it runs out."""
            if not self.steps:
                self.since = time.perf_counter()
            self.steps = batch + 1
            if time.perf_counter() - self.since >= seconds:
                self.model.stop_training = True

    first = slice(0, batch_size)
    xs, ys = np.repeat(x[first], max_steps, axis=0), np.repeat(y[first], max_steps, axis=0)
    stop = StopAfter()
    model.fit(xs, ys, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    return stop.steps


def scheduler_seconds(pids: Sequence[int]) -> tuple[float, float]:
    """(CPU seconds run, seconds ready to run but without a core) of every thread of ``pids`` so far.

    From Linux's /proc/PID/task/TID/schedstat; (nan, nan) where it cannot be read.
    A thread that ends between two readings takes its time with it.
    """
    run = wait = 0.0
    for pid in pids:
        threads = _threads(pid, named=False)
        if threads is None:
            return float("nan"), float("nan")
        for _, thread_run, thread_wait in threads:
            run += thread_run
            wait += thread_wait
    return run, wait


def thread_seconds(processes: Mapping[str, int]) -> dict[str, tuple[float, float]]:
    """(CPU seconds run, seconds ready to run but without a core) so far, per 'role:thread name'.

    ``processes`` maps a role to a pid; a thread's name is Linux's (at most 15 characters, as
    TensorFlow, gRPC and Eigen set them) as ``pool_name`` groups it. A process that cannot be
    read is left out.
    """
    totals: dict[str, tuple[float, float]] = {}
    for role, pid in processes.items():
        for name, run, wait in _threads(pid, named=True) or ():
            key = f"{role}:{pool_name(name)}"
            total_run, total_wait = totals.get(key, (0.0, 0.0))
            totals[key] = (total_run + run, total_wait + wait)
    return totals


def pool_name(name: str) -> str:
    """A thread's name without a trailing number ('worker-12' -> 'worker'), so that a pool's threads add up."""
    return re.sub(r"[-_./: ]*[0-9]+$", "", name) or name


def _threads(pid: int, named: bool) -> list[tuple[str, float, float]] | None:
    """(name, CPU seconds run, seconds waiting for a core) of each thread of ``pid``; None if it cannot be read.

    Names ('' unless ``named``) cost a second file per thread, read only when asked for.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    found = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            name = ""
            if named:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
        except OSError:  # the thread ended
            continue
        found.append((name, int(fields[0]) / 1e9, int(fields[1]) / 1e9))
    return found


def write_table(
    out: str, rows: Sequence[dict[str, Any]], markdown: str | None, fields: Sequence[str] | None = None
) -> None:
    """Write ``rows`` to OUT.csv (columns ``fields``, default the first row's keys) and ``markdown`` to OUT.md."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or rows[0]), restval="")
        writer.writeheader()
        writer.writerows(rows)
    if markdown is not None:
        with open(out + ".md", "w") as f:
            f.write(markdown + "\n")
