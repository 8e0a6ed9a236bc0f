"""Every Keras entry point's step across worker processes, against ``fit``'s, at K=1 (one worker) and K=2 (two).

Plain Keras (the same layers as a ``keras.Sequential`` in the training process) runs every entry point too: what
Keras' own entry points cost against its ``fit``, which tfpipe's are compared with.

One ``LocalCluster`` of two one-thread workers; K=1 puts the whole model on worker 0 (the reference a user compares
to), K=2 cuts it over both. Per model and K, each entry point runs ``--steps`` batches after warming up, in rounds
(every entry point of every K in turn, ``--rounds`` times); its figure is the median per-batch time of a round, and
the table gives min / median / max over the rounds and the median per-round ratio to ``fit``'s:

- ``fit``: Keras' batch begin to end (``report.timed_fit``);
- ``train_on_batch``: one call, in a Python loop (the guide's custom loop);
- ``train_step``: ``model.train_step((x, y))`` inside the user's own ``tf.function``, one call;
- ``test_on_batch``, ``predict_on_batch``: one call;
- ``evaluate``, ``predict``: Keras' test / predict batch begin to end.

torch.distributed.pipelining has one entry point, its schedule's ``step()`` in a loop: with torch installed (the
``peers`` extra) each round also runs ``benchmarks/benchmark_peers.py`` on the same model at K=1 and K=2, M=1 (one pair,
its own workers and torch processes), and the table gives torch's step beside tfpipe's ``fit`` of that round.

    python benchmarks/benchmark_entry_points.py                            # the floor and 20 x Dense(512), M=1
    python benchmarks/benchmark_entry_points.py --models=floor --rounds=5 --out=docs/results/entry_points
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import csv
import importlib.util
import statistics
import subprocess
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts.report import timed_fit, warm_up, write_table  # noqa: E402

FLAGS = flags.FLAGS
WIDTHS = {"floor": 16, "mlp256": 256, "mlp512": 512}
flags.DEFINE_list("models", ["floor", "mlp512"], f"Models: {', '.join(WIDTHS)} (20 x Dense(width) + tanh).")
flags.DEFINE_integer("layers", 20, "Dense layers.", lower_bound=2)
flags.DEFINE_integer("batch_size", 512, "Batch.", lower_bound=1)
flags.DEFINE_list("micro_batches", ["1", "8"], "Values of M at K=2 (K=1 runs M=1).")
flags.DEFINE_integer("steps", 20, "Timed batches per entry point and round.", lower_bound=3)
flags.DEFINE_integer("rounds", 3, "Rounds of every entry point.", lower_bound=1)
flags.DEFINE_float("warmup_s", 2.0, "Untimed fit steps per model before its first round (at most 100).", lower_bound=0)
flags.DEFINE_bool("torch", True, "Also time torch's schedule.step() each round, where torch is installed.")
flags.DEFINE_string("out", None, "Write the table to OUT.csv and OUT.md.")

ENTRY_POINTS = ("fit", "train_on_batch", "train_step", "test_on_batch", "predict_on_batch", "evaluate", "predict")


def per_call(fn: Any, steps: int) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def per_batch(run: Any, kind: str, steps: int) -> float:
    """Median seconds between Keras' ``kind`` ('test' or 'predict') batch begin and end callbacks of ``run``."""
    import keras

    times: list[float] = []
    began = [0.0]
    callback = keras.callbacks.LambdaCallback(
        **{
            f"on_{kind}_batch_begin": lambda batch, logs: began.__setitem__(0, time.perf_counter()),
            f"on_{kind}_batch_end": lambda batch, logs: times.append(time.perf_counter() - began[0]),
        }
    )
    run([callback])
    return statistics.median(times[1:] if len(times) > 1 else times)


def measure(model: Any, x: Any, y: Any, batch: int, steps: int) -> dict[str, float]:
    """Each entry point's seconds per batch on ``model`` (trained on the first batch of (x, y) throughout)."""
    import tensorflow as tf

    xb, yb = x[:batch], y[:batch]
    tx, ty = tf.constant(xb), tf.constant(yb)
    step = tf.function(lambda a, b: model.train_step((a, b)))
    many_x, many_y = x[: batch * steps], y[: batch * steps]
    return {
        "fit": timed_fit(model, many_x, many_y, batch, 1).median_s,
        "train_on_batch": per_call(lambda: model.train_on_batch(xb, yb), steps),
        "train_step": per_call(lambda: step(tx, ty), steps),
        "test_on_batch": per_call(lambda: model.test_on_batch(xb, yb), steps),
        "predict_on_batch": per_call(lambda: model.predict_on_batch(xb), steps),
        "evaluate": per_batch(lambda cb: model.evaluate(many_x, many_y, batch, verbose=0, callbacks=cb), "test", steps),
        "predict": per_batch(lambda cb: model.predict(many_x, batch, verbose=0, callbacks=cb), "predict", steps),
    }


def torch_steps(model: str, steps: int, micro_batches: list[int]) -> dict[str, float]:
    """torch's step seconds at K=1, M=1 and at K=2 at each of ``micro_batches`` (GPipe, no recomputation) on
    ``model``, by label ("K=2, M=8"), from one pair of ``benchmark_peers.py`` (a process of its own: its workers and
    torch stages start and stop with it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peers")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_peers.py")
        flags_ = [f"--models={model}", f"--micro_batches={','.join(map(str, micro_batches))}", "--schedules=gpipe"]
        flags_ += ["--default_remat_at=1", "--pairs=1", f"--steps={steps}", f"--out={out}"]  # no except_last rows
        done = subprocess.run([sys.executable, script, *flags_], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"benchmark_peers.py failed (exit {done.returncode}): {done.stderr[-2000:]}")
        with open(out + ".csv") as f:
            return {f"K={r['k']}, M={r['m']}": float(r["torch_median_ms"]) / 1e3 for r in csv.DictReader(f)}


def main(argv: list[str]) -> None:
    """Rounds of every entry point at K=1 and K=2 for each model; the table of medians and ratios to fit."""
    del argv
    import numpy as np

    import tfpipe

    with_torch = _check_flags()
    micro_batches = [int(m) for m in FLAGS.micro_batches]
    rows = []
    with tfpipe.cluster.LocalCluster(2, threads_per_worker=1) as cluster:
        for name in FLAGS.models:
            width, batch = WIDTHS[name], FLAGS.batch_size
            rng = np.random.default_rng(0)
            x = rng.standard_normal((batch * (FLAGS.steps + 1), width)).astype("float32")
            y = np.tanh(x)
            models = _warmed_models(cluster.devices, width, x, y, micro_batches)
            found = _rounds(name, models, x, y, micro_batches, with_torch)
            rows += _entry_rows(name, found, with_torch)
    text = markdown(rows)
    print(text)
    if FLAGS.out:
        write_table(FLAGS.out, rows, text)


def _check_flags() -> bool:
    """Reject unknown models and torch's figure at another size; whether torch's step is timed too."""
    unknown = [m for m in FLAGS.models if m not in WIDTHS]
    if unknown:
        raise app.UsageError(f"--models: unknown {unknown}; use {', '.join(WIDTHS)}")
    with_torch = FLAGS.torch and importlib.util.find_spec("torch") is not None
    if FLAGS.torch and not with_torch:
        print("torch is not installed (pip install -e '.[peers]'): its step() is not timed", flush=True)
    if with_torch and (FLAGS.layers != 20 or FLAGS.batch_size != 512):
        raise app.UsageError("torch's figure is benchmark_peers.py's model: 20 layers, batch 512; or give --notorch")
    return with_torch


def _warmed_models(devices: list[str], width: int, x: Any, y: Any, micro_batches: list[int]) -> dict[str, Any]:
    """Plain Keras and tfpipe at K=1, M=1 and K=2 at each M (on ``devices``), compiled and warmed up, by label."""
    import keras

    import tfpipe

    batch = FLAGS.batch_size
    keras.utils.set_random_seed(0)  # plain Keras in this process: what its own entry points cost against fit
    plain = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="tanh")
                                                         for _ in range(FLAGS.layers)])  # fmt: skip
    plain.compile(optimizer="sgd", loss="mse", jit_compile=False)
    warm_up(plain, x, y, batch, FLAGS.warmup_s)
    models = {"plain Keras": plain}
    for k, m in [(1, 1)] + [(2, m) for m in micro_batches]:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(width, activation="tanh") for _ in range(FLAGS.layers)]
        model = tfpipe.PipelineModel(layers, num_partitions=k, devices=devices[:k], num_micro_batches=m, remat="never")
        model.compile(optimizer="sgd", loss="mse")
        warm_up(model, x, y, batch, FLAGS.warmup_s)
        models[f"K={k}, M={m}"] = model
    return models


def _rounds(
    name: str, models: dict[str, Any], x: Any, y: Any, micro_batches: list[int], with_torch: bool
) -> dict[str, list[dict[str, float]]]:
    """--rounds of every entry point of every model in turn (and torch's step), printed; each round's figures."""
    found: dict[str, list[dict[str, float]]] = {label: [] for label in models}
    for r in range(FLAGS.rounds):
        for label, model in models.items():
            found[label].append(measure(model, x, y, FLAGS.batch_size, FLAGS.steps))
            shown = ", ".join(f"{e} {found[label][-1][e] * 1e3:.1f}" for e in ENTRY_POINTS)
            print(f"  {name} {label} round {r}: {shown} ms", flush=True)
        if with_torch:
            for label, seconds in torch_steps(name, FLAGS.steps, micro_batches).items():
                found[label][-1]["torch step()"] = seconds
                print(f"  {name} {label} round {r}: torch {seconds * 1e3:.1f} ms", flush=True)
    return found


def _entry_rows(name: str, found: dict[str, list[dict[str, float]]], with_torch: bool) -> list[dict[str, Any]]:
    """The table's rows of one model: per entry point, each setup's min / median / max and median ratio to fit."""
    rows = []
    for entry in ENTRY_POINTS + (("torch step()",) if with_torch else ()):
        row: dict[str, Any] = {"model": name, "entry": entry}
        for label, runs in found.items():
            ms = [f[entry] * 1e3 for f in runs if entry in f]
            if not ms:  # torch has no plain-Keras column
                row[f"{label} ms"], row[f"{label} x fit"] = "-", "-"
                continue
            row[f"{label} ms"] = f"{min(ms):.1f} / {statistics.median(ms):.1f} / {max(ms):.1f}"
            row[f"{label} x fit"] = round(statistics.median(f[entry] / f["fit"] for f in runs if entry in f), 2)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: per model and entry point, each setup's time per batch and against its own fit."""
    labels = [key[: -len(" ms")] for key in rows[0] if key.endswith(" ms")]
    lines = [
        f"{FLAGS.layers} x Dense(width) + tanh, batch {FLAGS.batch_size}, SGD; plain Keras in the training process, "
        "tfpipe K=1 on one one-thread worker, K=2 on two (remat='never', GPipe); per batch, min / median / max of "
        f"{FLAGS.rounds} rounds of {FLAGS.steps}; x fit: against the same setup's fit in the same round (torch: "
        "against tfpipe's)",
        "",
        "| model | entry point | " + " | ".join(f"{label} (ms) | x fit" for label in labels) + " |",
        "| --- | --- | " + " | ".join("--- | ---" for _ in labels) + " |",
    ]
    for r in rows:
        cells = " | ".join(f"{r[label + ' ms']} | {r[label + ' x fit']}" for label in labels)
        lines.append(f"| {r['model']} | `{r['entry']}` | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
