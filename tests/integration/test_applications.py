"""keras.applications models enter PipelineModel as they are, split, and train as themselves (sweep_applications.py).

The default suite runs a subset, one K each, chosen for their structures; ``pytest -m slow
tests/integration/test_applications.py`` runs every model at K=2 and K=4, as the script does.
"""

import csv

import pytest

from scripts import sweep_applications as sweep
from tests.util import run_script

TOLERANCE = 1e-5


def _check(row: sweep.Row, partitions: list[int]) -> None:
    """The target: no node over half the parameters, K non-empty cells, both errors below TOLERANCE at each K."""
    assert not row.error, row.error
    assert row.nodes > 0 and 0.0 < row.largest_share < 0.5, (row.largest, row.largest_share)
    assert sorted(row.balance) == partitions
    for k, balance in row.balance.items():
        assert len(balance) == k and min(balance) > 0 and sum(balance) == row.nodes, balance
        assert len(row.step_errors[k]) == sweep.STEPS and max(row.step_errors[k]) < TOLERANCE, row.step_errors[k]
        assert row.prediction_error[k] < TOLERANCE
    assert row.passed


# One K (the slow sweep runs both and every model), 45 s on two busy cores. With the script's test (VGG16: plain
# convolutions, a dense head) it covers most of the zoo's kinds of node.
SUBSET = [  # slow since the suite neared CI's 20 minutes (85 s on three busy processes); the script's test stays
    pytest.param("EfficientNetB0", 4, marks=pytest.mark.slow),  # Rescaling + Normalization, depthwise convs, SE, adds
]


@pytest.mark.parametrize("name, k", SUBSET)
def test_a_representative_application_splits_and_trains_exactly(name, k):
    _check(sweep.run_model(name, [k]), [k])


@pytest.mark.slow  # the script around sweep.run_model, which the tests above run (50 s): pytest -m slow runs it
def test_the_sweep_script_prints_a_row_and_writes_the_table(tmp_path):
    # VGG16 at 32x32: its fc2 holds 49.9% of the parameters, the nearest any model comes to the bound. A failed row
    # first (no error columns) is written too: the table has every row's columns.
    out = tmp_path / "apps"
    proc = run_script("sweep_applications.py", "--models=NoSuchModel,VGG16", "--partitions=4", f"--out={out}",
                      timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]  # the failure counts against the exit status
    assert "1/2 passed, 0 failed as expected (*), 1 unexpected: NoSuchModel" in proc.stdout
    failed, row = csv.DictReader(open(f"{out}.csv"))
    assert failed["model"] == "NoSuchModel" and failed["result"] == "FAIL" and failed["weight_error_k4_step1"] == ""
    assert row["model"] == "VGG16" and row["largest_node"] == "fc2" and 0.49 < float(row["largest_share"]) < 0.5
    assert len(row["balance"].split("+")) == 4 and row["result"] == "pass"
    assert max(float(row[f"weight_error_k4_step{i}"]) for i in (1, 2)) < TOLERANCE
    assert float(row["prediction_error"]) < TOLERANCE
    assert "| VGG16 | 32 |" in open(f"{out}.md").read()


def test_a_failure_is_a_row_and_counts_against_the_exit_status():
    row = sweep.run_model("NoSuchModel", [2])
    assert not row.passed and row.error.startswith("AttributeError")
    assert sweep.unexpected([row]) == ["NoSuchModel"] and "1 unexpected: NoSuchModel" in sweep.summary([row])
    assert "FAIL" in sweep.format_row(row)


def test_expected_failures_are_judged_strictly(monkeypatch):
    monkeypatch.setitem(sweep.EXPECTED_FAILURES, "A", "a reason")
    failed, passed = sweep.Row("A"), sweep.Row("A", passed=True)
    assert sweep.unexpected([failed]) == [] and sweep.format_row(failed).split()[-2] == "FAIL*"
    assert sweep.unexpected([passed]) == ["A"] and sweep.format_row(passed).split()[-2] == "pass!"
    assert sweep.unexpected([failed], expectations=False) == ["A"]  # another dtype or input: every failure counts


def _slow_params():
    params = []
    for name in sweep.all_models():
        reason = sweep.EXPECTED_FAILURES.get(name)
        params.append(pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else name)
    return params


@pytest.mark.slow
@pytest.mark.parametrize("name", _slow_params())
def test_every_application_splits_and_trains_exactly(name):
    _check(sweep.run_isolated(name, ["--partitions=2,4"]), [2, 4])  # a fresh process each: Keras keeps models


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MobileNetV3Small", "ResNet50V2"])
def test_in_float64_steps_chained_from_their_own_weights_are_exact(name):
    # Chained in float32 (each step from the pipeline's own weights), these drift 1e-4 to 6e-3 from the model by the
    # second step: a BatchNormalization over a few values per channel amplifies rounding. In float64 they do not.
    row = sweep.run_isolated(name, ["--partitions=2", "--dtype=float64", "--tolerance=1e-9", "--chain"])
    assert not row.error, row.error
    assert max(row.step_errors[2]) < 1e-9 and row.prediction_error[2] < 1e-9
