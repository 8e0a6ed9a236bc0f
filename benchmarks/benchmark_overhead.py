"""What PipelineModel and re-materialization cost in step time, against plain Keras, in one process.

One small Transformer LM (models/transformer.py ``transformer_lm``) and one data
set are trained three ways (five with --jit_compile), each model built from fresh layers under the same
seed (so all start from identical weights, which the script checks):

- ``plain``:  ``keras.Sequential(layers)``, compiled with ``jit_compile=False``;
- ``never``:  ``tfpipe.PipelineModel(layers, balance=[len(layers)], num_micro_batches=1,
  remat="never")``, i.e. K=1, M=1, on ``--device`` (default /CPU:0; plain Keras runs there too);
- ``always``: the same with ``remat="always"`` (the one cell is recomputed in the backward).

With ``--jit_compile``, two more: ``plain_xla``, plain Keras compiled with ``jit_compile=True`` (what
Keras' default ``"auto"`` gives on a machine with a GPU), and ``xla``, the ``never`` model with its cell
compiled by XLA (``compile(jit_compile=True)``); their ratio is reported beside the others.

The three run graph mode without XLA: tfpipe's default leaves its cells to
TensorFlow's executor, and plain Keras is given ``jit_compile=False`` (on a CPU
Keras' "auto" would already mean no XLA; it is explicit so the comparison stays
like-for-like on a GPU too). Each model is built and traced once; then they are
timed in alternating rounds (plain, never, always, plain, never, always, ...),
each round one ``fit`` of ``--warmup + --steps`` batches per model, with a
callback timing every step (``on_train_batch_begin`` to ``on_train_batch_end``).
A model's step time in a round is the median over its steps after the first
``--warmup``. Alternation spreads drifting machine load over all of them, and the
per-round ratios (never/plain and always/never) are the quantities reported,
as median and min-max over the rounds. Targets, printed but not asserted:
PipelineModel overhead within 5% of plain Keras; remat "always" at most 35%
slower than "never" (recomputing the forward adds about one forward to a step
whose backward costs about two, i.e. about +33%, so that target has little slack).

    python benchmarks/benchmark_overhead.py                          # 4 blocks, dim 128, seq 32, batch 32
    python benchmarks/benchmark_overhead.py --repeats=9 --out=docs/results/overhead   # also write .csv and .md
    python benchmarks/benchmark_overhead.py --device=/GPU:0                  # all three on a GPU
    python benchmarks/benchmark_overhead.py --device=/GPU:0 --jit_compile    # and both with XLA
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts.report import median_step_seconds, write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("blocks", 4, "Transformer blocks.", lower_bound=1)
flags.DEFINE_integer("dim", 128, "Model dimension (feed-forward 4*dim).", lower_bound=8)
flags.DEFINE_integer("heads", 2, "Attention heads.", lower_bound=1)
flags.DEFINE_integer("seq_len", 32, "Sequence length.", lower_bound=2)
flags.DEFINE_integer("batch_size", 32, "Batch size.", lower_bound=1)
flags.DEFINE_integer("vocab", 256, "Vocabulary size.", lower_bound=2)
flags.DEFINE_integer("steps", 30, "Timed steps per model per round (after warm-up).", lower_bound=1)
flags.DEFINE_integer("warmup", 3, "Untimed steps at the start of every fit.", lower_bound=1)
flags.DEFINE_integer(
    "repeats", 7, "Rounds; each round times plain, never and always once, in that order.", lower_bound=1
)
flags.DEFINE_integer("seed", 0, "Seed for the weights and the data.")
flags.DEFINE_string("out", None, "Write the rounds and the summary to OUT.csv and OUT.md.")
flags.DEFINE_string("device", "/CPU:0", "The device all models train on, such as /CPU:0 or /GPU:0.")
flags.DEFINE_bool(
    "jit_compile", False, "Also time plain Keras and remat=never with XLA (plain_xla, xla): per cell for tfpipe."
)

VARIANTS = ("plain", "never", "always")
XLA_VARIANTS = ("plain_xla", "xla")
OVERHEAD_TARGET = 0.05  # PipelineModel(K=1, M=1, remat=never) at most 5% slower than plain Keras
REMAT_TARGET = 0.35  # remat=always at most 35% slower than remat=never


def _validate_flags() -> None:
    """Reject combinations the flag bounds alone cannot catch, naming the fix."""
    if FLAGS.dim % FLAGS.heads:
        raise app.UsageError(f"--dim={FLAGS.dim} must be divisible by --heads={FLAGS.heads}.")


def _data() -> tuple[Any, Any]:
    """Random token ids for ``--warmup + --steps`` batches, and next-token targets."""
    import numpy as np

    rng = np.random.default_rng(FLAGS.seed)
    n = FLAGS.batch_size * (FLAGS.warmup + FLAGS.steps)
    x = rng.integers(0, FLAGS.vocab, size=(n, FLAGS.seq_len)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def _layers() -> list:
    """Fresh Transformer layers (weights are drawn when they are built)."""
    from tfpipe.models.transformer import transformer_lm

    return transformer_lm(FLAGS.vocab, FLAGS.seq_len, FLAGS.blocks, FLAGS.dim, 4 * FLAGS.dim, FLAGS.heads)


def build_model(variant: str, sample: Any) -> Any:
    """A compiled, built model of ``variant`` from fresh layers whose weights come from ``--seed``."""
    import keras

    import tfpipe

    keras.utils.set_random_seed(FLAGS.seed)
    layers = _layers()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    xla = variant in XLA_VARIANTS
    if variant.startswith("plain"):
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=xla)
        model(sample)  # builds every layer now, right after the seed, drawing the weights in layer order
    else:
        model = tfpipe.PipelineModel(
            layers,
            balance=[len(layers)],
            devices=[FLAGS.device],
            num_micro_batches=1,
            remat="never" if xla else variant,
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=xla)
        model.build(sample)
    return model


def _same_weights(models: dict[str, Any]) -> bool:
    """Whether all models start from identical weights (the comparison is like-for-like)."""
    import numpy as np

    reference = [w.numpy() for w in models["plain"].weights]
    return all(
        len(m.weights) == len(reference) and all(np.array_equal(w.numpy(), r) for w, r in zip(m.weights, reference))
        for m in models.values()
    )


def time_fit(model: Any, x: Any, y: Any) -> float:
    """Median seconds per training step over one fit, the first ``--warmup`` steps excluded."""
    return median_step_seconds(model, x, y, FLAGS.batch_size, FLAGS.warmup)


def main(argv: list[str]) -> None:
    """Build and trace the models, time them in alternating rounds, print and write the table."""
    del argv
    _validate_flags()
    import tensorflow as tf

    with tf.device(FLAGS.device):  # plain Keras' steps are traced under it, so they run where the cell does
        _run()


def _run() -> None:
    """Build, trace and time the models on the current device; print and write the table."""
    x, y = _data()
    variants = VARIANTS + (XLA_VARIANTS if FLAGS.jit_compile else ())
    models = {v: build_model(v, x[: FLAGS.batch_size]) for v in variants}
    same = _same_weights(models)
    for model in models.values():  # trace and run once, outside the timed rounds
        model.fit(
            x[: 2 * FLAGS.batch_size],
            y[: 2 * FLAGS.batch_size],
            batch_size=FLAGS.batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    print(
        f"Transformer: {FLAGS.blocks} blocks, dim {FLAGS.dim}, {FLAGS.heads} heads, seq {FLAGS.seq_len}, "
        f"batch {FLAGS.batch_size}, vocab {FLAGS.vocab}; on {FLAGS.device}; "
        f"{FLAGS.steps} timed steps per model per round after {FLAGS.warmup} warm-up; "
        f"identical initial weights: {'yes' if same else 'NO'}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for r in range(FLAGS.repeats):
        ms = {v: 1e3 * time_fit(models[v], x, y) for v in variants}
        row = {
            "round": r + 1,
            **{f"{v}_ms": ms[v] for v in variants},
            "never_over_plain": ms["never"] / ms["plain"],
            "always_over_never": ms["always"] / ms["never"],
        }
        if FLAGS.jit_compile:
            row["xla_over_plain_xla"] = ms["xla"] / ms["plain_xla"]
        rows.append(row)
        print(
            f"round {r + 1}: " + ", ".join(f"{v} {ms[v]:.2f} ms" for v in variants) + "; "
            f"never/plain {row['never_over_plain']:.3f}, always/never {row['always_over_never']:.3f}"
            + (f", xla/plain_xla {row['xla_over_plain_xla']:.3f}" if FLAGS.jit_compile else ""),
            flush=True,
        )
    summary = _summary(rows)
    table = _markdown(rows, summary)
    print("\n" + table)
    if FLAGS.out:
        fields = [*rows[0]]
        write_table(FLAGS.out, rows + [{"round": stat, **values} for stat, values in summary.items()], table, fields)


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max over the rounds of every timed column."""
    import numpy as np

    columns = [c for c in rows[0] if c != "round"]
    return {
        stat: {c: float(fn([row[c] for row in rows])) for c in columns}
        for stat, fn in (("median", np.median), ("min", np.min), ("max", np.max))
    }


def _markdown(rows: list[dict[str, Any]], summary: dict[str, dict[str, float]]) -> str:
    """The ratios with their spread and targets, then the absolute step times."""
    med, lo, hi = summary["median"], summary["min"], summary["max"]

    def verdict(ratio: float, target: float) -> str:
        return f"{'met' if ratio - 1.0 <= target else 'missed'} ({100 * (ratio - 1.0):+.1f}%)"

    lines = [
        f"| ratio (per round, {len(rows)} rounds) | median | min - max | target | median vs target |",
        "|---|---|---|---|---|",
        f"| PipelineModel(remat=never) / plain Keras | {med['never_over_plain']:.3f} | "
        f"{lo['never_over_plain']:.3f} - {hi['never_over_plain']:.3f} | <= {1 + OVERHEAD_TARGET:.2f} | "
        f"{verdict(med['never_over_plain'], OVERHEAD_TARGET)} |",
        f"| remat=always / remat=never | {med['always_over_never']:.3f} | "
        f"{lo['always_over_never']:.3f} - {hi['always_over_never']:.3f} | <= {1 + REMAT_TARGET:.2f} | "
        f"{verdict(med['always_over_never'], REMAT_TARGET)} |",
    ]
    if "xla_over_plain_xla" in med:  # the same overhead target, both sides compiled by XLA
        lines.append(
            f"| PipelineModel(remat=never, cell by XLA) / plain Keras with XLA | {med['xla_over_plain_xla']:.3f} | "
            f"{lo['xla_over_plain_xla']:.3f} - {hi['xla_over_plain_xla']:.3f} | <= {1 + OVERHEAD_TARGET:.2f} | "
            f"{verdict(med['xla_over_plain_xla'], OVERHEAD_TARGET)} |"
        )
    lines += ["", "| step time (ms) | median | min - max |", "|---|---|---|"]
    names = {
        "plain": "plain Keras",
        "never": "PipelineModel remat=never",
        "always": "PipelineModel remat=always",
        "plain_xla": "plain Keras, jit_compile=True",
        "xla": "PipelineModel remat=never, jit_compile=True (per cell)",
    }
    for v in [v for v in (*VARIANTS, *XLA_VARIANTS) if f"{v}_ms" in med]:
        c = f"{v}_ms"
        lines.append(f"| {names[v]} | {med[c]:.2f} | {lo[c]:.2f} - {hi[c]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    app.run(main)
