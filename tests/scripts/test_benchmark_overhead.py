"""benchmark_overhead.py still runs in its smallest mode (no timing assertions: speed lives in the script)."""

import csv

import pytest

from tests.util import run_script


@pytest.mark.slow  # a whole benchmark run (37 s)
def test_overhead_benchmark_writes_its_table(tmp_path):
    """One round of plain, remat=never and remat=always on a one-block Transformer, and both sides with XLA."""
    out = str(tmp_path / "overhead")
    proc = run_script(
        "benchmark_overhead.py",
        "--blocks=1",
        "--dim=32",
        "--seq_len=8",
        "--batch_size=4",
        "--steps=2",
        "--warmup=1",
        "--repeats=1",
        "--jit_compile",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical initial weights: yes" in proc.stdout
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows] == ["1", "median", "min", "max"]
    assert list(rows[0]) == [
        "round", "plain_ms", "never_ms", "always_ms", "plain_xla_ms", "xla_ms", "never_over_plain",
        "always_over_never", "xla_over_plain_xla",
    ]  # fmt: skip
    assert all(float(v) > 0 for r in rows for k, v in r.items() if k != "round")
    first = rows[0]
    assert float(first["never_over_plain"]) == pytest.approx(float(first["never_ms"]) / float(first["plain_ms"]))
    text = open(out + ".md").read()
    assert "PipelineModel(remat=never) / plain Keras" in text and "remat=always / remat=never" in text
    assert float(first["xla_over_plain_xla"]) == pytest.approx(float(first["xla_ms"]) / float(first["plain_xla_ms"]))
    assert "PipelineModel(remat=never, cell by XLA) / plain Keras with XLA" in text
    assert "| plain Keras, jit_compile=True |" in text
