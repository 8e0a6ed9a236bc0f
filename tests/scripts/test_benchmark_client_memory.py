"""benchmark_client_memory.py at two tiny depths: the training process keeps more of the step's graph at more blocks,
and its peak is read against the model's Adam state."""

import csv

import pytest

from tests.util import run_script


@pytest.mark.slow  # a benchmark's whole run (38 s of CPU)
def test_the_client_keeps_more_ops_and_memory_at_more_blocks(tmp_path):
    out = str(tmp_path / "client")
    # the Functional model with tied embeddings, built under deferred_weights as its tfpipe rows are
    flags = ["--rows=logical", "--model=transformer_tied", "--blocks=1,3", "--devices=2", "--dim=16", "--seq_len=8"]
    proc = run_script("benchmark_client_memory.py", *flags, "--batch_size=4", "--micro_batches=2", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["blocks"]))
    assert [(r["row"], r["blocks"]) for r in rows] == [("logical", "1"), ("logical", "3")]
    assert 0 < int(rows[0]["ops"]) < int(rows[1]["ops"]) and int(rows[0]["params"]) < int(rows[1]["params"])
    assert 0 < float(rows[0]["client_mib"]) < float(rows[1]["client_mib"])
    slope = (float(rows[1]["client_mib"]) - float(rows[0]["client_mib"])) / 2
    assert f"| logical | 3 | {int(rows[1]['params']) / 1e6:.2f}M |" in proc.stdout
    # Adam's state: float32 weights, each with a gradient and two slots (every weight trainable)
    assert [float(r["adam_mib"]) * 2**20 for r in rows] == pytest.approx([16 * int(r["params"]) for r in rows])
    peak, adam = float(rows[1]["client_peak_mib"]), float(rows[1]["adam_mib"])
    assert peak > 100  # TensorFlow alone; its share of this tiny model's state is large
    assert proc.stdout.rstrip().endswith(f"| {slope:.1f} | {adam:,.0f} | {peak:,.0f} ({peak / adam:.0%}) |")


@pytest.mark.parametrize(
    "flag, message", [("--rows=keras,gpu", "--rows=keras,gpu: each must be one of"), ("--blocks=0", "--blocks=0")]
)
def test_bad_rows_and_depths_are_refused_by_name(flag, message):
    proc = run_script("benchmark_client_memory.py", flag)
    assert proc.returncode != 0 and message in proc.stderr
