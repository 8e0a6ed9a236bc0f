"""Soak: client and worker memory, threads and descriptors over thousands of pipelined steps on two workers."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import json
import subprocess
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from benchmarks.soak_processes import fd_kinds, free_port, sample, start_servers, thread_pools  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 2000, "Training steps per mode.", lower_bound=1)
flags.DEFINE_integer(
    "sample_every", 100, "Sample every process every this many steps (and before the first).", lower_bound=1
)
flags.DEFINE_integer(
    "warmup_steps", 200, "Growth is measured from the sample at this step to the last one.", lower_bound=0
)
flags.DEFINE_integer("steps_per_epoch", 500, "Steps per epoch of the one fit (at most --steps).", lower_bound=1)
flags.DEFINE_integer("micro_batches", 8, "M.", lower_bound=1)
flags.DEFINE_integer("width", 128, "Units of each Dense layer (and input features).", lower_bound=2)
flags.DEFINE_integer("depth", 8, "Dense(width, tanh) layers before the Dense(1) output.", lower_bound=2)
flags.DEFINE_integer("batch_size", 256, "Batch size (every batch holds at least M samples).", lower_bound=1)
flags.DEFINE_list("modes", ["local", "connect"], "local: LocalCluster(2); connect: two tf.distribute.Server processes.")
flags.DEFINE_string("out", None, "Write the samples to OUT.csv, the summary to OUT.md and the RSS plot to OUT.png.")
flags.DEFINE_float("max_growth_mb", 50.0, "Target: resident memory grows less than this per process after warm-up.")
flags.DEFINE_integer("seed", 0, "Seed for the weights and the data.")
flags.DEFINE_float(
    "idle_s",
    60.0,
    "After the fit, keep the cluster idle this long and sample every process once more (0: no idle sample): "
    "shows whether a thread a pool started under load is retired once the load stops.",
    lower_bound=0.0,
)
flags.DEFINE_string("_child", None, "Internal: train one mode in this process (JSON configuration).")

MODES = ("local", "connect")
FIELDS = ("mode", "step", "idle_s", "process", "pid", "rss_mb", "threads", "fds", "elapsed_s")
MODEL_FLAGS = (
    "steps",
    "sample_every",
    "steps_per_epoch",
    "micro_batches",
    "width",
    "depth",
    "batch_size",
    "seed",
    "idle_s",
)
IDLE = "idle"  # the label of the descriptor and thread counts taken after the idle wait


class Sampler:
    """Counts training steps and samples every process at step 0, every ``--sample_every`` steps and the last."""

    def __init__(self, mode: str, pids: dict[str, int]):
        self.mode, self.pids, self.step, self.start = mode, pids, 0, time.monotonic()
        self.rows: list[dict[str, Any]] = []
        self.fds: dict[str, dict[str, dict[str, int]]] = {}  # step label -> process -> descriptor kind -> count
        self.threads: dict[str, dict[str, dict[str, int]]] = {}  # step label -> process -> thread name -> count

    def take(self, idle_s: float = 0.0) -> None:
        """One sample of every process at the current step (``idle_s``: after that long idle since the last step)."""
        elapsed = round(time.monotonic() - self.start, 3)
        for name, pid in self.pids.items():
            rss, threads, fds = sample(pid)
            row = {"mode": self.mode, "step": self.step, "idle_s": idle_s, "process": name, "pid": pid}
            self.rows.append({**row, "rss_mb": round(rss, 2), "threads": threads, "fds": fds, "elapsed_s": elapsed})
        label = IDLE if idle_s else str(self.step)
        if idle_s or self.step in (FLAGS.warmup_steps, FLAGS.steps):
            self.fds[label] = {name: fd_kinds(pid) for name, pid in self.pids.items()}
            self.threads[label] = {name: thread_pools(pid) for name, pid in self.pids.items()}

    def on_step(self) -> None:
        """After each training step."""
        self.step += 1
        if self.step % FLAGS.sample_every == 0 or self.step == FLAGS.steps:
            self.take()


def soak(mode: str, devices: list[str], worker_pids: list[int]) -> dict[str, Any]:
    """Train the MLP for ``--steps`` steps on ``devices`` with one fit over a repeated dataset, sampling as it goes."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfpipe

    keras.utils.set_random_seed(FLAGS.seed)
    layers = [keras.layers.Dense(FLAGS.width, activation="tanh") for _ in range(FLAGS.depth)]
    model = tfpipe.PipelineModel(
        layers + [keras.layers.Dense(1)], num_partitions=2, devices=devices, num_micro_batches=FLAGS.micro_batches
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(FLAGS.seed)
    x = rng.normal(size=(8 * FLAGS.batch_size, FLAGS.width)).astype("float32")
    y = np.tanh(x[:, :1] - x[:, 1:2]).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch_size, drop_remainder=True).repeat()
    pids = {"client": os.getpid(), **{f"worker {k}": pid for k, pid in enumerate(worker_pids)}}
    sampler = Sampler(mode, pids)
    sampler.take()  # step 0: connected, the model made but not yet built or traced
    spe = min(FLAGS.steps_per_epoch, FLAGS.steps)
    history = model.fit(
        data,
        epochs=FLAGS.steps // spe,
        steps_per_epoch=spe,
        shuffle=False,  # the dataset's order; Keras warns that it ignores shuffle=True for a dataset
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: sampler.on_step())],
    )
    if FLAGS.idle_s:
        time.sleep(FLAGS.idle_s)  # the cluster kept: nothing sent but the watchdog's status calls
        sampler.take(idle_s=FLAGS.idle_s)
    loss = history.history["loss"]
    print(f"{mode}: {sampler.step} steps on {devices}; loss {loss[0]:.4f} -> {loss[-1]:.4f}", flush=True)
    return {"rows": sampler.rows, "fds": sampler.fds, "threads": sampler.threads, "loss": [loss[0], loss[-1]]}


def child(config: dict[str, Any]) -> None:
    """In the child process: join the workers of ``config['mode']``, train, and write the samples to its result file."""
    import tfpipe

    if config["mode"] == "local":
        with tfpipe.cluster.LocalCluster(num_workers=2) as cluster:
            result = soak("local", cluster.devices, cluster.pids)
    else:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow logs the whole session config when connecting
        devices = tfpipe.cluster.connect({"worker": config["addresses"]})
        result = soak("connect", devices, config["pids"])
    with open(config["result"], "w") as f:
        json.dump(result, f)


def run_mode(mode: str) -> dict[str, Any]:
    """Train one mode in a fresh child process (TensorFlow's cluster context is process-wide); its samples."""
    servers: list[subprocess.Popen] = []
    logs: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        config: dict[str, Any] = {"mode": mode, "result": os.path.join(tmp, "result.json")}
        try:
            if mode == "connect":
                config["addresses"] = [f"127.0.0.1:{free_port()}" for _ in range(2)]
                servers = start_servers(config["addresses"], logs)
                config["pids"] = [s.pid for s in servers]
            flags_ = [f"--{name}={FLAGS[name].value}" for name in MODEL_FLAGS] + [
                f"--warmup_steps={FLAGS.warmup_steps}"
            ]
            command = [sys.executable, os.path.abspath(__file__), f"--_child={json.dumps(config)}", *flags_]
            code = subprocess.run(command).returncode
            if code != 0:
                raise RuntimeError(f"The {mode} run failed (exit code {code}); its output is above.")
            with open(config["result"]) as f:
                return json.load(f)
        finally:
            for server in servers:
                server.kill()
                server.wait(timeout=30)
            for log in logs:
                log.close()


def samples(rows: list[dict[str, Any]], mode: str, process: str, idle: bool = False) -> list[dict[str, Any]]:
    """The samples of ``process`` in ``mode`` taken while training, in step order; ``idle``: the one after idling."""
    return [r for r in rows if r["mode"] == mode and r["process"] == process and bool(r.get("idle_s")) == idle]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and process: the samples at warm-up, at the last step and after idling; the growth and the verdict."""
    found = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for process in dict.fromkeys(r["process"] for r in rows if r["mode"] == mode):
            mine = samples(rows, mode, process)
            first = next(r for r in mine if r["step"] == FLAGS.warmup_steps)
            last = mine[-1]
            idle = next(iter(samples(rows, mode, process, idle=True)), None)
            growth = {key: last[key] - first[key] for key in ("rss_mb", "threads", "fds")}
            ok = growth["rss_mb"] < FLAGS.max_growth_mb and growth["threads"] <= 0 and growth["fds"] <= 0
            found.append(
                {
                    "mode": mode,
                    "process": process,
                    "first": first,
                    "last": last,
                    "idle": idle,
                    "growth": growth,
                    "ok": ok,
                }
            )
    return found


def step_ms(rows: list[dict[str, Any]], mode: str) -> float:
    """Mean milliseconds per step from the warm-up sample to the last (sampling included)."""
    mine = samples(rows, mode, "client")
    first = next(r for r in mine if r["step"] == FLAGS.warmup_steps)
    return 1e3 * (mine[-1]["elapsed_s"] - first["elapsed_s"]) / max(mine[-1]["step"] - first["step"], 1)


def changes(counts: dict[str, dict[str, dict[str, int]]], end: str = "") -> dict[str, str]:
    """Per process, the descriptor kinds or thread names whose count changed from warm-up to ``end`` ('socket +2').

    ``end``: a label of ``counts``, the last step's by default (``IDLE``: after the idle wait).
    """
    before, after = counts.get(str(FLAGS.warmup_steps), {}), counts.get(end or str(FLAGS.steps), {})
    changes = {}
    for process in after:
        a, b = before.get(process, {}), after[process]
        diff = {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) != a.get(k, 0)}
        if diff:
            changes[process] = ", ".join(f"{k} {v:+d}" for k, v in diff.items())
    return changes


def listed(found: dict[str, str]) -> str:
    """What ``changes`` found, one process after another ('worker 1: event_engine +1'), or 'none'."""
    return "; ".join(f"{process}: {change}" for process, change in found.items()) or "none"


def markdown(rows: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> str:
    """The summary table, step times, losses, and the descriptors and threads that changed."""
    w, end, idle = FLAGS.warmup_steps, FLAGS.steps, f"{FLAGS.idle_s:g} s idle"
    spe = min(FLAGS.steps_per_epoch, FLAGS.steps)
    lines = [
        f"Soak: {end} steps of an MLP ({FLAGS.depth} x Dense({FLAGS.width}, tanh) + Dense(1), batch "
        f"{FLAGS.batch_size}, SGD, mse), K=2 on two worker processes, M={FLAGS.micro_batches}; one `fit` over a "
        f"repeated `tf.data` dataset, {end // spe} epochs of {spe} steps; every process sampled every "
        f"{FLAGS.sample_every} steps (/proc: VmRSS, Threads, fd)"
        + (f", and once more after {idle}, the cluster kept" if FLAGS.idle_s else "")
        + ". `local`: `LocalCluster(num_workers=2)`; "
        "`connect`: two plain `tf.distribute.Server` processes on loopback, joined with `connect()`. "
        f"Target: from step {w} to step {end}, RSS growth < {FLAGS.max_growth_mb:g} MB per process and no growth "
        "in threads or descriptors. (MB = 2^20 bytes.)",
        "",
        f"| mode | process | RSS at {w} (MB) | RSS at {end} (MB) | growth (MB) | threads {w} -> {end}"
        + (f" (after {idle})" if FLAGS.idle_s else "")
        + f" | fds {w} -> {end} | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summarize(rows):
        a, b, g, i = s["first"], s["last"], s["growth"], s["idle"]
        lines.append(
            f"| {s['mode']} | {s['process']} | {a['rss_mb']:.1f} | {b['rss_mb']:.1f} | {g['rss_mb']:+.1f} | "
            f"{a['threads']} -> {b['threads']}" + (f" ({i['threads']})" if i else "") + " | "
            f"{a['fds']} -> {b['fds']} | {'PASS' if s['ok'] else 'FAIL'} |"
        )
    lines.append("")
    for mode, result in results.items():
        after_idle = f"; from step {w} to after {idle}: " + listed(changes(result["threads"], IDLE))
        lines.append(
            f"- `{mode}`: {step_ms(rows, mode):.1f} ms per step after warm-up; loss {result['loss'][0]:.4f} -> "
            f"{result['loss'][1]:.4f}; from step {w} to {end}, descriptors that changed: "
            + listed(changes(result["fds"]))
            + "; threads that changed (by name): "
            + listed(changes(result["threads"]))
            + (after_idle if IDLE in result["threads"] else "")
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """RSS over the steps (top) and its change from warm-up (bottom), a column per mode; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path} not written).")
        return
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 7), sharex=True, sharey="row", squeeze=False)
    for col, mode in enumerate(modes):
        for process in dict.fromkeys(r["process"] for r in rows if r["mode"] == mode):
            mine = samples(rows, mode, process)
            base = next(r["rss_mb"] for r in mine if r["step"] == FLAGS.warmup_steps)
            steps = [r["step"] for r in mine]
            axes[0][col].plot(steps, [r["rss_mb"] for r in mine], marker=".", label=process)
            axes[1][col].plot(steps, [r["rss_mb"] - base for r in mine], marker=".", label=process)
        axes[0][col].set(title=f"{mode} (K=2, M={FLAGS.micro_batches})", ylim=(0, None))
        axes[1][col].axhline(FLAGS.max_growth_mb, color="red", linestyle=":", linewidth=1, label="target")
        axes[1][col].set(xlabel="step")
        for ax in axes[:, col]:
            ax.axvline(FLAGS.warmup_steps, color="gray", linestyle="--", linewidth=1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    axes[0][0].set_ylabel("resident memory (MB)")
    axes[1][0].set_ylabel(f"change from step {FLAGS.warmup_steps} (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _validate_flags() -> None:
    """Reject sampling settings that would not sample the warm-up step, naming the fix."""
    unknown = [m for m in FLAGS.modes if m not in MODES]
    if unknown or not FLAGS.modes:
        raise app.UsageError(f"--modes={','.join(FLAGS.modes)}: use a comma list of {', '.join(MODES)}.")
    if FLAGS.warmup_steps % FLAGS.sample_every:
        raise app.UsageError(f"--warmup_steps={FLAGS.warmup_steps} must be a multiple of --sample_every.")
    if FLAGS.warmup_steps >= FLAGS.steps:
        raise app.UsageError(f"--warmup_steps={FLAGS.warmup_steps} must be less than --steps={FLAGS.steps}.")
    if FLAGS.steps % min(FLAGS.steps_per_epoch, FLAGS.steps):
        raise app.UsageError(f"--steps={FLAGS.steps} must be a multiple of --steps_per_epoch.")
    if FLAGS.batch_size < FLAGS.micro_batches:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} must be at least --micro_batches.")


def main(argv: list[str]) -> None:
    """Run each mode in its own process, then print and write the samples, the summary and the plot."""
    del argv
    if FLAGS._child:
        child(json.loads(FLAGS._child))
        return
    _validate_flags()
    results = {mode: run_mode(mode) for mode in FLAGS.modes}
    rows = [row for result in results.values() for row in result["rows"]]
    table = markdown(rows, results)
    print("\n" + table, flush=True)
    failed = [f"{s['mode']} {s['process']}" for s in summarize(rows) if not s["ok"]]
    print(f"\nTarget {'MISSED by ' + ', '.join(failed) if failed else 'met by every process'}.")
    if FLAGS.out:
        from scripts.report import write_table

        write_table(FLAGS.out, rows, table, FIELDS)
        plot(rows, FLAGS.out + ".png")


if __name__ == "__main__":
    app.run(main)
