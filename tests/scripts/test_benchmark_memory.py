"""benchmark_memory.py still runs in its smallest mode (structure and signs; the memory targets live in the script)."""

import csv

import pytest

from tests.util import run_script


@pytest.mark.slow  # a whole benchmark run (56 s)
def test_memory_benchmark_writes_its_tables(tmp_path):
    """Tiny Transformer, L=1, M in {1, 4}: three child processes, since the searches reuse the table's points."""
    out = str(tmp_path / "memory")
    proc = run_script(
        "benchmark_memory.py",
        "--blocks=1",
        "--table_micro_batches=1,4",
        "--micro_batches=4",
        "--seq_len=64",
        "--dim=16",
        "--heads=4",
        "--batch_size=8",
        "--vocab=16",
        "--budget_gib=1",
        "--max_blocks=1",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    act = {(r["model"], r["M"]): r for r in rows if r["section"] == "activation"}
    assert sorted(act) == [("plain", "1"), ("remat", "1"), ("remat", "4")]
    assert all(int(r["peak_bytes"]) > 0 and int(r["transient_bytes"]) > 0 for r in act.values())
    assert all(int(r["peak_bytes"]) >= int(r["before_bytes"]) for r in act.values())
    # Scores of 4 heads x 64 x 64 dominate: recomputing a quarter of the batch keeps far less than plain Keras.
    assert int(act[("remat", "4")]["transient_bytes"]) < int(act[("plain", "1")]["transient_bytes"])
    assert [r["fitted"] for r in act.values()].count("True") == 2  # the model is fitted on M=1 and M=4
    largest = {r["model"]: r for r in rows if r["section"] == "largest"}
    assert {m: (r["blocks"], r["note"]) for m, r in largest.items()} == {"plain": ("1", "cap"), "remat": ("1", "cap")}
    text = open(out + ".md").read()
    assert "Part 1" in text and "Part 2" in text and "Both searches reached --max_blocks=1" in text


def test_memory_benchmark_rejects_bad_flags():
    """A budget out of range fails before any child is started, naming the flag."""
    proc = run_script("benchmark_memory.py", "--budget_gib=0", timeout=120)
    assert proc.returncode != 0 and "--budget_gib=0" in proc.stderr
