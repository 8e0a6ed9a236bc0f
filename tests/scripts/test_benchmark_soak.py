"""benchmark_soak.py still runs in its smallest mode (structure and cleanup; the growth targets live in the script)."""

import csv
import os
import time

import pytest

from tests.util import run_fresh, run_script


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
    """20 steps sampled every 5 and once idle, in both modes: 6 samples x 3 processes x 2 modes; no worker left."""
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
        "--idle_s=0.5",
        f"--out={out}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["mode", "step", "idle_s", "process", "pid", "rss_mb", "threads", "fds", "elapsed_s"]
    assert len(rows) == 6 * 3 * 2
    idle = [r for r in rows if float(r["idle_s"])]
    assert len(idle) == 3 * 2 and {(r["step"], r["idle_s"]) for r in idle} == {("20", "0.5")}
    last = {(r["mode"], r["process"]): float(r["elapsed_s"]) for r in rows if r["step"] == "20" and r not in idle}
    assert all(float(r["elapsed_s"]) >= last[r["mode"], r["process"]] + 0.5 for r in idle)
    assert {(r["mode"], r["process"]) for r in rows} == {
        (mode, process) for mode in ("local", "connect") for process in ("client", "worker 0", "worker 1")
    }
    assert sorted({int(r["step"]) for r in rows}) == [0, 5, 10, 15, 20]
    assert all(float(r["rss_mb"]) > 20 and int(r["threads"]) > 1 and int(r["fds"]) > 2 for r in rows)
    text = open(out + ".md").read()
    assert "| local | client |" in text and "| connect | worker 1 |" in text
    assert "threads 5 -> 20 (after 0.5 s idle)" in text and "from step 5 to after 0.5 s idle:" in text
    assert "`local`:" in text and "`connect`:" in text
    assert "Target" in proc.stdout
    pids = {int(r["pid"]) for r in rows}
    assert len(pids) == 2 * 3  # each mode's client and workers
    assert [pid for pid in pids if not _gone(pid)] == []


def test_soak_verdict_judges_the_last_training_step_and_reports_the_idle_sample_beside_it():
    # Threads, memory and descriptors are judged from warm-up to the last step; the idle sample never changes that.
    proc = run_fresh("""
        from benchmarks import benchmark_soak as soak

        def rows(process, rss, threads, idle):
            out = [{"mode": "connect", "step": step, "idle_s": 0.0, "process": process, "rss_mb": r, "threads": t,
                    "fds": 9, "elapsed_s": float(step)} for step, r, t in zip((0, 5, 20), rss, threads)]
            return out + [{**out[-1], "idle_s": 30.0, "threads": idle, "elapsed_s": 50.0}]

        soak.FLAGS(["benchmark_soak.py", "--steps=20", "--sample_every=5", "--warmup_steps=5", "--idle_s=30"])
        found = soak.summarize(
            rows("flat", (50, 60, 70), (9, 10, 10), idle=11)
            + rows("retired", (50, 60, 70), (9, 10, 11), idle=10)
            + rows("grown", (50, 60, 111), (9, 10, 10), idle=10)
        )
        print("RESULT", [(s["process"], s["growth"]["threads"], s["idle"]["threads"], s["ok"]) for s in found])
        print("MS", soak.step_ms(rows("client", (1, 1, 1), (1, 1, 1), idle=1), "connect"))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = proc.stdout.split("RESULT")[1].split("\n")[0].strip()
    assert found == "[('flat', 0, 11, True), ('retired', 1, 10, False), ('grown', 0, 10, False)]"
    assert float(proc.stdout.split("MS")[1]) == pytest.approx(1000.0)  # 15 steps in 15 s; the idle sample left out
