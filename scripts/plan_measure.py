"""scripts/plan.py's work: the models, the plan, one configuration measured in a child, predicted against measured."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from scripts import plan_devices

# The grid of configurations --grid measures: (K, R, M, remat, schedule); those needing more devices are skipped (the
# plan did not try them); K=4 under a schedule that shares devices: two cells on each of two devices
GRID = [
    (1, 1, 1, "never", "gpipe"),
    (1, 1, 4, "always", "gpipe"),
    (1, 2, 2, "never", "gpipe"),
    (2, 1, 1, "never", "gpipe"),
    (2, 1, 4, "never", "gpipe"),
    (2, 1, 8, "never", "gpipe"),
    (2, 1, 4, "except_last", "gpipe"),
    (2, 1, 8, "always", "gpipe"),
    (2, 1, 8, "never", "1f1b"),
    (2, 1, 8, "never", "zero_bubble"),
    (2, 1, 4, "never", "gpipe_batched_w"),
    (2, 1, 16, "except_last", "1f1b"),
    (2, 1, 16, "never", "gpipe"),
    (4, 1, 4, "never", "gpipe"),
    (4, 1, 8, "except_last", "1f1b"),
    (2, 2, 4, "never", "gpipe"),
    (4, 1, 4, "never", "interleaved_1f1b"),
    (4, 1, 8, "never", "interleaved_1f1b"),
    (4, 1, 8, "never", "zbv"),
    (4, 1, 8, "never", "looped_bfs"),
    (4, 1, 8, "never", "interleaved_zero_bubble"),
    (4, 1, 8, "never", "dualpipev"),
]
MIB = 2**20


def model_and_data(spec: dict[str, Any], steps: int = 1) -> tuple[Any, Any, Any, Any]:
    """The layers (or a keras_hub task), ``steps`` batches of (x, y), and the loss, from the model flags in ``spec``
    (seeded)."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    n = spec["batch_size"] * steps
    if spec["model"] == "mlp":
        layers = [keras.layers.Dense(spec["width"], activation="tanh") for _ in range(spec["depth"])]
        x = rng.standard_normal((n, spec["width"])).astype("float32")
        return layers, x, np.tanh(x[:, ::-1]), "mse"
    if spec["model"] == "amoebanet":  # AmoebaNet-D: 3 x --blocks normal cells of --dim filters, 10 classes
        from tfpipe.models import amoebanet

        side = spec.get("image_size", 64)
        x = rng.random((n, side, side, 3), dtype="float32")
        return (
            amoebanet.amoebanet_d(10, 3 * spec["blocks"], spec["dim"]),
            x,
            rng.integers(0, 10, n),
            amoebanet.amoebanet_loss(),
        )
    lm_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if spec["model"] == "hub":  # a keras_hub task (the hub extra), planned as a Functional model by its nodes
        from tfpipe.models import hub

        task = hub.task(
            spec["arch"],
            vocabulary_size=spec["vocab"],
            num_layers=spec["blocks"],
            hidden_dim=spec["dim"],
            sequence_length=spec["seq_len"],
        )
        batch = hub.inputs(task, n, spec["seq_len"], spec["vocab"])
        return task, batch, np.roll(batch["token_ids"], -1, axis=1), lm_loss
    from tfpipe.models.transformer import transformer_lm

    dim = spec["dim"]
    layers = transformer_lm(spec["vocab"], spec["seq_len"], spec["blocks"], dim, 4 * dim, 4)
    x = rng.integers(0, spec["vocab"], size=(n, spec["seq_len"])).astype("int32")
    return layers, x, np.roll(x, -1, axis=1), lm_loss


def make_plan(spec: dict[str, Any], budget: str | None) -> Any:
    """The plan for the model of ``spec`` on its devices: logical ones, or the workers of a LocalCluster."""
    import tfpipe

    # the devices first: TensorFlow splits a device only before it starts, which building a keras_hub task does
    devices = (
        None if spec.get("cluster") else plan_devices.logical_devices(spec["devices"], spec.get("device_type", "CPU"))
    )
    layers, x, _, _ = model_and_data(spec)
    kwargs = dict(
        sample=x, optimizer=spec["optimizer"], num_micro_batches=spec.get("micro_batches"), max_seconds=bound(spec)
    )
    if devices is not None:
        return tfpipe.plan(layers, spec["batch_size"], devices, budget, **kwargs)
    with tfpipe.cluster.LocalCluster(spec["devices"]) as cluster:
        return tfpipe.plan(layers, spec["batch_size"], cluster.devices, budget, **kwargs)


def measure(config: dict[str, Any]) -> dict[str, float]:
    """In a child: one configuration's median step seconds and its peak bytes (all its devices together)."""
    import tensorflow as tf

    import tfpipe
    from tfpipe.planner.calibration import step_times, warm_up

    peak = plan_devices.peak_reader(config)
    devices = peak.devices
    steps, batch = 20, config["batch_size"]
    layers, x, y, loss = model_and_data(config, steps=steps)
    # the data lives in the allocator before the model does: the peak counted is the model's own
    x = tf.nest.map_structure(tf.constant, x)
    data = tf.data.Dataset.from_tensor_slices((x, tf.constant(y))).batch(batch).repeat()
    peak.begin()
    k, r = config.get("partitions") or len(config["balance"]), config["replicas"]
    rows = [devices[i * k : (i + 1) * k] for i in range(r)]
    model = tfpipe.PipelineModel(
        layers,
        balance=config.get("balance"),
        num_partitions=None if config.get("balance") else k,  # cut by tfpipe's own balance where none is given
        devices=rows if r > 1 else rows[0],
        num_micro_batches=config["m"],
        remat=config["remat"],
        schedule=config["schedule"],
    )
    model.compile(optimizer=config["optimizer"], loss=loss)
    warm_up(model, data, seconds=4.0)
    peak.reset()
    times = step_times(model, data, steps)
    peak_bytes, process_bytes = peak.read()
    return {"step_s": statistics.median(times[2:]), "peak_bytes": peak_bytes, "process_bytes": process_bytes}


def _candidate(plan: Any, shape: Sequence[Any]) -> Any:
    """The plan's candidate of shape (K, R, M, remat, schedule), or None if the plan did not try it."""
    for c in plan.candidates:
        cfg = c.config
        if (cfg.num_partitions, cfg.num_replicas, cfg.num_micro_batches, cfg.remat, cfg.schedule) == tuple(shape):
            return c
    return None


def compare(
    plan: Any,
    configs: Sequence[Any],
    run: Callable[[dict[str, Any]], dict[str, float]],
    repeats: int,
    shared: bool = False,
) -> list[dict[str, Any]]:
    """Measure each configuration ``repeats`` times (interleaved) and pair the medians with the plan's predictions.

    ``shared``: the devices share one allocator (logical CPUs), whose peak is their bytes' sum at one moment: it is
    compared with that, predicted (``shared_peak_bytes``); else the devices' peaks add up.
    """
    chosen = []
    for config in configs:
        shape = config if isinstance(config, tuple) else _shape(config)
        candidate = _candidate(plan, shape)
        if candidate is not None:
            chosen.append(candidate)
    measured: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(chosen))}
    for _ in range(repeats):
        for i, candidate in enumerate(chosen):
            cfg = candidate.config
            measured[i].append(run(_config_of(cfg)))
            print(f"  measured {cfg.describe()}: {measured[i][-1]['step_s'] * 1e3:.1f} ms", flush=True)
    return [_compared_row(plan, candidate, measured[i], shared) for i, candidate in enumerate(chosen)]


def _compared_row(plan: Any, candidate: Any, measured: Sequence[dict[str, float]], shared: bool) -> dict[str, Any]:
    """One configuration's row: the medians of its ``measured`` runs beside the plan's predictions, and the errors."""
    from tfpipe.planning.predict import shared_peak_bytes

    cfg, pred = candidate.config, candidate.prediction
    step = statistics.median(m["step_s"] for m in measured)
    peak = statistics.median(m["peak_bytes"] for m in measured)
    process = [m["process_bytes"] for m in measured if m.get("process_bytes") is not None]
    predicted = sum(pred.peak_bytes)
    if shared:
        predicted = shared_peak_bytes(plan.profile, plan.calibration, plan.batch_size, cfg, plan.optimizer_slots)
    return {
        "K": cfg.num_partitions,
        "devices": cfg.num_devices,
        "R": cfg.num_replicas,
        "M": cfg.num_micro_batches,
        "remat": cfg.remat,
        "schedule": cfg.schedule,
        "balance": "-".join(map(str, cfg.balance)),
        "predicted_ms": round(pred.step_s * 1e3, 2),
        "measured_ms": round(step * 1e3, 2),
        "time_error": round(pred.step_s / step - 1, 3),
        "predicted_mib": round(predicted / MIB, 2),
        "measured_mib": round(peak / MIB, 2),
        "memory_error": round(predicted / peak - 1, 3),
        "fits": candidate.fits,
        # workers: their processes' resident peak, beside their allocators' (measured_mib)
        "process_mib": round(statistics.median(process) / MIB, 2) if process else None,
    }


BUDGET_FIELDS = [
    "fraction",
    "budget_mib",
    "chosen",
    "measured_ms",
    "measured_mib",
    "fits",
    "fastest_fitting_ms",
    "against_fastest",
]
REFERENCE = (2, 1, 8, "never", "gpipe")  # GPipe without recomputation, whose measured peak the budgets scale


def budgets(
    plan: Any,
    rows: Sequence[dict[str, Any]],
    fractions: Sequence[float],
    run: Callable[[dict[str, Any]], dict[str, float]],
    repeats: int,
    verify: Callable[[list[Any], float], list[Any]] | None = None,
) -> list[dict[str, Any]]:
    """For each fraction of the reference's measured peak: the plan's choice under that budget, run and compared.

    The choice is re-searched on the plan's measurements under the budget, and ordered by ``verify`` (the shortlist
    timed on the devices, as ``tfpipe.plan`` does) where given. Where it is not the grid's fastest configuration that
    fits, the two are run in turn ``repeats`` times and compared within pairs: the grid ran minutes earlier, and
    this machine's speed drifts by more than the 10% the comparison asks about.

    Logical CPU devices share one allocator, so a budget per device is checked against the measured total over
    the devices the choice uses: total <= budget x devices used.
    """
    from tfpipe.planning import search

    found = [r for r in rows if (r["K"], r["R"], r["M"], r["remat"], r["schedule"]) == REFERENCE]
    if not found:
        raise ValueError(f"--budgets scales the measured peak of {REFERENCE}: it must be in the grid.")
    reference = found[0]
    out = []
    for fraction in fractions:
        per_device = fraction * reference["measured_mib"] * MIB / REFERENCE[0]
        space = search.Space(num_devices=max(c.config.num_devices * c.config.num_replicas for c in plan.candidates))
        found = search.run(plan.profile, plan.calibration, plan.batch_size, space, per_device, plan.optimizer_slots)
        if not found or not found[0].fits:
            out.append({"fraction": fraction, "budget_mib": round(per_device / MIB, 2), "chosen": "none fits"})
            continue
        if verify is not None:
            found = verify(found, per_device)
        chosen = found[0].config
        used = chosen.num_devices * chosen.num_replicas
        fitting = [r for r in rows if r["measured_mib"] <= per_device / MIB * r.get("devices", r["K"]) * r["R"]]
        best = min(fitting, key=lambda r: r["measured_ms"]) if fitting else None
        if best is not None and _shape(chosen) != _row_shape(best):
            # measured minutes apart, two configurations differ by the machine's drift: time them in pairs
            row, best, against = _paired(_config_of(chosen), _row_config(best), run, repeats)
        else:
            row = next((r for r in rows if _row_shape(r) == _shape(chosen)), None) or _measure(
                _config_of(chosen), run, repeats
            )
            against = row["measured_ms"] / best["measured_ms"] - 1 if best else None
        out.append(
            {
                "fraction": fraction,
                "budget_mib": round(per_device / MIB, 2),
                "chosen": chosen.describe(),
                "measured_ms": row["measured_ms"],
                "measured_mib": row["measured_mib"],
                "fits": row["measured_mib"] <= per_device / MIB * used,
                "fastest_fitting_ms": best["measured_ms"] if best else None,
                "against_fastest": round(against, 3) if against is not None else None,
            }
        )
    return out


def _paired(
    chosen: dict[str, Any], other: dict[str, Any], run: Callable[[dict[str, Any]], dict[str, float]], repeats: int
) -> tuple[dict[str, float], dict[str, float], float]:
    """Two configurations run in turn ``repeats`` times: each one's medians, and the median ratio within pairs - 1."""
    pairs = [(run(chosen), run(other)) for _ in range(repeats)]
    ratio = statistics.median(a["step_s"] / b["step_s"] for a, b in pairs)
    return _medians([a for a, _ in pairs]), _medians([b for _, b in pairs]), ratio - 1


def verify_choice(spec: dict[str, Any], found: list[Any], budget: float | None = None, count: int = 3) -> list[Any]:
    """``found`` ordered as ``tfpipe.plan`` orders it: its shortlist timed on the spec's devices (this process's
    logical devices, or a fresh LocalCluster's workers)."""
    import tfpipe
    from tfpipe import planner

    layers, x, _, _ = model_and_data(spec)
    args = (layers, x, spec["batch_size"])
    if not spec.get("cluster"):
        devices = plan_devices.names(spec["devices"], spec.get("device_type", "CPU"))
        return planner.verified(found, *args, devices, spec["optimizer"], count, budget)
    with tfpipe.cluster.LocalCluster(spec["devices"]) as cluster:
        return planner.verified(found, *args, cluster.devices, spec["optimizer"], count, budget)


def _config_of(config: Any) -> dict[str, Any]:
    """A planner Config as ``run`` takes it."""
    return {
        "balance": list(config.balance),
        "replicas": config.num_replicas,
        "m": config.num_micro_batches,
        "remat": config.remat,
        "schedule": config.schedule,
    }


def _row_config(row: dict[str, Any]) -> dict[str, Any]:
    """A grid row's configuration as ``run`` takes it."""
    balance = [int(n) for n in str(row["balance"]).split("-")]
    return {"balance": balance, "replicas": row["R"], "m": row["M"], "remat": row["remat"], "schedule": row["schedule"]}


def _row_shape(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["K"], row["R"], row["M"], row["remat"], row["schedule"])


def _measure(config: dict[str, Any], run: Callable[[dict[str, Any]], dict[str, float]], repeats: int) -> dict:
    """The median measured step (ms) and peak (MiB) of one configuration over ``repeats`` runs."""
    return _medians([run(config) for _ in range(repeats)])


def _medians(results: Sequence[dict[str, float]]) -> dict[str, float]:
    return {
        "measured_ms": round(statistics.median(r["step_s"] for r in results) * 1e3, 2),
        "measured_mib": round(statistics.median(r["peak_bytes"] for r in results) / MIB, 2),
    }


def budget_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The budget runs as a markdown table."""
    lines = [
        "| budget (x GPipe's peak) | per device MiB | chosen | measured ms | measured MiB | fits "
        "| fastest fitting ms | against it |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        against = f"{r['against_fastest']:+.0%}" if r.get("against_fastest") is not None else "-"
        lines.append(
            f"| {r['fraction']} | {r['budget_mib']} | {r['chosen']} | {r.get('measured_ms', '-')} | "
            f"{r.get('measured_mib', '-')} | {r.get('fits', '-')} | {r.get('fastest_fitting_ms', '-')} | {against} |"
        )
    return "\n".join(lines)


def _shape(config: Any) -> tuple[Any, ...]:
    return (config.num_partitions, config.num_replicas, config.num_micro_batches, config.remat, config.schedule)


def markdown(rows: Sequence[dict[str, Any]], spec: dict[str, Any]) -> str:
    """The comparison as a markdown table, with the share of rows within 20% (time) and 15% (memory)."""
    processes = any(r.get("process_mib") is not None for r in rows)  # workers: their resident peak too
    head = "| K | R | M | remat | schedule | balance | predicted ms | measured ms | error "
    head += "| predicted MiB | measured MiB | error |" + (" process MiB |" if processes else "")
    lines = [head, "|" + "---|" * (13 if processes else 12)]
    for r in rows:
        shared = f" on {r['devices']}" if r.get("devices", r["K"]) != r["K"] else ""  # several cells a device
        lines.append(
            f"| {r['K']}{shared} | {r['R']} | {r['M']} | {r['remat']} | {r['schedule']} | {r['balance']} "
            f"| {r['predicted_ms']} | {r['measured_ms']} | {r['time_error']:+.0%} | {r['predicted_mib']} "
            f"| {r['measured_mib']} | {r['memory_error']:+.0%} |" + (f" {r['process_mib']} |" if processes else "")
        )
    time_ok = sum(abs(r["time_error"]) <= 0.2 for r in rows)
    memory_ok = sum(abs(r["memory_error"]) <= 0.15 for r in rows)
    model = ", ".join(f"{k}={v}" for k, v in spec.items() if v is not None)  # None: a default
    lines.append(
        f"\n{model}: time within 20% in {time_ok} of {len(rows)}; memory within 15% in {memory_ok} of {len(rows)}."
    )
    return "\n".join(lines)


def draw(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Predicted against measured step time and peak memory, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, (pred, meas, unit) in zip(
        axes, [("predicted_ms", "measured_ms", "step, ms"), ("predicted_mib", "measured_mib", "peak, MiB")]
    ):
        xs, ys = [r[meas] for r in rows], [r[pred] for r in rows]
        ax.scatter(xs, ys)
        top = max(xs + ys) * 1.1
        ax.plot([0, top], [0, top], "k--", linewidth=0.8)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
    fig.tight_layout()
    fig.savefig(path)


PLANNING_FIELDS = [
    "fraction",
    "budget_mib",
    "planning_s",
    "planning_steps",
    "probe_mib",
    "probe_process_mib",
    "not_run",
    "chosen",
    "measured_ms",
    "measured_mib",
    "measured_process_mib",
    "fits",
]


def bound(spec: dict[str, Any]) -> float | str | None:
    """``tfpipe.plan``'s max_seconds from the spec's --max_seconds: unset "auto", 0 None (no bound)."""
    given = spec.get("max_seconds")
    return "auto" if given is None else (float(given) or None)


def planning(spec: dict[str, Any], budget: float) -> dict[str, Any]:
    """In a child: ``tfpipe.plan`` on a fresh LocalCluster under ``budget`` bytes per worker, and what planning held on
    each worker beyond what it held idle: its allocator's peak (``Plan.planning_peaks``) and its process's resident
    high-water mark (VmHWM, started again before planning)."""
    import tensorflow as tf

    import tfpipe

    layers, x, _, _ = model_and_data(spec)
    with tfpipe.cluster.LocalCluster(spec["devices"]) as cluster:
        for device in cluster.devices:  # an op run on each: what the runtime holds idle is not planning's
            with tf.device(device):
                tf.reduce_sum(tf.ones([8])).numpy()
        rss = [plan_devices.status_bytes(pid, "VmRSS") for pid in cluster.pids]
        for pid in cluster.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # the high-water mark starts again from the resident size
        began = time.monotonic()
        try:
            plan = tfpipe.plan(
                layers,
                spec["batch_size"],
                cluster.devices,
                budget,
                sample=x,
                optimizer=spec["optimizer"],
                num_micro_batches=spec.get("micro_batches"),
                max_seconds=bound(spec),
                verbose=0,
            )
        except tfpipe.NothingFits as err:  # said in the row, with what planning held and took all the same
            plan, nothing, took = None, err, time.monotonic() - began
        process = [plan_devices.status_bytes(pid, "VmHWM") - base for pid, base in zip(cluster.pids, rss)]
    if plan is None:
        smallest = (
            f"the smallest predicted peak is {nothing.smallest_budget / MIB:.0f} MiB, with {nothing.config.describe()}"
        )
        return {
            "chosen": f"none fits ({smallest})",
            "planning_s": took,
            "probe_bytes": max((nothing.planning_peaks or {0: 0.0}).values()),
            "process_bytes": max(process),
            "not_run": len(nothing.profile.not_run),
        }
    chosen = plan.candidates[0].config
    return {
        **_config_of(chosen),
        "chosen": chosen.describe(),
        "planning_s": plan.planning_seconds,
        "probe_bytes": max((plan.planning_peaks or {0: 0.0}).values()),
        "process_bytes": max(process),
        "not_run": len(plan.profile.not_run),
    }


def planning_rows(
    spec: dict[str, Any],
    fractions: Sequence[float],
    run: Callable[[dict[str, Any]], dict[str, float]],
    plan_in_child: Callable[[float], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per fraction of GPipe-without-remat's measured peak (``REFERENCE``, per worker): planning's own peaks and time
    under that budget, and its choice run (its measured step gives planning's time in steps)."""
    k, r, m, remat, schedule = REFERENCE
    reference = run({"partitions": k, "replicas": r, "m": m, "remat": remat, "schedule": schedule})
    out = []
    for fraction in fractions:
        budget = fraction * reference["peak_bytes"] / k
        planned = plan_in_child(budget)
        if "balance" not in planned:  # none fits: planning's own time and peaks, no choice to run
            out.append(
                {
                    "fraction": fraction,
                    "budget_mib": round(budget / MIB, 2),
                    "planning_s": round(planned["planning_s"], 1),
                    "probe_mib": round(planned["probe_bytes"] / MIB, 2),
                    "probe_process_mib": round(planned["process_bytes"] / MIB, 1),
                    "not_run": planned["not_run"],
                    "chosen": planned["chosen"],
                }
            )
            continue
        ran = run({key: planned[key] for key in ("balance", "replicas", "m", "remat", "schedule")})
        used = len(planned["balance"]) * planned["replicas"]
        out.append(
            {
                "fraction": fraction,
                "budget_mib": round(budget / MIB, 2),
                "planning_s": round(planned["planning_s"], 1),
                "planning_steps": round(planned["planning_s"] / ran["step_s"]),
                "probe_mib": round(planned["probe_bytes"] / MIB, 2),
                "probe_process_mib": round(planned["process_bytes"] / MIB, 1),
                "not_run": planned["not_run"],
                "chosen": planned["chosen"],
                "measured_ms": round(ran["step_s"] * 1e3, 2),
                "measured_mib": round(ran["peak_bytes"] / used / MIB, 2),
                "measured_process_mib": round(ran["process_bytes"] / used / MIB, 1),
                "fits": ran["peak_bytes"] / used <= budget,
            }
        )
    return out


def planning_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The planning runs as a markdown table."""
    lines = [
        "| budget (x GPipe's peak) | per worker MiB | planning s | in steps of the choice | probes' peak MiB (worker "
        "allocator) | worker process MiB | probes not run | chosen | measured ms | measured MiB per worker | its "
        "process MiB | fits |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        if "measured_ms" not in r:  # none fits: planning's own figures, nothing run
            lines.append(
                f"| {r['fraction']} | {r['budget_mib']} | {r['planning_s']} | - | {r['probe_mib']} | "
                f"{r['probe_process_mib']} | {r['not_run']} | {r['chosen']} |" + " - |" * 4
            )
            continue
        lines.append(
            f"| {r['fraction']} | {r['budget_mib']} | {r['planning_s']} | {r['planning_steps']} | {r['probe_mib']} | "
            f"{r['probe_process_mib']} | {r['not_run']} | {r['chosen']} | {r['measured_ms']} | {r['measured_mib']} | "
            f"{r['measured_process_mib']} | {r['fits']} |"
        )
    return "\n".join(lines)
