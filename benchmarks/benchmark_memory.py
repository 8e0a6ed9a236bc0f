"""Peak memory of a training step: plain Keras vs PipelineModel with re-materialization, and GPipe's Table 1.

Each configuration runs in a fresh child process (this script with ``--_child=JSON``) under TensorFlow's BFC
CPU allocator, which counts the bytes. Part 1 fits GPipe's activation-memory model; part 2 searches the largest
L under a budget. The method, in full: docs/benchmarks.md, "Memory: GPipe Table 1", "How it is measured".

    python benchmarks/benchmark_memory.py                             # defaults: L=4 table, 2 GiB budget, M=8
    python benchmarks/benchmark_memory.py --out=docs/results/memory            # also write .csv and .md
    python benchmarks/benchmark_memory.py --max_blocks=32              # the full remat search (about 20 min)
    python benchmarks/benchmark_memory.py --schedules --table_micro_batches=2,4,8,16   # GPipe, 1F1B, zero bubble; K=2
    python benchmarks/benchmark_memory.py --device_type=GPU --budget_gib=4    # the first GPU (two logical for K=2)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import concurrent.futures
import json
import resource
import subprocess
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts: it reads this once
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from benchmarks import memory_report  # noqa: E402
from benchmarks.memory_report import GIB, MIB, largest_under_budget  # noqa: E402
from scripts.report import write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("blocks", 4, "L, the Transformer blocks of the activation table (part 1).", lower_bound=1)
flags.DEFINE_list(
    "table_micro_batches",
    ["1", "2", "4", "8"],
    "Values of M in the activation table; the smallest and largest fit the model.",
)
flags.DEFINE_integer("seq_len", 512, "Sequence length.", lower_bound=2)
flags.DEFINE_integer("dim", 32, "Model dimension (feed-forward 4*dim).", lower_bound=8)
flags.DEFINE_integer("heads", 8, "Attention heads (each keeps its own seq x seq scores).", lower_bound=1)
flags.DEFINE_integer("batch_size", 48, "Batch size N (in samples).", lower_bound=1)
flags.DEFINE_integer("vocab", 64, "Vocabulary size.", lower_bound=2)
flags.DEFINE_float("budget_gib", 2.0, "Peak-memory budget of the largest-L search (part 2), GiB.")
flags.DEFINE_integer("micro_batches", 8, "M of the remat model in the largest-L search.", lower_bound=1)
flags.DEFINE_integer(
    "max_blocks",
    8,
    "Largest L the search probes (a remat search at M=8 costs about 6 s of tracing per block).",
    lower_bound=1,
)
flags.DEFINE_integer("jobs", 2, "Child processes run at once.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed for the weights and the data.")
flags.DEFINE_string("out", None, "Write every measurement to OUT.csv and the tables to OUT.md.")
flags.DEFINE_bool(
    "schedules",
    False,
    "Instead of parts 1 and 2: the step's transient memory under each schedule (tfpipe.schedule) with K=2 cells "
    "on 2 logical CPU devices, remat='never', for every M of --table_micro_batches.",
)
flags.DEFINE_bool(
    "shared",
    False,
    "With --schedules: also the schedules that put two cells on each of the two devices (interleaved 1F1B, looped "
    "BFS, interleaved zero bubble, ZB-V; K=4 cells, v=2).",
)
flags.DEFINE_integer(
    "micro_batch_size",
    None,
    "With --schedules: micro-batches of this many samples, the global batch growing as M x this (instead of "
    "--batch_size at every M), so that what a schedule holds per micro-batch stays the same.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "device_type",
    "CPU",
    ["CPU", "GPU"],
    "Where the models train: the CPU (BFC allocator) or the first GPU; K=2 splits it into two logical devices.",
)
flags.DEFINE_integer(
    "gpu_memory_mib", 16384, "With --device_type=GPU and --schedules: memory of each logical GPU.", lower_bound=1024
)
flags.DEFINE_string("_child", None, "Internal: measure the JSON configuration in this process.")

MAX_BUDGET_GIB = 6.0  # two concurrent probes at up to twice the budget must fit in this 24 GiB machine
RESULT = "RESULT "
# As tfpipe.schedule.ALL_SCHEDULES, before TF loads; the last four put two cells on each of the two devices (v=2).
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "gpipe_batched_w")
SHARED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "zero_bubble": "zero bubble", "gpipe_batched_w": "batched W",
           "interleaved_1f1b": "interleaved 1F1B", "looped_bfs": "looped BFS",
           "interleaved_zero_bubble": "interleaved ZB", "zbv": "ZB-V", "dualpipev": "DualPipeV"}  # fmt: skip


# The child: one configuration, one process ---------------------------------------------------------
def measure(config: dict[str, Any]) -> dict[str, int]:
    """Bytes in use before one training step, and the step's peak, for ``config`` (runs in a child)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfpipe
    from tfpipe.models.transformer import transformer_lm

    kind = config["device_type"]
    pipelined = config["model"] in SCHEDULES + SHARED
    if pipelined:  # two logical devices, before TensorFlow starts
        physical = tf.config.list_physical_devices(kind)[0]
        limit = config["gpu_memory_mib"] if kind == "GPU" else None  # logical GPUs need one; CPUs take none
        tf.config.set_logical_device_configuration(physical, [tf.config.LogicalDeviceConfiguration(limit)] * 2)
    cells = [f"/{kind}:{k}" for k in range(2 if pipelined else 1)]
    # Logical CPUs share one allocator; logical GPUs have one each, whose peaks are summed (an upper bound)
    used = [d[1:] for d in cells] if kind == "GPU" else [f"{kind}:0"]
    keras.utils.set_random_seed(config["seed"])
    dim = config["dim"]
    layers = transformer_lm(config["vocab"], config["seq_len"], config["blocks"], dim, 4 * dim, config["heads"])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config["model"] == "plain":
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=False)
    elif pipelined:
        model = tfpipe.PipelineModel(
            layers,
            num_partitions=4 if config["model"] in SHARED else 2,
            devices=cells,
            num_micro_batches=config["m"],
            remat="never",
            schedule=config["model"],
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    else:
        model = tfpipe.PipelineModel(
            layers, balance=[len(layers)], devices=cells, num_micro_batches=config["m"], remat="always"
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    rng = np.random.default_rng(config["seed"])
    x = rng.integers(0, config["vocab"], size=(config["batch_size"], config["seq_len"])).astype("int32")
    data = tf.data.Dataset.from_tensors((x, np.roll(x, -1, axis=1)))  # one batch, made before measuring
    with tf.device(cells[0]):  # plain Keras' step too (on a GPU machine it would pick the GPU itself)
        model.fit(data, epochs=1, verbose=0, shuffle=False)  # traces; creates the optimizer's slots
        before = sum(tf.config.experimental.get_memory_info(d)["current"] for d in used)
        for d in used:
            tf.config.experimental.reset_memory_stats(d)
        model.fit(data, epochs=1, verbose=0, shuffle=False)
    peak = sum(tf.config.experimental.get_memory_info(d)["peak"] for d in used)
    if peak <= 0:
        raise RuntimeError(
            "get_memory_info('CPU:0') reports no bytes: TensorFlow started without "
            f"TF_CPU_ALLOCATOR_USE_BFC=true (it is {os.environ.get('TF_CPU_ALLOCATOR_USE_BFC')!r})."
        )
    # The process's high-water resident set, for comparison: it also holds the traced graph, TensorFlow's
    # own buffers outside the BFC allocator, and the allocator's reserved but unused pool.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"before": int(before), "peak": int(peak), "max_rss": int(rss)}


# The parent: children, the searches, the fit -------------------------------------------------------
def boundary_bytes() -> int:
    """N: bytes of one layer boundary (a float32 batch x seq x dim activation) for the whole batch."""
    return FLAGS.batch_size * FLAGS.seq_len * FLAGS.dim * 4


class Probes:
    """Runs configurations in child processes, each once: a repeated request waits for the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict[tuple, concurrent.futures.Future] = {}

    def run(self, model: str, blocks: int, m: int, batch: int | None = None) -> dict[str, Any]:
        """The measurement of ``model`` ("plain", "remat" or a schedule) with L=``blocks``, M=``m`` and the
        global batch ``batch`` (default --batch_size)."""
        batch = FLAGS.batch_size if batch is None else batch
        key = (model, blocks, m, batch)
        with self._lock:
            future, mine = self._results.get(key), False
            if future is None:
                future, mine = concurrent.futures.Future(), True
                self._results[key] = future
        if mine:
            try:
                future.set_result(self._child(model, blocks, m, batch))
            except BaseException as err:  # noqa: BLE001 - handed to every waiter
                future.set_exception(err)
        return future.result()

    @staticmethod
    def _child(model: str, blocks: int, m: int, batch: int) -> dict[str, Any]:
        """Measure one configuration in a fresh Python process running this script."""
        config = {
            "model": model,
            "blocks": blocks,
            "m": m,
            "seq_len": FLAGS.seq_len,
            "dim": FLAGS.dim,
            "heads": FLAGS.heads,
            "batch_size": batch,
            "vocab": FLAGS.vocab,
            "seed": FLAGS.seed,
            "device_type": FLAGS.device_type,
            "gpu_memory_mib": FLAGS.gpu_memory_mib,
        }
        began = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), f"--_child={json.dumps(config)}"],
            capture_output=True,
            text=True,
            # growth: children running at once share the GPU instead of the first taking all of its memory
            env=dict(
                os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", TF_FORCE_GPU_ALLOW_GROWTH="true"
            ),
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"The child measuring {config} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = {**config, **json.loads(lines[-1][len(RESULT) :]), "seconds": time.perf_counter() - began}
        result["transient"] = result["peak"] - result["before"]
        print(
            f"  measured {model:5} L={blocks:<3} M={m:<2}: transient {result['transient'] / MIB:8.1f} MiB, "
            f"peak {result['peak'] / MIB:8.1f} MiB ({result['seconds']:.0f} s)",
            flush=True,
        )
        return result


def _validate_flags() -> list[int]:
    """Reject bad flag values with a message naming the fix; return the table's values of M."""
    try:
        ms = sorted({int(m) for m in FLAGS.table_micro_batches})
    except ValueError:
        raise app.UsageError(
            f"--table_micro_batches={','.join(FLAGS.table_micro_batches)} must be integers, e.g. 1,2,4,8."
        ) from None
    if len(ms) < 2 or ms[0] < 1:
        raise app.UsageError(
            f"--table_micro_batches needs at least two distinct values >= 1 (the smallest and "
            f"largest fit the model); got {FLAGS.table_micro_batches}."
        )
    for m in ms + [FLAGS.micro_batches]:
        if m > FLAGS.batch_size and not (FLAGS.schedules and FLAGS.micro_batch_size):
            raise app.UsageError(
                f"M={m} exceeds --batch_size={FLAGS.batch_size}; every micro-batch needs a "
                "sample: lower M or raise the batch."
            )
    if not 0 < FLAGS.budget_gib <= MAX_BUDGET_GIB:
        raise app.UsageError(
            f"--budget_gib={FLAGS.budget_gib} must be in (0, {MAX_BUDGET_GIB}]: probes run up to "
            "about twice the budget, two at a time, on a 24 GiB machine."
        )
    if FLAGS.dim % FLAGS.heads:
        raise app.UsageError(f"--dim={FLAGS.dim} must be divisible by --heads={FLAGS.heads}.")
    return ms


def main(argv: list[str]) -> None:
    """Child: measure one configuration. Parent: run both parts concurrently, print and write the tables."""
    del argv
    if FLAGS._child:
        print(RESULT + json.dumps(measure(json.loads(FLAGS._child))), flush=True)
        return
    ms = _validate_flags()
    if FLAGS.schedules:
        _schedules(ms)
        return
    n, big_l, m_search = boundary_bytes(), FLAGS.blocks, FLAGS.micro_batches
    budget = FLAGS.budget_gib * GIB
    print(
        f"Transformer: seq {FLAGS.seq_len}, dim {FLAGS.dim}, heads {FLAGS.heads}, batch {FLAGS.batch_size}, "
        f"vocab {FLAGS.vocab}; "
        f"N = {n / MIB:.2f} MiB per layer boundary; TF_CPU_ALLOCATOR_USE_BFC="
        f"{os.environ['TF_CPU_ALLOCATOR_USE_BFC']}",
        flush=True,
    )
    remat_points, plain_point, largest = _probe_both_parts(ms, big_l, m_search, budget)
    a, b, m_lo, m_hi = memory_report.fit_model(remat_points, big_l, n)
    fitted = {("remat", big_l, m_lo), ("remat", big_l, m_hi)}
    rows = [memory_report.row("activation", r, a, b, n, fitted) for r in [plain_point] + [remat_points[m] for m in ms]]
    rows += _search_rows(largest, a, b, n, fitted, budget, m_search)
    text = memory_report.report(rows, a, b, m_lo, m_hi, n, largest, budget)
    print("\n" + text)
    if FLAGS.out:
        fields = [
            "section",
            "model",
            "blocks",
            "M",
            "before_bytes",
            "peak_bytes",
            "transient_bytes",
            "transient_over_N",
            "predicted_bytes",
            "rel_error",
            "fitted",
            "fits_budget",
            "max_rss_bytes",
            "note",
        ]
        write_table(FLAGS.out, rows, text, fields)


def _probe_both_parts(
    ms: list[int], big_l: int, m_search: int, budget: float
) -> tuple[dict[int, dict[str, Any]], dict[str, Any], dict[str, tuple[int, bool, list[dict[str, Any]]]]]:
    """Run part 1's points (remat at each M, plain Keras) and part 2's two searches, --jobs children at a time."""
    probes = Probes()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.jobs) as pool:  # longest task first
        remat_search = pool.submit(
            largest_under_budget, lambda blocks: probes.run("remat", blocks, m_search), budget, FLAGS.max_blocks
        )
        table = {m: pool.submit(probes.run, "remat", big_l, m) for m in ms}
        plain = pool.submit(probes.run, "plain", big_l, 1)
        plain_search = pool.submit(
            largest_under_budget, lambda blocks: probes.run("plain", blocks, 1), budget, FLAGS.max_blocks
        )
        remat_points = {m: f.result() for m, f in table.items()}
        plain_point = plain.result()
        largest = {"plain": plain_search.result(), "remat": remat_search.result()}
    return remat_points, plain_point, largest


def _search_rows(
    largest: dict[str, tuple[int, bool, list[dict[str, Any]]]],
    a: float,
    b: float,
    n: int,
    fitted: set[tuple[str, int, int]],
    budget: float,
    m_search: int,
) -> list[dict[str, Any]]:
    """Part 2's CSV rows: each search's probes beside their predictions, then the largest L it found."""
    rows = []
    for model, (blocks, capped, made) in largest.items():
        rows += [memory_report.row("probe", r, a, b, n, fitted, budget=budget) for r in made]
        top = [r for r in made if r["blocks"] == blocks]
        rows.append(
            {
                "section": "largest",
                "model": model,
                "blocks": blocks,
                "M": m_search if model == "remat" else 1,
                "before_bytes": top[0]["before"] if top else "",
                "peak_bytes": top[0]["peak"] if top else "",
                "fits_budget": True,
                "note": "cap" if capped else "",
            }
        )
    return rows


def _schedules(ms: list[int]) -> None:
    """The schedule table: per M, each schedule's transient bytes in one step and its share of GPipe's."""
    names = SCHEDULES + (SHARED if FLAGS.shared else ())
    probes = Probes()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.jobs) as pool:
        futures = {
            (name, m): pool.submit(probes.run, name, FLAGS.blocks, m, _schedules_batch(m)) for m in ms for name in names
        }
        results = {key: f.result() for key, f in futures.items()}
    per = FLAGS.micro_batch_size
    lines = [
        f"### Transient memory of one step by schedule: L={FLAGS.blocks} Transformer, 2 devices (K=2; "
        "K=4 where a schedule shares devices), remat='never', "
        + (f"micro-batches of {per} (batch {per} x M)" if per else f"batch {FLAGS.batch_size}"),
        "",
        "| M | " + " | ".join(_TITLES[n] for n in names) + " | "
        + " | ".join(f"{_TITLES[n]} / GPipe" for n in names[1:]) + " |",
        "|---" * (2 * len(names)) + "|",
    ]  # fmt: skip
    rows = []
    for m in ms:
        sizes = [results[(name, m)]["transient"] for name in names]
        cells = [memory_report.mib(b) for b in sizes] + [f"{b / sizes[0]:.2f}" for b in sizes[1:]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
        for name in names:
            r = results[(name, m)]
            rows.append({"schedule": name, "M": m, "batch": _schedules_batch(m), "before_bytes": r["before"],
                         "peak_bytes": r["peak"], "transient_bytes": r["transient"],
                         "max_rss_bytes": r["max_rss"]})  # fmt: skip
    text = "\n".join(lines)
    print("\n" + text)
    if FLAGS.out:
        write_table(FLAGS.out, rows, text, list(rows[0]))


def _schedules_batch(m: int) -> int:
    """The global batch of the schedule table at M=m: --micro_batch_size x M if given, else --batch_size."""
    return FLAGS.micro_batch_size * m if FLAGS.micro_batch_size else FLAGS.batch_size


if __name__ == "__main__":
    app.run(main)
