"""What the planner fits on the model's probe steps: every probe timed in the same rounds, each size scaled to its
own one-cell step, the parallelism and recomputation that predict the probes."""

import pytest

from tests.unit.planning.handmade import calibration, profile
from tfpipe import calibration as calibration_lib
from tfpipe import fitting
from tfpipe.planning import predict
from tfpipe.planning import profile as profile_lib
from tfpipe.planning.predict import Config


def test_spread_keeps_both_ends_and_spaces_the_rest_in_log_size():
    sizes = [2, 4, 8, 16, 32, 64, 128, 256]
    assert fitting.spread(sizes, 8) == sizes
    assert fitting.spread(sizes, 4) == [2, 8, 64, 256]
    assert fitting.spread([16], 3) == [16]
    many = profile(sizes=tuple(2**i for i in range(11)))  # 1 to 1024: more sizes than SCALE_PROBES
    stepped = list(fitting.scale_shapes(many, 1024, 3))
    assert len(stepped) <= fitting.SCALE_PROBES + 1 and set(fitting.profile_sizes([2**i for i in range(11)])) <= set(
        stepped
    )


def test_each_size_the_search_uses_is_scaled_to_its_own_step():
    # A step's time per micro-batch not linear in log(size) between far sizes (as the MLP's of docs/benchmarks.md):
    # 64 rows here cost 1.3 x what 32 and 256 put it at, so each size gets its own step
    per_micro_batch = {4: 1.0, 16: 2.0, 32: 3.0, 64: 4.2, 256: 12.0}
    cal = calibration()
    prof = profile(sizes=(4, 32, 256))  # the layers alone at three sizes, the rest interpolated
    profile_lib.fill(prof, [4, 16, 32, 64, 256])
    shapes = fitting.scale_shapes(prof, 256, 3)
    assert [(s.b, s.m, s.cut) for s in shapes.values()] == [(b, min(256 // b, 8), (3,)) for b in per_micro_batch]
    update_s = sum(prof.trainable_bytes) * cal.update_s_per_byte
    steps = {
        s: calibration_lib.Probe(cal.step_s + update_s + s.m * (per_micro_batch[s.b] + 2 * cal.task_s), None)
        for s in shapes.values()
    }
    fitting.scale_to_whole_steps(prof, steps, cal, "/CPU:0")
    for b, seconds in per_micro_batch.items():
        costs = prof.costs(b)
        assert sum(costs.forward_s) + sum(costs.backward_s) == pytest.approx(seconds)
        assert costs.forward_s[0] / costs.backward_s[0] == pytest.approx(0.5)  # the layers' shares kept
    assert "[4, 16, 32, 64, 256] samples" in prof.time_source


def test_every_probe_is_timed_once_in_the_same_rounds_and_the_fits_predict_them(monkeypatch):
    cal = calibration(parallelism=2.0)
    prof = profile(sizes=(1, 2, 4, 8))
    rounds, made = [], []

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept):
        made.append((b, m, tuple(cut), remat))
        return calibration_lib.Probe({"never": 20.0, "always": 26.0}[remat] / len(cut) + m, None)

    def replicated_step(layers, data, b, devices, optimizer, kept):
        made.append((b, 1, "replicas", len(devices)))
        return calibration_lib.Probe(15.0, None)

    def in_rounds(probes, kept, steps):
        rounds.append(set(probes))
        return probes

    for name, fake in (("split_step", split_step), ("replicated_step", replicated_step), ("in_rounds", in_rounds)):
        monkeypatch.setattr(calibration_lib, name, fake)
    fitted = fitting.fit_model(prof, [None] * 3, None, 8, ["/CPU:0", "/CPU:1"], "sgd", cal, 0)
    assert len(rounds) == 1 and len(rounds[0]) == len(made) == len(set(made))  # one set of rounds, no probe twice
    # the layers as one cell at each size (M up to 8), K=2 at M=8 recomputing all or none, two replicas at M=1; the
    # one-cell step at M=8 is also K=1's step recomputing none
    assert sorted(made, key=str) == sorted(
        [(1, 8, (3,), "never"), (2, 4, (3,), "never"), (4, 2, (3,), "never"), (8, 1, (3,), "never")]
        + [(1, 8, (3,), "always"), (1, 8, (2, 1), "never"), (1, 8, (2, 1), "always"), (4, 1, "replicas", 2)],
        key=str,
    )
    pipeline = predict.step_seconds(prof, fitted, 8, Config((2, 1), 1, 8, "never", "gpipe")).step_s
    assert pipeline == pytest.approx(20.0 / 2 + 8, rel=1e-3)  # its parallelism and speed predict the probe
    replicas = predict.step_seconds(prof, fitted, 8, Config((3,), 2, 1, "never", "gpipe")).step_s
    assert replicas == pytest.approx(15.0, rel=1e-3) and 1.0 < fitted.replica_parallelism < 2.0
    assert sorted(prof.recompute_ratios) == [1, 2]
