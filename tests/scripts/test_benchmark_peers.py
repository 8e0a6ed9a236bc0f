"""benchmarks/benchmark_peers.py runs in its smallest mode against torch (skipped where torch is not installed)."""

import csv

import pytest

from tests.util import run_script
from tfpipe import schedule

pytest.importorskip("torch")


@pytest.mark.slow  # a whole benchmark run on both sides (35 s)
def test_peers_benchmark_checks_both_sides_and_writes_their_ratios(tmp_path):
    out = str(tmp_path / "peers")
    proc = run_script(
        "benchmark_peers.py",
        "--models=floor",
        "--layers=4",
        "--batch_size=floor=8",
        "--micro_batches=1,2",
        "--schedules=gpipe,1f1b,zbv",  # zbv: two cells (stages) per device on both sides
        "--default_remat_at=",
        "--check",
        "--pairs=1",
        "--steps=2",
        "--warmup_s=0",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # --check: the reference and each schedule at the largest M, from the Keras weights copied into torch
    checks = [line for line in proc.stdout.splitlines() if line.startswith("check floor")]
    assert len(checks) == 4 and all(line.endswith("(ok)") for line in checks), checks
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    # the reference, M=1 (one schedule: every schedule runs F then B), K=1 at M=2 (the limits' kernels), then each
    # schedule at M=2
    assert [(r["k"], r["m"], r["schedule"], r["peer"]) for r in rows] == [
        ("1", "1", "gpipe", "plain"),
        ("2", "1", "gpipe", "gpipe"),
        ("1", "2", "gpipe", "plain"),
        ("2", "2", "gpipe", "gpipe"),
        ("2", "2", "1f1b", "1f1b"),
        ("2", "2", "zbv", "zbv"),
    ]
    assert [r["v"] for r in rows] == ["1"] * 5 + ["2"]
    # each side's limit: what its schedule allows at M=2 times its own K=1 speed at M=2 over K=1, M=1
    allowed = {"gpipe": 4 / 3, "1f1b": 4 / 3, "zbv": schedule.allowed_speedup("zbv", 4, 2, num_devices=2)}
    assert allowed["zbv"] > 4 / 3  # two cells a device shrink the bubble
    for r in rows[3:]:
        for side in ("tfpipe", "torch"):
            limit = allowed[r["schedule"]] * float(rows[2][f"{side}_speedup"])
            assert float(r[f"{side}_limit"]) == pytest.approx(limit)
            assert float(r[f"{side}_of_limit"]) == pytest.approx(float(r[f"{side}_speedup"]) / limit)
    assert rows[0]["tfpipe_limit"] == rows[2]["torch_limit"] == ""  # none for K=1
    assert float(rows[1]["tfpipe_limit"]) == float(rows[1]["torch_limit"]) == 1.0  # M=1: nothing to overlap
    for r in rows:
        for side in ("tfpipe", "torch"):
            low, mid, high = (float(r[f"{side}_{s}_ms"]) for s in ("min", "median", "max"))
            assert 0 < low <= mid <= high and float(r[f"{side}_speedup"]) > 0
        assert float(r["ratio_median"]) > 0 and r["pairs"] == "1"
    assert float(rows[0]["tfpipe_speedup"]) == float(rows[0]["torch_speedup"]) == 1.0
    table = open(out + ".md").read()
    assert "### floor: 4 x Dense(16) + tanh, batch 8" in table and "| tfpipe / torch (median of pairs) |" in table
    assert len([line for line in table.splitlines() if line.startswith("| 2 | ")]) == 4
    assert "| 2 | 2 | zbv (v=2) | never | zbv |" in table
    zbv = next(line for line in table.splitlines() if line.startswith("| 2 | 2 | zbv"))
    assert zbv.endswith(f"% of {float(rows[5]['torch_limit']):.2f}x) |"), zbv
    # each side's fastest schedule at M=2 and its share of its own limit, over every schedule
    fastest = {side: max(rows[3:], key=lambda r: float(r[f"{side}_speedup"])) for side in ("tfpipe", "torch")}
    share = next(line for line in table.splitlines() if line.startswith("| floor | 2 | "))
    assert share.startswith(f"| floor | 2 | {fastest['tfpipe']['schedule']} "), share
    assert f"| {fastest['torch']['peer']} {float(fastest['torch']['torch_speedup']):.2f}x (" in share, share
    best = max(float(r["torch_of_limit"]) for r in rows[3:])
    assert share.endswith(f"| {100 * best:.0f}% |"), share
