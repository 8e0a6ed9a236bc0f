"""The training process's own memory against depth: what TensorFlow's single client keeps for the step's graph.

TensorFlow traces, optimizes and partitions the whole training step in the process that calls ``fit``, whatever
devices run it, and keeps every op of it (and of each function it calls) there. This measures that process's resident
memory before and after the first ``fit`` step of the Transformer of ``models/`` at several depths: plain Keras in its
one process, tfpipe on logical CPUs in the same process, and tfpipe on one-thread ``LocalCluster`` workers (whose own
growth is printed beside it); the ``_call`` rows are tfpipe with ``repeated_layers="call"`` (each cell's run of blocks
traced once and called per block, ``tfpipe.partition.repeats``). The graph grows with the ops, not with the width,
batch or sequence, so a short sequence measures it at little cost. Each depth runs in a fresh process (this script
with ``--_child=JSON``). Beside the growth, the process's peak resident memory against the model's Adam state
(weights, gradients, two slots): at a width where the model no longer fits one device, the client's share of it
(``--model``: the layer list, the Functional model with tied embeddings, or a keras_hub Llama; the Functional
ones built under ``tfpipe.deferred_weights()`` as docs/guide/model.md says, so their weights are made on the
devices).
``benchmark_scale.py`` measures the same first step against K x M at one depth.

    python benchmarks/benchmark_client_memory.py                          # 21 and 42 blocks, K=8, a few minutes
    python benchmarks/benchmark_client_memory.py --rows=workers --blocks=42,84 --cells_per_device=4 --micro_batches=32
    python benchmarks/benchmark_client_memory.py --rows=workers --model=llama --dim=4096 --blocks=7 --devices=2 \
        --micro_batches=2 --batch_size=2 --seq_len=8   # a 16.2 GB Adam state on the workers: the client's share
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import json
import subprocess
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from benchmarks.memory_report import process_peak  # noqa: E402
from scripts.report import write_table  # noqa: E402

ROWS = ("keras", "logical", "logical_call", "workers", "workers_call")
FLAGS = flags.FLAGS
flags.DEFINE_list(
    "rows",
    list(ROWS),
    "keras (plain, one device), logical (tfpipe, logical CPUs), workers (tfpipe); _call: repeated_layers='call'.",
)
flags.DEFINE_list("blocks", ["21", "42"], "Depths measured; the MiB per block is the slope from the first to the last.")
flags.DEFINE_integer("devices", 8, "Devices of the tfpipe rows (logical CPUs or workers).", lower_bound=1)
flags.DEFINE_integer("cells_per_device", 1, "v: cells a device (interleaved 1F1B above 1, else 1F1B).", lower_bound=1)
flags.DEFINE_integer("micro_batches", 8, "M of the tfpipe rows (divides --batch_size).", lower_bound=1)
flags.DEFINE_enum(
    "model",
    "transformer",
    ["transformer", "transformer_tied", "llama"],
    "models/transformer.py's layer list, its Functional model whose output projection is the token embedding, or a "
    "keras_hub Llama task (tfpipe.models.hub); the Functional ones built under tfpipe.deferred_weights() in the "
    "tfpipe rows.",
)
flags.DEFINE_integer("dim", 128, "Model width (feed-forward 4*dim; Llama's intermediate 2*dim).", lower_bound=8)
flags.DEFINE_integer("seq_len", 16, "Tokens per sequence.", lower_bound=2)
flags.DEFINE_integer("batch_size", 32, "Sequences a step.", lower_bound=1)
flags.DEFINE_string("out", None, "Write the table to OUT.md and the rows to OUT.csv.")
flags.DEFINE_string("_child", None, "Internal: measure one row at one depth (JSON) and print the result.")


def resident_mib(pid: int | None = None) -> float:
    """A process's resident memory, MiB (this one's by default)."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def graph_ops() -> int:
    """Ops this process keeps for traced graphs: every live FuncGraph's, and every function registered to run."""
    import gc

    from tensorflow.python.eager import context
    from tensorflow.python.framework import func_graph

    gc.collect()
    alive = sum(len(o.get_operations()) for o in gc.get_objects() if isinstance(o, func_graph.FuncGraph))
    ctx = context.context()
    return alive + sum(len(ctx.get_function_def(name).node_def) for name in ctx.list_function_names())


def adam_state_mib(model: Any) -> float:
    """The model's Adam state, MiB: every weight, and a gradient and two slots per trainable weight."""
    import math

    import tensorflow as tf

    def size(variables: Any) -> float:
        return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables) / 2**20

    return size(model.weights) + 3 * size(model.trainable_weights)


def _build(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``config``'s model (a layer list, or a Functional model), its inputs and its targets."""
    import numpy as np

    from tfpipe.models import hub, transformer

    dim, seq, n, blocks = config["dim"], config["seq_len"], config["batch_size"], config["blocks"]
    if config["model"] == "llama":
        task = hub.task("llama", vocabulary_size=256, num_layers=blocks, hidden_dim=dim)
        x = hub.inputs(task, n, seq, 256)
        return task, x, x["token_ids"]
    x = np.random.default_rng(0).integers(0, 256, (n, seq))
    if config["model"] == "transformer_tied":
        return transformer.transformer_lm_tied(256, seq, blocks, dim, 4 * dim, 4), x, x
    return transformer.transformer_lm(256, seq, blocks, dim, 4 * dim, 4), x, x


def child(config: dict[str, Any]) -> dict[str, Any]:
    """One row at one depth: the process's and the workers' growth over the first ``fit`` step, and the process's
    peak against the model's Adam state."""
    import tensorflow as tf

    row, k = config["row"], config["devices"]
    place, repeated = row.split("_")[0], "call" if row.endswith("_call") else "inline"
    if place == "logical":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * k)
    import contextlib

    import keras

    import tfpipe

    keras.utils.set_random_seed(0)
    with contextlib.ExitStack() as stack:
        devices, pids = [f"/CPU:{i}" for i in range(k)], []
        if place == "workers":
            cluster = stack.enter_context(tfpipe.cluster.LocalCluster(num_workers=k, threads_per_worker=1))
            devices, pids = cluster.devices, cluster.pids
        if row == "keras":
            made, x, y = _build(config)
        else:  # a Functional model's weights made on the devices, not here (a layer list builds each cell there)
            with tfpipe.deferred_weights():
                made, x, y = _build(config)
        v = config["cells_per_device"]
        model = (
            (keras.Sequential(made) if isinstance(made, list) else made)
            if row == "keras"
            else tfpipe.PipelineModel(
                made,
                num_partitions=k * v,
                devices=devices,
                num_micro_batches=config["micro_batches"],
                schedule="interleaved_1f1b" if v > 1 else "1f1b",
                repeated_layers=repeated,
            )
        )
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before, workers = resident_mib(), sum(resident_mib(pid) for pid in pids)
        began = time.monotonic()
        model.fit(x, y, batch_size=config["batch_size"], epochs=1, verbose=0, shuffle=False)
        return {
            "client_peak_mib": process_peak() / 2**20,
            "adam_mib": adam_state_mib(model),
            "seconds": time.monotonic() - began,
            "client_mib": resident_mib() - before,
            "workers_mib": sum(resident_mib(pid) for pid in pids) - workers,
            "ops": graph_ops(),
            "params": model.count_params(),
        }


def measure(row: str, blocks: int) -> dict[str, Any]:
    """``child`` in a fresh process."""
    config = {"row": row, "blocks": blocks, "devices": FLAGS.devices, "cells_per_device": FLAGS.cells_per_device}
    config.update(micro_batches=FLAGS.micro_batches, dim=FLAGS.dim, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size)
    config.update(model=FLAGS.model)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--_child={json.dumps(config)}"], capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{row} at {blocks} blocks failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1]), row=row, blocks=blocks)


def table(found: list[dict[str, Any]]) -> str:
    """Each row at each depth, and its MiB per block (the slope from the shallowest to the deepest)."""
    lines = [
        f"{FLAGS.model} width {FLAGS.dim}, {FLAGS.batch_size} sequences of {FLAGS.seq_len} tokens, Adam; tfpipe: "
        f"{FLAGS.devices} devices x {FLAGS.cells_per_device} cells, M={FLAGS.micro_batches}; growth over the first "
        "fit; the client's peak resident memory against the model's Adam state (weights, gradients, two slots)",
        "",
        "| row | blocks | parameters | ops kept | client +MiB | workers +MiB | first fit (s) | client MiB a block "
        "| Adam state (MiB) | client peak (MiB, of the Adam state) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in dict.fromkeys(f["row"] for f in found):
        mine = sorted((f for f in found if f["row"] == row), key=lambda f: f["blocks"])
        low, high = mine[0], mine[-1]
        slope = (high["client_mib"] - low["client_mib"]) / (high["blocks"] - low["blocks"]) if len(mine) > 1 else None
        for f in mine:
            per = f"{slope:.1f}" if slope is not None and f is high else "-"
            workers = f"{f['workers_mib']:.0f}" if row.startswith("workers") else "-"
            lines.append(
                f"| {row} | {f['blocks']} | {f['params'] / 1e6:.2f}M | {f['ops']} | {f['client_mib']:.0f} | "
                f"{workers} | {f['seconds']:.0f} | {per} | {f['adam_mib']:,.0f} | "
                f"{f['client_peak_mib']:,.0f} ({f['client_peak_mib'] / f['adam_mib']:.0%}) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    del argv
    if FLAGS._child is not None:
        print(json.dumps(child(json.loads(FLAGS._child))))
        return
    rows = [r.strip() for r in FLAGS.rows]
    if not rows or any(r not in ROWS for r in rows):
        raise app.UsageError(f"--rows={','.join(FLAGS.rows)}: each must be one of {', '.join(ROWS)}.")
    if not all(b.strip().isdigit() and int(b) > 0 for b in FLAGS.blocks):
        raise app.UsageError(f"--blocks={','.join(FLAGS.blocks)}: positive integers, e.g. 21,42.")
    found = []
    for blocks in sorted({int(b) for b in FLAGS.blocks}):  # rows in turn at each depth: the machine's load shared
        for row in rows:
            found.append(measure(row, blocks))
            f = found[-1]
            print(f"  {row} at {blocks} blocks: client +{f['client_mib']:.0f} MiB, {f['seconds']:.0f} s", flush=True)
    text = table(found)
    print(text)
    if FLAGS.out:
        fields = ["row", "blocks", "params", "ops", "client_mib", "workers_mib", "seconds"]
        fields += ["adam_mib", "client_peak_mib"]
        write_table(FLAGS.out, [{f: r[f] for f in fields} for r in found], text, fields)


if __name__ == "__main__":
    app.run(main)
