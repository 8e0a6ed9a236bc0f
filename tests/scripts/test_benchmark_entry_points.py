"""benchmarks/benchmark_entry_points.py at toy size: every Keras entry point timed at K=1 and K=2 against fit's."""

import csv

import pytest

from tests.util import run_script


@pytest.mark.slow  # a benchmark's whole run (33 s of CPU)
def test_every_entry_point_is_timed_at_both_k_against_fit(tmp_path):
    out = str(tmp_path / "entry")
    proc = run_script(
        "benchmark_entry_points.py", "--models=floor", "--layers=4", "--batch_size=32", "--rounds=1", "--steps=3",
        "--warmup_s=0", "--micro_batches=1,2", "--notorch", f"--out={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = {r["entry"]: r for r in csv.DictReader(f)}
    assert list(rows) == [
        "fit", "train_on_batch", "train_step", "test_on_batch", "predict_on_batch", "evaluate", "predict"
    ]  # fmt: skip
    setups = ["plain Keras", "K=1, M=1", "K=2, M=1", "K=2, M=2"]
    assert [key[: -len(" ms")] for key in rows["fit"] if key.endswith(" ms")] == setups
    assert all(rows["fit"][f"{setup} x fit"] == "1.0" for setup in setups)  # each against its own fit
    for row in rows.values():
        low, median, high = (float(v) for v in row["K=2, M=2 ms"].split(" / "))
        assert 0 < low <= median <= high and float(row["K=2, M=2 x fit"]) > 0
    assert "| floor | `train_on_batch` |" in open(out + ".md").read()


@pytest.mark.slow  # a flag's error, a whole process
def test_torchs_figure_needs_its_model():
    pytest.importorskip("torch")  # the peers extra: without it there is no figure to refuse
    proc = run_script("benchmark_entry_points.py", "--layers=4", "--torch")
    assert proc.returncode != 0 and "torch's figure is benchmark_peers.py's model: 20 layers" in proc.stderr
