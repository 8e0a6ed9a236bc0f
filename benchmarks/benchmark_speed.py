"""Pipeline speed-up on single-thread worker processes: GPipe's Table 2, measured on this machine.

Each cell runs in its own TensorFlow worker process (tfpipe.cluster.LocalCluster)
whose thread pools have one thread, so a cell is a device that runs one thing at
a time. Rows are K (cells), columns M (micro-batches); the global batch is the
same everywhere. The reference is what a user compares to: the same model on ONE
worker, K=1, M=1, without re-materialization. Each entry: examples/s, speed-up
over that reference, the ideal K*M/(M+K-1), and measured/ideal; a second table
compares with K=1 at the same M and remat (equal work: a diagnostic); a third gives
the CPU of every process per step and the speed-up that CPU allows on this machine's
cores (no step is shorter than its CPU spread over every core). Warm-up
steps are excluded (by default up to 100 of them, for 5 s, so that TensorFlow's
executor has learnt its kernels' costs) and the median step time is used. Every size in --dims x
--batch_sizes gets its own tables, all from one run.

    python benchmarks/benchmark_speed.py                       # Transformer, K in {1, 2}, M in {1, 2, 4, 8, 16, 32}
    python benchmarks/benchmark_speed.py --model=mlp --dims=256,1024 --batch_sizes=128,1024 --remat=never
    python benchmarks/benchmark_speed.py --max_partitions=4 --out=docs/results/speed   # also K=4; write .csv and .md
    python benchmarks/benchmark_speed.py --replicas=2     # also R=2 replicas of each K, on 2K workers
    python benchmarks/benchmark_speed.py --model=hub:llama --blocks=4 --dims=128   # a keras_hub causal LM (hub extra)

With --replicas=R, R x K entries run R data-parallel replicas of the K cells on R x K
workers, each replica on 1/R of the batch; their ideal is R x K*M/(M+K-1). On a
machine with fewer cores than workers those entries only indicate: the workers share cores.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts import hub_models  # noqa: E402
from scripts.report import StepTimes, timed_fit, warm_up, write_table  # noqa: E402

FLAGS = flags.FLAGS
MODELS = ("transformer", "amoebanet", "mlp", "unet", "resnet50")
flags.DEFINE_string(
    "model",
    "transformer",
    f"Model to time: one of {', '.join(MODELS)} or hub:NAME; mlp: --blocks Dense(--dims) + tanh layers and a "
    "Dense(10) classifier; unet: models/unet.py (a Functional model: depth 3, 2 convolutions per stage, --dims base "
    "channels, --seq_len pixels square); resnet50: keras.applications.ResNet50 (Functional, --seq_len pixels "
    "square, --dims ignored); hub:NAME: a tiny random keras_hub causal LM of models/hub.py (gpt2, gemma, llama, "
    "...: --blocks blocks, --dims wide, --seq_len tokens, --vocab tokens; needs the hub extra).",
)
flags.DEFINE_integer("max_partitions", 2, "Largest K (powers of two from 1).", lower_bound=1)
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16", "32"], "Values of M.")
flags.DEFINE_list("batch_sizes", ["64"], "Global batches, the same for every M; one set of tables each.")
flags.DEFINE_integer("steps", 8, "Timed steps per entry (after warm-up).", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Untimed steps per entry (the first one traces).", lower_bound=1)
flags.DEFINE_float(
    "warmup_s",
    5.0,
    "Before them, untimed steps for this many seconds after the first (at most 100): TensorFlow's executor "
    "takes about 90 runs to learn that a kernel is cheap, which small models need.",
    lower_bound=0.0,
)
flags.DEFINE_integer(
    "blocks", 8, "Transformer/hub blocks / AmoebaNet normal cells (a multiple of 3) / MLP hidden layers.", lower_bound=1
)
flags.DEFINE_list("dims", ["256"], "Transformer/hub model dimension / AmoebaNet filters / MLP width; tables each.")
flags.DEFINE_integer("seq_len", 32, "Transformer/hub sequence length / image size.", lower_bound=8)
flags.DEFINE_integer("vocab", 256, "Transformer/hub vocabulary size.", lower_bound=2)
flags.DEFINE_bool(
    "tie_embeddings",
    False,
    "Transformer: the output projection is the token embedding (models/transformer.py transformer_lm_tied), used "
    "by the first and last cells; the reference too.",
)
flags.DEFINE_enum(
    "remat",
    "except_last",
    ["always", "except_last", "never"],
    "Re-materialization of the pipelined entries (the K=1 M=1 reference never recomputes).",
)
flags.DEFINE_bool(
    "unroll", True, "Pipelined entries unrolled (default) or, with --nounroll, as loops (the reference: unrolled)."
)
flags.DEFINE_enum(
    "schedule",
    "gpipe",
    ["gpipe", "1f1b", "zero_bubble", "gpipe_batched_w"],
    "Schedule of the pipelined entries (tfpipe.schedule).",
)
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "Optimizer of every entry (SGD 1e-3, Adam 1e-4).")
flags.DEFINE_integer("replicas", 1, "Also time R data-parallel replicas of each K (R x K workers).", lower_bound=1)
flags.DEFINE_integer(
    "steps_per_execution",
    1,
    "Keras' steps_per_execution for every entry, the reference too: S steps per call of the train function.",
    lower_bound=1,
)
flags.DEFINE_bool(
    "threads",
    False,
    "Also break each entry's CPU and wait for a core per step down by process (client, worker0, ...) and thread "
    "name (Linux): printed, and in the CSV's 'threads' column.",
)
flags.DEFINE_bool(
    "jit_compile",
    False,
    "Compile each cell of the entries by XLA on its worker (compile(jit_compile=True)); the reference stays as "
    "Keras runs it by default on a CPU, without XLA, so the K=1, M=1 entry shows what XLA itself gains.",
)
flags.DEFINE_string("out", None, "Write the table to OUT.csv and OUT.md.")


def _layers_and_data(dim: int, n: int):
    """The model's layers and one global batch (x, y) of n examples."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    if FLAGS.model == "transformer":
        from scripts.data import random_lm

        return random_lm(n, FLAGS.seq_len, FLAGS.blocks, dim, FLAGS.vocab, tied=FLAGS.tie_embeddings)
    if hub_models.is_hub(FLAGS.model):
        name = FLAGS.model[len(hub_models.PREFIX) :]
        task = hub_models.causal_lm(name, FLAGS.vocab, FLAGS.blocks, dim, FLAGS.seq_len)
        return (task, *hub_models.random_batch(n, FLAGS.seq_len, FLAGS.vocab))
    if FLAGS.model == "mlp":
        layers = [keras.layers.Dense(dim, activation="tanh") for _ in range(FLAGS.blocks)] + [keras.layers.Dense(10)]
        return layers, rng.normal(size=(n, dim)).astype("float32"), rng.integers(0, 10, size=n)
    size = FLAGS.seq_len
    if FLAGS.model == "unet":
        from tfpipe.models.unet import unet

        model = unet((size, size, 3), output_channels=2, depth=3, num_convs=2, base_channels=dim)
        return model, rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 2, size=(n, size, size))
    if FLAGS.model == "resnet50":
        model = keras.applications.ResNet50(
            weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
        )
        return model, rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 10, size=n)
    from tfpipe.models.amoebanet import amoebanet_d

    layers = amoebanet_d(10, FLAGS.blocks, dim)
    return layers, rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 10, size=n)


def time_entry(
    devices: list[str] | list[list[str]],
    m: int,
    remat: str,
    dim: int,
    batch_size: int,
    unroll: bool = True,
    pids: Sequence[int] = (),
    jit_compile: bool = False,
) -> StepTimes:
    """The training steps with the cells on ``devices`` (or R lists: replicas), M = m, ``remat``, each cell compiled
    by XLA with ``jit_compile``: their median time, and the CPU that this process and ``pids`` (the workers) used."""
    import keras
    import numpy as np

    import tfpipe

    keras.utils.set_random_seed(0)
    layers, x, y = _layers_and_data(dim, batch_size)
    model = tfpipe.PipelineModel(
        layers,
        num_partitions=len(devices[0]) if isinstance(devices[0], list) else len(devices),
        devices=devices,
        num_micro_batches=m,
        remat=remat,
        unroll=unroll,
        schedule=FLAGS.schedule,  # at K=1, M=1 (the reference) every schedule is F then B
    )
    optimizer = keras.optimizers.Adam(1e-4) if FLAGS.optimizer == "adam" else keras.optimizers.SGD(1e-3)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=FLAGS.steps_per_execution,
        jit_compile=jit_compile,
    )
    if hub_models.is_hub(FLAGS.model):  # x: token ids; each fit adds the padding mask
        model = hub_models.FitOnTokenIds(model)
    if FLAGS.warmup_s > 0:
        warm_up(model, x, y, batch_size, FLAGS.warmup_s)
    batches = FLAGS.warmup + FLAGS.steps
    return timed_fit(
        model,
        np.repeat(x, batches, axis=0),
        np.repeat(y, batches, axis=0),
        batch_size,
        FLAGS.warmup,
        pids,
        by_thread=FLAGS.threads,
    )


def main(argv: list[str]) -> None:
    """Time the reference and every pipelined entry of each size; print the tables and write them."""
    del argv
    hub = _check_model_flags()
    from tfpipe.cluster import LocalCluster

    ks = [k for k in (1, 2, 4, 8, 16) if k <= FLAGS.max_partitions]
    ms = [int(m) for m in FLAGS.micro_batches]
    sizes = [(int(d), int(n)) for d in FLAGS.dims for n in FLAGS.batch_sizes]
    rs = sorted({1, FLAGS.replicas})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows: list[dict] = []
    for k in ks:
        with LocalCluster(k * rs[-1], threads_per_worker=1) as cluster:
            for r, (dim, n) in [(r, size) for r in rs for size in sizes]:
                size = f"dim={dim} batch={n}"
                reference = _reference(cluster, rows, size, dim, n)
                for m in ms:
                    if n < m * r:
                        continue
                    grid = [cluster.devices[i * k : (i + 1) * k] for i in range(r)]
                    times = time_entry(
                        grid if r > 1 else grid[0],
                        m,
                        FLAGS.remat,
                        dim,
                        n,
                        FLAGS.unroll,
                        cluster.pids,
                        FLAGS.jit_compile,
                    )
                    rows.append(_entry_row(rows, size, r, k, m, n, times, reference, cores))
                    _print_entry(rows[-1], times)
    table = _tables(rows, ms, hub)
    print("\n" + table)
    if FLAGS.out:
        write_table(FLAGS.out, rows, table)


def _check_model_flags() -> bool:
    """Reject a --model, or a flag of another model, that cannot work; return whether --model is a hub:NAME."""
    hub = hub_models.is_hub(FLAGS.model)
    try:
        if hub:
            hub_models.check(FLAGS.model)
        elif FLAGS.model not in MODELS:
            raise ValueError(f"use one of {', '.join(MODELS)} or hub:NAME, e.g. hub:gpt2")
    except ValueError as err:
        raise app.UsageError(f"--model={FLAGS.model}: {err}") from None
    for name, kinds in (("tie_embeddings", ("transformer",)), ("vocab", ("transformer", "hub:NAME"))):
        if FLAGS[name].present and ("hub:NAME" if hub else FLAGS.model) not in kinds:
            raise app.UsageError(f"--{name} applies to --model={' or '.join(kinds)}, not --model={FLAGS.model}")
    return hub


def _reference(cluster: Any, rows: list[dict], size: str, dim: int, n: int) -> tuple[float, float]:
    """The reference of ``size`` (examples/s, CPU ms per step): timed at its first row, else taken from ``rows``."""
    known = next((r for r in rows if r["size"] == size), None)
    if known is not None:
        return known["reference"], known["reference_cpu_ms"]
    # The reference: one worker, K=1, M=1, no recomputation.
    # Best of two: the first model on fresh workers ran up to 25% slow (measured).
    times = [time_entry(cluster.devices[:1], 1, "never", dim, n, pids=cluster.pids) for _ in range(2)]
    ref = min(times, key=lambda t: t.median_s)
    base, base_cpu = n / ref.median_s, 1e3 * ref.cpu_s
    print(f"{size}: reference K=1 M=1 remat='never' {base:8.1f} examples/s  {_cpu(ref)}", flush=True)
    return base, base_cpu


def _entry_row(
    rows: list[dict],
    size: str,
    r: int,
    k: int,
    m: int,
    n: int,
    times: StepTimes,
    reference: tuple[float, float],
    cores: int,
) -> dict:
    """The row of one timed entry: its speed against the reference, K=1 at the same M, the ideal and the bounds."""
    from tfpipe import schedule

    base, base_cpu = reference
    rate = n / times.median_s
    ideal = r * schedule.ideal_speedup(k, m)
    recomputed = list(range({"always": m, "except_last": m - 1, "never": 0}[FLAGS.remat]))
    allowed = r * schedule.allowed_speedup(FLAGS.schedule, k, m, recomputed)
    # Over one worker at this M, which recomputes as much: what the schedule allows beside it.
    allowed_same_m = allowed / schedule.allowed_speedup(FLAGS.schedule, 1, m, recomputed)
    one_cell = next(
        (e["examples_per_s"] for e in rows if e["size"] == size and e["K"] * e["R"] == 1 and e["M"] == m),
        rate,
    )
    return {
        "size": size,
        "R": r,
        "K": k,
        "M": m,
        "remat": FLAGS.remat,
        "schedule": FLAGS.schedule,
        "optimizer": FLAGS.optimizer,
        "jit_compile": FLAGS.jit_compile,
        "tie_embeddings": FLAGS.tie_embeddings,
        "examples_per_s": rate,
        "reference": base,
        "speedup": rate / base,
        "ideal": ideal,
        "of_ideal": rate / base / ideal,
        "allowed": allowed,
        "of_allowed": rate / base / allowed,
        "speedup_same_m": rate / one_cell,
        "of_ideal_same_m": rate / one_cell / ideal,
        "allowed_same_m": allowed_same_m,
        "of_allowed_same_m": rate / one_cell / allowed_same_m,
        # A perfect pipeline of one worker's micro-batches at this M: its kernels on
        # smaller matrices set this bound before any cost of pipelining.
        "microbatches_allow": allowed_same_m * one_cell / base,
        "cpu_ms": 1e3 * times.cpu_s,
        "waiting_ms": 1e3 * times.waiting_s,
        "cores_busy": times.cores_busy,
        "reference_cpu_ms": base_cpu,
        # No step can take less than its CPU spread over every core of the machine.
        "cores_allow": n / base * cores / times.cpu_s,
        "cores": cores,
        **({"threads": _thread_line(times)} if FLAGS.threads else {}),
    }


def _print_entry(row: dict, times: StepTimes) -> None:
    """One timed entry's line (and with --threads its CPU by thread), as it is timed."""
    r, rate = row["R"], row["examples_per_s"]
    print(
        f"{row['size']} {f'R={r} ' if r > 1 else ''}K={row['K']} M={row['M']:>2}: {rate:8.1f} examples/s  "
        f"speed-up {row['speedup']:5.2f}  ideal "
        f"{row['ideal']:5.2f}  measured/ideal {row['of_ideal']:5.2f}  (schedule allows {row['allowed']:4.2f}: "
        f"{row['of_allowed']:4.2f}; over K=1 at this M: "
        f"{row['speedup_same_m']:5.2f}, {row['of_ideal_same_m']:5.2f} of ideal; one worker's micro-batches "
        f"allow {row['microbatches_allow']:.2f}x)  {_cpu(times)}; "
        f"the {row['cores']} cores allow {row['cores_allow']:.2f}x",
        flush=True,
    )
    if FLAGS.threads:
        print(f"  CPU / wait for a core, ms per step: {row['threads']}", flush=True)


def _tables(rows: list[dict], ms: list[int], hub: bool) -> str:
    """Every size's heading (the flags it ran with) and its three tables."""
    return "\n\n".join(
        f"### {FLAGS.model} {size}, remat={FLAGS.remat!r}, unroll={FLAGS.unroll}, schedule={FLAGS.schedule!r}"
        + (f", optimizer={FLAGS.optimizer!r}" if FLAGS.optimizer != "sgd" else "")
        + (f", steps_per_execution={FLAGS.steps_per_execution}" if FLAGS.steps_per_execution > 1 else "")
        + (", cells compiled by XLA (the reference without)" if FLAGS.jit_compile else "")
        + (f", vocabulary {FLAGS.vocab}" if FLAGS.model == "transformer" or hub else "")
        + (", embedding tied to the output" if FLAGS.tie_embeddings else "")
        + "\n\n"
        + _markdown([r for r in rows if r["size"] == size], ms)
        for size in dict.fromkeys(r["size"] for r in rows)
    )


def _cpu(times: StepTimes) -> str:
    """The CPU that a timed entry used, per step, as one line."""
    return (
        f"CPU {1e3 * times.cpu_s:.1f} ms/step ({times.cores_busy:.2f} cores busy), "
        f"threads waited {1e3 * times.waiting_s:.1f} ms/step for a core"
    )


def _thread_line(times: StepTimes) -> str:
    """Each 'role:thread name' that ran or waited, busiest first: 'name run/wait' in ms per step, ';'-separated."""
    busiest = sorted(times.threads.items(), key=lambda item: -(item[1][0] + item[1][1]))
    return "; ".join(f"{key} {1e3 * run:.2f}/{1e3 * wait:.2f}" for key, (run, wait) in busiest if run + wait >= 5e-6)


def _speedup_entry(
    key: str, share: str, allowed: str, allowed_share: str, limit: bool = False
) -> Callable[[dict], str]:
    """A speed-up table's entry of a row: the speed-up ``key``, its ``share`` of the ideal, of what is ``allowed``
    where that differs, and with ``limit`` of what one worker's micro-batches allow; then examples/s."""

    def entry(row: dict) -> str:
        note = f"{100 * row[share]:.0f}% of {row['ideal']:.2f}x"
        if abs(row[allowed] - row["ideal"]) >= 5e-3:
            note += f"; {100 * row[allowed_share]:.0f}% of the {row[allowed]:.2f}x allowed"
        if limit and row["K"] * row["R"] > 1:  # what one worker's micro-batches and the schedule allow together
            note += f"; {100 * row[key] / row['microbatches_allow']:.0f}% of the limit {row['microbatches_allow']:.2f}x"
        return f"{row[key]:.2f}x ({note}), {row['examples_per_s']:.0f}/s"

    return entry


def _markdown(rows: list[dict], ms: list[int]) -> str:
    """Three tables, K (or R x K) rows and M columns: speed-up over K=1 M=1, over K=1 at the same M, and CPU.

    Each speed-up entry: 'speed-up (share of the ideal K*M/(M+K-1)), examples/s', and
    where the schedule or the recomputation allows less than the ideal (``schedule.allowed_speedup``),
    the share of that too. The second table compares equal work (the same micro-batches and
    re-materialization), so it isolates what pipelining gains: a perfect pipeline of one worker's
    micro-batches reaches what the schedule allows there. The third says what each step
    cost the machine: CPU time of the client and the workers, how many cores that kept busy, and
    the speed-up over the reference that the machine's cores allow at that CPU per step.
    """
    reference_cpu = rows[0]["reference_cpu_ms"]
    tables = []
    for title, entry in (
        (
            "Speed-up over one worker, K=1, M=1, no re-materialization (the limit: what the schedule allows times "
            "one worker's speed at this M, its kernels on smaller matrices)",
            _speedup_entry("speedup", "of_ideal", "allowed", "of_allowed", limit=True),
        ),
        (
            "Speed-up over K=1 at the same M and remat (diagnostic; its share of what the schedule allows is the "
            "share of the bound that one worker's micro-batches set)",
            _speedup_entry("speedup_same_m", "of_ideal_same_m", "allowed_same_m", "of_allowed_same_m"),
        ),
        (
            f"CPU per step, every process (the reference: {reference_cpu:.1f} ms), the cores it kept busy, and the "
            f"speed-up that CPU allows on {rows[0]['cores']} cores",
            lambda row: (
                f"{row['cpu_ms']:.1f} ms, {row['cores_busy']:.2f} cores, waited {row['waiting_ms']:.1f} ms; "
                f"allows {row['cores_allow']:.2f}x"
            ),
        ),
    ):
        lines = [
            f"{title}:",
            "",
            ("| R x K \\ M | " if any(r["R"] > 1 for r in rows) else "| K \\ M | ")
            + " | ".join(str(m) for m in ms)
            + " |",
            "|---" * (len(ms) + 1) + "|",
        ]
        for rk in sorted({(r["R"], r["K"]) for r in rows}):
            cells = {r["M"]: r for r in rows if (r["R"], r["K"]) == rk}
            label = f"{rk[0]} x {rk[1]}" if rk[0] > 1 else str(rk[1])
            lines.append(f"| {label} | " + " | ".join(entry(cells[m]) if m in cells else "-" for m in ms) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


if __name__ == "__main__":
    app.run(main)
