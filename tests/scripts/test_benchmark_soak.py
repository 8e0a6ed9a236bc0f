"""benchmark_soak.py still runs in its smallest mode (structure and cleanup; the growth targets live in the script)."""

import csv
import os
import time

import pytest

from tests.util import run_script


def _gone(pid: int, seconds: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (or ends within ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.slow  # a whole benchmark run in both modes (64 s)
def test_soak_benchmark_samples_both_modes_and_leaves_no_worker(tmp_path):
    """20 steps sampled every 5, in both modes: 5 samples x 3 processes x 2 modes, and every worker gone after."""
    out = str(tmp_path / "soak")
    proc = run_script(
        "benchmark_soak.py",
        "--steps=20",
        "--sample_every=5",
        "--warmup_steps=5",
        "--steps_per_epoch=10",
        "--depth=2",
        "--width=16",
        "--batch_size=16",
        "--micro_batches=2",
        f"--out={out}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["mode", "step", "process", "pid", "rss_mb", "threads", "fds", "elapsed_s"]
    assert len(rows) == 5 * 3 * 2
    assert {(r["mode"], r["process"]) for r in rows} == {
        (mode, process) for mode in ("local", "connect") for process in ("client", "worker 0", "worker 1")
    }
    assert sorted({int(r["step"]) for r in rows}) == [0, 5, 10, 15, 20]
    assert all(float(r["rss_mb"]) > 20 and int(r["threads"]) > 1 and int(r["fds"]) > 2 for r in rows)
    text = open(out + ".md").read()
    assert "| local | client |" in text and "| connect | worker 1 |" in text
    assert "`local`:" in text and "`connect`:" in text
    assert "Target" in proc.stdout
    pids = {int(r["pid"]) for r in rows}
    assert len(pids) == 2 * 3  # each mode's client and workers
    assert [pid for pid in pids if not _gone(pid)] == []
