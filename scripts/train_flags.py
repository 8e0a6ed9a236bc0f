"""The main job's flags (scripts/train.py): their definitions, absl's parsing in the script's one error form, and
the checks of flag combinations that need no TensorFlow."""

from __future__ import annotations

import re
import sys

from absl import flags

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
    "plan",
    False,
    "Let tfpipe.plan choose the cells, balance, replicas, micro-batches, remat and schedule: it measures every "
    "layer and the --devices first (seconds to a minute), prints the plan, and trains it. --micro_batches, --remat "
    "or --schedule given beside it fix that choice.",
)
flags.DEFINE_string(
    "memory_budget",
    None,
    "With --plan: the bytes each device may hold at its peak, e.g. 2GiB or 512MB (default: no limit).",
)
flags.DEFINE_list(
    "plan_micro_batches",
    None,
    "With --plan: the micro-batch counts M it may choose from, e.g. 2,4 (default 1,2,4,8,16,32); fewer plan faster.",
)
flags.DEFINE_float(
    "plan_seconds",
    None,
    'With --plan: how long planning may take, in seconds (tfpipe.plan\'s max_seconds; default its "auto": 200 '
    "steps of the configuration it chooses, at least 30 s; 0: no bound).",
    lower_bound=0,
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


def guilty_flag(message: str, balance: list[int] | None) -> str:
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
            return flag_as_given(name)
    return flag_as_given("partitions") if not balance else flag_as_given("balance")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with its errors in the script's one form: 'train.py: error: --flag=value: why', exit 2."""
    try:
        return FLAGS(argv)
    except flags.Error as err:
        text = re.sub(r"^flag (--[^:]+): ", r"\1: ", str(err).strip().splitlines()[0])
        print(f"train.py: error: {text}", file=sys.stderr)
        sys.exit(2)


def ints(name: str) -> list[int] | None:
    """A comma-list flag as ints."""
    values = FLAGS[name].value
    if values is None:
        return None
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UsageError(f"--{name}={','.join(values)}: give comma-separated integers, e.g. 2,3") from None


# Pipeline flags that --plan chooses itself: given beside it, they would be silently ignored.
PLANNED = ("balance", "partitions", "replicas", "cost")
# Pipeline flags that, given beside --plan, fix that choice of the plan's.
PLAN_FIXES = {"micro_batches": "num_micro_batches", "remat": "remats", "schedule": "schedules"}


def check_plan_flags() -> None:
    """--plan and its flags: alone or with what it chooses (every model plans: layer lists and Functional ones)."""
    if not FLAGS.plan:
        for name in ("memory_budget", "plan_micro_batches", "plan_seconds"):
            if FLAGS[name].present:
                raise UsageError(f"{flag_as_given(name)}: applies with --plan; give --plan too")
        return
    for name in PLANNED:
        if FLAGS[name].present:
            raise UsageError(
                f"{flag_as_given(name)}: --plan chooses the cells, balance and replicas itself; drop one of them "
                "(--devices says which devices the plan may use)"
            )
    if FLAGS.plan_micro_batches is not None and FLAGS["micro_batches"].present:
        raise UsageError(
            f"{flag_as_given('plan_micro_batches')}: --micro_batches={FLAGS.micro_batches} already fixes M; drop one"
        )
    counts = ints("plan_micro_batches") or []
    if any(m < 1 for m in counts) or FLAGS.plan_micro_batches == []:
        raise UsageError(f"{flag_as_given('plan_micro_batches')}: give positive integers, e.g. 2,4")
    if counts and min(counts) > FLAGS.batch_size:
        raise UsageError(f"{flag_as_given('plan_micro_batches')}: each is more than --batch_size={FLAGS.batch_size}")


def plan_choices() -> dict[str, list]:
    """tfpipe.plan's keyword arguments that narrow its search, from --plan_micro_batches and the fixing flags."""
    out: dict[str, list] = {}
    if FLAGS.plan_micro_batches is not None:
        out["num_micro_batches"] = ints("plan_micro_batches")
    for name, argument in PLAN_FIXES.items():
        if FLAGS[name].present:
            out[argument] = [FLAGS[name].value]
    return out


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


def flag_as_given(name: str) -> str:
    """A flag as given: --name=value."""
    value = FLAGS[name].value
    return f"--{name}={','.join(value) if isinstance(value, list) else value}"
