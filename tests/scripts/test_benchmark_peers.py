"""benchmarks/benchmark_peers.py runs in its smallest mode against torch (skipped where torch is not installed)."""

import csv

import pytest

from tests.util import run_script

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
    # the reference, M=1 (one schedule: every schedule runs F then B), then each schedule at M=2
    assert [(r["k"], r["m"], r["schedule"], r["peer"]) for r in rows] == [
        ("1", "1", "gpipe", "plain"),
        ("2", "1", "gpipe", "gpipe"),
        ("2", "2", "gpipe", "gpipe"),
        ("2", "2", "1f1b", "1f1b"),
        ("2", "2", "zbv", "zbv"),
    ]
    assert [r["v"] for r in rows] == ["1"] * 4 + ["2"]
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
