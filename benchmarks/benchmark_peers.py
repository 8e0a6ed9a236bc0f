"""tfpipe against torch.distributed.pipelining: the same model, the same machine, one run, runs interleaved.

tfpipe's cells run on ``LocalCluster`` worker processes with one thread each; torch's stages
(benchmarks/peers_torch.py) on as many processes joined by gloo on loopback, one thread each. Both sides train the same
layers (the same shapes, FLOPs, loss and SGD step) and keep their models and processes alive for a configuration: a
"run" is ``--warmup`` untimed then ``--steps`` timed steps of the live model, and its figure is the median step.
Runs alternate, tfpipe first, ``--pairs`` pairs per configuration, after one warm-up per side (tfpipe: untimed steps
for ``--warmup_s``, at most 100, as benchmark_speed.py; torch: as many, at most 3). Each row gives each side's min /
median / max run, the median of the per-pair ratios tfpipe / torch, and each side's speed-up over its own K=1
reference (one worker or process, the whole model, M=1, no recomputation). With ``--limits`` (the default) each side
also runs K=1 at every M (its micro-batches one after the other), and each pipelined row without recomputation gives
the share of that side's own limit it reaches: what its schedule allows times its K=1 speed at that M over its
reference. Where tfpipe misses its limit, that says whether the peer on the same machine is bound too.

What a timed step holds. tfpipe: Keras' on_train_batch_begin to on_train_batch_end around one call of the train
function (the batch from the prefetched dataset, the pipelined forward and backward, the SGD update on every worker,
the loss back in the client; scripts/report.py ``timed_fit``). torch, on rank 0: ``schedule.step``,
``optimizer.step()``, ``zero_grad()`` and one ``all_reduce`` of a scalar over every stage (so every stage has
stepped); at K=1 forward, backward, step, zero_grad. Garbage (earlier rows' models) is collected before each row is
built, never inside a run.

    python benchmarks/benchmark_peers.py                          # every model, K=2, M in 1,4,8,16: ~30 min, 2 cores
    python benchmarks/benchmark_peers.py --models=floor,mlp512 --micro_batches=1,8 --pairs=3 --out=/tmp/peers
    python benchmarks/benchmark_peers.py --check --pairs=0         # only: both sides' losses from the same weights
Needs the ``peers`` extra (torch); tfpipe itself never imports torch, nor does this process.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import contextlib
import dataclasses
import gc
import importlib.util
import json
import socket
import subprocess
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from scripts.report import timed_fit, warm_up, write_table  # noqa: E402

FLAGS = flags.FLAGS
MODELS = ("floor", "mlp256", "mlp512", "mlp1024", "transformer")
BATCH = {"floor": 512, "mlp256": 512, "mlp512": 512, "mlp1024": 256, "transformer": 32}
SIDES = ("tfpipe", "torch")
PEER = {"gpipe": "gpipe", "1f1b": "1f1b", "zero_bubble": "zero_bubble", "gpipe_batched_w": "gpipe"}
# Several cells per device: torch's schedule of the same name (ScheduleInterleaved1F1B, ScheduleLoopedBFS,
# ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV), stages placed as tfpipe places its cells.
PEER.update({name: name for name in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")})
flags.DEFINE_list("models", list(MODELS), f"Models: {', '.join(MODELS)} (floor: the MLP at width 16).")
flags.DEFINE_integer("partitions", 2, "K: cells on tfpipe's side, stages (processes) on torch's.", lower_bound=2)
flags.DEFINE_list("micro_batches", ["1", "4", "8", "16"], "Values of M (every model; M=1 runs one schedule).")
flags.DEFINE_list(
    "batch_size",
    [],
    "Global batch per model as NAME=N, e.g. mlp1024=256,transformer=16 (defaults: " + str(BATCH) + ").",
)
flags.DEFINE_integer("layers", 20, "MLP: Dense(width) + tanh layers.", lower_bound=2)
flags.DEFINE_integer("blocks", 4, "Transformer: pre-norm blocks.", lower_bound=2)
flags.DEFINE_integer("dim", 256, "Transformer: model dimension (feed-forward 4 x dim, one head per 64).")
flags.DEFINE_integer("seq_len", 32, "Transformer: sequence length.", lower_bound=1)
flags.DEFINE_integer("pairs", 5, "Pairs of runs (tfpipe, torch) per configuration; 0: --check only.", lower_bound=0)
flags.DEFINE_integer("steps", 3, "Timed steps per run.", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Untimed steps at the start of every run.", lower_bound=1)
flags.DEFINE_float(
    "warmup_s",
    3.0,
    "tfpipe: untimed steps per configuration before its first run, for this many seconds after the first (at most "
    "100; TensorFlow's executor learns its kernels' costs over about 90 runs); torch: as many, at most 3.",
    lower_bound=0,
)
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "zero_bubble"], f"tfpipe schedules; torch's peer: {PEER}.")
flags.DEFINE_integer(
    "cells_per_device", 2, "v: cells (stages) per device of the schedules that share devices (zbv: 2).", lower_bound=1
)
flags.DEFINE_list("default_remat_at", ["8"], "Values of M with a row of tfpipe's default remat='except_last' (GPipe).")
flags.DEFINE_bool(
    "limits",
    True,
    "A K=1 row at each M > 1 (the M micro-batches one after the other on one worker / process), and beside each "
    "pipelined row without recomputation each side's limit: what its schedule allows times its own K=1 speed at that "
    "M over its K=1, M=1 (smaller matrices run slower per row), and the share of it reached.",
)
flags.DEFINE_float("lr", 1e-3, "SGD learning rate on both sides.")
flags.DEFINE_bool(
    "check",
    False,
    "First compare both sides' losses over two steps from the same weights (every model, the reference and each "
    "schedule at the largest M); stop if any differs by more than 1e-4 relative. --pairs=0: only that.",
)
flags.DEFINE_bool("jit_compile", False, "tfpipe: compile(jit_compile=True), each cell's tasks by XLA (K=1 too).")
flags.DEFINE_string("out", None, "Write the table to OUT.csv and OUT.md.")


@dataclasses.dataclass(frozen=True)
class Config:
    """One row: K devices, M micro-batches, tfpipe's schedule and remat, torch's schedule ('plain' at K=1), and v
    cells (stages) per device."""

    k: int
    m: int
    schedule: str
    remat: str
    peer: str
    v: int = 1

    @property
    def cells(self) -> int:
        """The cells on tfpipe's side and the stages on torch's: v per device."""
        return self.k * self.v

    def placement(self) -> list[int]:
        """Each cell's (stage's) device, as tfpipe's schedule places them."""
        from tfpipe import schedule

        return schedule.placement(self.schedule, self.cells, self.k)


REFERENCE = Config(1, 1, "gpipe", "never", "plain")  # one worker / process, the whole model, M=1, no recomputation


def model_spec(name: str) -> dict[str, Any]:
    """What both sides build for model ``name`` (the torch side reads the same dict)."""
    sizes = dict(BATCH, **{k: int(v) for k, v in (item.split("=", 1) for item in FLAGS.batch_size)})
    if name == "transformer":
        dim = FLAGS.dim
        return {"kind": "transformer", "width": dim, "hidden": 4 * dim, "heads": max(1, dim // 64),
                "seq_len": FLAGS.seq_len, "layers": FLAGS.blocks, "batch": sizes[name]}  # fmt: skip
    width = 16 if name == "floor" else int(name[3:])
    return {"kind": "mlp", "width": width, "layers": FLAGS.layers, "batch": sizes[name]}


def describe(name: str, spec: dict[str, Any]) -> str:
    """One line: the model, its batch and the step."""
    what = f"{spec['layers']} x Dense({spec['width']}) + tanh, batch {spec['batch']}"
    if spec["kind"] == "transformer":
        what = (
            f"{spec['layers']} pre-norm Transformer blocks (dim {spec['width']}, feed-forward {spec['hidden']}, "
            f"{spec['heads']} heads, causal), batch {spec['batch']} x {spec['seq_len']} tokens"
        )
    return f"{name}: {what}; MSE loss, SGD {FLAGS.lr:g}"


def data(spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """One global batch (x, y) of ``spec``'s shapes, the same on both sides."""
    rng = np.random.default_rng(0)
    shape = (spec["batch"], spec["width"]) if spec["kind"] == "mlp" else (spec["batch"], spec["seq_len"], spec["width"])
    return rng.normal(size=shape).astype(np.float32), rng.uniform(-1, 1, size=shape).astype(np.float32)


def configs(spec: dict[str, Any], k: int) -> list[Config]:
    """The reference (K=1, M=1) and every pipelined row of ``spec``, M dividing its batch."""
    rows = [REFERENCE]
    for m in (int(m) for m in FLAGS.micro_batches):
        if spec["batch"] % m:
            continue
        if FLAGS.limits and m > 1:  # each side's kernels at this M, the limit's second factor
            rows.append(Config(1, m, "gpipe", "never", "plain"))
        for schedule in FLAGS.schedules if m > 1 else FLAGS.schedules[:1]:  # at M=1 all run F then B
            rows.append(Config(k, m, schedule, "never", PEER[schedule], _v(schedule)))
        if m > 1 and m in {int(v) for v in FLAGS.default_remat_at}:  # at M=1 except_last recomputes nothing
            rows.append(Config(k, m, "gpipe", "except_last", "gpipe"))
    return rows


def _v(schedule_name: str) -> int:
    """The cells per device of ``schedule_name``: ``--cells_per_device`` where it shares devices, else 1."""
    from tfpipe import schedule

    return FLAGS.cells_per_device if schedule.shares_devices(schedule_name) else 1


def balance(n: int, k: int) -> list[int]:
    """``n`` layers over ``k`` cells as evenly as possible, the larger cells first."""
    return [n // k + (i < n % k) for i in range(k)]


def keras_model(spec: dict[str, Any], config: Config, devices: list[str], lr: float) -> tuple[Any, list[Any]]:
    """A compiled ``PipelineModel`` of ``spec`` for ``config`` on ``devices`` (seed 0), and its layers."""
    import keras

    import tfpipe
    from tfpipe.models.transformer import TransformerBlock

    keras.utils.set_random_seed(0)
    if spec["kind"] == "mlp":
        layers = [keras.layers.Dense(spec["width"], activation="tanh") for _ in range(spec["layers"])]
    else:
        layers = [TransformerBlock(spec["width"], spec["hidden"], spec["heads"]) for _ in range(spec["layers"])]
    model = tfpipe.PipelineModel(
        layers,
        balance=balance(spec["layers"], config.cells),
        devices=devices[: config.k],
        num_micro_batches=config.m,
        remat=config.remat,
        schedule=config.schedule,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr), loss=keras.losses.MeanSquaredError(), jit_compile=FLAGS.jit_compile
    )
    return model, layers


def keras_weights(layers: list[Any]) -> dict[str, np.ndarray]:
    """Each layer's weights by 'index/name' (peers_torch.load_keras_weights reads them)."""
    arrays = {}
    for i, layer in enumerate(layers):
        owners = {"": layer}  # a Dense layer; a TransformerBlock's are its parts
        if not hasattr(layer, "kernel"):
            owners = {f"{p}/": getattr(layer, p) for p in ("norm1", "norm2", "up", "down")}
            attention = layer.attention
            owners.update(
                {f"attention/{p}/": getattr(attention, f"{p}_dense") for p in ("query", "key", "value", "output")}
            )
        for prefix, owner in owners.items():
            for weight in ("gamma", "beta") if prefix.startswith("norm") else ("kernel", "bias"):
                arrays[f"{i}/{prefix}{weight}"] = getattr(owner, weight).numpy()
    return arrays


class TorchPeers:
    """K torch processes (benchmarks/peers_torch.py), one stage each, alive for the whole benchmark."""

    def __init__(self, k: int):
        """Start the K processes on a free loopback port (each answers once when it has joined the group)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers_torch.py")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
        self.procs = [
            subprocess.Popen([sys.executable, script, str(rank), str(k), str(port)], **pipes) for rank in range(k)
        ]
        self.pids = [p.pid for p in self.procs]

    def replies(self) -> list[dict[str, Any]]:
        """One protocol line from each process; a process that fails or dies raises, naming its rank."""
        got = []
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = next((line for line in proc.stdout if line.startswith("@@")), None)
            if line is None:
                raise RuntimeError(f"torch rank {rank} exited (code {proc.wait()}); its stderr is above")
            reply = json.loads(line[2:])
            if "error" in reply:
                raise RuntimeError(f"torch rank {rank}: {reply['error']}")
            got.append(reply)
        return got

    def command(self, **command: Any) -> list[dict[str, Any]]:
        """Send ``command`` to every process and return their replies, rank by rank."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        return self.replies()

    def setup(self, spec: dict[str, Any], config: Config, data: str, lr: float, weights: str | None = None) -> None:
        """Build ``config`` of ``spec`` on every rank: the batch from the .npz ``data``, weights from ``weights``."""
        balanced = balance(spec["layers"], config.cells)
        torch_spec = dict(spec, k=config.k, m=config.m, schedule=config.peer, balance=balanced, data=data, lr=lr)
        torch_spec["placement"] = config.placement() if config.k > 1 else [0]
        self.command(cmd="setup", spec=dict(torch_spec, weights=weights))

    def run(self, steps: int, warmup: int, losses: bool = False) -> tuple[list[float], list[float]]:
        """Rank 0's step seconds of ``steps`` timed steps after ``warmup``, and the last stage's losses."""
        replies = self.command(cmd="run", steps=steps, warmup=warmup, losses=losses)
        return replies[0]["times"], next((r["losses"] for r in reversed(replies) if r.get("losses")), [])

    def close(self) -> None:
        """Ask every process to exit; kill any that does not within 30 s."""
        for proc in self.procs:
            with contextlib.suppress(OSError):  # a process that died has closed its end
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure(
    spec: dict[str, Any], config: Config, cluster: Any, peers: TorchPeers, x: np.ndarray, y: np.ndarray, path: str
) -> tuple[list[float], list[float], dict[str, float]]:
    """``--pairs`` interleaved runs of ``config`` on both sides: each run's median step, seconds (tfpipe, torch),
    and the seconds to collect garbage and for each side to build and warm up (tfpipe's first step traces)."""
    began = time.perf_counter()
    gc.collect()  # the models of earlier rows go now, while their workers run, not in a timed step or at exit
    collected = time.perf_counter()
    model = keras_model(spec, config, cluster.devices, FLAGS.lr)[0]
    n = spec["batch"]
    warmed = warm_up(model, x, y, n, FLAGS.warmup_s) if FLAGS.warmup_s > 0 else 1
    built = time.perf_counter()
    setup = {"gc_s": collected - began, "tfpipe_setup_s": built - collected}
    peers.setup(spec, config, path, FLAGS.lr)
    peers.run(min(warmed, 3), 0)
    setup["torch_setup_s"] = time.perf_counter() - built
    xs, ys = (np.repeat(a, FLAGS.warmup + FLAGS.steps, axis=0) for a in (x, y))
    ours, theirs = [], []
    for _ in range(FLAGS.pairs):
        ours.append(timed_fit(model, xs, ys, n, FLAGS.warmup, cluster.pids).median_s)
        theirs.append(float(np.median(peers.run(FLAGS.steps, FLAGS.warmup)[0])))
    return ours, theirs, setup


def row(name: str, config: Config, measured: tuple[list[float], list[float], dict], earlier: list[dict]) -> dict:
    """The CSV row of one configuration (``measure``'s result): ms per step on each side, the median ratio, each
    side's speed-up over the reference (``earlier[0]``; none: this is it) and, with a K=1 row at this M in
    ``earlier``, each side's limit and the share of it reached."""
    ours, theirs, setup = measured
    ratios = [a / b for a, b in zip(ours, theirs)]
    out = {"model": name, **dataclasses.asdict(config), "pairs": len(ours), **setup}
    for side, runs in zip(SIDES, (ours, theirs)):
        out.update({f"{side}_{s}_ms": 1e3 * f(runs) for s, f in (("min", min), ("median", np.median), ("max", max))})
        out[f"{side}_runs_ms"] = " ".join(f"{1e3 * t:.2f}" for t in runs)
    out["ratio_median"] = float(np.median(ratios))
    out["ratio_min"], out["ratio_max"] = min(ratios), max(ratios)
    base = earlier[0] if earlier else out
    out["tfpipe_speedup"] = base["tfpipe_median_ms"] / out["tfpipe_median_ms"]
    out["torch_speedup"] = base["torch_median_ms"] / out["torch_median_ms"]
    same_m = next((r for r in earlier if r["k"] == 1 and r["m"] == config.m), None)
    if config.k > 1 and config.remat == "never" and same_m is not None:
        out.update(limits(config, out, same_m))
    return out


def limits(config: Config, out: dict, same_m: dict) -> dict[str, float]:
    """Each side's limit for pipelined ``config`` (row ``out``): what its schedule allows with equal cells and free
    transfers (``schedule.allowed_speedup``) times its K=1 speed-up at this M (row ``same_m``), and the share of it
    that ``out``'s speed-up reaches."""
    from tfpipe import schedule

    got = {}
    for side, name in zip(SIDES, (config.schedule, config.peer)):
        allowed = schedule.allowed_speedup(name, config.cells, config.m, num_devices=config.k)
        got[f"{side}_limit"] = allowed * same_m[f"{side}_speedup"]
        got[f"{side}_of_limit"] = out[f"{side}_speedup"] / got[f"{side}_limit"]
    return got


def markdown(rows: list[dict]) -> str:
    """One table: a row per configuration, each side as min / median / max ms per step, its speed-up over its own
    K=1 and, where measured, the share of its limit reached."""
    lines = [
        "| K | M | tfpipe schedule | remat | torch schedule | tfpipe ms/step min / median / max "
        "| torch ms/step min / median / max | tfpipe / torch (median of pairs) "
        "| tfpipe speed-up over its K=1 (of its limit) | torch speed-up over its K=1 (of its limit) |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        ms = [" / ".join(f"{r[f'{side}_{s}_ms']:.2f}" for s in ("min", "median", "max")) for side in SIDES]
        schedule = "-" if r["k"] == 1 else r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else "")
        ups = [
            f"{r[f'{side}_speedup']:.2f}x" + (f" ({_of_limit(r, side)})" if f"{side}_limit" in r else "")
            for side in SIDES
        ]
        lines.append(
            f"| {r['k']} | {r['m']} | {schedule} | {r['remat']} | {r['peer']} | {ms[0]} | {ms[1]} "
            f"| {r['ratio_median']:.2f} | {ups[0]} | {ups[1]} |"
        )
    return "\n".join(lines)


def limits_markdown(rows: list[dict]) -> str:
    """One table over every model: at each pipelined M, each side's fastest schedule without recomputation, its
    speed-up over its own K=1 and the share of its own limit reached ('' where no row has a limit)."""
    lines = []
    for model, m in dict.fromkeys((r["model"], r["m"]) for r in rows if r["k"] > 1 and r["m"] > 1):
        timed = [r for r in rows if (r["model"], r["m"]) == (model, m) and "tfpipe_limit" in r]
        if not timed:
            continue
        cells = []
        for side in SIDES:
            best = max(timed, key=lambda r: r[f"{side}_speedup"])
            name = best["schedule"] if side == "tfpipe" else best["peer"]
            share = max(r[f"{side}_of_limit"] for r in timed)
            cells.append(f"{name} {best[f'{side}_speedup']:.2f}x ({_of_limit(best, side)}) | {100 * share:.0f}%")
        lines.append(f"| {model} | {m} | {cells[0]} | {cells[1]} |")
    if not lines:
        return ""
    head = (
        "| model | M | tfpipe's fastest: speed-up over its K=1 (of its limit) | tfpipe's highest share "
        "| torch's fastest: speed-up over its K=1 (of its limit) | torch's highest share |\n" + "|---" * 6 + "|\n"
    )
    return head + "\n".join(lines)


def check(name: str, spec: dict[str, Any], cluster: Any, peers: TorchPeers, tmp: str) -> bool:
    """Two steps of the reference and of every --schedules at K and the largest M, from the same weights, on both
    sides: print the losses (before and after an SGD step); True if they agree within 1e-4 relative."""
    x, y = data(spec)
    m = max(int(m) for m in FLAGS.micro_batches if spec["batch"] % int(m) == 0)
    good = True
    for config in [REFERENCE] + [Config(FLAGS.partitions, m, s, "never", PEER[s], _v(s)) for s in FLAGS.schedules]:
        model, layers = keras_model(spec, config, cluster.devices, 0.1)
        model.build((None, *x.shape[1:]))
        path = os.path.join(tmp, f"{name}-check.npz")
        np.savez(path, x=x, y=y, **keras_weights(layers))  # the initial weights
        ours = [float(model.train_on_batch(x, y)) for _ in range(2)]  # each the loss before its update
        peers.setup(spec, config, path, 0.1, weights=path)
        theirs = peers.run(2, 0, losses=True)[1]
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        good &= worst <= 1e-4
        print(
            f"check {name} K={config.k} M={config.m} tfpipe {config.schedule} / torch {config.peer}: losses before "
            f"and after one SGD(0.1) step tfpipe {ours[0]:.6f} {ours[1]:.6f}, torch {theirs[0]:.6f} {theirs[1]:.6f}; "
            f"largest relative difference {worst:.1e} ({'ok' if worst <= 1e-4 else 'ABOVE 1e-4'})",
            flush=True,
        )
    return good


def main(argv: list[str]) -> None:
    """--check, then every model and configuration, both sides interleaved; print the tables, write --out."""
    del argv
    bad = [f"--models: unknown {n!r}" for n in FLAGS.models if n not in MODELS]
    bad += [f"--schedules: unknown {s!r}" for s in FLAGS.schedules if s not in PEER]
    bad += [f"--batch_size: {b!r} is not NAME=N" for b in FLAGS.batch_size if not _is_size(b)]
    ms = [*FLAGS.micro_batches, *FLAGS.default_remat_at]
    bad += [f"--micro_batches/--default_remat_at: {m!r} is not M >= 1" for m in ms if not (m.isdigit() and int(m))]
    if bad or not (FLAGS.pairs or FLAGS.check):
        known = f"models {', '.join(MODELS)}; schedules {', '.join(PEER)}"
        raise app.UsageError("; ".join(bad or ["--pairs=0 times nothing: add --check"]) + f" ({known})")
    if importlib.util.find_spec("torch") is None:
        sys.exit('benchmark_peers.py needs torch: pip install -e ".[peers]"')
    from tfpipe.cluster import LocalCluster

    k, rows, tables, began = FLAGS.partitions, [], [], time.perf_counter()
    peers = TorchPeers(k)  # its processes start while TensorFlow's workers do
    try:
        with LocalCluster(k, threads_per_worker=1) as cluster, tempfile.TemporaryDirectory() as tmp:
            peers.replies()  # every torch process has joined its group
            if FLAGS.check and not all([check(name, model_spec(name), cluster, peers, tmp) for name in FLAGS.models]):
                raise SystemExit("--check: the two sides' losses differ by more than 1e-4 (above)")
            for name in FLAGS.models if FLAGS.pairs else ():
                spec = model_spec(name)
                x, y = data(spec)
                path = os.path.join(tmp, f"{name}.npz")
                np.savez(path, x=x, y=y)
                mine: list[dict] = []
                for config in configs(spec, k):
                    mine.append(row(name, config, measure(spec, config, cluster, peers, x, y, path), mine))
                    r = mine[-1]
                    print(
                        f"{name} K={config.k} M={config.m} {config.schedule}/{config.remat} vs torch {config.peer}: "
                        f"tfpipe {r['tfpipe_median_ms']:.2f} ms ({r['tfpipe_runs_ms']}), torch "
                        f"{r['torch_median_ms']:.2f} ms ({r['torch_runs_ms']}), ratio {r['ratio_median']:.2f}; "
                        f"speed-up tfpipe {r['tfpipe_speedup']:.2f}x torch {r['torch_speedup']:.2f}x{_of_limits(r)}; "
                        "built and "
                        f"warmed up in {r['tfpipe_setup_s']:.1f} s / {r['torch_setup_s']:.1f} s (gc {r['gc_s']:.1f} s) "
                        f"[{time.perf_counter() - began:.0f} s]",
                        flush=True,
                    )
                rows += mine
                tables.append(f"### {describe(name, spec)}\n\n{markdown(mine)}")
    finally:
        peers.close()
    if rows:
        table = report(k, rows, tables)
        print("\n" + table)
        if FLAGS.out:
            write_table(FLAGS.out, rows, table, fields=list(dict.fromkeys(c for r in rows for c in r)))
    print(f"\ntook {time.perf_counter() - began:.0f} s")


def report(k: int, rows: list[dict], tables: list[str]) -> str:
    """The whole markdown report: a heading line, each model's table, then each side against its own limit."""
    text = (
        f"K={k}: one-thread LocalCluster workers / one-thread gloo processes; {FLAGS.pairs} pairs of runs, each "
        f"{FLAGS.steps} timed steps after {FLAGS.warmup} untimed; ms per step: each run's median step.\n\n"
    ) + "\n\n".join(tables)
    shares = limits_markdown(rows)
    if shares:
        text += (
            "\n\n### Each side against its own limit\n\nThe limit: what the schedule allows with equal cells "
            "and free transfers (`tfpipe.schedule.allowed_speedup`) times the side's own K=1 speed at M "
            "micro-batches over its K=1, M=1.\n\n" + shares
        )
    return text


def _of_limits(r: dict) -> str:
    """'; of the limit tfpipe 87% of 1.62x, torch ...' where row ``r`` has limits, else ''."""
    if "tfpipe_limit" not in r:
        return ""
    return "; of the limit " + ", ".join(f"{side} {_of_limit(r, side)}" for side in SIDES)


def _of_limit(r: dict, side: str) -> str:
    """'87% of 1.62x': the share of ``side``'s limit that row ``r`` reached, and the limit."""
    return f"{100 * r[f'{side}_of_limit']:.0f}% of {r[f'{side}_limit']:.2f}x"


def _is_size(item: str) -> bool:
    """Whether ``item`` is NAME=N, NAME a model and N a positive integer."""
    name, _, n = item.partition("=")
    return name in MODELS and n.isdigit() and int(n) > 0


if __name__ == "__main__":
    app.run(main)
