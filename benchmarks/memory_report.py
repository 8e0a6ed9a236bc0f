"""The memory benchmark's model of a step's peak bytes (GPipe's a*N + b*(L/K)*(N/M), fitted and checked) and its
tables (benchmarks/benchmark_memory.py); a process's peak resident memory, for the benchmarks that read it beside
the allocators'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import flags

FLAGS = flags.FLAGS
GIB, MIB = 1 << 30, 1 << 20
MODEL_TARGET = 0.25  # held-out points within 25% of the fitted GPipe model
RATIO_TARGET = 3.0  # remat holds at least 3x the blocks of plain Keras under the budget
_NAMES = {"plain": "plain Keras", "remat": 'PipelineModel remat="always"'}  # the tables' names of the models


def fit_model(points: dict[int, dict[str, Any]], blocks: int, n: int) -> tuple[float, float, int, int]:
    """Constants a, b of ``a*N + b*L*N/M`` through the remat points of the smallest and largest M."""
    m1, m2 = min(points), max(points)
    t1, t2 = points[m1]["transient"] / n, points[m2]["transient"] / n
    b = (t1 - t2) / (blocks / m1 - blocks / m2)
    return t1 - b * blocks / m1, b, m1, m2


def predicted(a: float, b: float, blocks: int, m: int, n: int) -> float:
    """GPipe's activation memory a*N + b*(L/K)*(N/M), K=1, in bytes."""
    return a * n + b * blocks * n / m


def row(
    section: str,
    r: dict[str, Any],
    a: float,
    b: float,
    n: int,
    fitted: set[tuple[str, int, int]],
    budget: float | None = None,
) -> dict[str, Any]:
    """One CSV row: a measurement beside its prediction (plain Keras is predicted with the M=1 formula)."""
    m = r["m"] if r["model"] == "remat" else 1
    pred = predicted(a, b, r["blocks"], m, n)
    row = {
        "section": section,
        "model": r["model"],
        "blocks": r["blocks"],
        "M": m,
        "before_bytes": r["before"],
        "peak_bytes": r["peak"],
        "transient_bytes": r["transient"],
        "transient_over_N": r["transient"] / n,
        "predicted_bytes": pred,
        "rel_error": r["transient"] / pred - 1.0 if pred > 0 else "",
        "fitted": (r["model"], r["blocks"], m) in fitted,
        "max_rss_bytes": r["max_rss"],
    }
    if budget is not None:
        row["fits_budget"] = r["peak"] <= budget
    return row


def process_peak(pid: int | None = None) -> int:
    """A process's peak resident memory (this one's by default), bytes: beside its allocator's, what TensorFlow keeps
    outside it (the step's graph above all: docs/guide/limitations.md)."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:"))
    return int(peak.split()[1]) * 1024  # kB


def mib(nbytes: float) -> str:
    """Bytes as MiB: whole MiB from 100 up, three significant digits below."""
    mib = nbytes / MIB
    return f"{mib:.0f}" if mib >= 100 else f"{mib:.3g}"


def extrapolated_blocks(a: float, b: float, m: int, n: int, before: float, budget: float) -> float:
    """The L at which the fitted model's peak (``before`` + a*N + b*L*N/M) reaches the budget."""
    return (budget - before - a * n) / (b * n / m) if b > 0 else float("inf")


def report(
    rows: list[dict[str, Any]],
    a: float,
    b: float,
    m_lo: int,
    m_hi: int,
    n: int,
    largest: dict[str, tuple[int, bool, list]],
    budget: float,
) -> str:
    """Both parts as markdown tables, with the fitted constants, the held-out errors and the targets."""
    lines = _activation_part(rows, a, b, m_lo, m_hi, n)
    lines += _budget_part(rows, a, b, n, budget)
    lines.append("")
    lines += _ratio_lines(largest, budget)
    lines.append(
        "'model extrapolates': the L at which the part-1 model, plus the bytes in use before the step, "
        "reaches the budget (an extrapolation, not a measurement)."
    )
    return "\n".join(lines)


def _activation_part(rows: list[dict[str, Any]], a: float, b: float, m_lo: int, m_hi: int, n: int) -> list[str]:
    """Part 1: the activation table, the fitted model and its held-out errors against the target."""
    act = [r for r in rows if r["section"] == "activation"]
    lines = [
        f"Part 1: one training step, L={act[0]['blocks']} blocks, K=1, N = {mib(n)} MiB "
        f"(seq {FLAGS.seq_len}, dim {FLAGS.dim}, heads {FLAGS.heads}, batch {FLAGS.batch_size})",
        "",
        "| model | M | transient = activations (MiB) | transient / N | predicted (MiB) | error | "
        "in use before (MiB) | total peak (MiB) | process max RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in act:
        err = "fitted" if r["fitted"] else f"{100 * r['rel_error']:+.1f}%"
        lines.append(
            f"| {_NAMES[r['model']]} | {r['M']} | {mib(r['transient_bytes'])} | "
            f"{r['transient_over_N']:.1f} | {mib(r['predicted_bytes'])} | {err} | "
            f"{mib(r['before_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['max_rss_bytes'])} |"
        )
    remat_probes = sorted(
        (r for r in rows if r["section"] == "probe" and r["model"] == "remat" and not r["fitted"]),
        key=lambda r: r["blocks"],
    )
    held_out = [r for r in act if not r["fitted"]] + remat_probes
    worst = max(abs(r["rel_error"]) for r in held_out) if held_out else float("nan")
    return lines + [
        "",
        f"Model: predicted = a*N + b*(L/K)*(N/M), fitted on remat M={m_lo} and M={m_hi} at "
        f"L={act[0]['blocks']}: a = {a:.2f}, b = {b:.2f} (in units of N).",
        "Held out (measured/predicted - 1): "
        + ", ".join(f"{r['model']} L={r['blocks']} M={r['M']} {100 * r['rel_error']:+.1f}%" for r in held_out)
        + ".",
        f"Target: every held-out point within {100 * MODEL_TARGET:.0f}% -> "
        f"{'met' if worst <= MODEL_TARGET else 'missed'} (worst {100 * worst:.1f}%).",
        "",
    ]


def _budget_part(rows: list[dict[str, Any]], a: float, b: float, n: int, budget: float) -> list[str]:
    """Part 2's table: each model's largest L under the budget, its peak, the model's extrapolation, the probes."""
    lines = [
        f"Part 2: largest L whose training step peaks under {budget / GIB:g} GiB (measured peak, not an "
        "allocation limit; doubling then bisection, one fresh process per probe)",
        "",
        "| model | M | largest L | its peak (MiB) | model extrapolates | probes: L (peak MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for model in ("plain", "remat"):
        top = next(r for r in rows if r["section"] == "largest" and r["model"] == model)
        probes = sorted(
            (r for r in rows if r["section"] == "probe" and r["model"] == model and r["M"] == top["M"]),
            key=lambda r: r["blocks"],
        )
        shown = ", ".join(
            f"{r['blocks']} ({mib(r['peak_bytes'])}{'' if r['fits_budget'] else ' over'})" for r in probes
        )
        cap = " (the --max_blocks cap)" if top["note"] == "cap" else ""
        peak = mib(top["peak_bytes"]) if top["peak_bytes"] != "" else "-"
        before = top["before_bytes"] if top["before_bytes"] != "" else probes[0]["before_bytes"]
        guess = extrapolated_blocks(a, b, top["M"], n, before, budget)
        lines.append(f"| {_NAMES[model]} | {top['M']} | {top['blocks']}{cap} | {peak} | {guess:.1f} | {shown} |")
    return lines


def _ratio_lines(largest: dict[str, tuple[int, bool, list]], budget: float) -> list[str]:
    """The largest L of remat over plain Keras's, against the target (or why there is no ratio)."""
    (plain_l, plain_cap, _), (remat_l, remat_cap, _) = largest["plain"], largest["remat"]
    if plain_cap:
        return [f"Both searches reached --max_blocks={FLAGS.max_blocks}: raise it to compare."]
    if plain_l == 0:
        return [f"Plain Keras does not fit even one block in {budget / GIB:g} GiB; remat fits {remat_l}."]
    ratio = remat_l / plain_l
    bound = (
        f" (a lower bound: the remat search stopped at --max_blocks={FLAGS.max_blocks}, still under budget)"
        if remat_cap
        else ""
    )
    return [
        f"Ratio remat / plain: {ratio:.2f}x{bound}; target >= {RATIO_TARGET:g}x -> "
        f"{'met' if ratio >= RATIO_TARGET else ('not shown' if remat_cap else 'missed')}."
    ]


def largest_under_budget(
    probe: Callable[[int], dict[str, Any]], budget: float, cap: int, first: int = 1
) -> tuple[int, bool, list[dict[str, Any]]]:
    """The largest L in [first, cap] whose probe peaks at most ``budget`` (doubling from ``first``, then bisection);
    one less than the first depth probed, min(first, cap), where none does.

    Also returns whether the cap was reached and every probe made. Assumes the peak
    grows with L, as it does: every block adds its weights and activations.
    """
    made: list[dict[str, Any]] = []

    def fits(blocks: int) -> bool:
        made.append(probe(blocks))
        return made[-1]["peak"] <= budget

    blocks = min(first, cap)
    ok, bad = blocks - 1, None
    while bad is None:
        if fits(blocks):
            ok = blocks
            if blocks == cap:
                return cap, True, made
            blocks = min(2 * blocks, cap)
        else:
            bad = blocks
    while bad - ok > 1:
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok, False, made
