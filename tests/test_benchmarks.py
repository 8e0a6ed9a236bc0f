"""Benchmark scripts still run, in their smallest mode (no timing assertions: speed lives in the scripts)."""

import csv

import pytest

from tests.util import run_script


def test_speed_benchmark_writes_its_table(tmp_path):
    out = str(tmp_path / "speed")
    proc = run_script("benchmark_speed.py", "--micro_batches=1,2", "--steps=1", "--warmup=1", "--blocks=1", "--dim=32",
                      "--seq_len=8", "--batch_size=4", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["K"], r["M"]) for r in rows] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[3]["ideal"]) == pytest.approx(4 / 3)
    assert all(float(r["examples_per_s"]) > 0 for r in rows)
    table = open(out + ".md").read()
    assert "| K \\ M | 1 | 2 |" in table and "over K=1 at the same M" in table
    # K=2 M=1 against K=1 M=1: the second table's reference is the same-M row of K=1
    assert float(rows[2]["speedup_same_m"]) == pytest.approx(
        float(rows[2]["examples_per_s"]) / float(rows[0]["examples_per_s"]))
