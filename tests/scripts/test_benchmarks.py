"""Benchmark scripts still run, in their smallest mode (no timing assertions: speed lives in the scripts)."""

import csv
import math
import os
import re
import time

import pytest

from scripts import report
from tests.util import run_script
from tfpipe import schedule


@pytest.mark.slow  # a whole benchmark run (58 s); the suite's time: pytest -m slow runs it
def test_speed_benchmark_writes_its_table(tmp_path):
    out = str(tmp_path / "speed")
    proc = run_script(
        "benchmark_speed.py",
        "--model=mlp",
        "--micro_batches=2",
        "--steps=1",
        "--warmup=1",
        "--blocks=2",
        "--dims=16,32",
        "--batch_sizes=4",
        "--remat=always",
        "--threads",
        "--jit_compile",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    sizes = ["dim=16 batch=4", "dim=32 batch=4"]
    for r in rows:  # --threads: each process's threads by name, CPU/wait in ms per step, adding up to the CPU
        threads = [entry.rsplit(" ", 1) for entry in r["threads"].split("; ")]
        roles = {key.split(":")[0] for key, _ in threads}
        assert roles == {"client", "worker0"} | ({"worker1"} if r["K"] == "2" else set())
        cpu = sum(float(times.split("/")[0]) for _, times in threads)
        assert cpu == pytest.approx(float(r["cpu_ms"]), rel=0.1, abs=0.1)
    assert "  CPU / wait for a core, ms per step: client:" in proc.stdout
    assert [(r["size"], r["K"], r["M"]) for r in rows] == [(s, k, "2") for k in ("1", "2") for s in sizes]
    # K=2's share of the limit: the schedule's allowance times one worker's speed at M=2, from the K=1 row
    limit = float(rows[2]["allowed_same_m"]) * float(rows[0]["speedup"])
    assert float(rows[2]["microbatches_allow"]) == pytest.approx(limit, rel=1e-6)
    assert f"% of the limit {limit:.2f}x" in open(out + ".md").read()
    for r in rows:  # every entry against its size's reference: one worker, K=1, M=1, no recomputation
        assert r["remat"] == "always" and r["jit_compile"] == "True" and float(r["examples_per_s"]) > 0
        assert float(r["speedup"]) == pytest.approx(float(r["examples_per_s"]) / float(r["reference"]))
    assert len({r["reference"] for r in rows if r["size"] == sizes[0]}) == 1
    assert float(rows[-1]["ideal"]) == pytest.approx(4 / 3)
    # Recomputing both micro-batches, GPipe at K=2, M=2 allows no speed-up: 3 forward cycles, then 3 backward
    # cycles of 2 + 1 each: 12 units, as long as one device doing all 12 units of work without recomputing.
    assert float(rows[-1]["allowed"]) == pytest.approx(schedule.allowed_speedup("gpipe", 2, 2, [0, 1])) == 1.0
    assert float(rows[-1]["of_allowed"]) == pytest.approx(float(rows[-1]["speedup"]))
    for r in rows:  # the CPU of the client and the workers, per step, and the speed-up it allows on the cores
        assert float(r["cpu_ms"]) > 0 and float(r["reference_cpu_ms"]) > 0 and 0 < float(r["cores_busy"]) <= 2.5
        reference_step_ms = 4e3 / float(r["reference"])
        allowed = reference_step_ms * int(r["cores"]) / float(r["cpu_ms"])
        assert int(r["cores"]) == len(os.sched_getaffinity(0)) and float(r["cores_allow"]) == pytest.approx(allowed)
    table = open(out + ".md").read()
    assert "### mlp dim=16 batch=4, remat='always'" in table and "| K \\ M | 2 |" in table
    assert "cells compiled by XLA (the reference without)" in table  # each cell of each entry, on its worker
    assert "of the 1.00x allowed" in table and "CPU per step, every process" in table
    assert len(re.findall(r"waited \d+\.\d ms; allows \d+\.\d\dx \|", table)) == len(rows)
    assert f"speed-up that CPU allows on {len(os.sched_getaffinity(0))} cores" in table
    assert "over one worker, K=1, M=1, no re-materialization" in table and "over K=1 at the same M" in table
    # K=2 M=2 against K=1 M=2 of the same size and remat: the second table's reference
    k1 = next(r for r in rows if r["size"] == sizes[1] and r["K"] == "1")
    k2 = next(r for r in rows if r["size"] == sizes[1] and r["K"] == "2")
    assert float(k2["speedup_same_m"]) == pytest.approx(float(k2["examples_per_s"]) / float(k1["examples_per_s"]))
    # Beside one worker at the same M, which recomputes as much, the schedule allows 1.33x (not 1.00x); that
    # times one worker's speed-up at this M is the bound that its micro-batches set.
    same_m = schedule.allowed_speedup("gpipe", 2, 2, [0, 1]) / schedule.allowed_speedup("gpipe", 1, 2, [0, 1])
    assert float(k2["allowed_same_m"]) == pytest.approx(same_m) == pytest.approx(4 / 3)
    bound = same_m * float(k1["examples_per_s"]) / float(k2["reference"])
    assert float(k2["microbatches_allow"]) == pytest.approx(bound)
    assert float(k2["of_allowed_same_m"]) == pytest.approx(float(k2["speedup"]) / bound)
    diagnostic = table.split("over K=1 at the same M")[1].split("CPU per step")[0]
    # ... so its entries name no lower 'allowed' figure, as they would against one worker at M=1 (1.00x)
    assert "share of the bound that one worker's micro-batches set" in diagnostic and "allowed" not in diagnostic


@pytest.mark.slow  # 48 s alone; U-Net exactness: integration/test_reference_models.py
def test_speed_benchmark_times_a_functional_unet(tmp_path):
    out = str(tmp_path / "unet")
    flags = ("--model=unet", "--micro_batches=2", "--steps=2", "--warmup=2", "--warmup_s=0", "--dims=2", "--seq_len=8")
    proc = run_script("benchmark_speed.py", *flags, "--batch_sizes=2", "--optimizer=adam", "--steps_per_execution=2",
                      f"--out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["K"], r["M"]) for r in rows] == [("1", "2"), ("2", "2")] and float(rows[-1]["examples_per_s"]) > 0
    assert {r["optimizer"] for r in rows} == {"adam"} and {r["jit_compile"] for r in rows} == {"False"}
    assert "optimizer='adam', steps_per_execution=2" in open(out + ".md").read()


@pytest.mark.slow  # tied weights: integration/test_tied.py
def test_speed_benchmark_times_a_transformer_with_its_embedding_tied_to_the_output(tmp_path):
    out = str(tmp_path / "tied")
    flags = ("--micro_batches=2", "--steps=1", "--warmup=1", "--warmup_s=0", "--dims=16", "--blocks=2", "--seq_len=8")
    proc = run_script("benchmark_speed.py", *flags, "--batch_sizes=4", "--vocab=40", "--tie_embeddings", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["K"], r["M"], r["tie_embeddings"]) for r in rows] == [("1", "2", "True"), ("2", "2", "True")]
    assert "vocabulary 40, embedding tied to the output" in open(out + ".md").read()
    refused = run_script("benchmark_speed.py", "--model=mlp", "--tie_embeddings")
    assert refused.returncode != 0 and "--tie_embeddings applies to --model=transformer" in refused.stderr


@pytest.mark.slow  # a whole benchmark run (35 s)
def test_scale_benchmark_times_the_first_step_in_a_fresh_process(tmp_path):
    out = str(tmp_path / "scale")
    proc = run_script(
        "benchmark_scale.py",
        "--configs=keras,2x2",
        "--blocks=4",
        "--dim=16",
        "--seq_len=4",
        "--batch_size=4",
        "--steps=1",
        "--repeated_layers=inline,call",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        keras_row, row, called = list(csv.DictReader(f))
    assert (keras_row["K"], keras_row["graph"]) == ("0", "keras")  # the same layers in plain Keras
    assert (row["K"], row["M"], row["tasks"]) == ("2", "2", "8")
    assert (row["graph"], called["graph"]) == ("unrolled", "unrolled, call")
    for r in (keras_row, row, called):
        assert float(r["first_s"]) > 0 and float(r["step_ms"]) > 0 and float(r["peak_rss_gb"]) > 0.1
    assert "| - | - | - | keras |" in open(out + ".md").read()


def test_scale_benchmark_refuses_a_bad_config():
    proc = run_script("benchmark_scale.py", "--configs=8by32", timeout=120)
    assert proc.returncode != 0 and "--configs: '8by32' is not KxM" in proc.stderr
    proc = run_script("benchmark_scale.py", "--repeated_layers=calls", timeout=120)
    assert proc.returncode != 0 and "--repeated_layers: ['calls'] holds a value other than inline, call" in proc.stderr


@pytest.mark.slow  # a benchmark's whole run
def test_kernel_benchmark_prints_a_row_per_size():
    proc = run_script("benchmark_kernels.py", "--dim=16", "--layers=1", "--rows=4,2", "--repeats=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip() in ("4", "2")]
    assert [r[0] for r in rows] == ["4", "2"] and all(float(r[3]) > 0 for r in rows)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("weight gradient"))
    assert "Dense(16), 4 rows against 2 micro-batches of 2: one product" in line
    assert "2 products, summed" in line
    stack = next(line for line in proc.stdout.splitlines() if line.startswith("1 layers in 2 micro-batches of 2"))
    assert "weight gradients per micro-batch" in stack and "once over all micro-batches" in stack


@pytest.mark.slow  # a whole benchmark run (29 s)
def test_speed_benchmark_times_replicas_against_one_worker(tmp_path):
    out = str(tmp_path / "replicas")
    flags = ("--model=mlp", "--micro_batches=2", "--steps=1", "--warmup=1", "--blocks=2", "--dims=16")
    proc = run_script("benchmark_speed.py", *flags, "--batch_sizes=4", "--replicas=2", "--max_partitions=1",
                      f"--out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["R"], r["K"], r["M"]) for r in rows] == [("1", "1", "2"), ("2", "1", "2")]
    assert float(rows[1]["ideal"]) == pytest.approx(2.0)  # R x K*M/(M+K-1)
    assert rows[0]["reference"] == rows[1]["reference"]  # both against one worker, K=1, M=1
    assert "| R x K \\ M | 2 |" in open(out + ".md").read() and "| 2 x 1 |" in open(out + ".md").read()


@pytest.mark.slow  # a benchmark's whole run
def test_replica_sums_benchmark_times_the_in_graph_sum():
    proc = run_script("benchmark_replica_sums.py", "--dims=64", "--tensors=2", "--repeats=3", "--nocollective")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [line.split() for line in proc.stdout.splitlines() if line.startswith("  64")]
    assert float(row[1]) == pytest.approx(2 * 64 * 64 * 4 / 2**20, abs=0.05) and float(row[2]) > 0


def test_scheduler_seconds_counts_this_process_cpu_and_says_nan_for_a_process_it_cannot_read():
    run, wait = report.scheduler_seconds([os.getpid()])
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # 0.2 s of CPU in this thread
        pass
    run_after, wait_after = report.scheduler_seconds([os.getpid()])
    assert 0.15 < run_after - run < 2.0 and wait_after >= wait
    no_such_pid = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10**6
    assert all(math.isnan(v) for v in report.scheduler_seconds([os.getpid(), no_such_pid]))


def test_pool_name_drops_a_trailing_number_only():
    assert report.pool_name("worker-12") == report.pool_name("worker_3") == "worker"
    assert report.pool_name("tf_Compute") == "tf_Compute" and report.pool_name("python3.11") == "python3"
    assert report.pool_name("42") == "42"  # nothing would be left: the name stays


def test_thread_seconds_adds_up_a_pools_threads_per_role_and_name():
    import threading

    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        name = f.read().strip()
    before = report.thread_seconds({"me": os.getpid()})
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # 0.2 s of CPU in this thread
        pass
    no_such_pid = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10**6
    after = report.thread_seconds({"me": os.getpid(), "gone": no_such_pid})
    key = f"me:{report.pool_name(name)}"
    assert 0.15 < after[key][0] - before[key][0] < 2.0 and after[key][1] >= before[key][1]
    assert all(k.startswith("me:") for k in after)  # the process it cannot read is left out
    # Every thread of the process is in some name's sum: together they are scheduler_seconds' total.
    run, _ = report.scheduler_seconds([os.getpid()])
    assert sum(r for r, _ in report.thread_seconds({"me": os.getpid()}).values()) == pytest.approx(run, rel=0.05)


@pytest.mark.parametrize("steps_per_execution, timed", [(1, 5), (2, 4)])
def test_timed_fit_times_the_steps_after_the_warm_up_in_calls_of_several_steps(steps_per_execution, timed):
    """8 batches, 3 warm-up steps: calls of 2 steps begin at batches 0, 2, 4 and 6, so the timing starts at 4."""
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    x, y = np.ones((32, 3), "float32"), np.zeros((32, 2), "float32")
    times = report.timed_fit(model, x, y, batch_size=4, warmup=3, pids=[])
    assert times.steps == timed and times.median_s > 0 and times.cpu_s > 0
    with pytest.raises(ValueError, match="no step of the fit came after the 8 warm-up steps"):
        report.timed_fit(model, x, y, batch_size=4, warmup=8)


def test_warm_up_runs_steps_for_its_seconds_and_no_more_than_its_cap():
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    assert report.warm_up(model, x, y, batch_size=4, seconds=0.0) == 1  # the first step only
    assert report.warm_up(model, x, y, batch_size=4, seconds=60.0, max_steps=7) == 7
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    assert report.warm_up(model, x, y, batch_size=4, seconds=0.0) == 3  # steps, not calls
    began = time.perf_counter()
    ran = report.warm_up(model, x, y, batch_size=4, seconds=0.3, max_steps=100_000)
    assert 0.3 <= time.perf_counter() - began < 30 and 2 < ran < 100_000
