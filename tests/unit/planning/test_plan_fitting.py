"""The layers' times scaled to one-cell steps: every micro-batch size the search uses, each to its own step."""

import pytest

from tests.unit.planning.handmade import calibration, profile
from tfpipe import calibration as calibration_lib
from tfpipe import fitting
from tfpipe.planning import profile as profile_lib


def test_spread_keeps_both_ends_and_spaces_the_rest_in_log_size():
    sizes = [2, 4, 8, 16, 32, 64, 128, 256]
    assert fitting.spread(sizes, 8) == sizes
    assert fitting.spread(sizes, 4) == [2, 8, 64, 256]
    assert fitting.spread([16], 3) == [16]


def test_each_size_the_search_uses_is_scaled_to_its_own_step(monkeypatch):
    # A step's time per micro-batch not linear in log(size) between far sizes (as the MLP's of docs/benchmarks.md):
    # 64 rows here cost 1.3 x what 32 and 256 put it at, so each size gets its own step
    per_micro_batch = {4: 1.0, 16: 2.0, 32: 3.0, 64: 4.2, 256: 12.0}
    cal = calibration()
    prof = profile(sizes=(4, 32, 256))  # the layers alone at three sizes, the rest interpolated
    profile_lib.fill(prof, [4, 16, 32, 64, 256])
    update_s = sum(prof.trainable_bytes) * cal.update_s_per_byte
    probed = []

    def whole_steps(layers, data, sizes, device, optimizer, steps=10, warm=True):
        probed.extend(sizes)
        step = {b: cal.step_s + update_s + m * (per_micro_batch[b] + 2 * cal.task_s) for b, m in sizes}
        return {b: calibration_lib.Probe(step[b], None) for b, _ in sizes}

    monkeypatch.setattr(calibration_lib, "whole_steps", whole_steps)
    fitting.scale_to_whole_steps(prof, [None] * 3, None, 256, "/CPU:0", "sgd", cal, 0)
    assert probed == [(4, 8), (16, 8), (32, 8), (64, 4), (256, 1)]  # M = the batch over b, at most 8
    for b, seconds in per_micro_batch.items():
        costs = prof.costs(b)
        assert sum(costs.forward_s) + sum(costs.backward_s) == pytest.approx(seconds)
        assert costs.forward_s[0] / costs.backward_s[0] == pytest.approx(0.5)  # the layers' shares kept
    assert "[4, 16, 32, 64, 256] samples" in prof.time_source
