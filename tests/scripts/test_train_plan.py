"""scripts/train.py --plan: tfpipe.plan chooses the pipeline, the script prints the plan and trains it; bad uses fail
in one line."""

import json
import re

import pytest

from tests.scripts.test_train_script import TINY_TRANSFORMER, _losses, _run
from tests.util import run_fresh

# Two micro-batch counts to choose from: two micro-batch sizes to profile, a few seconds of planning
SMALL_PLAN = (*TINY_TRANSFORMER, "--batch_size=16", "--plan_micro_batches=2,4", "--devices=cpu:2")
# "K=4 on 2 devices" where the planner chose several cells a device (interleaved, looped, V-shaped schedules)
CHOSEN = re.compile(
    r"  chosen: K=(\d+)(?: on (\d+) devices)?(?: x (\d+) replicas)?, M=(\d+), remat='(\w+)', schedule='(\w+)', "
    r"balance=(\[[\d, ]+\])"
)


@pytest.mark.slow  # a plan trains in tests/integration/test_plan.py; the flags' errors: below
def test_the_plan_is_printed_and_trained():
    # a short bound: under "auto"'s 30 s floor planning was most of the test
    proc = _run("--plan", "--memory_budget=64MiB", "--plan_seconds=10", "--epochs=1", "--steps=3", *SMALL_PLAN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "tfpipe plan for a batch of 16 over 4 layers, memory budget 64 MiB per device:" in out, out[-3000:]
    found = CHOSEN.search(out)
    assert found, out[-3000:]
    k, devices, replicas, m, remat, schedule, balance = found.groups()
    assert m in ("2", "4") and (int(devices or k) * int(replicas or 1)) <= 2
    assert "  predicted step: " in out and "  predicted peak memory: /CPU:0 " in out
    assert re.search(r"  runners-up \(\d+ other configurations tried\):\n    K=", out), out[-3000:]
    # what trained is what was planned
    shape = (f"{replicas} replicas x " if replicas else "") + f"{k} cells, balance={balance}, num_micro_batches={m}"
    assert re.search(rf'PipelineModel "\w+": {re.escape(shape)}, remat=\'{remat}\', schedule=\'{schedule}\'', out)
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"balance {balance} on ") and f", {m} micro-batches, remat='{remat}'" in last, last
    assert (f"schedule='{schedule}'" in last) == (schedule != "gpipe"), last
    start, final = _losses(out)
    assert final < start


BAD_PLANS = [
    (["--plan", "--balance=2,3"], "train.py: error: --balance=2,3: --plan chooses the cells, balance and replicas"),
    (["--plan", "--partitions=3"], "train.py: error: --partitions=3: --plan chooses the cells, balance and replicas"),
    (["--plan", "--replicas=2"], "train.py: error: --replicas=2: --plan chooses the cells, balance and replicas"),
    (["--plan_micro_batches=2,4"], "train.py: error: --plan_micro_batches=2,4: applies with --plan; give --plan too"),
    (["--plan_seconds=10"], "train.py: error: --plan_seconds=10.0: applies with --plan; give --plan too"),
    (["--plan", "--memory_budget=lots"], "error: --memory_budget=lots: memory_budget must be a number of bytes > 0"),
    (["--plan", "--memory_budget=0"], "error: --memory_budget=0: memory_budget must be a number of bytes > 0"),
    (["--plan", "--plan_micro_batches=0"], "error: --plan_micro_batches=0: give positive integers, e.g. 2,4"),
    (["--plan", "--plan_micro_batches=x"], "error: --plan_micro_batches=x: give comma-separated integers"),
    (["--plan", "--plan_micro_batches=64"], "error: --plan_micro_batches=64: each is more than --batch_size=32"),
    (["--plan", "--micro_batches=2", "--plan_micro_batches=2,4"], "--micro_batches=2 already fixes M; drop one"),
]


@pytest.mark.slow  # it measures before it fails (30 s); tfpipe.plan's own no-fit error is tested in CI
def test_a_budget_nothing_fits_names_the_smallest_in_one_line():
    proc = _run("--plan", "--memory_budget=1KiB", *SMALL_PLAN)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        "train.py: error: --memory_budget=1KiB: No configuration fits memory_budget=1 KiB on every device: the "
        "smallest predicted peak is "
    ) in proc.stderr


def test_a_memory_budget_without_plan_is_an_error():
    proc = _run("--memory_budget=2GiB")  # as a user meets it: exit code 2, one line
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.py: error: --memory_budget=2GiB: applies with --plan; give --plan too" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_plan_flags_name_the_flag():
    # Through the script's own parse_flags and main in one process, each a fresh parse (as test_bad_flags_name_the_flag)
    proc = run_fresh(f"""
        import contextlib, io, json, sys
        import tensorflow as tf
        tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                                   [tf.config.LogicalDeviceConfiguration()] * 2)
        sys.argv = ["train.py"]
        from scripts import train
        tf.config.set_logical_device_configuration = lambda *args: None  # set once, above, for every run
        results = []
        for flags in {[flags for flags, _ in BAD_PLANS]!r}:
            train.FLAGS.unparse_flags()
            err, code = io.StringIO(), 0
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    train.main(train.parse_flags(["train.py", *flags]))
                except SystemExit as exit:
                    code = exit.code
            results.append([code, err.getvalue()])
        print("RESULTS", json.dumps(results))
        from scripts import train_flags
        train.FLAGS.unparse_flags()
        train.parse_flags(["train.py", "--plan", "--remat=never", "--schedule=1f1b", "--plan_micro_batches=2,4"])
        print("NARROWED", json.dumps(train_flags.plan_choices()))
        train.FLAGS.unparse_flags()
        train.parse_flags(["train.py", "--plan", "--micro_batches=8"])
        print("NARROWED", json.dumps(train_flags.plan_choices()))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS")[1].split("NARROWED")[0])
    for (flags, message), (code, stderr) in zip(BAD_PLANS, results, strict=True):
        assert code == 2 and message in stderr and "Traceback" not in stderr, (flags, stderr[-1500:])
    # --micro_batches, --remat, --schedule given beside --plan fix that choice; --plan_micro_batches lists M's
    narrowed = [json.loads(part) for part in proc.stdout.split("NARROWED")[1:]]
    assert narrowed == [
        {"num_micro_batches": [2, 4], "remats": ["never"], "schedules": ["1f1b"]},
        {"num_micro_batches": [8]},
    ]
