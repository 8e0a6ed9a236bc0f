"""What the planner fits on the model's probe steps: every probe timed in the same rounds, each size scaled to its
own one-cell step, the parallelism and recomputation that predict the probes."""

import pytest

from tests.unit.planning.handmade import DEVICES, calibration, profile
from tfpipe.planner import calibration as calibration_lib
from tfpipe.planner import probe_fits
from tfpipe.planning import predict, search
from tfpipe.planning import profile as profile_lib
from tfpipe.planning import progress as progress_lib
from tfpipe.planning.predict import Config


def test_spread_keeps_both_ends_and_spaces_the_rest_in_log_size():
    sizes = [2, 4, 8, 16, 32, 64, 128, 256]
    assert probe_fits.spread(sizes, 8) == sizes
    assert probe_fits.spread(sizes, 4) == [2, 8, 64, 256]
    assert probe_fits.spread([16], 3) == [16]
    many = profile(sizes=tuple(2**i for i in range(11)))  # 1 to 1024: more sizes than SCALE_PROBES
    stepped = list(probe_fits.scale_shapes(many, 1024, 3))
    assert len(stepped) <= probe_fits.SCALE_PROBES + 1 and set(
        probe_fits.profile_sizes([2**i for i in range(11)])
    ) <= set(stepped)


def test_each_size_the_search_uses_is_scaled_to_its_own_step():
    # A step's time per micro-batch not linear in log(size) between far sizes (as the MLP's of docs/benchmarks.md):
    # 64 rows here cost 1.3 x what 32 and 256 put it at, so each size gets its own step
    per_micro_batch = {4: 1.0, 16: 2.0, 32: 3.0, 64: 4.2, 256: 12.0}
    cal = calibration()
    prof = profile(sizes=(4, 32, 256))  # the layers alone at three sizes, the rest interpolated
    profile_lib.fill(prof, [4, 16, 32, 64, 256])
    shapes = probe_fits.scale_shapes(prof, 256, 3)
    assert [(s.b, s.m, s.cut) for s in shapes.values()] == [(b, min(256 // b, 8), (3,)) for b in per_micro_batch]
    update_s = sum(prof.trainable_bytes) * cal.update_s_per_byte
    steps = {
        s: calibration_lib.Probe(cal.step_s + update_s + s.m * (per_micro_batch[s.b] + 2 * cal.task_s), None)
        for s in shapes.values()
    }
    probe_fits.scale_to_whole_steps(prof, steps, cal, "/CPU:0")
    for b, seconds in per_micro_batch.items():
        costs = prof.costs(b)
        assert sum(costs.forward_s) + sum(costs.backward_s) == pytest.approx(seconds)
        assert costs.forward_s[0] / costs.backward_s[0] == pytest.approx(0.5)  # the layers' shares kept
    assert "[4, 16, 32, 64, 256] samples" in prof.time_source


def test_every_probe_is_timed_once_in_the_same_rounds_and_the_fits_predict_them(monkeypatch):
    cal = calibration(parallelism=2.0)
    prof = profile(sizes=(1, 2, 4, 8))
    rounds, made = [], []

    built_as = set()

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept, schedule="gpipe", repeated_layers="-"):
        made.append((b, m, tuple(cut), remat))
        built_as.add(repeated_layers)
        return calibration_lib.Probe({"never": 20.0, "always": 26.0}[remat] / len(cut) + m, None)

    def replicated_step(layers, data, b, devices, optimizer, kept, repeated_layers="-"):
        made.append((b, 1, "replicas", len(devices)))
        built_as.add(repeated_layers)
        return calibration_lib.Probe(15.0, None)

    def in_rounds(probes, kept, steps):
        rounds.append(set(probes))
        return probes

    for name, fake in (("split_step", split_step), ("replicated_step", replicated_step), ("in_rounds", in_rounds)):
        monkeypatch.setattr(calibration_lib, name, fake)
    fitted = probe_fits.fit_model(prof, [None] * 3, None, 8, DEVICES, "sgd", cal, 0, repeated_layers="call")
    assert built_as == {"call"}  # every probe built as the planned model will train
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


def test_probes_keep_to_the_budget_in_groups_and_one_predicted_over_it_is_not_run():
    cal, prof = calibration(), profile(sizes=(1, 2, 4, 8), outputs=(4.0, 4.0, 4.0))
    whole = probe_fits.Shape(8, 1, (3,))  # all three layers on one device at 8 rows
    halves = probe_fits.Shape(1, 8, (2, 1))
    small = probe_fits.Shape(1, 8, (3,))
    # each figure below is the room a budget leaves: the budget less the headroom a prediction may be short by
    memory = lambda room: probe_fits.ProbeMemory(prof, cal, 2, DEVICES, _budget(room))  # noqa: E731
    peaks = {s: memory(None).bytes(s)[0] for s in (whole, halves, small)}
    kept = {s: memory(None).bytes(s)[1] for s in (whole, halves, small)}
    # what a model keeps between steps: weights, two Adam slots per trainable weight, the batch on its first device
    assert kept[whole] == {"/CPU:0": 60.0 + 2 * 60.0 + 8 * 8.0}
    assert kept[halves] == {"/CPU:0": 30.0 + 2 * 30.0 + 8 * 8.0, "/CPU:1": 30.0 + 2 * 30.0}
    assert peaks[whole]["/CPU:0"] == pytest.approx(626.0) and peaks[small]["/CPU:0"] == pytest.approx(613.75)
    assert peaks[halves] == pytest.approx({"/CPU:0": 453.75, "/CPU:1": 192.75})
    # no budget: one group, all of them
    assert memory(None).groups([whole, halves, small]) == [[whole, halves, small]]
    # under the whole-model probe's peak: it is not run, and the summary is told why; the other two fit alone, but
    # together /CPU:0 would keep both models (244 + 154) and the larger step's own bytes (369.75): one after the other
    groups = memory(620.0).groups([whole, halves, small])
    assert groups == [[halves], [small]]
    assert prof.not_run == [
        "probe 8 rows x M=1 on 1 device(s) not run: predicted to peak at 626 B on /CPU:0, within 13% of the budget"
    ]
    assert memory(620.0).room == pytest.approx(620.0) and memory(620.0).budget == pytest.approx(712.64, abs=0.01)
    # with room for both at once: one group
    assert memory(768.0).groups([halves, small]) == [[halves, small]]
    # a budget of 620 leaves room for 539: the small probe, predicted under the budget but not within the room, is
    # not run either
    prof.not_run.clear()
    assert probe_fits.ProbeMemory(prof, cal, 2, DEVICES, 620.0).groups([whole, halves, small]) == [[halves]]
    assert [line.rsplit(", ", 1)[1] for line in prof.not_run] == ["over the budget", "within 13% of the budget"]


def test_each_group_of_several_is_timed_in_its_own_rounds_and_a_time_bound_stops_the_building(monkeypatch):
    made, rounds = [], []

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept, schedule="gpipe", repeated_layers="-"):
        made.append(b)
        kept.extend(["model", None, [1.0]])
        return calibration_lib.Probe(0.5, None)

    def in_rounds(probes, kept, steps):
        rounds.append(sorted(s.b for s in probes))
        return probes

    monkeypatch.setattr(calibration_lib, "split_step", split_step)
    monkeypatch.setattr(calibration_lib, "in_rounds", in_rounds)
    shapes = [probe_fits.Shape(b, 1, (3,)) for b in (1, 2, 4)]
    took = probe_fits.time_probes([shapes[:2], shapes[2:]], [None] * 3, None, DEVICES, "sgd")
    # the second group's one probe keeps its first timing: no rounds against nothing
    assert made == [1, 2, 4] and rounds == [[1, 2]] and set(took) == set(shapes)
    # under a time bound: after the first probe (100 s at a fake clock), no time for more
    clock = [0.0]
    monkeypatch.setattr(probe_fits.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(progress_lib.time, "monotonic", lambda: clock[0])

    def slow(*args, **kwargs):
        clock[0] += 100.0
        return split_step(*args, **kwargs)

    monkeypatch.setattr(calibration_lib, "split_step", slow)
    made.clear()
    prof = profile()  # its layers' tracing not measured: no probe is predicted, the first is built
    progress = progress_lib.Progress(0, max_seconds=150.0)
    took = probe_fits.time_probes([shapes], [None] * 3, None, DEVICES, "sgd", progress, prof)
    assert made == [1] and list(took) == [shapes[0]]
    assert prof.not_run == [
        "probe 2 rows x M=1 on 1 device(s) not run: no time left within max_seconds",
        "probe 4 rows x M=1 on 1 device(s) not run: no time left within max_seconds",
    ]
    # predicted from the layers' tracing (2 s in all: traced in 3 x 2 + 0.25 x 2 ** 1.45 s at M=1, two steps of 4.5 s
    # at 1 row with it, none timed): the first built in 100 s, 6.4 times its prediction; the next predicted at that
    made.clear()
    clock[0] = 0.0
    prof = profile()
    prof.trace_s = [0.5, 0.5, 1.0]
    monkeypatch.setattr(probe_fits, "STEPS", 0)
    monkeypatch.setattr(calibration_lib, "PROBE_WARM_SECONDS", 0.0)
    assert probe_fits.build_seconds(prof, shapes[0]) == pytest.approx(6.0 + 0.25 * 2.0**1.45 + 2 * 4.5)
    progress = progress_lib.Progress(0, max_seconds=150.0)
    took = probe_fits.time_probes([shapes], [None] * 3, None, DEVICES, "sgd", progress, prof)
    assert made == [1]
    assert (
        prof.not_run[0]
        == "probe 2 rows x M=1 on 1 device(s) not run: predicted to take 157 s, 50 s left within max_seconds"
    )


def test_a_first_probe_predicted_past_the_bound_is_not_built(monkeypatch):
    """A deep model's first whole step can take longer to build than planning's bound: it is left out, said so."""
    made = []

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept, schedule="gpipe", repeated_layers="-"):
        made.append(b)
        kept.extend(["model", None, [1.0]])
        return calibration_lib.Probe(0.5, None)

    monkeypatch.setattr(calibration_lib, "split_step", split_step)
    prof = profile()
    prof.trace_s = [
        10.0,
        10.0,
        10.0,
    ]  # 30 s of tracing alone: a probe at M=8 traced in 3 x 30 + 0.25 x (30 x 8) ** 1.45 s
    shape = probe_fits.Shape(4, 8, (2, 1))
    predicted = probe_fits.build_seconds(prof, shape)
    # and 12 steps of 8 micro-batches of 4 rows (18 s each), the warm-up's 0.5 s
    assert predicted == pytest.approx(90.0 + 0.25 * 240.0**1.45 + 12 * 8 * 18.0 + 0.5)
    progress = progress_lib.Progress(0, max_seconds=2000.0)
    assert probe_fits.time_probes([[shape]], [None] * 3, None, DEVICES, "sgd", progress, prof) == {}
    assert made == [] and prof.not_run == [
        "probe 4 rows x M=8 on 2 device(s) not run: predicted to take 2525 s, 2000 s left within max_seconds"
    ]
    # with the time for it, it is built
    progress = progress_lib.Progress(0, max_seconds=predicted + 1.0)
    assert list(probe_fits.time_probes([[shape]], [None] * 3, None, DEVICES, "sgd", progress, prof)) == [shape]


def test_time_probes_of_none_says_so_and_opens_no_phase(capsys):
    """Where every probe is over the budget, no phase of 0 probes takes the time of what follows it."""
    progress = progress_lib.Progress(1)
    progress.phase("measuring each layer", 1)
    assert probe_fits.time_probes([], [None] * 3, None, DEVICES, "sgd", progress) == {}
    said = capsys.readouterr().out
    assert "measuring each layer: done in" in said and "stepping" not in said
    assert "no probe of the whole model is predicted to fit the budget (see summary())" in said


def _budget(room):
    """The budget that leaves ``room`` bytes for a probe's predicted peak (``ProbeMemory.room``)."""
    return None if room is None else room / search.TIMED_HEADROOM


def _probes_under(room, monkeypatch):
    """fit_model's probes of the three handmade layers under the budget that leaves ``room``: the fitted calibration,
    the profile, and each probe made as (b, M, cut, remat, schedule)."""
    cal, prof = calibration(parallelism=2.0), profile(sizes=(1, 2, 4, 8), outputs=(4.0, 4.0, 4.0))
    made = []

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept, schedule="gpipe", repeated_layers="-"):
        made.append((b, m, tuple(cut), remat, schedule))
        return calibration_lib.Probe({"never": 20.0, "always": 26.0}[remat] / len(cut) + m, None)

    monkeypatch.setattr(calibration_lib, "split_step", split_step)
    monkeypatch.setattr(calibration_lib, "in_rounds", lambda probes, kept, steps: probes)
    fitted = probe_fits.fit_model(
        prof, [None] * 3, None, 8, DEVICES, "sgd", cal, 2, replicas=False, budget=_budget(room)
    )
    return fitted, prof, made


def test_a_probe_over_the_budget_in_gpipe_order_runs_in_1f1b_order_and_is_fitted_so(monkeypatch):
    # predicted peaks (ProbeMemory.bytes): K=1 at M=8 613.75 bytes in GPipe's order, 400.25 in 1F1B's; K=2 453.75 and
    # 300.75; recomputing, K=1 456.25 (GPipe), K=2 331.25; 4 rows at M=2 619 and 497; 8 rows at M=1 626 in either
    fitted, prof, made = _probes_under(460.0, monkeypatch)
    assert (1, 8, (2, 1), "never", "gpipe") in made  # fits as it is: GPipe's order, the most held at once
    assert (1, 8, (3,), "never", "1f1b") in made and (2, 4, (3,), "never", "1f1b") in made
    assert all(b < 4 for b, *_ in made)
    assert "measured at [1, 2] samples" in prof.time_source
    assert prof.not_run == [
        "probe 4 rows x M=2 on 1 device(s), 1f1b not run: predicted to peak at 497 B on /CPU:0, within 13% of the "
        "budget",
        "probe 8 rows x M=1 on 1 device(s) not run: predicted to peak at 626 B on /CPU:0, over the budget",
    ]
    assert sorted(prof.recompute_ratios) == [1, 2]  # both K's pairs ran, K=1's in 1F1B's order


def test_the_cut_probe_recomputes_then_shrinks_until_it_fits_the_budget():
    cal, prof = calibration(parallelism=2.0), profile(sizes=(1, 2, 4, 8), outputs=(4.0, 4.0, 4.0))
    shape = probe_fits.Shape(4, 8, (2, 1))  # peaks on /CPU:0 predicted (ProbeMemory.bytes): 1,455 bytes in GPipe's
    # order, 843 in 1F1B's, 773 recomputing; at 2 rows 787.5, 481.5, 446.5; at 1 row 453.75, 300.75, 283.25

    def fitted(budget):
        cut = probe_fits.ProbeMemory(prof, cal, 2, DEVICES, _budget(budget)).fitting_cut(shape)
        return cut.b, cut.remat, cut.schedule

    assert fitted(None) == fitted(1500.0) == (4, "never", "gpipe")
    assert fitted(900.0) == (4, "never", "1f1b")
    assert fitted(800.0) == (4, "always", "1f1b")
    assert fitted(500.0) == (2, "never", "1f1b")  # the planned size first, then recomputing, then smaller
    assert fitted(290.0) == (1, "always", "1f1b")
    assert fitted(200.0) == (4, "never", "1f1b")  # none fits: groups leaves it out and says so


def test_the_parallelism_is_fitted_to_the_cut_probe_as_it_ran(monkeypatch):
    # under 290 bytes only the cut probe recomputing every micro-batch in 1F1B's order fits: the parallelism is
    # fitted to it as it ran, not to the same cut without recomputation
    fitted, prof, made = _probes_under(290.0, monkeypatch)
    assert made == [(1, 8, (2, 1), "always", "1f1b")]
    assert "parallelism measured with this model's layers cut over the 2 devices at M=8" in fitted.source
    step = predict.step_seconds(prof, fitted, 8, Config((2, 1), 1, 8, "always", "1f1b")).step_s
    assert step == pytest.approx(26.0 / 2 + 8, rel=1e-3)


def test_without_the_whole_model_probes_the_fit_uses_what_ran(monkeypatch):
    # a budget that only the probes cut over two devices fit (in 1F1B's order: 300.75 bytes, 331.25 recomputing in
    # GPipe's): no layer time is scaled, the parallelism still fitted, to the probe in the order it ran
    fitted, prof, made = _probes_under(390.0, monkeypatch)
    assert sorted(made) == [(1, 8, (2, 1), "always", "gpipe"), (1, 8, (2, 1), "never", "1f1b")]
    assert "not scaled to whole steps: no one-cell step was run" in prof.time_source
    assert sorted(prof.recompute_ratios) == [2]  # K=1's probes did not run: only K=2's ratio is fitted
    pipeline = predict.step_seconds(prof, fitted, 8, Config((2, 1), 1, 8, "never", "1f1b")).step_s
    assert pipeline == pytest.approx(20.0 / 2 + 8, rel=1e-3)
    assert prof.not_run and all(line.endswith(("over the budget", "of the budget")) for line in prof.not_run)


def test_a_probe_that_runs_out_of_memory_is_left_out_and_said(monkeypatch):
    import tensorflow as tf

    def split_step(layers, data, b, m, cut, devices, optimizer, remat, kept, schedule="gpipe", repeated_layers="-"):
        if b == 2:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
        kept.extend(["model", None, [1.0]])
        return calibration_lib.Probe(0.5, None)

    monkeypatch.setattr(calibration_lib, "split_step", split_step)
    monkeypatch.setattr(calibration_lib, "in_rounds", lambda probes, kept, steps: probes)
    shapes = [probe_fits.Shape(b, 1, (3,)) for b in (1, 2, 4)]
    prof = profile()
    took = probe_fits.time_probes([shapes], [None] * 3, None, DEVICES, "sgd", None, prof)
    assert list(took) == [shapes[0], shapes[2]]
    assert prof.not_run == ["probe 2 rows x M=1 on 1 device(s) ran out of memory on its devices"]


def test_the_cut_probes_own_peaks_give_the_held_ratio_at_its_size():
    # no one-cell step fits a tight budget, the probe cut over two devices does: its peaks, read on each device,
    # give what a micro-batch's activations held; the search then predicts it as measured
    cal = calibration(parallelism=2.0)
    prof = profile(sizes=(1, 2, 4, 8), outputs=(4.0, 4.0, 4.0), held=(4000.0, 3000.0, 2000.0))  # most of its peak
    shape = probe_fits.Shape(1, 8, (2, 1), schedule="1f1b")
    config = Config((2, 1), 1, 8, "never", "1f1b")
    prof.held_ratios = {True: ([1], [0.6])}
    peaks = predict.peak_bytes(prof, 8, config, 2, cal.noinline_tasks, cal.across_processes)
    prof.held_ratios = {}
    assert probe_fits.held_ratio_of_cut(prof, shape, peaks, 2, cal) == (1, pytest.approx(0.6))
    probe_fits.fit_held_ratios(prof, {}, 2, probe_fits.held_ratio_of_cut(prof, shape, peaks, 2, cal))
    assert predict.peak_bytes(prof, 8, config, 2, cal.noinline_tasks, cal.across_processes) == pytest.approx(peaks)
    assert "x0.60 at [1] samples" in prof.memory_source


def test_a_cut_probe_whose_activations_are_a_small_share_of_its_peak_fits_no_held_ratio():
    # weights and slots large against a micro-batch: a small error in their prediction would be read as the ratio
    cal, prof = calibration(parallelism=2.0), profile(sizes=(1, 2, 4, 8), outputs=(4.0, 4.0, 4.0))
    prof.weight_bytes = prof.trainable_bytes = [1e4, 1e4, 1e4]
    shape = probe_fits.Shape(1, 8, (2, 1), schedule="1f1b")
    peaks = predict.peak_bytes(prof, 8, Config((2, 1), 1, 8, "never", "1f1b"), 2, cal.noinline_tasks)
    assert probe_fits.held_ratio_of_cut(prof, shape, peaks, 2, cal) is None


def test_a_probe_warms_up_its_steps_and_no_more():
    import keras
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensors((np.ones((8, 4), "float32"), np.ones((8, 2), "float32"))).repeat()
    calibration_lib.warm_up(model, data, seconds=60.0, steps=calibration_lib.PROBE_WARM_STEPS)
    assert int(model.optimizer.iterations) == calibration_lib.PROBE_WARM_STEPS  # 2 traced, then 8 (not 10)
    calibration_lib.warm_up(model, data, seconds=0.0)
    assert int(model.optimizer.iterations) == calibration_lib.PROBE_WARM_STEPS + 2  # no time to warm: traced only
