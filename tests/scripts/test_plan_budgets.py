"""scripts/plan_measure: the budgets' comparison (the chosen and the fastest fitting in pairs), and the grid's peaks."""

import pytest

from scripts import plan_measure


def test_a_grid_row_is_run_as_it_was_cut():
    row = {"K": 2, "R": 1, "M": 4, "remat": "never", "schedule": "gpipe_batched_w", "balance": "7-5"}
    assert plan_measure._row_config(row) == {
        "balance": [7, 5],
        "replicas": 1,
        "m": 4,
        "remat": "never",
        "schedule": "gpipe_batched_w",
    }
    assert plan_measure._row_shape(row) == (2, 1, 4, "never", "gpipe_batched_w")


def test_two_configurations_are_compared_within_pairs_run_in_turn():
    # the machine slows threefold between the pairs: each pair's ratio still says the chosen is 10-20% faster
    steps = iter([0.010, 0.0125, 0.030, 0.0333])
    order = []

    def run(config):
        order.append(config["m"])
        return {"step_s": next(steps), "peak_bytes": 2**20 * config["m"]}

    chosen, other, against = plan_measure._paired({"m": 2}, {"m": 4}, run, 2)
    assert order == [2, 4, 2, 4]
    assert against == pytest.approx((0.010 / 0.0125 + 0.030 / 0.0333) / 2 - 1)
    assert chosen == {"measured_ms": 20.0, "measured_mib": 2.0}
    assert other == {"measured_ms": 22.9, "measured_mib": 4.0}


def test_devices_of_one_allocator_are_compared_with_their_predicted_peak_together():
    import types

    from tests.unit.planning.handmade import calibration, profile
    from tfpipe.planning import predict, search

    # four cells that hold their most at different moments (tests/unit/planning/test_plan_timeline.py)
    prof = profile(
        forward=(1.0,) * 4, backward=(2.0,) * 4, weights=(1.0,) * 4, trainable=(1.0,) * 4,
        outputs=(10.0,) * 4, held=(40.0,) * 4, working=(5.0,) * 4,
    )  # fmt: skip
    cal = calibration()
    config = predict.Config((1, 1, 1, 1), 1, 8, "never", "1f1b")
    peaks = predict.peak_bytes(prof, 16, config, 2)
    found = search.Candidate(config, predict.Prediction(1.0, 1.0, 0.0, 0.0, peaks), True)
    plan = types.SimpleNamespace(candidates=[found], profile=prof, calibration=cal, batch_size=16, optimizer_slots=2)
    measured = lambda _: {"step_s": 1.0, "peak_bytes": 1000.0}  # noqa: E731
    shape = (4, 1, 8, "never", "1f1b")
    apart = plan_measure.compare(plan, [shape], measured, 1)[0]["memory_error"]
    together = plan_measure.compare(plan, [shape], measured, 1, shared=True)[0]["memory_error"]
    assert apart == round(sum(peaks) / 1000.0 - 1, 3)
    assert together == round(predict.shared_peak_bytes(prof, cal, 16, config, 2) / 1000.0 - 1, 3) < apart


def test_planning_rows_scale_the_budget_from_gpipes_peak_per_worker_and_count_steps_of_the_choice():
    mib = plan_measure.MIB
    ran = []

    def run(config):
        ran.append(config)
        if config.get("partitions"):  # the reference: GPipe without recomputation, K=2, M=8, its cut tfpipe's own
            return {"step_s": 0.5, "peak_bytes": 200 * mib, "process_bytes": 400 * mib}
        return {"step_s": 0.25, "peak_bytes": 100 * mib, "process_bytes": 300 * mib}

    def plan_in_child(budget):
        if budget < 50 * mib:  # its error said in the row, with what planning took and held all the same
            chosen = "none fits (the smallest predicted peak is 60 MiB)"
            return {
                "chosen": chosen,
                "planning_s": 20.04,
                "probe_bytes": 30 * mib,
                "process_bytes": 90 * mib,
                "not_run": 9,
            }
        return {
            "balance": [3, 3], "replicas": 1, "m": 4, "remat": "never", "schedule": "1f1b", "chosen": "K=2, M=4",
            "planning_s": 50.0, "probe_bytes": 40 * mib, "process_bytes": 120 * mib, "not_run": 5,
        }  # fmt: skip

    rows = plan_measure.planning_rows({}, [0.4, 1.0], run, plan_in_child)
    assert ran[0] == {"partitions": 2, "replicas": 1, "m": 8, "remat": "never", "schedule": "gpipe"}
    assert rows[0] == {
        "fraction": 0.4, "budget_mib": 40.0, "planning_s": 20.0, "probe_mib": 30.0, "probe_process_mib": 90.0,
        "not_run": 9, "chosen": "none fits (the smallest predicted peak is 60 MiB)",
    }  # fmt: skip
    assert len(ran) == 2  # the reference and the one choice: nothing run where none fits
    assert rows[1] == {
        "fraction": 1.0, "budget_mib": 100.0, "planning_s": 50.0, "planning_steps": 200, "probe_mib": 40.0,
        "probe_process_mib": 120.0, "not_run": 5, "chosen": "K=2, M=4", "measured_ms": 250.0, "measured_mib": 50.0,
        "measured_process_mib": 150.0, "fits": True,
    }  # fmt: skip
    table = plan_measure.planning_markdown(rows)
    assert (
        "| 0.4 | 40.0 | 20.0 | - | 30.0 | 90.0 | 9 | none fits (the smallest predicted peak is 60 MiB) | - |" in table
        and "| 1.0 | 100.0 | 50.0 | 200 | 40.0 |" in table
    )
    assert plan_measure.bound({}) == "auto" and plan_measure.bound({"max_seconds": 0.0}) is None
    assert plan_measure.bound({"max_seconds": 90.0}) == 90.0
