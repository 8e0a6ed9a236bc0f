"""scripts/plan.py on a LocalCluster: the plan reads the workers' bytes on this process's CPU, and the measured
configurations' peaks are read from the workers' own allocators, their processes' resident peaks beside them."""

import re

import pytest

from tests.util import run_script

# | K | R | M | remat | schedule | balance | predicted ms | measured ms | error | predicted MiB | measured MiB | error
# | process MiB |
ROW = re.compile(r"^\| \d+( on \d+)? \| \d+ \| \d+ \|")  # K, or "K on D" where cells share devices


@pytest.mark.slow  # timing on workers is tested in tests/integration/test_plan.py (56 s of CPU)
def test_a_plan_on_workers_is_measured_on_the_workers():
    proc = run_script(
        "plan.py",
        "--cluster",
        "--devices=2",
        "--depth=4",
        "--width=256",
        "--batch_size=128",
        "--optimizer=sgd",
        "--micro_batches=2,4",  # a narrower search: fewer sizes to step
        "--max_seconds=10",  # under "auto"'s 30 s floor the probes took most of the test
        "--measure=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # the workers' allocators are theirs: the bytes are read on this process's CPU, and the summary says so
    assert "this process's stand-in for /job:worker/task:0/device:CPU:0" in out, out[-3000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if ROW.match(line)]
    assert len(rows) == 1 and rows[0][2] in ("2", "4"), out[-3000:]
    predicted_ms, measured_ms, predicted_mib, measured_mib, process_mib = (float(rows[0][i]) for i in (6, 7, 9, 10, 12))
    assert predicted_ms > 0 and measured_ms > 0
    # the workers' allocators, read over their pipes (4 layers of 256 x 256 weights, their gradients, the
    # activations of 128 rows), near the prediction; their processes held that and their runtime's working memory
    assert 0.7 * predicted_mib < measured_mib < 1.3 * predicted_mib, rows[0]
    assert process_mib > measured_mib, rows[0]


def test_planning_on_a_gpu_without_one_names_the_fix():
    # the suite hides GPUs (tests/conftest.py): --device_type=GPU finds none and says what to give instead
    proc = run_script("plan.py", "--device_type=GPU", "--depth=2", "--width=16", "--batch_size=8")
    assert proc.returncode != 0
    assert "device_type='GPU': this machine has no GPU; give 'CPU'." in proc.stderr, proc.stderr[-3000:]


def test_micro_batches_over_the_batch_name_the_fix():
    proc = run_script("plan.py", "--micro_batches=2,16", "--depth=2", "--width=16", "--batch_size=8")
    assert proc.returncode != 0
    assert "--micro_batches=2,16: each must be 1 to --batch_size=8" in proc.stderr, proc.stderr[-3000:]


def test_the_amoebanet_model_gives_images_and_their_classes():
    import keras
    import numpy as np

    from scripts import plan_measure

    spec = {"model": "amoebanet", "blocks": 1, "dim": 8, "image_size": 32, "batch_size": 2}
    layers, x, y, loss = plan_measure.model_and_data(spec)
    assert x.shape == (2, 32, 32, 3) and y.shape == (2,) and set(y) <= set(range(10))
    logits = keras.Sequential(layers)(x)
    assert logits.shape == (2, 10) and np.isfinite(float(loss(y, logits)))


@pytest.mark.slow  # a diagnostic's whole run
def test_pressed_rounds_compare_the_layers_profiled_whole_and_pressed_per_size():
    # tiny layers' summed time can be 0 once their calls' cost is taken off (under the suite's load it was): n/a then
    proc = run_script("plan.py", "--pressed_rounds=2", "--depth=3", "--width=512", "--batch_size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = re.findall(r"^whole \d+ s, pressed \d+ s: 1 rows .* ms \((\d+\.\d+x|n/a)\), 4 rows", proc.stdout, re.M)
    assert len(rounds) == 2, proc.stdout
    assert all(r == "n/a" or float(r[:-1]) > 0 for r in rounds), proc.stdout
    # each profile shows its progress, as the planner does: which round, which profile, how far
    assert re.search(r"^round 2, pressed: measuring each of the 3 layers alone .*: done in \d+ s$", proc.stdout, re.M)
    assert re.search(r"^8 rows: pressed / whole (\d+\.\d+-\d+\.\d+x \(median \d+\.\d+\)|n/a .*)$", proc.stdout, re.M)


def test_pressed_rounds_summary_gives_min_median_max_per_size():
    from scripts import plan_layers

    found = [
        {"ratios": {1: r, 8: 2 * r}, "pressed": {"notes": ["5 layer(s) ... measured alone at [4]"]}}
        for r in (1.0, 1.2, 0.9)
    ]
    assert plan_layers.summary(found).splitlines() == [
        "1 rows: pressed / whole 0.90-1.20x (median 1.00)",
        "8 rows: pressed / whole 1.80-2.40x (median 2.00)",
        "5 layer(s) ... measured alone at [4]",
    ]


def test_pressed_rounds_leave_out_a_size_the_whole_profile_timed_at_no_time():
    from scripts import plan_layers

    assert plan_layers._ratio(1.0, 0.0) != plan_layers._ratio(1.0, 0.0)  # nan, not a division by zero
    nan = float("nan")
    found = [{"ratios": {1: nan, 8: r}, "pressed": {"notes": []}} for r in (nan, 1.5, 0.5)]
    assert plan_layers.summary(found).splitlines() == [
        "1 rows: pressed / whole n/a (no measurable time timed whole)",
        "8 rows: pressed / whole 0.50-1.50x (median 1.00)",
    ]
