"""Every check that needs a GPU, as one command that fits a lent GPU's minutes: tests, overhead, planner, capacity.

GPUs are lent for minutes: this runs, each with a time limit of its own and all within ``--budget_s`` (default 470 s,
under 8 minutes), the GPU tests (``tests/gpu``), PipelineModel's overhead against plain Keras on ``/GPU:0`` with and
without XLA per cell, the planner's predictions against a measured grid on two logical GPUs and its choices under
budgets, and the capacity table on logical GPUs whose ``memory_limit`` is the budget. Each step's log and tables go
to ``--out_dir`` (``$OUT`` on the device machine) under the names docs/benchmarks.md reads from ``docs/results/``
(``overhead_gpu``, ``plan_gpu_mlp``, ``capacity_gpu``: copy them there), and a summary (step, status, seconds, its
last line) is printed and written as ``summary.md``. ``--dry_run`` runs the
same steps on the CPU at toy sizes (the overhead step without XLA, which is slow to compile on a CPU), to check the
command before a GPU is lent (tests/scripts/test_gpu_checks.py).

    python benchmarks/gpu_checks.py --out_dir="$OUT"         # on the GPU machine
    python benchmarks/gpu_checks.py --dry_run --out_dir=/tmp/gpu_checks
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool(
    "dry_run",
    False,
    "Run every step on the CPU at toy sizes (checks the commands, measures nothing; only --budget_s bounds them).",
)
flags.DEFINE_string("out_dir", os.environ.get("OUT", "/tmp/gpu_checks"), "Where each step's output and tables go.")
flags.DEFINE_integer("budget_s", 470, "Seconds for all the steps together; a step gets what is left.", lower_bound=10)
flags.DEFINE_list("steps", [], "Only these steps (default: all): tests, overhead, planner, capacity.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps(dry_run: bool, out: str) -> list[tuple[str, list[str], int]]:
    """(name, command, its own time limit in seconds) of each check; toy sizes on the CPU for a dry run."""
    python = sys.executable
    script = lambda name: os.path.join(REPO, "benchmarks" if name.startswith("benchmark_") else "scripts", name)
    device, kind = ("/CPU:0", "CPU") if dry_run else ("/GPU:0", "GPU")
    overhead = ["--blocks=1", "--dim=16", "--steps=2", "--repeats=1"] if dry_run else ["--repeats=3", "--steps=20"]
    if not dry_run:  # with and without XLA per cell; the flag's smoke test: test_benchmark_overhead.py (pytest -m slow)
        overhead.append("--jit_compile")
    planner = (
        # a short bound: "auto"'s 30 s floor is most of the dry run's planning, which checks the command alone
        ["--devices=2", "--width=16", "--depth=4", "--batch_size=32", "--micro_batches=1", "--measure=1"]
        + ["--max_seconds=5"]
        if dry_run
        else ["--devices=2", "--width=2048", "--depth=12", "--batch_size=1024", "--grid", "--budgets=0.4,0.6,1.0"]
        # the one-cell schedules' 13 rows, as plan_gpu_mlp was measured, and interleaved 1F1B and ZB-V's three: the
        # grid's other shared rows would take the step past its time
        + ["--grid_schedules=gpipe,1f1b,zero_bubble,gpipe_batched_w,interleaved_1f1b,zbv"]
    )
    capacity = (
        ["--rows=plain,2", "--dim=16", "--seq_len=16", "--batch_size=4", "--vocab=32", "--micro_batches=2"]
        + ["--budget_mib=256", "--max_blocks=1"]
        if dry_run
        else ["--rows=plain,1,2", "--dim=256", "--seq_len=256", "--batch_size=16", "--budget_mib=512"]
        + ["--max_blocks=32", "--micro_batches=4"]
    )
    tests = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", os.path.join(REPO, "tests", "gpu")]
    return [
        ("tests", tests, 90),
        (
            "overhead",
            [python, script("benchmark_overhead.py"), f"--device={device}", *overhead, f"--out={out}/overhead_gpu"],
            70,
        ),
        ("planner", [python, script("plan.py"), f"--device_type={kind}", *planner, f"--out={out}/plan_gpu_mlp"], 180),
        (
            "capacity",
            [python, script("benchmark_capacity.py"), f"--device_type={kind}", *capacity, f"--out={out}/capacity_gpu"],
            130,
        ),
    ]


def main(argv: list[str]) -> None:
    """Run the steps in turn within the budget; print and write the summary; exit 1 if any failed."""
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    chosen = steps(FLAGS.dry_run, FLAGS.out_dir)
    unknown = set(FLAGS.steps) - {name for name, _, _ in chosen}
    if unknown:
        raise app.UsageError(f"--steps: unknown {sorted(unknown)}; use tests, overhead, planner, capacity")
    began, rows = time.monotonic(), []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    if FLAGS.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for name, command, limit in chosen:
        if FLAGS.steps and name not in FLAGS.steps:
            continue
        left = FLAGS.budget_s - (time.monotonic() - began)
        if left < 10:
            rows.append((name, "skipped: the budget ran out", 0.0, ""))
            continue
        # Each step's own limit keeps the GPU run within its minutes; a dry run checks the commands alone, on CPUs
        # that may be shared (the test suite's: the overhead step took 39 s alone and past 70 s under its load)
        limit = left if FLAGS.dry_run else min(limit, left)
        start = time.monotonic()
        with open(os.path.join(FLAGS.out_dir, f"{name}.log"), "w") as log:
            try:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, env=env)
                status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
            except subprocess.TimeoutExpired:
                status = f"stopped after {limit:.0f} s"
        with open(os.path.join(FLAGS.out_dir, f"{name}.log")) as log:
            lines = [line.strip() for line in log if line.strip()]
        rows.append((name, status, time.monotonic() - start, lines[-1][:160] if lines else ""))
        print(f"{name}: {status} in {rows[-1][2]:.0f} s", flush=True)
    table = ["| step | status | seconds | last line |", "| --- | --- | --- | --- |"]
    table += [f"| {n} | {s} | {t:.0f} | {last.replace('|', '/')} |" for n, s, t, last in rows]
    text = f"gpu_checks{' (dry run, CPU)' if FLAGS.dry_run else ''}: {time.monotonic() - began:.0f} s\n\n" + "\n".join(
        table
    )
    print(text)
    with open(os.path.join(FLAGS.out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    if any(s != "ok" for _, s, _, _ in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
