"""First-step cost at scale: build, trace and first run of a pipelined step for large K x M.

Each configuration runs in a fresh process with K logical CPU devices (TensorFlow's
device setup happens once per process). It reports the seconds of the first
``train_on_batch`` (build, trace, TensorFlow's first run), the median of the next
steps, and the process's peak resident memory; the build (split, cells, variables) is
also reported on its own.

    python benchmarks/benchmark_scale.py                               # K=2 and K=8 at M=32, 8-block Transformer
    python benchmarks/benchmark_scale.py --configs=2x4,2x16,2x32,8x32 --out=docs/results/scale
    python benchmarks/benchmark_scale.py --configs=2x32,8x32 --unroll=true,false   # unrolled graph against loops
    python benchmarks/benchmark_scale.py --configs=keras,2x32   # beside the same layers in a plain keras.Sequential
    python benchmarks/benchmark_scale.py --configs=2x8,8x32 --repeated_layers=inline,call   # blocks traced once

``keras`` in ``--configs`` times the same layers as a plain ``keras.Sequential`` on one
device: what a user compares a first step with.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import json
import subprocess

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts.report import write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "configs",
    ["2x32", "8x32"],
    "KxM pairs: K cells on K logical CPU devices, M micro-batches; 'keras': the layers in a plain keras.Sequential.",
)
flags.DEFINE_integer("blocks", 8, "Transformer blocks.", lower_bound=1)
flags.DEFINE_integer("dim", 64, "Transformer model dimension.", lower_bound=8)
flags.DEFINE_integer("seq_len", 32, "Sequence length.", lower_bound=2)
flags.DEFINE_integer("batch_size", 64, "Global batch (at least the largest M).", lower_bound=1)
flags.DEFINE_enum("remat", "except_last", ["always", "except_last", "never"], "Re-materialization mode.")
flags.DEFINE_list("unroll", ["true"], "Step graphs to compare: true (unrolled, the default), false (loops).")
flags.DEFINE_list(
    "repeated_layers", ["inline"], "PipelineModel(repeated_layers=) values to compare, each right after the other."
)
flags.DEFINE_integer("steps", 5, "Steps timed after the first.", lower_bound=1)
flags.DEFINE_string("out", None, "Write the table to OUT.csv and OUT.md.")

# Runs in the child process: argv = K M blocks dim seq_len batch remat steps unroll repeated; K=0 is plain Keras.
_CHILD = r"""
import json, os, resource, sys, time
k, m, blocks, dim, seq, batch, remat, steps, unroll, repeated = sys.argv[1:]
unroll = unroll == "true"
k, m, blocks, dim, seq, batch, steps = map(int, (k, m, blocks, dim, seq, batch, steps))
import tensorflow as tf
if k:
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * k)
import keras, numpy as np
import tfpipe
from scripts.data import random_lm
keras.utils.set_random_seed(0)
layers, x, y = random_lm(batch, seq, blocks, dim)
began = time.perf_counter()
if k:
    model = tfpipe.PipelineModel(layers, num_partitions=k, devices=[f"/CPU:{i}" for i in range(k)],
                                 num_micro_batches=m, remat=remat, unroll=unroll, repeated_layers=repeated)
else:
    model = keras.Sequential(layers)
model.compile(optimizer=keras.optimizers.SGD(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if k:
    tfpipe.training.build_before_tracing(model, x, y, None)  # what train_on_batch does first: split, cells, variables
else:
    model.build(x.shape)
build = time.perf_counter() - began
model.train_on_batch(x, y)
first = time.perf_counter() - began
times = []
for _ in range(steps):
    t = time.perf_counter(); model.train_on_batch(x, y); times.append(time.perf_counter() - t)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"first_s": first, "build_s": build, "step_ms": 1e3 * float(np.median(times)),
                              "peak_rss_gb": rss / 1e9, "balance": model.balance if k else [blocks],
                              "graph": (("unrolled" if model.unrolled else "loops")
                                        + (", call" if repeated == "call" else "")) if k else "keras"}))
"""


def run_config(k: int, m: int, unroll: str, repeated: str = "inline") -> dict:
    """First-step seconds, steady step ms and peak RSS of one K x M configuration, in a fresh process."""
    args = [str(a) for a in (k, m, FLAGS.blocks, FLAGS.dim, FLAGS.seq_len, FLAGS.batch_size, FLAGS.remat, FLAGS.steps)]
    args += [unroll, repeated]
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"K={k} M={m} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _parse(config: str) -> tuple[int, int]:
    if config.lower() == "keras":
        return 0, 1
    try:
        k, m = (int(v) for v in config.lower().split("x"))
    except ValueError:
        raise app.UsageError(f"--configs: {config!r} is not KxM (e.g. 8x32) or keras.") from None
    if k < 1 or m < 1:
        raise app.UsageError(f"--configs: {config!r} needs K >= 1 and M >= 1.")
    return k, m


def main(argv: list[str]) -> None:
    del argv
    rows = []
    unrolls = [u.lower() for u in FLAGS.unroll]
    if any(u not in ("true", "false") for u in unrolls):
        raise app.UsageError(f"--unroll: {FLAGS.unroll} holds a value other than true, false.")
    repeats = [r.lower() for r in FLAGS.repeated_layers]
    if any(r not in ("inline", "call") for r in repeats):
        raise app.UsageError(f"--repeated_layers: {FLAGS.repeated_layers} holds a value other than inline, call.")
    configs = [_parse(c) for c in FLAGS.configs]
    runs = [
        (c, u, r) for c in configs for u in (unrolls if c[0] else ["true"]) for r in (repeats if c[0] else ["inline"])
    ]
    for (k, m), unroll, repeated in runs:
        if FLAGS.batch_size < m:
            raise app.UsageError(f"--batch_size={FLAGS.batch_size} is smaller than M={m}.")
        found = run_config(k, m, unroll, repeated)
        rows.append({"K": k, "M": m, "tasks": 2 * k * m, **found})
        print(
            (f"K={k} M={m:>2} " if k else "plain Keras ") + f"{found['graph']:>8}: "
            f"first step {found['first_s']:6.1f} s (build {found['build_s']:.1f} s), "
            f"then {found['step_ms']:7.1f} ms/step, "
            f"peak RSS {found['peak_rss_gb']:.2f} GB, balance {found['balance']}",
            flush=True,
        )
    lines = [
        "| K | M | tasks | step graph | first train_on_batch (s) | of which build (s) | later steps (ms) "
        "| peak RSS (GB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['K'] or '-'} | {r['M'] if r['K'] else '-'} | {r['tasks'] or '-'} | {r['graph']} "
        f"| {r['first_s']:.1f} | {r['build_s']:.1f} | {r['step_ms']:.1f} | {r['peak_rss_gb']:.2f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if FLAGS.out:
        write_table(FLAGS.out, rows, table)


if __name__ == "__main__":
    app.run(main)
