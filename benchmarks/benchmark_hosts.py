"""Cells on other hosts against cells in worker processes on loopback: the same pipeline's step, in turn.

Two setups of K single-thread worker servers, each run in a fresh process per round:

- ``loopback``: a ``LocalCluster`` on this host (what every other benchmark uses);
- ``hosts``: K simulated hosts (``scripts/hosts.py``: network namespaces on a bridge, each worker at its own
  address, the training process outside them, joined with ``connect()``), with ``--delay_ms`` of latency added
  each way on every host's link where the kernel has ``netem`` (``tc qdisc ... netem``; an error where it has not).

Each round runs both, in turn; the figure is the ratio hosts / loopback within each round (min, median, max).
Needs root and ``ip`` for the hosts.

    python benchmarks/benchmark_hosts.py                       # 20 x Dense(512), batch 256, K=2, M=4
    python benchmarks/benchmark_hosts.py --delay_ms=1          # with 1 ms each way (where netem exists)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import json
import statistics
import subprocess

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from scripts.report import write_table  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "Worker servers (K cells, one each).", lower_bound=2)
flags.DEFINE_integer("width", 512, "MLP width.", lower_bound=1)
flags.DEFINE_integer("depth", 20, "MLP layers (Dense(width, tanh)).", lower_bound=2)
flags.DEFINE_integer("batch_size", 256, "Mini-batch size.", lower_bound=1)
flags.DEFINE_integer("micro_batches", 4, "M.", lower_bound=1)
flags.DEFINE_string("schedule", "1f1b", "Schedule.")
flags.DEFINE_integer("steps", 30, "Timed steps per run (after 5 warm-up steps).", lower_bound=3)
flags.DEFINE_integer("rounds", 3, "Rounds; each runs both setups, in turn.", lower_bound=1)
flags.DEFINE_float("delay_ms", 0.0, "Latency added each way on every simulated host's link (netem).", lower_bound=0)
flags.DEFINE_string("out", None, "Write OUT.csv and OUT.md.")
flags.DEFINE_string("_child", None, "Internal: run one setup in this process.")

WARMUP = 5


def child(config: dict) -> dict:
    """One setup: build the workers, train, return the median step."""
    import keras
    import numpy as np

    import tfpipe
    from scripts.hosts import Hosts
    from scripts.report import median_step_seconds

    keras.utils.set_random_seed(0)
    n = config["batch_size"] * (WARMUP + config["steps"])
    x = np.random.default_rng(0).standard_normal((n, config["width"])).astype("float32")

    def run(devices: list[str]) -> float:
        layers = [keras.layers.Dense(config["width"], activation="tanh") for _ in range(config["depth"])]
        model = tfpipe.PipelineModel(
            layers,
            num_partitions=config["workers"],
            devices=devices,
            num_micro_batches=config["micro_batches"],
            schedule=config["schedule"],
            remat="never",
        )
        model.compile(optimizer="sgd", loss="mse")
        return median_step_seconds(model, x, np.tanh(x), config["batch_size"], WARMUP)

    if config["setup"] == "loopback":
        with tfpipe.cluster.LocalCluster(config["workers"], threads_per_worker=1) as cluster:
            return {"step_s": run(cluster.devices)}
    with Hosts(config["workers"], threads=1) as hosts:
        if config["delay_ms"]:
            for k in range(config["workers"]):
                hosts.delay(k, config["delay_ms"])
        return {"step_s": run(tfpipe.cluster.connect(hosts.cluster))}


def run_child(config: dict) -> dict:
    """``child(config)`` in a fresh process (connecting changes TensorFlow's process-wide context)."""
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--_child={json.dumps(config)}"], capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{config['setup']} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str]) -> None:
    """Rounds of both setups in turn; the ratio within each round."""
    del argv
    keys = ("workers", "width", "depth", "batch_size", "micro_batches", "schedule", "steps", "delay_ms")
    base = {k: getattr(FLAGS, k) for k in keys}
    if FLAGS._child:
        print(json.dumps(child(json.loads(FLAGS._child))), flush=True)
        return
    from scripts.hosts import available

    why = available()
    if why is not None:
        raise app.UsageError(f"simulated hosts cannot be made here: {why}")
    rows = []
    for r in range(FLAGS.rounds):
        loopback = run_child({**base, "setup": "loopback"})["step_s"]
        hosts = run_child({**base, "setup": "hosts"})["step_s"]
        rows.append({"round": r, "loopback_ms": loopback * 1e3, "hosts_ms": hosts * 1e3, "ratio": hosts / loopback})
        print(f"  round {r}: loopback {loopback * 1e3:.1f} ms, hosts {hosts * 1e3:.1f} ms", flush=True)
    ratios = [row["ratio"] for row in rows]
    text = (
        f"{FLAGS.depth} x Dense({FLAGS.width}), batch {FLAGS.batch_size}, K={FLAGS.workers}, M={FLAGS.micro_batches}, "
        f"{FLAGS.schedule}, one-thread workers, delay {FLAGS.delay_ms:g} ms each way: hosts / loopback "
        f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f} (min / median / max of "
        f"{len(ratios)} rounds); loopback {statistics.median(r['loopback_ms'] for r in rows):.1f} ms, hosts "
        f"{statistics.median(r['hosts_ms'] for r in rows):.1f} ms (medians)\n"
    )
    print(text)
    if FLAGS.out:
        write_table(FLAGS.out, rows, text)


if __name__ == "__main__":
    app.run(main)
