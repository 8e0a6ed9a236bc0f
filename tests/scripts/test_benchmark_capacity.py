"""benchmark_capacity.py in its smallest mode: plain Keras and tfpipe K=2 (deferred keras_hub weights, the
configuration tfpipe.plan chose) at one block; the fixed configuration runs in tests/scripts/test_gpu_checks.py."""

import csv
import re

import pytest

from tests.util import run_fresh, run_script


@pytest.mark.slow  # its command runs in gpu_checks' dry run (tests/scripts/test_gpu_checks.py)
def test_capacity_benchmark_writes_its_table_with_the_planned_configuration(tmp_path):
    pytest.importorskip("keras_hub")
    out = str(tmp_path / "capacity")
    proc = run_script(
        "benchmark_capacity.py",
        "--model=llama",
        "--rows=plain,2",
        "--dim=16",
        "--seq_len=16",
        "--batch_size=4",
        "--vocab=32",
        "--micro_batches=2",
        "--budget_mib=256",
        "--max_blocks=1",
        "--plan",
        "--plan_seconds=5",  # the plan from the layers and the devices alone: its probes are test_plan_fitting's
        "--plan_micro_batches=2",
        f"--out={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  2 L=1: tfpipe.plan: measuring the 2 devices" in proc.stderr  # each probe's planning shown as it runs
    with open(out + ".csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["2", "plain"] and all(r["blocks"] == "1" for r in rows.values())
    assert rows["2"]["params"] == rows["plain"]["params"] and int(rows["2"]["params"]) > 0
    assert len(eval(rows["2"]["peaks"])) == 2 and all(p > 0 for p in eval(rows["2"]["peaks"]))
    # the weights live on the workers: the training process holds less than plain Keras' whole step
    assert 0 < float(rows["2"]["client_peak"]) < float(rows["plain"]["peak"])
    # the process's resident peak holds its allocator's and the rest TensorFlow keeps (the graph)
    assert all(float(r["client_process"]) > float(r["client_peak"]) for r in rows.values())
    text = open(out + ".md").read()
    assert "| processes (MiB) |" in text and float(rows["2"]["workers_process"]) > float(rows["2"]["peak"])
    assert "| plain Keras | 1 (cap) |" in text and "| tfpipe K=2 | 1 (cap) |" in text
    assert "budget 256 MiB per device" in text and "tfpipe as tfpipe.plan chose for each probe" in text
    assert "chose for each probe within max_seconds=5, M among 2" in text  # the narrowed search, said
    # M as narrowed; one cell, two, or more interleaved on the 2 devices (zbv), as the measured times choose (at
    # this size one device's time is within noise of two's, so a loaded machine may pick either)
    assert rows["plain"]["config"] == "plain", rows["plain"]
    assert re.match(r"K=([12]|\d+ on 2 devices), M=2,", rows["2"]["config"]), rows["2"]
    # planning's own peaks apart from training's: its probes on the workers, the layers' bytes read in the client
    assert float(rows["2"]["planning_peak"]) > 0 and float(rows["2"]["planning_client_peak"]) > 0
    assert rows["plain"]["planning_peak"] == "" and "; planning's peaks: devices " in text


def test_capacity_benchmark_refuses_a_bad_row():
    proc = run_script("benchmark_capacity.py", "--rows=plain,two")
    assert proc.returncode != 0 and "--rows=plain,two: each must be 'plain' or a K >= 1" in proc.stderr
    proc = run_script("benchmark_capacity.py", "--plan_micro_batches=2,0")
    assert proc.returncode != 0 and "--plan_micro_batches=2,0: each must be an M >= 1." in proc.stderr


def test_the_search_starts_at_the_first_depth_a_row_can_take():
    from benchmarks.memory_report import largest_under_budget

    peaks = {blocks: 10.0 * blocks for blocks in range(1, 200)}  # a model of L blocks peaks at 10 L

    def probe(blocks):
        return {"blocks": blocks, "peak": peaks[blocks]}

    found, capped, made = largest_under_budget(probe, 650.0, 128, first=8)
    assert (found, capped) == (65, False) and made[0]["blocks"] == 8 and min(m["blocks"] for m in made) == 8
    assert largest_under_budget(probe, 50.0, 128, first=8)[0] == 7  # the first depth is over: none fits
    assert largest_under_budget(probe, 2000.0, 128, first=8)[:2] == (128, True)
    # a first depth past the cap probes the cap; over the budget there, what fits is under it, not under the first
    found, capped, made = largest_under_budget(probe, 50.0, 128, first=336)
    assert (found, capped, [m["blocks"] for m in made]) == (127, False, [128])


def test_a_row_where_no_probed_depth_fit_says_so():
    proc = run_fresh("""
        from benchmarks import benchmark_capacity as capacity
        capacity.FLAGS(["benchmark_capacity.py", "--rows=1,8", "--plan"])
        row = {"capped": False, "peak": 0, "client_peak": 0, "client_process": 0, "config": "", "planning": ""}
        k1 = {**row, "row": "1", "blocks": 46, "params": 9e6, "peak": 7e8}
        print(capacity.table([k1, {**row, "row": "8", "blocks": 335, "params": 0}]))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tfpipe K=1 | 46 | 9.00M | 1.00 |" in proc.stdout
    assert "| tfpipe K=8 | under 336 (none probed fit) | 0.00M | - |" in proc.stdout
