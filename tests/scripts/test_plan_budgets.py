"""scripts/plan_measure's budget comparison: the chosen and the fastest fitting configuration timed in pairs."""

import pytest

from tfpipe.scripts import plan_measure


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
