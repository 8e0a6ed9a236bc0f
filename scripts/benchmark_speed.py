"""Pipeline speed-up on single-thread worker processes: GPipe's Table 2, measured on this machine.

Each cell runs in its own TensorFlow worker process (tfpipe.cluster.LocalCluster)
whose thread pools have one thread, so a cell is a device that runs one thing at
a time. Rows are K (cells), columns M (micro-batches); the global batch is the
same everywhere. Each entry: examples/s, speed-up over K=1 M=1 (same setup),
the ideal K*M/(M+K-1), and measured/ideal. Warm-up steps are excluded and the
median step time is used.

    python scripts/benchmark_speed.py                       # K in {1, 2}, M in {1, 2, 4, 8, 16, 32}
    python scripts/benchmark_speed.py --max_partitions=4 --out=docs/speed   # also K=4; write .csv and .md
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from scripts.report import median_step_seconds, write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "transformer", ["transformer", "amoebanet"], "Model to time.")
flags.DEFINE_integer("max_partitions", 2, "Largest K (powers of two from 1).", lower_bound=1)
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16", "32"], "Values of M.")
flags.DEFINE_integer("batch_size", 64, "Global batch, the same for every M.", lower_bound=1)
flags.DEFINE_integer("steps", 8, "Timed steps per entry (after warm-up).", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Untimed steps per entry (the first one traces).", lower_bound=1)
flags.DEFINE_integer("blocks", 8, "Transformer blocks / AmoebaNet normal cells (a multiple of 3).", lower_bound=1)
flags.DEFINE_integer("dim", 256, "Transformer model dimension / AmoebaNet filters.", lower_bound=8)
flags.DEFINE_integer("seq_len", 32, "Transformer sequence length / image size.", lower_bound=8)
flags.DEFINE_string("remat", "except_last", "Re-materialization mode.")
flags.DEFINE_string("out", None, "Write the table to OUT.csv and OUT.md.")


def _layers_and_data():
    import numpy as np

    rng = np.random.default_rng(0)
    n = FLAGS.batch_size
    if FLAGS.model == "transformer":
        from scripts.data import random_lm

        return random_lm(n, FLAGS.seq_len, FLAGS.blocks, FLAGS.dim)
    from models.amoebanet import amoebanet_d

    size = FLAGS.seq_len
    layers = amoebanet_d(10, FLAGS.blocks, FLAGS.dim)
    return layers, rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 10, size=n)


def time_entry(devices: list[str], m: int) -> float:
    """Median seconds of one training step with the cells on ``devices`` and M = m."""
    import keras
    import numpy as np

    import tfpipe

    keras.utils.set_random_seed(0)
    layers, x, y = _layers_and_data()
    model = tfpipe.PipelineModel(layers, num_partitions=len(devices), devices=devices, num_micro_batches=m,
                                 remat=FLAGS.remat)
    model.compile(optimizer=keras.optimizers.SGD(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = FLAGS.warmup + FLAGS.steps
    return median_step_seconds(model, np.repeat(x, batches, axis=0), np.repeat(y, batches, axis=0),
                               FLAGS.batch_size, FLAGS.warmup)


def main(argv: list[str]) -> None:
    del argv
    from tfpipe import schedule
    from tfpipe.cluster import LocalCluster

    ks = [k for k in (1, 2, 4, 8, 16) if k <= FLAGS.max_partitions]
    ms = [int(m) for m in FLAGS.micro_batches]
    rows, base = [], None
    for k in ks:
        with LocalCluster(k, threads_per_worker=1) as cluster:
            for m in ms:
                if FLAGS.batch_size < m:
                    continue
                seconds = time_entry(cluster.devices, m)
                rate = FLAGS.batch_size / seconds
                base = base or rate  # K=1, M=first: the reference
                ideal = schedule.ideal_speedup(k, m)
                one_cell = next((r["examples_per_s"] for r in rows if r["K"] == 1 and r["M"] == m), rate)
                rows.append({"K": k, "M": m, "examples_per_s": rate, "speedup": rate / base, "ideal": ideal,
                             "of_ideal": rate / base / ideal, "speedup_same_m": rate / one_cell,
                             "of_ideal_same_m": rate / one_cell / ideal})
                print(f"K={k} M={m:>2}: {rate:8.1f} examples/s  speed-up {rate / base:5.2f}  ideal {ideal:5.2f}  "
                      f"measured/ideal {rate / base / ideal:5.2f}  (over K=1 at this M: {rate / one_cell:5.2f}, "
                      f"{rate / one_cell / ideal:5.2f} of ideal)", flush=True)
    table = _markdown(rows, ms)
    print("\n" + table)
    if FLAGS.out:
        write_table(FLAGS.out, rows, table)


def _markdown(rows: list[dict], ms: list[int]) -> str:
    """Two tables, K rows and M columns: speed-up over K=1 M=1, then over K=1 at the same M.

    Each entry: 'speed-up (share of the ideal K*M/(M+K-1)), examples/s'. The second
    table compares equal work (the same micro-batches and re-materialization), so it
    isolates what pipelining gains.
    """
    tables = []
    for key, share, title in (("speedup", "of_ideal", "over K=1, M=1"),
                              ("speedup_same_m", "of_ideal_same_m", "over K=1 at the same M")):
        lines = [f"Speed-up {title}:", "", "| K \\ M | " + " | ".join(str(m) for m in ms) + " |",
                 "|---" * (len(ms) + 1) + "|"]
        for k in sorted({r["K"] for r in rows}):
            cells = {r["M"]: r for r in rows if r["K"] == k}
            entries = [f"{cells[m][key]:.2f}x ({100 * cells[m][share]:.0f}% of {cells[m]['ideal']:.2f}x), "
                       f"{cells[m]['examples_per_s']:.0f}/s" if m in cells else "-" for m in ms]
            lines.append(f"| {k} | " + " | ".join(entries) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


if __name__ == "__main__":
    app.run(main)
