"""Capacity, GPipe's Table 1 on this machine: the deepest model that trains under a per-device memory budget, against K.

For each row (plain Keras on one device, then tfpipe at K = 1, 2, 4, 8 cells on as many ``LocalCluster`` workers),
the depth grows (doubling, then bisection) until a device's allocator peak over two Adam steps passes the budget;
width, batch and sequence stay fixed and are printed with the table. Every probe is a fresh process (this script
with ``--_child=JSON``) under TensorFlow's BFC CPU allocator: plain Keras is read from its own process's allocator,
tfpipe from each worker's (``LocalCluster.memory_info``), beside the training process's own allocator peak and its
resident peak (``ru_maxrss``, planning included: where the step's graph shows). A keras_hub task
(``--model=llama``) is built under ``tfpipe.deferred_weights()``, so its weights are made on the workers; the
Transformer is a layer list, whose cells are built on their devices.

    python benchmarks/benchmark_capacity.py                                  # small defaults, a few minutes
    python benchmarks/benchmark_capacity.py --model=llama --out=docs/results/capacity_llama
    python benchmarks/benchmark_capacity.py --noconstant_folding --dim=128 --seq_len=512 --batch_size=32 \\
        --budget_mib=1024                                                 # GPipe's activations (hours)
    python benchmarks/benchmark_capacity.py --device_type=GPU --budget_mib=2048 --rows=plain,1,2,4  # logical GPUs

Each row runs one fixed configuration (``--micro_batches``, ``remat="always"``, 1F1B above K=1, cut by FLOPs), or
with ``--plan`` the one ``tfpipe.plan`` chooses for each probe under the budget (minutes of planning per probe).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import functools
import json
import subprocess
import threading
from typing import Any

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts, here and in the workers
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from benchmarks.memory_report import MIB, largest_under_budget, mib, process_peak  # noqa: E402
from scripts.report import write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "model",
    "transformer",
    ["transformer", "llama", "amoebanet"],
    "models/transformer.py, a keras_hub Llama, or models/amoebanet.py's AmoebaNet-D (its depth L = 3 x blocks normal "
    "cells, --dim its filters D, --vocab its classes, images of --image_size pixels).",
)
flags.DEFINE_list("rows", ["plain", "1", "2", "4"], "plain (Keras on one device) and the values of K to measure.")
flags.DEFINE_integer("dim", 64, "Model width (feed-forward 4*dim; Llama's intermediate 2*dim).", lower_bound=8)
flags.DEFINE_integer("heads", 4, "Attention heads of the Transformer.", lower_bound=1)
flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.", lower_bound=2)
flags.DEFINE_integer("batch_size", 16, "Sequences per batch N.", lower_bound=1)
flags.DEFINE_integer("vocab", 256, "Vocabulary size (AmoebaNet: classes).", lower_bound=2)
flags.DEFINE_integer("image_size", 64, "AmoebaNet's image height and width.", lower_bound=32)
flags.DEFINE_integer("micro_batches", 4, "M of the tfpipe rows.", lower_bound=1)
flags.DEFINE_float("budget_mib", 64.0, "Each device's allocator budget, MiB.", lower_bound=1.0)
flags.DEFINE_integer("max_blocks", 64, "The deepest model probed.", lower_bound=1)
flags.DEFINE_integer(
    "start_blocks", 1, "The first depth probed (times K for a tfpipe row): doubling starts there.", lower_bound=1
)
flags.DEFINE_enum(
    "device_type",
    "CPU",
    ["CPU", "GPU"],
    "CPU: LocalCluster workers' allocators against the budget; GPU: the first GPU split into K logical GPUs whose "
    "memory_limit is the budget (a hard cap).",
)
flags.DEFINE_bool(
    "plan",
    False,
    "Each tfpipe probe trains the configuration tfpipe.plan chooses for it under the budget (its K devices, no "
    "replicas, chosen by prediction: verify=0); default: the fixed one of --micro_batches.",
)
flags.DEFINE_float(
    "plan_seconds",
    None,
    "With --plan: tfpipe.plan's max_seconds for each probe (default: its own, 200 steps of the fastest configuration "
    "its layers predict, which at GPipe's activations is most of an hour a probe).",
    lower_bound=1.0,
)
flags.DEFINE_list(
    "plan_micro_batches",
    [],
    "With --plan: the values of M tfpipe.plan may choose from (its num_micro_batches=; default: all it searches). "
    "Fewer micro-batches keep a smaller step's graph in the training process and the workers, whose host memory a "
    "deep model's inlined step can outgrow before its devices' budget (docs/results/capacity_amoebanet.md).",
)
flags.DEFINE_bool(
    "constant_folding",
    True,
    "Grappler's constant folding in the training process (--noconstant_folding: off, as docs/guide/limitations.md "
    "advises for long sequences: it folds every block's causal mask into that process at the first step).",
)
flags.DEFINE_enum(
    "repeated_layers",
    "inline",
    ["inline", "call"],
    "The tfpipe rows' PipelineModel(repeated_layers=): call traces each cell's run of blocks and each kind of "
    "optimizer update once, so the processes' graphs stop growing with depth (tfpipe.partition.repeats).",
)
flags.DEFINE_string("out", None, "Write every probe to OUT.csv and the table to OUT.md.")
flags.DEFINE_string("_child", None, "Internal: measure one configuration (JSON) and print the result.")

TIMEOUT_S = 3600  # a deep K=8 probe at 512 tokens plans, traces and trains two steps in about 25 min here


def child(config: dict[str, Any]) -> dict[str, Any]:
    """Train ``config``'s model two Adam steps; its parameters and the peaks of every device and of this process."""
    import keras
    import tensorflow as tf

    import tfpipe

    keras.utils.set_random_seed(0)
    if not config.get("constant_folding", True):
        tf.config.optimizer.set_experimental_options({"constant_folding": False})
    k, n = config["k"], config["batch_size"]
    build = functools.partial(_build, config)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config.get("device_type") == "GPU":
        return dict(_on_logical_gpus(config, build, loss), client_process=process_peak())
    if k == 0:  # plain Keras, in this process
        model, x, y = build()
        model = keras_sequential(model)
        model.compile(optimizer="adam", loss=loss)
        model.fit(x, y, batch_size=n, epochs=1, verbose=0, shuffle=False)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        return {
            "params": model.count_params(),
            "peak": peak,
            "peaks": [peak],
            "client_peak": peak,
            "client_process": process_peak(),
            "config": "plain",
        }
    with tfpipe.cluster.LocalCluster(num_workers=k, threads_per_worker=1) as cluster:
        with tfpipe.deferred_weights():
            made, x, y = build()
        model, chosen = pipelined(made, x, cluster.devices, config)
        planned: dict[str, float] = {}
        if config.get("plan"):  # planning's own peaks (its probes on the workers, each layer's bytes read here) apart
            planned = {
                "planning_peak": max(info["peak"] for info in cluster.memory_info()),
                "planning_client_peak": tf.config.experimental.get_memory_info("CPU:0")["peak"],
            }
            cluster.reset_memory_stats()  # from what the model holds now: training's own peaks below
            tf.config.experimental.reset_memory_stats("CPU:0")
        model.compile(optimizer="adam", loss=loss)
        model.fit(x, y, batch_size=n, epochs=1, verbose=0, shuffle=False)
        peaks = [info["peak"] for info in cluster.memory_info()]
        client = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        return {
            "params": model.count_params(),
            "peak": max(peaks),
            "peaks": peaks,
            "client_peak": client,
            "client_process": process_peak(),
            "workers_process": max(process_peak(pid) for pid in cluster.pids),
            "config": chosen,
            **planned,
        }


def _build(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``config``'s model (layers or a task), its inputs for two batches, and its targets."""
    import numpy as np

    blocks, n = config["blocks"], config["batch_size"]
    if config["model"] == "llama":
        from tfpipe.models import hub

        task = hub.task("llama", vocabulary_size=config["vocab"], num_layers=blocks, hidden_dim=config["dim"])
        x = hub.inputs(task, 2 * n, config["seq_len"], config["vocab"])
        return task, x, x["token_ids"]
    rng = np.random.default_rng(0)
    if config["model"] == "amoebanet":
        from tfpipe.models import amoebanet

        layers = amoebanet.amoebanet_d(config["vocab"], 3 * blocks, config["dim"])
        size = config["image_size"]
        images = rng.normal(size=(2 * n, size, size, 3)).astype("float32")
        return layers, images, rng.integers(0, config["vocab"], 2 * n)
    from tfpipe.models import transformer

    layers = transformer.transformer_lm(
        config["vocab"], config["seq_len"], blocks, config["dim"], 4 * config["dim"], config["heads"]
    )
    x = rng.integers(0, config["vocab"], (2 * n, config["seq_len"]))
    return layers, x, x


def _on_logical_gpus(config: dict[str, Any], build: Any, loss: Any) -> dict[str, Any]:
    """``child`` on the first GPU split into max(K, 1) logical GPUs whose ``memory_limit`` is the budget: a hard cap,
    as a GPU of that size would be (running out of memory fails the probe: over the budget)."""
    import tensorflow as tf

    import tfpipe

    k = config["k"]
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise RuntimeError("--device_type=GPU: this machine has no GPU")
    limit = tf.config.LogicalDeviceConfiguration(memory_limit=int(config["budget_mib"]))
    tf.config.set_logical_device_configuration(gpus[0], [limit] * max(k, 1))
    devices = [f"/GPU:{i}" for i in range(max(k, 1))]
    if k == 0:  # plain Keras on one logical GPU
        with tf.device(devices[0]):
            model, x, y = build()
            model = keras_sequential(model)
            model.compile(optimizer="adam", loss=loss)
            model.fit(x, y, batch_size=config["batch_size"], epochs=1, verbose=0, shuffle=False)
    else:
        with tfpipe.deferred_weights():
            made, x, y = build()
        model, chosen = pipelined(made, x, devices, config)
        model.compile(optimizer="adam", loss=loss)
        model.fit(x, y, batch_size=config["batch_size"], epochs=1, verbose=0, shuffle=False)
    peaks = [tf.config.experimental.get_memory_info(d.lstrip("/"))["peak"] for d in devices]
    client = (
        tf.config.experimental.get_memory_info("CPU:0")["peak"] if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") else 0
    )
    return {"params": model.count_params(), "peak": max(peaks), "peaks": peaks, "client_peak": client}


def pipelined(made: Any, x: Any, devices: list[str], config: dict[str, Any]) -> tuple[Any, str]:
    """The PipelineModel of a tfpipe row over ``devices``, and its configuration: the fixed one (``--micro_batches``,
    ``remat="always"``, 1F1B above K=1), or with ``--plan`` the one ``tfpipe.plan`` chooses under the budget (a
    ValueError where nothing fits: the probe is over the budget)."""
    import tensorflow as tf

    import tfpipe

    k, n = len(devices), config["batch_size"]
    if not config.get("plan"):
        model = tfpipe.PipelineModel(
            made,
            num_partitions=k,
            devices=devices,
            num_micro_batches=config["micro_batches"],
            remat="always",
            schedule="1f1b" if k > 1 else "gpipe",
            repeated_layers=config.get("repeated_layers", "inline"),
        )
        return model, f"K={k}, M={config['micro_batches']}, remat='always', schedule='{model.schedule}'"
    sample = tf.nest.map_structure(lambda t: t[:n], x)
    budget = int(config["budget_mib"] * MIB)
    seconds = config.get("plan_seconds") or "auto"
    repeated = config.get("repeated_layers", "inline")
    plan = tfpipe.plan(
        made, n, devices, budget, sample=sample, optimizer="adam", replicas=False, verify=0, max_seconds=seconds,
        repeated_layers=repeated, num_micro_batches=config.get("plan_micro_batches"),
    )  # fmt: skip
    model = tfpipe.PipelineModel(made, plan=plan, repeated_layers=repeated)
    return model, plan.candidates[0].config.describe()


def keras_sequential(made: Any) -> Any:
    """A layer list as a ``keras.Sequential`` (plain Keras' row); a model as it is."""
    import keras

    return keras.Sequential(made) if isinstance(made, list) else made


def _child_run(command: list[str], prefix: str) -> subprocess.CompletedProcess:
    """Run a probe's process to its end (at most ``TIMEOUT_S``), its output kept, and its progress (tfpipe's lines:
    planning's phases and time left, the step being built) shown on stderr as it comes."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kept: dict[str, list[str]] = {"out": [], "err": []}

    def read(stream: Any, name: str) -> None:
        for line in stream:
            kept[name].append(line)
            if line.startswith("tfpipe"):
                print(prefix + line.rstrip(), file=sys.stderr, flush=True)

    readers = [
        threading.Thread(target=read, args=(child.stdout, "out")),
        threading.Thread(target=read, args=(child.stderr, "err")),
    ]
    for reader in readers:
        reader.start()
    try:
        child.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        kept["err"].append(f"Error: the probe ran past {TIMEOUT_S} s and was stopped\n")
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(command, child.returncode, "".join(kept["out"]), "".join(kept["err"]))


def probe(row: str, blocks: int) -> dict[str, Any]:
    """Measure one row at one depth in a fresh process; a failed run counts as over the budget."""
    config = {
        "model": FLAGS.model,
        "k": 0 if row == "plain" else int(row),
        "blocks": blocks,
        "dim": FLAGS.dim,
        "heads": FLAGS.heads,
        "seq_len": FLAGS.seq_len,
        "batch_size": FLAGS.batch_size,
        "vocab": FLAGS.vocab,
        "image_size": FLAGS.image_size,
        "micro_batches": FLAGS.micro_batches,
        "device_type": FLAGS.device_type,
        "budget_mib": FLAGS.budget_mib,
        "plan": FLAGS.plan,
        "plan_seconds": FLAGS.plan_seconds,
        "plan_micro_batches": [int(m) for m in FLAGS.plan_micro_batches] or None,
        "constant_folding": FLAGS.constant_folding,
        "repeated_layers": FLAGS.repeated_layers,
    }
    done = _child_run(
        [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), f"--_child={json.dumps(config)}"],
        f"  {row} L={blocks}: ",
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        said = done.stderr.strip().splitlines()
        why = [line for line in said if "Error" in line or "Fatal" in line][-1:] or said[-1:]
        print(f"  {row} L={blocks}: failed (exit {done.returncode}: {why}), counted over the budget")
        return {
            "row": row,
            "blocks": blocks,
            "params": 0,
            "peak": float("inf"),
            "peaks": [],
            "client_peak": 0,
            "client_process": 0,
            "workers_process": 0,
            "config": "",
        }
    result = dict(json.loads(lines[-1]), row=row, blocks=blocks)
    print(
        f"  {row} L={blocks}: {result['params'] / 1e6:.2f}M parameters, device peak {mib(result['peak'])} MiB "
        f"(budget {FLAGS.budget_mib:g}), client {mib(result['client_peak'])} MiB "
        f"(process {mib(result['client_process'])})"
        + (
            f"; planning: devices {mib(result['planning_peak'])} MiB, client {mib(result['planning_client_peak'])} MiB"
            if "planning_peak" in result
            else ""
        ),
        flush=True,
    )
    return result


def _check_rows() -> list[str]:
    rows = [r.strip() for r in FLAGS.rows]
    bad = [r for r in rows if r != "plain" and not (r.isdigit() and int(r) >= 1)]
    if bad or not rows:
        raise app.UsageError(f"--rows={','.join(FLAGS.rows)}: each must be 'plain' or a K >= 1, e.g. plain,1,2,4,8.")
    if any(not (m.strip().isdigit() and int(m) >= 1) for m in FLAGS.plan_micro_batches):
        raise app.UsageError(f"--plan_micro_batches={','.join(FLAGS.plan_micro_batches)}: each must be an M >= 1.")
    return rows


def table(found: list[dict[str, Any]]) -> str:
    """The capacity table: each row's deepest model under the budget, and its parameters against tfpipe K=1's."""
    base = next((f["params"] for f in found if f["row"] == "1" and f["params"]), None)
    amoebanet = FLAGS.model == "amoebanet"
    depth = "normal cells L" if amoebanet else "blocks"
    folding = "" if FLAGS.constant_folding else ", constant folding off in the training process"
    data = (
        f"AmoebaNet-D (L, {FLAGS.dim}), {FLAGS.batch_size} images of {FLAGS.image_size}x{FLAGS.image_size}, "
        f"{FLAGS.vocab} classes"
        if amoebanet
        else f"{FLAGS.model}: width {FLAGS.dim}, {FLAGS.batch_size} sequences of {FLAGS.seq_len} tokens, vocabulary "
        f"{FLAGS.vocab}"
    )
    lines = [
        f"{data}{folding}, Adam, budget {FLAGS.budget_mib:g} MiB per device (allocator peak); tfpipe "
        + (
            "as tfpipe.plan chose for each probe"
            + (f" within max_seconds={FLAGS.plan_seconds:g}" if FLAGS.plan_seconds else "")
            + (f", M among {','.join(FLAGS.plan_micro_batches)}" if FLAGS.plan_micro_batches else "")
            if FLAGS.plan
            else f"at M={FLAGS.micro_batches}, remat='always', 1F1B above K=1"
        )
        + (", repeated_layers='call'" if FLAGS.repeated_layers == "call" else ""),
        "",
        f"| row | {depth} | parameters | x tfpipe K=1 | device peak (MiB) | client peak (MiB) | processes (MiB) "
        "| configuration |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in found:
        ratio = f"{f['params'] / base:.2f}" if base and f["params"] else "-"
        capped = " (cap)" if f["capped"] else ""
        name = "plain Keras" if f["row"] == "plain" else f"tfpipe K={f['row']}"
        blocks = 3 * f["blocks"] if amoebanet else f["blocks"]
        if not f["params"]:  # no depth probed fit: the least probed was over the budget
            blocks = f"under {3 * (f['blocks'] + 1) if amoebanet else f['blocks'] + 1} (none probed fit)"
        lines.append(
            f"| {name} | {blocks}{capped} | {f['params'] / 1e6:.2f}M | {ratio} | {mib(f['peak'])} | "
            f"{mib(f['client_peak'])} | {_processes(f)} | {f['config']}{f['planning']} |"
        )
    return "\n".join(lines) + "\n"


def _processes(found: dict[str, Any]) -> str:
    """The resident peaks of a row's training process and (tfpipe on workers) of its fullest worker's process."""
    client = mib(found["client_process"])
    return f"{client}, a worker {mib(found['workers_process'])}" if found.get("workers_process") else client


def main(argv: list[str]) -> None:
    del argv
    if FLAGS._child is not None:
        print(json.dumps(child(json.loads(FLAGS._child))))
        return
    rows, budget = _check_rows(), FLAGS.budget_mib * MIB
    found, probes = [], []
    for row in rows:
        print(f"{row}: the deepest model under {FLAGS.budget_mib:g} MiB per device (doubling, then bisection)")
        # K cells need K layers: a model of K blocks has at least that many, whatever else it holds.
        first = FLAGS.start_blocks * (max(1, int(row)) if row != "plain" else 1)
        blocks, capped, made = largest_under_budget(lambda b, r=row: probe(r, b), budget, FLAGS.max_blocks, first)
        probes += made
        best = next((m for m in made if m["blocks"] == blocks), None)
        found.append(
            {
                "row": row,
                "blocks": blocks,
                "capped": capped,
                "params": best["params"] if best else 0,
                "peak": best["peak"] if best else 0,
                "client_peak": best["client_peak"] if best else 0,
                "client_process": best["client_process"] if best else 0,
                "workers_process": best.get("workers_process", 0) if best else 0,
                "config": best["config"] if best else "",
                "planning": (
                    f"; planning's peaks: devices {mib(best['planning_peak'])}, "
                    f"client {mib(best['planning_client_peak'])}"
                    if best and "planning_peak" in best
                    else ""
                ),
            }
        )
    text = table(found)
    print(text)
    if FLAGS.out:
        fields = [
            "row", "blocks", "params", "peak", "peaks", "client_peak", "client_process", "workers_process", "config"
        ]  # fmt: skip
        fields += ["planning_peak", "planning_client_peak"] if FLAGS.plan else []
        write_table(FLAGS.out, [{f: p.get(f, "") for f in fields} for p in probes], text, fields)


if __name__ == "__main__":
    app.run(main)
