"""Sweep keras.applications: each model enters a PipelineModel as it is, is split, and trains exactly as itself.

For every model: build it at a small input (32x32, or its minimum), list its nodes, find the
node with the most parameters, train the plain model two SGD steps on one batch, then for each
K train a PipelineModel of an identical copy (same seed) the same way, each step from the plain
model's weights before it, and compare every layer's weights after each step (relative to that
layer's largest weight, tests.util's ``per_layer_error``) and the predictions after training.

    python scripts/sweep_applications.py                                 # all of them, K=2 and K=4 (about an hour)
    python scripts/sweep_applications.py --models=ResNet50,VGG16 --partitions=2
    python scripts/sweep_applications.py --models=InceptionV3 --dtype=float64   # without float32's rounding
    python scripts/sweep_applications.py --out=docs/applications         # also write .csv and .md

A model passes when no node holds more than half the parameters and, at every K, there are K
non-empty cells and both errors are below ``--tolerance``, at M=1 (at M > 1 BatchNormalization
normalizes each micro-batch on its own, GPipe's semantics, not the plain model's). The exit status
is 1 if any result is not the expected one (a failure not in ``EXPECTED_FAILURES``, or one in it that passes).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import dataclasses
import gc
import json
import subprocess
import time
import traceback
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", [], "keras.applications model names, comma separated; default all of them.")
flags.DEFINE_list("partitions", ["2", "4"], "Values of K, the number of cells.")
flags.DEFINE_integer("input_size", 0, "Height and width of the input; 0: 32, or the model's minimum.", lower_bound=0)
flags.DEFINE_integer("batch", 4, "Samples in the one batch each step trains on.", lower_bound=1)
flags.DEFINE_integer("classes", 5, "Classes of the models' heads.", lower_bound=2)
flags.DEFINE_float("learning_rate", 0.01, "SGD's learning rate (Keras' default).")
flags.DEFINE_enum("dtype", "float32", ["float32", "float64"], "keras.config.floatx() for both models.")
flags.DEFINE_bool("chain", False, "Each step from the model's own weights, not the plain model's: rounding compounds.")
flags.DEFINE_float("tolerance", 1e-5, "Largest relative weight and prediction error that passes.")
flags.DEFINE_string("out", None, "Write OUT.csv and OUT.md with one row per model.")
flags.DEFINE_float("timeout", 3600, "Seconds a child may take for one model.", lower_bound=1)
flags.DEFINE_bool("child", False, "(Internal) run the one model of --models here and print its row as JSON.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_FLAGS = ("partitions", "input_size", "batch", "classes", "learning_rate", "dtype", "tolerance", "chain")
ROW_MARK = "sweep row: "  # a child's row on its stdout, as JSON after this
SMALL_SIZE = 32
MIN_SIZE = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}  # their own checks refuse smaller inputs
STEPS = 2  # SGD steps, each one epoch of the one batch
SEED = 1

# Models that cannot meet the target in float32 at M=1, and why (see the module docstring).
EXPECTED_FAILURES: dict[str, str] = {}  # none today


@dataclasses.dataclass
class Row:
    """What one model did: its size and graph, its largest node, and per K the balance and the errors."""

    name: str
    size: int = 0
    params: int = 0
    nodes: int = 0
    largest: str = ""  # the node (layer) holding the most parameters
    largest_share: float = float("nan")
    balance: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # K -> nodes per cell
    step_errors: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # K -> weight error after each step
    prediction_error: dict[int, float] = dataclasses.field(default_factory=dict)
    nan_predictions: int = 0  # NaNs the plain model predicts after training (its own training overflowed)
    passed: bool = False
    seconds: float = 0.0
    error: str = ""  # why it failed, when it did

    def cells(self) -> str:
        """The balance at each K, as 'a+b / a+b+c+d'."""
        return " / ".join("+".join(map(str, b)) for b in self.balance.values()) or "-"

    def errors(self) -> str:
        """Weight errors after the last step, one per K."""
        return ",".join(f"{e[-1]:.0e}" for e in self.step_errors.values()) or "-"

    def result(self) -> str:
        """'pass' or 'FAIL', with '*' for an expected failure and '!' for an expected one that passed."""
        text = "pass" if self.passed else "FAIL"
        if self.name in EXPECTED_FAILURES:
            text += "!" if self.passed else "*"
        return text

    def to_json(self) -> str:
        """The row as one line of JSON (``from_json`` reads it back)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Row:
        """A row from ``to_json``'s text (JSON's string keys back to K)."""
        fields = json.loads(text)
        for name in ("balance", "step_errors", "prediction_error"):
            fields[name] = {int(k): v for k, v in fields[name].items()}
        return cls(**fields)

    def csv_fields(self) -> dict[str, Any]:
        """The row as flat CSV columns."""
        fields: dict[str, Any] = dict(model=self.name, input=self.size, params=self.params, nodes=self.nodes)
        fields.update(largest_node=self.largest, largest_share=round(self.largest_share, 4), balance=self.cells())
        for k, errors in self.step_errors.items():
            fields.update({f"weight_error_k{k}_step{i + 1}": f"{e:.2e}" for i, e in enumerate(errors)})
        fields.update(
            prediction_error=f"{max(self.prediction_error.values(), default=float('nan')):.2e}",
            nan_predictions=self.nan_predictions,
            result=self.result(),
            seconds=round(self.seconds, 1),
            error=self.error,
        )
        return fields


def all_models() -> list[str]:
    """Every model constructor keras.applications exports, by name."""
    import keras

    return sorted(name for name in dir(keras.applications) if name[:1].isupper())


def input_size(name: str, asked: int = 0) -> int:
    """The input height and width to build ``name`` at: ``asked`` if given, else 32 or the model's minimum."""
    return asked or MIN_SIZE.get(name, SMALL_SIZE)


def build(name: str, size: int, classes: int) -> Any:
    """``keras.applications.<name>`` with random weights, a ``classes``-way head, the same weights every call."""
    import keras

    keras.utils.set_random_seed(SEED)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=classes)


def largest_node(model: Any) -> tuple[str, float]:
    """The layer of a Functional model that holds the most parameters (a layer called twice counted once), and its
    share."""
    counts = [(layer.name, layer.count_params()) for layer in model.layers]
    total = sum(n for _, n in counts)
    name, most = max(counts, key=lambda c: c[1], default=("", 0))
    return name, most / total if total else 0.0


def per_layer_error(mine: Sequence[Sequence[Any]], theirs: Sequence[Sequence[Any]]) -> float:
    """The largest difference of a layer's weights relative to that layer's largest weight (tests.util's measure).

    Both are lists of each layer's weights (``get_weights()``), the layers in the same order; NaN anywhere is inf.
    """
    import numpy as np

    assert len(mine) == len(theirs), (len(mine), len(theirs))
    worst = 0.0
    for a, b in zip(mine, theirs):
        if b:
            scale = max(float(np.max(np.abs(w))) for w in b) or 1.0
            diffs = [float(np.max(np.abs(x - y))) for x, y in zip(a, b)]
            worst = max(worst, float("inf") if np.isnan(diffs).any() else max(diffs) / scale)  # max() skips NaN
    return worst


def relative_error(got: Any, expected: Any) -> float:
    """The largest difference over the largest expected magnitude where both are numbers; inf if NaNs differ.

    (A model whose own training overflows predicts NaN for some samples: equal NaNs are equal predictions.)"""
    import numpy as np

    nan = np.isnan(expected)
    if not np.array_equal(np.isnan(got), nan):
        return float("inf")
    if nan.all():
        return 0.0
    return float(np.max(np.abs(got - expected)[~nan]) / (np.max(np.abs(expected[~nan])) or 1.0))


def _train(model: Any, layers: Sequence[Any], x: Any, y: Any, learning_rate: float, starts: Sequence[Any] = ()) -> Any:
    """Compile with SGD and fit STEPS single-batch epochs; the layers' weights and all weights after each step.

    A step after the first starts from ``starts[step - 1]`` where given, so each step is compared from the same
    weights. Chained, a BatchNormalization over a few values per channel amplifies float32's rounding step by step
    (ResNet50V2: 1e-6 after one step, 6e-3 after two; exact in float64).
    """
    import keras

    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy")
    layer_weights, weights = [], []
    for step in range(STEPS):  # one fit per step: the train function is traced once
        if step and starts:
            model.set_weights(starts[step - 1])
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        layer_weights.append([layer.get_weights() for layer in layers])
        weights.append(model.get_weights())
    return layer_weights, weights


def run_model(
    name: str,
    partitions: Sequence[int] = (2, 4),
    size: int = 0,
    batch: int = 4,
    classes: int = 5,
    tolerance: float = 1e-5,
    learning_rate: float = 0.01,
    chain: bool = False,
) -> Row:
    """Enter, split and train ``name`` at each K in ``partitions`` against the plain model; its row."""
    import keras
    import numpy as np

    import tfpipe

    began = time.perf_counter()
    row = Row(name, size=input_size(name, size))
    try:
        reference = build(name, row.size, classes)
        row.params = reference.count_params()
        row.largest, row.largest_share = largest_node(reference)
        rng = np.random.default_rng(0)  # one batch of random images (of Keras' float type) and labels
        x = rng.standard_normal((batch, row.size, row.size, 3)).astype(keras.config.floatx())
        y = rng.integers(0, classes, batch)
        layers = [layer for layer in reference.layers if not isinstance(layer, keras.layers.InputLayer)]
        expected_weights, starts = _train(reference, layers, x, y, learning_rate)
        expected = reference.predict(x, verbose=0)
        row.nan_predictions = int(np.isnan(expected).sum())
        failures = [] if row.largest_share <= 0.5 else [f"{row.largest} holds {row.largest_share:.1%}"]
        for k in partitions:
            model = tfpipe.PipelineModel(
                build(name, row.size, classes),
                num_partitions=k,
                devices=[f"/CPU:{i}" for i in range(k)],
            )
            row.balance[k] = model.balance
            row.nodes = sum(model.balance)  # the nodes of the model's graph, each in one cell
            if len(model.balance) != k or not all(cell.layers for cell in model.cells):
                failures.append(f"K={k}: cells {model.balance}")
            got_weights, _ = _train(model, model.pipeline_layers, x, y, learning_rate, () if chain else starts)
            row.step_errors[k] = [per_layer_error(a, b) for a, b in zip(got_weights, expected_weights)]
            row.prediction_error[k] = relative_error(model.predict(x, verbose=0), expected)
            exact = row.step_errors[k][-1] < tolerance and row.prediction_error[k] < tolerance
            if not exact:
                errors = ", ".join(f"{e:.1e}" for e in [*row.step_errors[k], row.prediction_error[k]])
                failures.append(f"K={k}: weight error after each step, prediction error: {errors}")
            del model
            gc.collect()
        row.error = "; ".join(failures)
        row.passed = not failures
    except Exception as e:  # noqa: BLE001 - one model's failure is a row of the table, not the end of the sweep
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        traceback.print_exc()
    finally:
        keras.backend.clear_session()
        gc.collect()
    row.seconds = time.perf_counter() - began
    return row


HEADER = (
    f"{'model':<18} {'input':>5} {'params':>11} {'nodes':>5}  {'largest node':<38} {'share':>5}  "
    f"{'balance (nodes per cell, each K)':<36} {'weight err':>12} {'pred err':>8} {'result':<6} {'s':>6}"
)


def format_row(row: Row) -> str:
    """One line of the table, and a second one with the reason where it failed."""
    prediction = max(row.prediction_error.values(), default=float("nan"))
    line = (
        f"{row.name:<18} {row.size:>5} {row.params:>11,} {row.nodes:>5}  {row.largest[:38]:<38} "
        f"{row.largest_share:>5.3f}  {row.cells()[:36]:<36} {row.errors():>12} {prediction:>8.0e} "
        f"{row.result():<6} {row.seconds:>6.1f}"
    )
    if row.nan_predictions:
        line += f"\n    the plain model predicts {row.nan_predictions} NaNs after its two steps (compared where equal)"
    return line + (f"\n    {row.error}" if row.error else "")


def unexpected(rows: Sequence[Row], expectations: bool = True) -> list[str]:
    """Models whose result is not the expected one: failures not in EXPECTED_FAILURES, and passes that are.

    Without ``expectations`` (another dtype or input than the list is for) every failure is unexpected.
    """
    return [r.name for r in rows if r.passed == (expectations and r.name in EXPECTED_FAILURES)]


def summary(rows: Sequence[Row], expectations: bool = True) -> str:
    """The closing line: how many passed, failed as expected, and failed (or passed) unexpectedly."""
    passed = sum(r.passed for r in rows)
    wrong = unexpected(rows, expectations)
    expected = sum(not r.passed and r.name not in wrong for r in rows)
    seconds = sum(r.seconds for r in rows)
    return (
        f"{passed}/{len(rows)} passed, {expected} failed as expected (*), "
        f"{len(wrong)} unexpected{': ' + ', '.join(wrong) if wrong else ''}; {seconds:.0f} s"
    )


def markdown(rows: Sequence[Row], settings: str) -> str:
    """The rows as a Markdown table under a line of the settings."""
    lines = [
        f"keras.applications through PipelineModel, {settings}: weight error per layer relative to the layer's "
        "largest weight, after the last step, one per K.",
        "",
        "| model | input | params | nodes | largest node | share | balance | weight error | prediction error "
        "| result | s |",
        "|---|--:|--:|--:|---|--:|---|--:|--:|---|--:|",
    ]
    for r in rows:
        prediction = max(r.prediction_error.values(), default=float("nan"))
        lines.append(
            f"| {r.name} | {r.size} | {r.params:,} | {r.nodes} | {r.largest} | {r.largest_share:.3f} | {r.cells()} "
            f"| {r.errors()} | {prediction:.0e} | {r.result()} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def run_isolated(name: str, flags_: Sequence[str] = (), timeout: float | None = None) -> Row:
    """``run_model`` for ``name`` in a fresh process of this script run with ``flags_``; its row.

    Keras keeps every model a process builds, so one process cannot build them all; a child
    that dies (out of memory) or runs past ``timeout`` seconds is a failed row.
    """
    command = [sys.executable, os.path.abspath(__file__), f"--models={name}", "--child", *flags_]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    began = time.perf_counter()
    try:  # the child's stderr (tracebacks) goes to ours
        proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Row(name, error=f"timed out after {timeout:.0f} s", seconds=time.perf_counter() - began)
    rows = [line[len(ROW_MARK) :] for line in proc.stdout.splitlines() if line.startswith(ROW_MARK)]
    if proc.returncode or not rows:
        why = "killed by SIGKILL (out of memory?)" if proc.returncode == -9 else f"exit status {proc.returncode}"
        return Row(name, error=f"the child process ended without a row: {why}", seconds=time.perf_counter() - began)
    return Row.from_json(rows[-1])


def _set_up_devices(count: int) -> None:
    """``count`` logical CPU devices (before TensorFlow initializes), and quieter logs for a long run."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    tf.get_logger().setLevel("ERROR")  # one process traces many models: TensorFlow's retracing warnings
    absl_logging.set_verbosity(absl_logging.WARNING)


def main(argv: list[str]) -> int:
    """Run the sweep, print a row per model and a summary; nonzero exit status if any result is unexpected."""
    del argv
    import keras

    partitions = [int(k) for k in FLAGS.partitions]
    names = FLAGS.models or all_models()
    keras.config.set_floatx(FLAGS.dtype)
    settings = [FLAGS[n].serialize() for n in CHILD_FLAGS]
    if FLAGS.child:  # one model in this process, its row to the parent (each model in its own: Keras keeps models)
        _set_up_devices(max(partitions))
        keras.config.disable_interactive_logging()  # tfpipe's notes go to absl's log
        sizes = (FLAGS.input_size, FLAGS.batch, FLAGS.classes)
        row = run_model(names[0], partitions, *sizes, FLAGS.tolerance, FLAGS.learning_rate, FLAGS.chain)
        print(ROW_MARK + row.to_json(), flush=True)
        return 0
    expectations = FLAGS.dtype == "float32" and not FLAGS.input_size
    title = (
        f"K = {', '.join(map(str, partitions))}, M = 1, {FLAGS.dtype}, batch {FLAGS.batch}, "
        f"{STEPS} SGD steps at learning rate {FLAGS.learning_rate}"
    )
    print(title)
    print(HEADER, flush=True)
    rows = []
    for name in names:
        row = run_isolated(name, settings, FLAGS.timeout)
        rows.append(row)
        print(format_row(row), flush=True)
    print(summary(rows, expectations))
    for name in names:
        if expectations and name in EXPECTED_FAILURES:
            print(f"* {name}: {EXPECTED_FAILURES[name]}")
    if FLAGS.out:
        from scripts.report import write_table

        table = [r.csv_fields() for r in rows]  # a failed row has no error columns: every row's columns
        write_table(FLAGS.out, table, markdown(rows, title), list(dict.fromkeys(k for r in table for k in r)))
    return 1 if unexpected(rows, expectations) else 0


if __name__ == "__main__":
    app.run(main)
