"""Plan a pipeline with tfpipe.plan, and with --measure run configurations to compare predicted with measured.

Each measured configuration runs in a fresh child process (this script with ``--_child=JSON``) on
the same devices, under TensorFlow's BFC CPU allocator (or the logical GPUs' own) so that its peak can be read; the
parent plans (profile and calibration) before any child runs. With ``--cluster`` the devices are
the workers of a LocalCluster (a fresh one per child): the peak is the workers' allocators', and their
processes' resident peak is printed beside it.

    python scripts/plan.py                                        # the plan for an MLP on 2 logical CPUs
    python scripts/plan.py --model=transformer --memory_budget=64MiB
    python scripts/plan.py --model=hub --arch=llama --grid      # a keras_hub task, planned by its nodes
    python scripts/plan.py --measure=5 --png=/tmp/plan.png       # also run the top 5 and plot them
    python scripts/plan.py --grid --out=docs/results/plan_mlp     # a fixed grid of configurations, measured
    python scripts/plan.py --cluster --grid                       # the same on two worker processes
    python scripts/plan.py --device_type=GPU --grid               # on two logical GPUs of the first GPU
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import json
import subprocess
import time
from typing import Any

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts: peaks are read from it
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts import plan_layers, plan_measure  # noqa: E402
from scripts.report import write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "model",
    "mlp",
    ["mlp", "transformer", "hub", "amoebanet"],
    "Model: Dense(width, tanh) x depth, a Transformer LM, or a keras_hub task (--arch; the hub extra) of --blocks, "
    "--dim, --seq_len and --vocab, planned as a Functional model; or AmoebaNet-D of 3 x --blocks normal cells of "
    "--dim filters on --image_size images.",
)
flags.DEFINE_integer("image_size", 64, "--model=amoebanet's image height and width.", lower_bound=32)
flags.DEFINE_string("arch", "llama", "--model=hub's architecture (tfpipe.models.hub.names()).")
flags.DEFINE_integer("width", 512, "MLP width.", lower_bound=1)
flags.DEFINE_integer("depth", 12, "MLP layers.", lower_bound=1)
flags.DEFINE_integer("blocks", 4, "Transformer blocks.", lower_bound=1)
flags.DEFINE_integer("dim", 128, "Transformer dimension (feed-forward 4 x dim).", lower_bound=8)
flags.DEFINE_integer("seq_len", 64, "Transformer sequence length.", lower_bound=2)
flags.DEFINE_integer("vocab", 256, "Transformer vocabulary.", lower_bound=2)
flags.DEFINE_integer("batch_size", 256, "Mini-batch size.", lower_bound=1)
flags.DEFINE_integer("devices", 2, "Logical devices this process splits its CPU (or first GPU) into.", lower_bound=1)
flags.DEFINE_enum(
    "device_type", "CPU", ["CPU", "GPU"], "Split the CPU, or the first GPU (8 GiB a device), into --devices."
)
flags.DEFINE_bool(
    "cluster",
    False,
    "Plan and measure on a LocalCluster of --devices worker processes (one thread each) instead of logical "
    "devices; a worker's peak is its allocator's (LocalCluster.memory_info), its process's resident peak beside it.",
)
flags.DEFINE_string("memory_budget", None, "Peak bytes per device, e.g. 64MiB (default: no limit).")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "Optimizer.")
flags.DEFINE_list(
    "micro_batches", [], "The M the plan may choose, e.g. 2,4 (default: every power of two up to --batch_size)."
)
flags.DEFINE_integer("measure", 0, "Run the top N configurations of the plan and compare.", lower_bound=0)
flags.DEFINE_bool("grid", False, "Run the fixed grid of configurations (plan_measure.GRID) and compare.")
flags.DEFINE_list(
    "grid_schedules", [], "With --grid: only its configurations of these schedules, e.g. 1f1b,interleaved_1f1b,zbv."
)
flags.DEFINE_list(
    "budgets",
    [],
    "With --grid: budgets as fractions of GPipe-without-remat's measured peak (K=2, M=8), e.g. 0.4,0.6,1.0; for "
    "each, the plan's choice is run and compared with the fastest measured grid configuration that fits.",
)
flags.DEFINE_list(
    "planning_budgets",
    [],
    "With --cluster: for each fraction of GPipe-without-remat's measured peak per worker (K=2, M=8), e.g. "
    "0.4,0.6,1.0, plan under that budget in a fresh child and report what planning held on the workers (their "
    "allocators' and processes' peaks), how long it took in steps of its choice, and its choice run.",
)
flags.DEFINE_float(
    "max_seconds", None, 'tfpipe.plan\'s max_seconds (default: its own, "auto"; 0: no bound).', lower_bound=0
)
flags.DEFINE_integer(
    "pressed_rounds",
    0,
    "Instead of planning: this many rounds, in turn, of the layers profiled alone at every size and as "
    "max_seconds='auto' presses them (fewer sizes each), on the first device, each showing its progress; their summed "
    "times per size compared.",
    lower_bound=0,
)
flags.DEFINE_string("_plan_child", None, "Internal: plan under the JSON budget in this process (--planning_budgets).")
flags.DEFINE_integer("repeats", 1, "Measure each configuration this many times (interleaved).", lower_bound=1)
flags.DEFINE_string("png", None, "Draw predicted against measured to this PNG (needs --measure or --grid).")
flags.DEFINE_string("out", None, "Write the comparison to OUT.csv and OUT.md.")
flags.DEFINE_string("_child", None, "Internal: measure the JSON configuration in this process.")
RESULT = "PLAN_RESULT "


def model_spec() -> dict[str, Any]:
    """The model flags, as the child rebuilds the model from them."""
    keys = (
        "model",
        "arch",
        "width",
        "depth",
        "blocks",
        "dim",
        "seq_len",
        "vocab",
        "image_size",
        "batch_size",
        "devices",
        "device_type",
        "cluster",
    )
    return {k: getattr(FLAGS, k) for k in (*keys, "optimizer", "max_seconds")}


def micro_batches() -> list[int] | None:
    """--micro_batches as integers (None: the planner's default), each checked against --batch_size."""
    if not FLAGS.micro_batches:
        return None
    if FLAGS.grid:
        raise app.UsageError(
            "--micro_batches narrows the plan's search, and --grid measures fixed M up to 16: drop one."
        )
    try:
        counts = [int(m) for m in FLAGS.micro_batches]
    except ValueError:
        raise app.UsageError(
            f"--micro_batches={','.join(FLAGS.micro_batches)}: give comma-separated integers, e.g. 2,4"
        ) from None
    if any(m < 1 or m > FLAGS.batch_size for m in counts):
        raise app.UsageError(
            f"--micro_batches={','.join(FLAGS.micro_batches)}: each must be 1 to --batch_size={FLAGS.batch_size}"
        )
    return counts


def run_child(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration in a fresh Python process running this script."""
    return _child(f"--_child={json.dumps({**spec, **config})}", f"measuring {config}")


def _child(flag: str, what: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), flag],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3"),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"The child {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def planning_budgets() -> None:
    """--planning_budgets: planning's own peaks and time under each budget, each in a fresh child; its choice run."""
    if not FLAGS.cluster:
        raise app.UsageError("--planning_budgets reads each worker's process: give --cluster.")
    spec = dict(model_spec(), micro_batches=micro_batches())

    def plan_in_child(budget: float) -> dict[str, Any]:
        return _child(f"--_plan_child={json.dumps([spec, budget])}", f"planning under {budget:.0f} bytes")

    rows = plan_measure.planning_rows(spec, [float(f) for f in FLAGS.planning_budgets], lambda c: run_child(spec, c),
                                      plan_in_child)  # fmt: skip
    text = plan_measure.planning_markdown(rows)
    print(text, flush=True)
    if FLAGS.out:
        write_table(FLAGS.out, rows, text, fields=plan_measure.PLANNING_FIELDS)


def main(argv: list[str]) -> None:
    """Child: measure one configuration. Parent: plan, print the plan, measure and compare."""
    del argv
    if FLAGS._child:
        print(RESULT + json.dumps(plan_measure.measure(json.loads(FLAGS._child))), flush=True)
        return
    if FLAGS._plan_child:
        spec, budget = json.loads(FLAGS._plan_child)
        found = plan_measure.planning(spec, budget)
        print(RESULT + json.dumps(found), flush=True)
        return
    if FLAGS.planning_budgets:
        planning_budgets()
        return
    if FLAGS.pressed_rounds:
        print(plan_layers.summary(plan_layers.rounds(model_spec(), FLAGS.pressed_rounds)), flush=True)
        return
    if FLAGS.png and not (FLAGS.measure or FLAGS.grid):
        raise app.UsageError("--png draws measured configurations: give --measure=N or --grid too.")
    spec = dict(model_spec(), micro_batches=micro_batches())
    began = time.perf_counter()
    plan = plan_measure.make_plan(spec, FLAGS.memory_budget)
    print(f"planned in {time.perf_counter() - began:.1f} s")
    plan.summary()
    grid = [c for c in plan_measure.GRID if not FLAGS.grid_schedules or c[4] in FLAGS.grid_schedules]
    configs = grid if FLAGS.grid else [c.config for c in plan.candidates if c.fits][: FLAGS.measure]
    if not configs:
        return
    run = lambda config: run_child(spec, config)  # noqa: E731
    shared = not FLAGS.cluster and FLAGS.device_type == "CPU"  # logical CPUs: one allocator
    rows = plan_measure.compare(plan, configs, run, FLAGS.repeats, shared)
    text = plan_measure.markdown(rows, spec)
    print(text, flush=True)
    if FLAGS.out:
        write_table(FLAGS.out, rows, text)
    if FLAGS.budgets:
        fractions = [float(f) for f in FLAGS.budgets]
        verify = lambda found, budget: plan_measure.verify_choice(spec, found, budget)  # noqa: E731
        budget_rows = plan_measure.budgets(plan, rows, fractions, run, FLAGS.repeats, verify)
        text += "\n\n" + plan_measure.budget_markdown(budget_rows)
        print(plan_measure.budget_markdown(budget_rows), flush=True)
        if FLAGS.out:
            write_table(FLAGS.out, rows, text)
            write_table(FLAGS.out + "_budgets", budget_rows, None, fields=plan_measure.BUDGET_FIELDS)
    if FLAGS.png:
        plan_measure.draw(rows, FLAGS.png)


if __name__ == "__main__":
    app.run(main)
