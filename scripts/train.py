"""Train a pipelined reference model: the project's main job.

python scripts/train.py                      # small Transformer, 2 cells, generated sorting task
python scripts/train.py --model=resnet --depth=50 --width=16 --devices=cpu:4 --partitions=4 --micro_batches=8
python scripts/train.py --model=amoebanet --dataset=tfds:cifar10 --model_dir=/tmp/run --tensorboard
python scripts/train.py --model=unet --unet_depth=3 --image_size=32   # a Functional model: skips cross the cuts
python scripts/train.py --model=keras:MobileNetV2 --partitions=4      # any keras.applications model by name
python scripts/train.py --model=hub:llama --blocks=4 --dim=64         # a keras_hub causal LM, tiny and random
python scripts/train.py --plan --devices=cpu:4 --memory_budget=64MiB  # tfpipe.plan picks K, balance, R, M, remat
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import contextlib
import json
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402

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

    from scripts import hub_models

    tf.config.list_physical_devices()

from scripts.train_flags import (  # noqa: E402
    FLAGS,
    MODEL_FLAGS,
    MODELS,
    UsageError,
    check_plan_flags,
    flag_as_given,
    guilty_flag,
    ints,
    parse_flags,
    plan_choices,
)
from scripts.train_task import Task, make_task  # noqa: E402


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
            raise UsageError(
                f"{flag_as_given(name)}: applies to --model={' or '.join(kinds)}, not --model={FLAGS.model}"
            )
    if FLAGS.model == "unet" and FLAGS.image_size % 2**FLAGS.unet_depth:
        raise UsageError(f"--image_size={FLAGS.image_size} must be divisible by 2**--unet_depth={2**FLAGS.unet_depth}")
    if FLAGS.model == "unet" and FLAGS.dataset != "synthetic":
        raise UsageError("--model=unet trains on the generated segmentation task; use --dataset=synthetic")
    check_plan_flags()
    if FLAGS.batch_size < FLAGS.micro_batches * FLAGS.replicas and (not FLAGS.plan or FLAGS["micro_batches"].present):
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
        from scripts.data import parse_tfds

        try:
            parse_tfds(FLAGS.dataset)
        except ValueError as err:
            raise UsageError(f"--dataset={FLAGS.dataset}: {err}") from None


# TensorFlow's lines while it looks for CUDA on a machine without it: harmless, and they read like failures.
def setup_devices(spec: str, partitions: int, stack: contextlib.ExitStack, every: bool = False) -> list[str] | None:
    """Configure logical CPU devices (before TensorFlow starts) or start local workers; return the cells' devices.

    Workers started for ``local:N`` stop when ``stack`` closes. ``every``: return all the devices (for --plan to
    choose from), not the first ``partitions``.
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
        if every:
            return [f"/CPU:{i}" for i in range(count)]
        return [f"/CPU:{i}" for i in range(count)][:partitions] if count >= partitions else None
    if spec.startswith("local:"):
        from tfpipe.cluster import LocalCluster, WorkerError

        try:
            count = int(spec[6:])
        except ValueError:
            raise UsageError(f"--devices={spec}: write local:N with an integer N") from None
        if count < partitions and not every:
            raise UsageError(f"--devices={spec} starts {count} workers for {partitions} cells; use local:{partitions}")
        try:
            started = stack.enter_context(LocalCluster(count, max_restarts=FLAGS.max_restarts)).devices
            return list(started) if every else started[:partitions]
        except (ValueError, WorkerError) as err:
            raise UsageError(f"--devices={spec}: {err}") from None
    return [d.strip() for d in spec.split(",") if d.strip()]


def replica_devices(devices: list[str] | None, partitions: int) -> list[str] | list[list[str]] | None:
    """The cells' devices, cut into --replicas rows of K when there are replicas."""
    r = FLAGS.replicas
    if r == 1:
        return devices
    if devices is None:  # every GPU, else the logical CPU devices (cpu:N), as PipelineModel's devices=None
        import tensorflow as tf

        devices = [d.name for d in tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")]
    if len(devices) < r * partitions:
        raise UsageError(
            f"--replicas={r} x {partitions} cells need {r * partitions} devices; --devices={FLAGS.devices} "
            f"gives {len(devices)}"
        )
    return [devices[i * partitions : (i + 1) * partitions] for i in range(r)]


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
    """Set up the devices, build the task and the model, train it; return the report."""
    balance = ints("balance")
    partitions = len(balance) if balance else FLAGS.partitions
    if FLAGS.plan:  # every device, for the plan to choose from
        devices = setup_devices(FLAGS.devices, partitions, stack, every=True)
    else:
        devices = replica_devices(setup_devices(FLAGS.devices, partitions * FLAGS.replicas, stack), partitions)

    import keras

    keras.utils.set_random_seed(FLAGS.seed)
    task = _task()
    model = _compiled_model(task, devices, balance, partitions)
    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
    extra, resumed = callbacks(FLAGS.model_dir)
    if resumed is not None:  # restore now (BackupAndRestore would at fit) so the starting loss is the resumed one
        model.optimizer.build(model.trainable_variables)
        model.load_weights(os.path.join(FLAGS.model_dir, "backup", "latest.weights.h5"))
        print(f"resuming from epoch {resumed} (backup in {os.path.join(FLAGS.model_dir, 'backup')})")
    report = _train(model, task, extra, resumed)
    _print_report(report, model, task.scored)
    return report


def _task() -> Task:
    """The task the flags ask for, its builders' errors mapped to the flags."""
    try:
        return make_task()
    except ValueError as err:  # the model builders name their argument; map it to the flags
        raise UsageError(f"--model={FLAGS.model} sizes: {err}") from None
    except ImportError as err:  # keras_hub missing after all (scripts/hub_models.py names the extra)
        if err.name != "keras_hub":
            raise
        raise UsageError(str(err)) from None


def _compiled_model(task: Task, devices: Any, balance: list[int] | None, partitions: int) -> Any:
    """The PipelineModel of ``task`` (planned with --plan, else as the flags cut it), built, compiled, summarized."""
    import keras

    import tfpipe

    model = None
    if FLAGS.plan:
        try:
            model = planned_model(task, devices)
        except (ValueError, TypeError) as err:  # nothing fits the budget, a layer the planner cannot measure
            guilty = flag_as_given("memory_budget") if "memory_budget" in str(err) else "--plan"
            raise UsageError(f"{guilty}: {err}") from None
    try:
        if model is None:
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
        raise UsageError(f"{guilty_flag(str(err), balance)}: {err}") from None
    optimizer = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD, "adamw": keras.optimizers.AdamW}[
        FLAGS.optimizer
    ](learning_rate(int(task.dataset.cardinality())))
    model.compile(optimizer=optimizer, loss=task.loss, jit_compile=FLAGS.jit_compile, **task.metrics)
    model.summary()
    return model


def _train(model: Any, task: Task, extra: list, resumed: int | None) -> dict:
    """Fit ``model`` on the task, scored on a few batches before and after (and the held-out ones); the report."""
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
    return {
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


def _print_report(report: dict, model: Any, scored: str) -> None:
    """The report's three lines: loss and accuracy, speed, and how the model was cut."""
    held_acc = report["held_out_accuracy"]
    print(
        f"\nloss {report['start_loss']:.3f} -> {report['final_loss']:.3f}, "
        f"accuracy {report['start_accuracy']:.3f} -> {report['final_accuracy']:.3f} ({scored})"
        + (f"; held-out accuracy {held_acc:.3f}" if held_acc is not None else "")
    )
    print(
        f"{report['examples_per_second']:.0f} examples/s over {report['seconds']:.1f} s, {report['epochs_run']} epochs "
        "(first-step tracing included)"
    )
    print(
        f"balance {report['balance']} on {report['devices']}, {report['micro_batches']} micro-batches, "
        f"remat={model.remat!r}" + (f", schedule={model.schedule!r}" if model.schedule != "gpipe" else "")
    )


def planned_model(task: Any, devices: list[str] | None) -> Any:
    """The PipelineModel that tfpipe.plan chooses for ``task`` on ``devices`` (None: the GPUs), its plan printed."""
    import tfpipe

    sample = next(iter(task.dataset.take(1)))[0]  # one batch of the inputs: what each layer is measured on
    plan = tfpipe.plan(
        task.layers,
        batch_size=FLAGS.batch_size,
        devices=devices,
        memory_budget=FLAGS.memory_budget,
        sample=sample,
        optimizer=FLAGS.optimizer,
        max_seconds="auto" if FLAGS.plan_seconds is None else (FLAGS.plan_seconds or None),
        **plan_choices(),
    )
    plan.summary()
    return tfpipe.PipelineModel(task.layers, plan=plan)


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
