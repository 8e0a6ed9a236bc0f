"""Train a pipelined model on built-in generated data: the project's main job.

    python scripts/train.py                      # small Transformer, 2 cells, this machine's devices
    python scripts/train.py --devices=cpu:4 --partitions=4 --micro_batches=8
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "transformer", ["transformer"], "Reference model to train.")
flags.DEFINE_integer("blocks", 4, "Transformer blocks (L).", lower_bound=1)
flags.DEFINE_integer("dim", 64, "Model dimension.", lower_bound=1)
flags.DEFINE_integer("hidden", 256, "Feed-forward hidden size (H).", lower_bound=1)
flags.DEFINE_integer("heads", 4, "Attention heads (A).", lower_bound=1)
flags.DEFINE_integer("seq_len", 8, "Length of the sequence to copy.", lower_bound=1)
flags.DEFINE_integer("vocab", 12, "Vocabulary size (token 0 is the separator).", lower_bound=3)
flags.DEFINE_integer("examples", 4096, "Generated training examples.", lower_bound=1)
flags.DEFINE_integer("partitions", 2, "Number of cells K, balanced by --cost.", lower_bound=1)
flags.DEFINE_enum("cost", "flops", ["flops", "params", "time"], "Per-layer cost that --partitions balances.")
flags.DEFINE_list("balance", None, "Layers per cell, e.g. 2,2,3; overrides --partitions.")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches per mini-batch (M).", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Mini-batch size.", lower_bound=1)
flags.DEFINE_enum("remat", "except_last", ["always", "except_last", "never"], "Re-materialization mode.")
flags.DEFINE_string("devices", "auto", "'auto', 'cpu:N' (split the CPU into N logical devices) or a comma list.")
flags.DEFINE_integer("epochs", 4, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("steps", None, "Steps per epoch (default: the whole data set).", lower_bound=1)
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd", "adamw"], "Optimizer.")
flags.DEFINE_float("learning_rate", 3e-3, "Learning rate.", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Random seed for data and weights.")
flags.DEFINE_integer("verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")


class UsageError(Exception):
    """A flag value that cannot work; reported in one line."""


def setup_devices(spec: str, partitions: int) -> list[str] | None:
    """Configure logical CPU devices (before TensorFlow starts) and return the cells' devices."""
    import tensorflow as tf

    if spec == "auto":
        if tf.config.list_physical_devices("GPU"):
            return None
        spec = f"cpu:{max(partitions, 1)}"
    if spec.startswith("cpu:"):
        try:
            count = int(spec[4:])
        except ValueError:
            raise UsageError(f"--devices={spec}: write cpu:N with an integer N") from None
        if count < 1:
            raise UsageError(f"--devices={spec}: N must be >= 1")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        return [f"/CPU:{i}" for i in range(count)][:partitions] if count >= partitions else None
    return [d.strip() for d in spec.split(",") if d.strip()]


def parse_balance(values: list[str] | None) -> list[int] | None:
    """--balance as ints."""
    if values is None:
        return None
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UsageError(f"--balance={','.join(values)}: give comma-separated integers, e.g. 2,3") from None


def run() -> dict:
    """Train as the flags say; return the report."""
    balance = parse_balance(FLAGS.balance)
    partitions = len(balance) if balance else FLAGS.partitions
    devices = setup_devices(FLAGS.devices, partitions)

    import keras
    import numpy as np

    import tfpipe
    from models.transformer import transformer_lm
    from scripts.data import copy_task

    keras.utils.set_random_seed(FLAGS.seed)
    x, y, w = copy_task(FLAGS.examples, FLAGS.seq_len, FLAGS.vocab, seed=FLAGS.seed)
    layers = transformer_lm(FLAGS.vocab, x.shape[1], FLAGS.blocks, FLAGS.dim, FLAGS.hidden, FLAGS.heads)
    try:
        model = tfpipe.PipelineModel(
            layers, balance=balance, num_partitions=None if balance else partitions, cost=FLAGS.cost, devices=devices,
            num_micro_batches=FLAGS.micro_batches, remat=FLAGS.remat)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--balance/--partitions/--devices/--micro_batches: {err}") from None
    optimizer = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD,
                 "adamw": keras.optimizers.AdamW}[FLAGS.optimizer](FLAGS.learning_rate)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    batch = FLAGS.batch_size
    if batch < FLAGS.micro_batches:
        raise UsageError(f"--batch_size={batch} is smaller than --micro_batches={FLAGS.micro_batches}")
    usable = len(x) - len(x) % batch  # whole batches only, so every batch splits into M micro-batches
    if usable == 0:
        raise UsageError(f"--examples={FLAGS.examples} is smaller than --batch_size={batch}")
    x, y, w = x[:usable], y[:usable], w[:usable]
    model.build((None, x.shape[1]))
    model.summary()
    start_loss, start_acc = model.evaluate(x[:512], y[:512], sample_weight=w[:512], batch_size=batch, verbose=0)
    began = time.perf_counter()
    history = model.fit(x, y, sample_weight=w, batch_size=batch, epochs=FLAGS.epochs,
                        steps_per_epoch=FLAGS.steps, verbose=FLAGS.verbose)
    seconds = time.perf_counter() - began
    steps = FLAGS.epochs * (FLAGS.steps or usable // batch)
    report = {
        "start_loss": float(start_loss), "start_accuracy": float(start_acc),
        "final_loss": float(history.history["loss"][-1]), "final_accuracy": float(history.history["accuracy"][-1]),
        "examples_per_second": steps * batch / seconds, "seconds": seconds,
        "balance": model.balance, "devices": model.devices, "micro_batches": model.num_micro_batches,
    }
    print(f"\nloss {report['start_loss']:.3f} -> {report['final_loss']:.3f}, "
          f"accuracy {report['start_accuracy']:.3f} -> {report['final_accuracy']:.3f} (copied tokens)")
    print(f"{report['examples_per_second']:.0f} examples/s over {seconds:.1f} s (first-step tracing included)")
    print(f"balance {report['balance']} on {report['devices']}, {report['micro_batches']} micro-batches, "
          f"remat={FLAGS.remat!r}")
    return report


def main(argv: list[str]) -> None:
    del argv
    try:
        run()
    except UsageError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
