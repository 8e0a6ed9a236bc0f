"""Train a pipelined reference model: the project's main job.

python scripts/train.py                      # small Transformer, 2 cells, generated sorting task
python scripts/train.py --model=resnet --depth=50 --width=16 --devices=cpu:4 --partitions=4 --micro_batches=8
python scripts/train.py --model=amoebanet --dataset=tfds:cifar10 --model_dir=/tmp/run --tensorboard
python scripts/train.py --model=unet --unet_depth=3 --image_size=32   # a Functional model: skips cross the cuts
python scripts/train.py --model=keras:MobileNetV2 --partitions=4      # any keras.applications model by name
python scripts/train.py --model=hub:llama --blocks=4 --dim=64         # a keras_hub causal LM, tiny and random
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

PROBE_NOISE = (
    "cudart_stub.cc",
    "cuda_platform.cc",
    "failed call to cuInit",
    "All log messages before absl::InitializeLog()",
    "cpu_feature_guard.cc",
    "To enable the following instructions",
)


@contextlib.contextmanager
def quiet_gpu_probe():
    """Hide TensorFlow's CUDA-probe lines (stderr, file descriptor 2) when this machine has no NVIDIA driver."""
    if os.path.exists("/proc/driver/nvidia"):
        yield  # a GPU machine: what TensorFlow says about CUDA matters
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not any(noise in line for noise in PROBE_NOISE):
                    sys.stderr.write(line)


with quiet_gpu_probe():  # importing tfpipe starts TensorFlow; its first device query probes for CUDA
    import tensorflow as tf

    from tfpipe.scripts import hub_models

    tf.config.list_physical_devices()

FLAGS = flags.FLAGS
MODELS = ("transformer", "amoebanet", "resnet", "unet")
flags.DEFINE_string(
    "model",
    "transformer",
    f"Reference model to train: one of {', '.join(MODELS)}, keras:NAME for a keras.applications model "
    "(weights=None, on the image task), or hub:NAME for a tiny random keras_hub causal LM (models/hub.py: gpt2, "
    "gemma, llama, mistral, ...; --blocks, --dim, --vocab size it) on the generated language task (--task) or "
    "tfds text; needs the hub extra.",
)
# model sizes
flags.DEFINE_integer(
    "blocks",
    None,
    "Transformer or keras_hub blocks (L, default 4) or AmoebaNet-D normal cells (L, a multiple of 3, default 3).",
    lower_bound=1,
)
flags.DEFINE_integer("dim", 64, "Transformer (or keras_hub model) dimension.", lower_bound=1)
flags.DEFINE_integer("hidden", 256, "Transformer feed-forward hidden size (H).", lower_bound=1)
flags.DEFINE_integer("heads", 4, "Transformer attention heads (A).", lower_bound=1)
flags.DEFINE_float("logit_clip", None, "Clip the Transformer's logits to [-c, c] (GPipe section 5).")
flags.DEFINE_bool(
    "tie_embeddings",
    False,
    "Transformer: the output projection is the token embedding, transposed (as GPT-2); the first and last "
    "cells share it.",
)
flags.DEFINE_integer("filters", 32, "AmoebaNet-D filters (D, a multiple of 8).", lower_bound=8)
flags.DEFINE_enum("depth", "50", ["50", "101"], "ResNet depth.")
flags.DEFINE_integer("width", 16, "ResNet stem filters (64 in the paper).", lower_bound=1)
flags.DEFINE_list("stage_blocks", None, "ResNet bottleneck blocks per stage, e.g. 1,1,1,1; overrides --depth.")
flags.DEFINE_integer("unet_depth", 3, "U-Net down/up stages (5 in torchgpipe).", lower_bound=1)
flags.DEFINE_integer("unet_convs", 2, "U-Net convolutions per stage (5 in torchgpipe).", lower_bound=1)
flags.DEFINE_integer("unet_channels", 8, "U-Net channels of the first stage (64 in torchgpipe).", lower_bound=1)
flags.DEFINE_integer("image_size", 32, "Image height and width for the image models.", lower_bound=8)
flags.DEFINE_integer("num_classes", 10, "Classes of the generated image task.", lower_bound=2)
# data
flags.DEFINE_string("dataset", "synthetic", "'synthetic' (generated, learnable) or tfds:NAME[:SPLIT].")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory.")
flags.DEFINE_integer("examples", 4096, "Generated training examples.", lower_bound=1)
flags.DEFINE_integer("seq_len", 8, "Sort/copy task: length of the sequence; text: tokens per example.", lower_bound=1)
flags.DEFINE_integer("vocab", 12, "Sort/copy task vocabulary size (token 0 is the separator).", lower_bound=3)
flags.DEFINE_enum(
    "task",
    "sort",
    ["sort", "copy"],
    "Transformer's (or keras_hub LM's) generated task: write the sequence sorted (keeps improving over the run) or "
    "copied (easy).",
)
# pipeline
flags.DEFINE_integer("partitions", 2, "Number of cells K, balanced by --cost.", lower_bound=1)
flags.DEFINE_list("balance", None, "Layers per cell, e.g. 2,2,3; overrides --partitions.")
flags.DEFINE_enum("cost", "flops", ["flops", "params", "time"], "Per-layer cost that --partitions balances.")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches per mini-batch (M).", lower_bound=1)
flags.DEFINE_enum("remat", "except_last", ["always", "except_last", "never"], "Re-materialization mode.")
flags.DEFINE_enum(
    "schedule",
    "gpipe",
    ["gpipe", "1f1b", "zero_bubble", "gpipe_batched_w"],
    "Task order: GPipe's, 1F1B (fewer activations held), zero_bubble (1F1B's memory, a third of its bubble) or "
    "gpipe_batched_w (GPipe's, each cell's weight gradients once over all micro-batches; needs --remat=never).",
)
flags.register_multi_flags_validator(
    ["schedule", "remat"],
    lambda f: f["schedule"] != "gpipe_batched_w" or f["remat"] == "never",
    "--schedule=gpipe_batched_w holds every micro-batch's activations until its weight gradients: use --remat=never.",
)
flags.DEFINE_bool(
    "jit_compile", False, "Compile each cell by XLA on its device (compile(jit_compile=True)); meant for GPUs."
)
flags.DEFINE_integer(
    "replicas",
    1,
    "Data-parallel replicas R of the K-cell pipeline, on R x K devices (--devices lists replica 0's first).",
    lower_bound=1,
)
flags.DEFINE_string(
    "devices",
    "auto",
    "'auto', 'cpu:N' (split the CPU into N logical devices), 'local:N' (N "
    "single-thread worker processes on loopback) or a comma list.",
)
# training
flags.DEFINE_integer("batch_size", 32, "Mini-batch size.", lower_bound=1)
flags.DEFINE_integer("epochs", 4, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("steps", None, "Steps per epoch (default: the whole data set).", lower_bound=1)
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd", "adamw"], "Optimizer.")
flags.DEFINE_float(
    "learning_rate",
    3e-3,
    "Peak learning rate; it decays along a cosine to a tenth over the run (constant if the data's length is unknown).",
    lower_bound=0.0,
)
flags.DEFINE_integer("seed", 0, "Random seed for data and weights.")
flags.DEFINE_integer("verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")
# checkpoints and logs
flags.DEFINE_string("model_dir", None, "Checkpoints go here; a restart with the same directory resumes.")
flags.DEFINE_integer(
    "save_every", None, "Back up every N steps (default: every epoch); needs --model_dir.", lower_bound=1
)
flags.DEFINE_bool("tensorboard", False, "Write TensorBoard logs under --model_dir/logs.")
flags.DEFINE_integer(
    "max_restarts",
    0,
    "With --devices=local:N and --model_dir: replace dead workers and go on from the last backup, up to N times.",
    lower_bound=0,
)


class UsageError(Exception):
    """A flag value that cannot work; reported in one line."""


@dataclasses.dataclass
class Task:
    """What to train: the layers, their loss and metrics, and the data."""

    layers: Any  # a list of layers, or a Functional keras.Model
    loss: Any
    metrics: dict  # keyword arguments for compile: metrics or weighted_metrics
    dataset: Any  # tf.data.Dataset of whole batches: (inputs, targets[, weights])
    input_shape: tuple
    scored: str  # what the accuracy counts
    held_out: Any = None  # batches never trained on (generated tasks), for the report's held-out accuracy


# TensorFlow's lines while it looks for CUDA on a machine without it: harmless, and they read like failures.
def setup_devices(spec: str, partitions: int, stack: contextlib.ExitStack) -> list[str] | None:
    """Configure logical CPU devices (before TensorFlow starts) or start local workers; return the cells' devices.

    Workers started for ``local:N`` stop when ``stack`` closes.
    """
    with quiet_gpu_probe():
        import tensorflow as tf

        tf.config.list_physical_devices()  # where TensorFlow looks for CUDA
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
    if spec.startswith("local:"):
        from tfpipe.distributed.cluster import LocalCluster, WorkerError

        try:
            count = int(spec[6:])
        except ValueError:
            raise UsageError(f"--devices={spec}: write local:N with an integer N") from None
        if count < partitions:
            raise UsageError(f"--devices={spec} starts {count} workers for {partitions} cells; use local:{partitions}")
        try:
            return stack.enter_context(LocalCluster(count, max_restarts=FLAGS.max_restarts)).devices[:partitions]
        except (ValueError, WorkerError) as err:
            raise UsageError(f"--devices={spec}: {err}") from None
    return [d.strip() for d in spec.split(",") if d.strip()]


def replica_devices(devices: list[str] | None, partitions: int) -> list[str] | list[list[str]] | None:
    """The cells' devices, cut into --replicas rows of K when there are replicas."""
    r = FLAGS.replicas
    if r == 1:
        return devices
    if devices is None:  # 'auto' on a GPU machine: every GPU
        from tfpipe.distributed.devices import available

        devices = available()
    if len(devices) < r * partitions:
        raise UsageError(
            f"--replicas={r} x {partitions} cells need {r * partitions} devices; --devices={FLAGS.devices} "
            f"gives {len(devices)}"
        )
    return [devices[i * partitions : (i + 1) * partitions] for i in range(r)]


def _guilty_flag(message: str, balance: list[int] | None) -> str:
    """The pipeline flag that a PipelineModel argument error is about, as given."""
    for word, name in (
        ("balance", "balance"),
        ("num_partitions", "partitions"),
        ("num_micro_batches", "micro_batches"),
        ("remat", "remat"),
        ("schedule", "schedule"),
        ("replica", "replicas"),
        ("device", "devices"),
    ):
        if word in message and (name != "balance" or balance):
            return _flag(name)
    return _flag("partitions") if not balance else _flag("balance")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with its errors in the script's one form: 'train.py: error: --flag=value: why', exit 2."""
    try:
        return FLAGS(argv)
    except flags.Error as err:
        text = re.sub(r"^flag (--[^:]+): ", r"\1: ", str(err).strip().splitlines()[0])
        print(f"train.py: error: {text}", file=sys.stderr)
        sys.exit(2)


def _ints(name: str) -> list[int] | None:
    """A comma-list flag as ints."""
    values = FLAGS[name].value
    if values is None:
        return None
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UsageError(f"--{name}={','.join(values)}: give comma-separated integers, e.g. 2,3") from None


# Flags that size one kind of model: given with another, they would be silently ignored.
MODEL_FLAGS = {
    "dim": ("transformer", "hub:NAME"),
    "hidden": ("transformer",),
    "heads": ("transformer",),
    "logit_clip": ("transformer",),
    "tie_embeddings": ("transformer",),
    "vocab": ("transformer", "hub:NAME"),
    "task": ("transformer", "hub:NAME"),
    "blocks": ("transformer", "amoebanet", "hub:NAME"),
    "filters": ("amoebanet",),
    "depth": ("resnet",),
    "width": ("resnet",),
    "stage_blocks": ("resnet",),
    "unet_depth": ("unet",),
    "unet_convs": ("unet",),
    "unet_channels": ("unet",),
    "image_size": ("amoebanet", "resnet", "unet", "keras:NAME"),
    "num_classes": ("amoebanet", "resnet", "keras:NAME"),
}


def _flag(name: str) -> str:
    """A flag as given: --name=value."""
    value = FLAGS[name].value
    return f"--{name}={','.join(value) if isinstance(value, list) else value}"


def check_flags() -> None:
    """Flag combinations that cannot work, found before anything is built."""
    if FLAGS.model not in MODELS and not FLAGS.model.startswith("keras:") and not hub_models.is_hub(FLAGS.model):
        raise UsageError(
            f"--model={FLAGS.model}: use one of {', '.join(MODELS)} or keras:NAME, e.g. keras:ResNet50, "
            "or hub:NAME, e.g. hub:gpt2"
        )
    kind = {"keras": "keras:NAME", "hub": "hub:NAME"}.get(FLAGS.model.split(":")[0], FLAGS.model)
    if kind == "hub:NAME":
        with quiet_gpu_probe():  # models/hub.py imports Keras, and with it TensorFlow
            try:
                hub_models.check(FLAGS.model)
            except ValueError as err:
                raise UsageError(f"--model={FLAGS.model}: {err}") from None
    for name, kinds in MODEL_FLAGS.items():
        if FLAGS[name].present and kind not in kinds:
            raise UsageError(f"{_flag(name)}: applies to --model={' or '.join(kinds)}, not --model={FLAGS.model}")
    if FLAGS.model == "unet" and FLAGS.image_size % 2**FLAGS.unet_depth:
        raise UsageError(f"--image_size={FLAGS.image_size} must be divisible by 2**--unet_depth={2**FLAGS.unet_depth}")
    if FLAGS.model == "unet" and FLAGS.dataset != "synthetic":
        raise UsageError("--model=unet trains on the generated segmentation task; use --dataset=synthetic")
    if FLAGS.batch_size < FLAGS.micro_batches * FLAGS.replicas:
        what = f"--micro_batches={FLAGS.micro_batches}" + (
            f" x --replicas={FLAGS.replicas}" if FLAGS.replicas > 1 else ""
        )
        raise UsageError(f"--batch_size={FLAGS.batch_size} is smaller than {what}")
    if FLAGS.tensorboard and not FLAGS.model_dir:
        raise UsageError("--tensorboard writes under --model_dir; give --model_dir too")
    if FLAGS.save_every and not FLAGS.model_dir:
        raise UsageError("--save_every backs up into --model_dir; give --model_dir too")
    if FLAGS.max_restarts and not (FLAGS.model_dir and FLAGS.devices.startswith("local:")):
        raise UsageError("--max_restarts restarts --devices=local:N workers from the backup in --model_dir; give both")
    if FLAGS.dataset != "synthetic":
        from tfpipe.scripts.data import parse_tfds

        try:
            parse_tfds(FLAGS.dataset)
        except ValueError as err:
            raise UsageError(f"--dataset={FLAGS.dataset}: {err}") from None


def held_out_examples() -> int:
    """Generated examples kept out of training, on which the report measures accuracy: an eighth, at least a batch."""
    return max(FLAGS.batch_size, FLAGS.examples // 8)


def _batches(arrays: tuple, batch: int, seed: int):
    """The training batches of the first --examples arrays, and the held-out batches of the rest."""
    import tensorflow as tf

    n = FLAGS.examples
    if n < batch:
        raise UsageError(f"--examples={n} is smaller than --batch_size={batch}")
    dataset = tf.data.Dataset.from_tensor_slices(tuple(a[:n] for a in arrays)).shuffle(n, seed=seed)
    held = tf.data.Dataset.from_tensor_slices(tuple(a[n:] for a in arrays))
    # whole batches: each splits into M micro-batches
    return dataset.batch(batch, drop_remainder=True), held.batch(batch, drop_remainder=True)


def _tfds(kind: str):
    from tfpipe.scripts.data import load_tfds

    try:
        return load_tfds(
            FLAGS.dataset, kind, FLAGS.batch_size, FLAGS.data_dir, FLAGS.image_size, FLAGS.seq_len, seed=FLAGS.seed
        )
    except ImportError as err:
        if err.name != "tensorflow_datasets":  # tensorflow-datasets is there; something it imports is not
            raise
        raise UsageError(f"--dataset={FLAGS.dataset} needs tensorflow-datasets: pip install -e '.[data]'") from None
    except Exception as err:  # noqa: BLE001 - unknown names, missing downloads: one line naming the flag
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"--dataset={FLAGS.dataset}: {message}") from None


def make_task() -> Task:
    """The model's layers, loss, metrics and data as the flags say."""
    import keras

    from tfpipe.scripts import data

    if FLAGS.model == "transformer" or hub_models.is_hub(FLAGS.model):
        if FLAGS.dataset == "synthetic":
            make = data.sort_task if FLAGS.task == "sort" else data.copy_task
            arrays = make(FLAGS.examples + held_out_examples(), FLAGS.seq_len, FLAGS.vocab, seed=FLAGS.seed)
            (dataset, held), vocab = _batches(arrays, FLAGS.batch_size, FLAGS.seed), FLAGS.vocab
            scored = "sorted tokens" if FLAGS.task == "sort" else "copied tokens"
        else:
            loaded = _tfds("text")
            dataset, held, vocab, scored = loaded.dataset, None, loaded.vocab_size, "next bytes"
        length, input_shape = dataset.element_spec[0].shape[1], None
        if hub_models.is_hub(FLAGS.model):  # a keras_hub CausalLM: named inputs, the padding mask among them
            pad = None if FLAGS.dataset == "synthetic" else data.SEPARATOR  # text pads with it; the tasks have none
            dataset, held = (None if d is None else hub_models.lm_batches(d, pad) for d in (dataset, held))
            layers = hub_models.causal_lm(FLAGS.model[4:], vocab, FLAGS.blocks or 4, FLAGS.dim, length, FLAGS.seed)
            input_shape = hub_models.input_spec(length)
        else:
            from tfpipe.models.transformer import transformer_lm, transformer_lm_tied

            make_lm = transformer_lm_tied if FLAGS.tie_embeddings else transformer_lm
            layers = make_lm(
                vocab, length, FLAGS.blocks or 4, FLAGS.dim, FLAGS.hidden, FLAGS.heads, logit_clip=FLAGS.logit_clip
            )
        metrics = {"weighted_metrics": ["accuracy"]}
        return Task(
            layers,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics,
            dataset,
            input_shape or (None, length),
            scored,
            held,
        )

    size = FLAGS.image_size
    if FLAGS.model == "unet":
        from tfpipe.models.unet import unet

        images, masks = data.shapes_segmentation(FLAGS.examples + held_out_examples(), size, seed=FLAGS.seed)
        model = unet((size, size, 3), 1, FLAGS.unet_depth, FLAGS.unet_convs, FLAGS.unet_channels)
        dataset, held = _batches((images, masks), FLAGS.batch_size, FLAGS.seed)
        return Task(
            model,
            keras.losses.BinaryCrossentropy(from_logits=True),
            {"metrics": [keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")]},
            dataset,
            (None, size, size, 3),
            "pixels",
            held,
        )
    if FLAGS.dataset == "synthetic":
        n = FLAGS.examples + held_out_examples()
        images, labels = data.pattern_images(n, FLAGS.image_size, FLAGS.num_classes, seed=FLAGS.seed)
        (dataset, held), classes = _batches((images, labels), FLAGS.batch_size, FLAGS.seed), FLAGS.num_classes
    else:
        loaded = _tfds("image")
        dataset, held, classes = loaded.dataset, None, loaded.num_classes
    if FLAGS.model == "amoebanet":
        from tfpipe.models.amoebanet import amoebanet_d

        layers = amoebanet_d(classes, FLAGS.blocks or 3, FLAGS.filters)
    elif FLAGS.model.startswith("keras:"):
        name = FLAGS.model[len("keras:") :]
        application = getattr(keras.applications, name, None)
        if not callable(application):
            raise UsageError(f"--model={FLAGS.model}: keras.applications has no model {name!r}, e.g. keras:ResNet50")
        try:
            layers = application(weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None)
        except ValueError as err:
            raise UsageError(f"--model={FLAGS.model}: {str(err).splitlines()[0]}") from None
    else:
        from tfpipe.models.resnet import resnet

        layers = resnet(int(FLAGS.depth), classes, FLAGS.width, stage_blocks=_ints("stage_blocks"))
    return Task(
        layers,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        {"metrics": ["accuracy"]},
        dataset,
        (None, size, size, 3),
        "images",
        held,
    )


def callbacks(model_dir: str | None) -> tuple[list, int | None]:
    """Backup (resumable), latest weights and TensorBoard callbacks; the epoch a backup resumes from."""
    import keras

    if not model_dir:
        return [], None
    backup = os.path.join(model_dir, "backup")
    resumed = None
    metadata = os.path.join(backup, "training_metadata.json")
    if os.path.exists(metadata):
        with open(metadata) as f:
            resumed = int(json.load(f)["epoch"])
    result = [
        keras.callbacks.BackupAndRestore(backup, save_freq=FLAGS.save_every or "epoch", delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(model_dir, "latest.weights.h5"), save_weights_only=True),
    ]
    if FLAGS.tensorboard:
        result.append(keras.callbacks.TensorBoard(os.path.join(model_dir, "logs")))
    return result, resumed


def run() -> dict:
    """Train as the flags say; return the report."""
    check_flags()
    with contextlib.ExitStack() as stack:
        return _run(stack)


def _run(stack: contextlib.ExitStack) -> dict:
    balance = _ints("balance")
    partitions = len(balance) if balance else FLAGS.partitions
    devices = replica_devices(setup_devices(FLAGS.devices, partitions * FLAGS.replicas, stack), partitions)

    import keras

    import tfpipe

    keras.utils.set_random_seed(FLAGS.seed)
    try:
        task = make_task()
    except ValueError as err:  # the model builders name their argument; map it to the flags
        raise UsageError(f"--model={FLAGS.model} sizes: {err}") from None
    except ImportError as err:  # keras_hub missing after all (scripts/hub_models.py names the extra)
        if err.name != "keras_hub":
            raise
        raise UsageError(str(err)) from None
    try:
        model = tfpipe.PipelineModel(
            task.layers,
            balance=balance,
            num_partitions=None if balance else partitions,
            cost=FLAGS.cost,
            devices=devices,
            num_micro_batches=FLAGS.micro_batches,
            remat=FLAGS.remat,
            schedule=FLAGS.schedule,
        )
        model.build(task.input_shape)
    except (ValueError, TypeError) as err:
        raise UsageError(f"{_guilty_flag(str(err), balance)}: {err}") from None
    optimizer = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD, "adamw": keras.optimizers.AdamW}[
        FLAGS.optimizer
    ](learning_rate(int(task.dataset.cardinality())))
    model.compile(optimizer=optimizer, loss=task.loss, jit_compile=FLAGS.jit_compile, **task.metrics)
    model.summary()
    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
    extra, resumed = callbacks(FLAGS.model_dir)
    if resumed is not None:  # restore now (BackupAndRestore would at fit) so the starting loss is the resumed one
        model.optimizer.build(model.trainable_variables)
        model.load_weights(os.path.join(FLAGS.model_dir, "backup", "latest.weights.h5"))
        print(f"resuming from epoch {resumed} (backup in {os.path.join(FLAGS.model_dir, 'backup')})")
    probe = task.dataset.take(4).cache()  # the same few batches before and after training
    start_loss, start_acc = model.evaluate(probe, verbose=0)
    # One iterator for the whole run: handed the finite data set, Keras makes a new iterator at every epoch's
    # end and another at the next one's start, and the first step of each epoch waited 0.1-2.5 s for the shuffle
    # buffers those fill (the same in a plain keras.Model); repeated, with the steps given, it makes one.
    known = int(task.dataset.cardinality())  # negative where tf.data cannot tell (some tfds pipelines)
    steps_per_epoch = FLAGS.steps or (known if known > 0 else None)
    train_data = task.dataset.repeat() if steps_per_epoch else task.dataset
    began = time.perf_counter()
    history = model.fit(
        train_data,
        epochs=FLAGS.epochs,
        steps_per_epoch=steps_per_epoch,
        callbacks=extra,
        verbose=FLAGS.verbose,
        shuffle=False,
    )  # the data set shuffles itself
    seconds = time.perf_counter() - began
    epochs_run = len(history.history.get("loss", []))
    final_loss, final_acc = model.evaluate(probe, verbose=0)
    held_acc = float(model.evaluate(task.held_out, verbose=0)[1]) if task.held_out is not None else None
    steps = FLAGS.steps or int(task.dataset.cardinality())
    report = {
        "start_loss": float(start_loss),
        "start_accuracy": float(start_acc),
        "final_loss": float(final_loss),
        "final_accuracy": float(final_acc),
        "held_out_accuracy": held_acc,
        "epochs_run": epochs_run,
        "resumed_from_epoch": resumed,
        "examples_per_second": epochs_run * steps * FLAGS.batch_size / seconds if epochs_run else 0.0,
        "seconds": seconds,
        "balance": model.balance,
        "devices": model.devices,
        "micro_batches": model.num_micro_batches,
        "replicas": model.num_replicas,
    }
    print(
        f"\nloss {report['start_loss']:.3f} -> {report['final_loss']:.3f}, "
        f"accuracy {report['start_accuracy']:.3f} -> {report['final_accuracy']:.3f} ({task.scored})"
        + (f"; held-out accuracy {held_acc:.3f}" if held_acc is not None else "")
    )
    print(
        f"{report['examples_per_second']:.0f} examples/s over {seconds:.1f} s, {epochs_run} epochs "
        "(first-step tracing included)"
    )
    print(
        f"balance {report['balance']} on {report['devices']}, {report['micro_batches']} micro-batches, "
        f"remat={FLAGS.remat!r}" + (f", schedule={FLAGS.schedule!r}" if FLAGS.schedule != "gpipe" else "")
    )
    return report


def learning_rate(batches_per_epoch: int) -> Any:
    """--learning_rate, decaying along a cosine to a tenth of it over the run when its length is known.

    At a constant 3e-3, Adam's loss on the default task jumped up in the last epoch
    (epoch means 0.324, 0.063, 0.038, 0.048).
    """
    import keras

    steps = FLAGS.epochs * (FLAGS.steps or batches_per_epoch)
    if steps <= 0:  # a data set of unknown length
        return FLAGS.learning_rate
    return keras.optimizers.schedules.CosineDecay(FLAGS.learning_rate, decay_steps=steps, alpha=0.1)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"train.py: error: unexpected arguments {argv[1:]}; flags look like --name=value", file=sys.stderr)
        sys.exit(2)
    try:
        run()
    except UsageError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
