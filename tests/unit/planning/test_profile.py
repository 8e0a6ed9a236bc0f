"""What the planner measures per layer: alike layers (same class, configuration and inputs) share their times."""

import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.planning import profile as profile_lib
from tfpipe.planning import walk
from tfpipe.planning.progress import Progress


def test_alike_layers_get_their_mean_times_and_the_total_is_kept():
    costs = profile_lib.LayerCosts([1.0, 5.0, 3.0, 7.0, 2.0], [2.0, 1.0, 4.0, 9.0, 0.0], [1.0] * 5, [0.0] * 5)
    profile_lib.tie_alike(costs, ["dense", "norm", "dense", None, "dense"])
    assert costs.forward_s == [2.0, 5.0, 2.0, 7.0, 2.0]  # the three alike layers share 6.0; the others keep theirs
    assert costs.backward_s == [2.0, 1.0, 2.0, 9.0, 2.0]
    assert costs.held_bytes == [1.0] * 5  # bytes are read from the allocator, not timed: left as measured


def test_a_layers_kind_is_its_class_configuration_and_inputs_not_its_name():
    x8, x4 = tf.zeros((2, 8)), tf.zeros((2, 4))
    first, second = keras.layers.Dense(8, name="first"), keras.layers.Dense(8, name="second")
    assert walk.same_layer_key(first, x8) == walk.same_layer_key(second, x8)
    assert walk.same_layer_key(first, x8) != walk.same_layer_key(first, x4)  # another input: other work
    assert walk.same_layer_key(first, x8) != walk.same_layer_key(keras.layers.Dense(16), x8)
    assert walk.same_layer_key(first, x8) != walk.same_layer_key(keras.layers.Dense(8, activation="tanh"), x8)

    class Unconfigured(keras.layers.Layer):  # compared by its attributes, as keras_hub's Llama decoder block
        def __init__(self, scale, table=None, **kwargs):
            super().__init__(**kwargs)
            self._scale, self.table, self.activation = scale, table, keras.activations.relu

        def get_config(self):
            raise NotImplementedError

    assert walk.same_layer_key(Unconfigured(2.0, name="a"), x8) == walk.same_layer_key(Unconfigured(2.0), x8)
    assert walk.same_layer_key(Unconfigured(2.0), x8) != walk.same_layer_key(Unconfigured(3.0), x8)
    other = Unconfigured(2.0)
    other.activation = keras.activations.gelu
    assert walk.same_layer_key(other, x8) != walk.same_layer_key(Unconfigured(2.0), x8)
    assert walk.same_layer_key(Unconfigured(2.0, table=object()), x8) is None  # not comparable: timed on its own


def test_a_measured_profile_gives_alike_layers_one_time_and_others_their_own(monkeypatch):
    real, calls = profile_lib._unit_costs, []

    def unit_costs(*args, **kwargs):
        # the real run, with times that tell the calls apart: tiny layers' measured times can all round to 0 s
        per_size, over, trace_s = real(*args, **kwargs)
        assert trace_s > 0.0  # a traced function's first call: measured, not assumed
        calls.append(float(len(calls) + 1))
        return [(calls[-1], 10 * calls[-1], held, working) for _, _, held, working in per_size], over, 100 * calls[-1]

    monkeypatch.setattr(profile_lib, "_unit_costs", unit_costs)
    layers = [keras.layers.Dense(64, activation="tanh") for _ in range(4)] + [keras.layers.Dense(8)]
    measured = profile_lib.measure(layers, np.zeros((16, 64), "float32"), [4, 16], "/CPU:0", repeats=3)
    # the layers are not built: their weights are counted on the built copies that were measured
    assert measured.weight_bytes == measured.trainable_bytes == [(64 * 64 + 64) * 4.0] * 4 + [(64 * 8 + 8) * 4.0]
    assert calls == [1.0, 2.0, 3.0]  # two of the four alike Dense(64), then the Dense(8)
    for costs in measured.by_batch.values():
        assert costs.forward_s == [1.5] * 4 + [3.0]  # the mean of the two timed, and Dense(8) its own
        assert costs.backward_s == [15.0] * 4 + [30.0]
    assert measured.trace_s == [100.0, 200.0, 150.0, 150.0, 300.0]  # the first two their own, the rest their mean


def test_alike_layers_past_the_first_two_are_not_timed_but_given_their_mean(monkeypatch):
    timed = []
    real = profile_lib._unit_costs

    def unit_costs(walked, *args, **kwargs):
        timed.append(walked.copy.units)
        return real(walked, *args, **kwargs)

    monkeypatch.setattr(profile_lib, "_unit_costs", unit_costs)
    layers = [keras.layers.Dense(32, activation="tanh") for _ in range(5)] + [keras.layers.Dense(8)]
    measured = profile_lib.measure(layers, np.zeros((8, 32), "float32"), [2, 8], "/CPU:0", repeats=1)
    assert timed == [32, 32, 8]  # the first two Dense(32) and the Dense(8): five alike, three not timed
    assert "(3 given the times of the first 2 of their kind)" in measured.time_source
    for costs in measured.by_batch.values():
        assert len(set(costs.forward_s[:5])) == 1
        assert costs.held_bytes[2:5] == [np.mean(costs.held_bytes[:2])] * 3  # their bytes too, where not read


def test_a_size_predicted_over_the_budget_alone_is_scaled_from_a_smaller_one_and_said():
    layers = [keras.layers.Dense(64, activation="tanh") for _ in range(2)]
    sizes = [4, 16, 256]
    roomy = profile_lib.measure(layers, np.zeros((256, 64), "float32"), sizes, "/CPU:0", repeats=1)
    assert roomy.not_run == []
    weights = (64 * 64 + 64) * 4.0  # and as much again in gradients; the walk's input and output of 256 rows
    walk = 2 * 256 * 64 * 4.0
    budget = 2 * weights + walk + 100 * 64 * 4.0 * 5  # 16 rows fit, 256 do not, by any of the ways bytes are counted
    tight = profile_lib.measure(layers, np.zeros((256, 64), "float32"), sizes, "/CPU:0", repeats=1, budget=budget)
    big, middle = tight.by_batch[256], tight.by_batch[16]
    for values, smaller in zip(
        (big.forward_s, big.backward_s, big.held_bytes, big.working_bytes),
        (middle.forward_s, middle.backward_s, middle.held_bytes, middle.working_bytes),
    ):
        np.testing.assert_allclose(values, [v * 16 for v in smaller])  # 256 / 16 rows, in proportion
    assert tight.not_run == [
        "2 unit(s) alone at 256 samples not run (predicted over the budget alone): scaled from a smaller size "
        f"({layers[0].name}, {layers[1].name})"
    ]


def test_bytes_read_on_a_stand_in_are_read_once_per_kind(monkeypatch):
    made = []

    class Counted(profile_lib._Measured):
        def __init__(self, copies, device):
            made.append([type(c).__name__ + str(getattr(c, "units", "")) for c in copies])
            super().__init__(copies, device)

        def held(self, x, memory):
            rows = int(tf.nest.flatten(x)[0].shape[0])
            return float(rows * len(made)), float(rows)  # which reading it was, and its rows

    monkeypatch.setattr(profile_lib, "_Measured", Counted)
    layers = [keras.layers.Dense(16, activation="tanh") for _ in range(4)] + [keras.layers.Dense(8)]
    out, notes = profile_lib._bytes_on(layers, np.zeros((4, 16), "float32"), [2, 4], "/CPU:0", "CPU:0", None, None)
    assert made == [["Dense16"], ["Dense8"]] and notes == []  # the four alike Dense(16) read once, at every size
    assert [got for got, _ in out] == [[(2.0, 2.0), (4.0, 4.0)]] * 4 + [[(4.0, 2.0), (8.0, 4.0)]]
    assert all(over == set() for _, over in out)


def _bytes_clocked(monkeypatch):
    """Reading a Dense(u)'s bytes at b rows takes 1 s of a fake clock and gives (u * b, b); the sizes each read at,
    and the rows each was traced at first without reading (``prime``)."""
    clock, read, primed = [0.0], {}, {}
    real_prime = profile_lib._Measured.prime

    def held(self, x, memory):
        clock[0] += 1.0
        rows, units = int(tf.nest.flatten(x)[0].shape[0]), self._copies[0].units
        read.setdefault(units, []).append(rows)
        return float(units * rows), float(rows)

    def prime(self, x):
        primed.setdefault(self._copies[0].units, []).append(int(x.shape[0]))
        real_prime(self, x)

    monkeypatch.setattr(profile_lib, "timeit", types.SimpleNamespace(default_timer=lambda: clock[0]))
    monkeypatch.setattr(profile_lib._Measured, "held", held)
    monkeypatch.setattr(profile_lib._Measured, "prime", prime)
    return read, primed


@pytest.mark.parametrize("max_seconds, later", [(None, [2, 4, 8]), (64.0, [2, 4, 8]), (24.0, [4])])
def test_bytes_on_a_stand_in_are_read_at_the_middle_size_alone_where_their_pace_passes_their_share(
    monkeypatch, max_seconds, later
):
    read, primed = _bytes_clocked(monkeypatch)
    layers = [keras.layers.Dense(units) for units in range(8, 13)]  # five kinds: each read
    # A quarter of max_seconds for the bytes. The first at three sizes (3 s); then the four left at three sizes need
    # 12 s: by 16 s they fit; by 6 s not, nor (each read at one size, 1 s) the three, two or one left after it
    progress = Progress(verbose=0, max_seconds=max_seconds)
    x = np.zeros((4, 8), "float32")
    out, notes = profile_lib._bytes_on(layers, x, [2, 4, 8], "/CPU:0", "CPU:0", None, progress)
    # at one size, once three were read (COUNTED_FROM) the rest are not: counted on the device (``_by_count``)
    read_units = range(8, 11) if later == [4] else range(8, 13)
    assert read[8] == [2, 4, 8] and all(read[u] == later for u in read_units[1:]), str(read)
    assert sorted(read) == list(read_units) and out[len(read_units) :] == [None] * (13 - read_units[-1] - 1)
    # each read traced general in the rows first (fed the smallest size): every size it is read at runs that trace
    assert primed == {u: [2] for u in read_units}
    # the sizes not read scaled as the first (read at every size) scales: here each unit's own bytes
    assert [got for got, _ in out[: len(read_units)]] == [[(u * b, b) for b in (2, 4, 8)] for u in read_units]
    assert all(over == set() for _, over in out[: len(read_units)])
    if later == [4]:
        assert notes == [
            f"2 layer(s) ({layers[1].name}, {layers[2].name}) read for their bytes on /CPU:0 at 4 of [2, 4, 8] rows "
            "only, to keep to 25% of the time left within max_seconds; the other sizes scaled as the layer read at "
            "every size before them"
        ]
    else:
        assert notes == []


def test_under_auto_the_bytes_keep_to_their_share_of_the_least_bound(monkeypatch):
    monkeypatch.setattr(profile_lib, "timeit", types.SimpleNamespace(default_timer=lambda: 100.0))
    asked = []

    def auto_bound(step):  # the planner's: here its floor, whatever the step
        asked.append(step)
        return 30.0

    until = profile_lib._bytes_deadline(Progress(verbose=0), auto_bound)
    assert asked == [0.0] and 100.0 + 0.25 * 29.0 < until <= 100.0 + 0.25 * 30.0
    assert profile_lib._bytes_deadline(Progress(verbose=0), None) == float("inf")  # no bound
    assert profile_lib._bytes_deadline(None, auto_bound) == float("inf")
    assert profile_lib._bytes_deadline(Progress(verbose=0, max_seconds=8.0), auto_bound) <= 102.0  # the bound given


def test_a_size_not_read_but_predicted_over_the_budget_is_marked_over(monkeypatch):
    read, primed = _bytes_clocked(monkeypatch)
    layers = [keras.layers.Dense(8), keras.layers.Dense(64)]
    x = np.zeros((4, 8), "float32")
    # Dense(64) read at 4 rows (no time left; under a budget at 2 rows first, to predict 4): its weights and
    # gradients (4608 bytes), its input and output at 2 rows (576) and per row its input and bytes (32 + 65) go over
    # 5800 bytes at 8 rows, not at 4
    progress = Progress(verbose=0, max_seconds=0.0)
    out, _ = profile_lib._bytes_on(layers, x, [2, 4, 8], "/CPU:0", "CPU:0", 5800.0, progress)
    assert read == {8: [2, 4, 8], 64: [2, 4]} and primed == {8: [2], 64: [2]}
    assert out[1][1] == {8} and out[0][1] == set()
    assert out[1][0][2] == (64 * 8, 8)  # scaled as the first, all the same


def test_a_unit_run_at_one_size_is_a_line_in_the_rows_through_it_with_a_fixed_part_per_op():
    sizes = profile_lib._Sizes([1, 4, 16], [4], fixed=(0.001, 0.002), ops=(100, 300))
    got = sizes.scaled({4: (0.5, 1.0, 40.0, 80.0)})
    # forward 0.1 s fixed (100 ops), its other 0.4 s by the rows; backward 0.6 fixed, 0.4 by the rows; bytes by the rows
    np.testing.assert_allclose(got, [(0.2, 0.7, 10.0, 20.0), (0.5, 1.0, 40.0, 80.0), (1.7, 2.2, 160.0, 320.0)])
    # a fixed part past FIXED_SHARE of the time (a small layer's per op, given to many ops) is cut there; none: by rows
    got = profile_lib._Sizes([1, 4, 16], [4], fixed=(0.01, 0.0), ops=(100, 300)).scaled({4: (0.5, 1.0, 40.0, 80.0)})
    fixed = profile_lib.FIXED_SHARE * 0.5
    np.testing.assert_allclose([f for f, *_ in got], [fixed + (0.5 - fixed) / 4, 0.5, fixed + (0.5 - fixed) * 4])
    np.testing.assert_allclose([b for _, b, *_ in got], [0.25, 1.0, 4.0])


def test_a_units_ops_are_counted_in_its_traced_forward_and_backward():
    x = tf.ones((4, 8))
    counted = []
    for n in (1, 2):
        layers = [keras.layers.Dense(8) for _ in range(n)]
        for layer in layers:
            layer.build((None, 8))
        measured = profile_lib._Measured(layers, "/CPU:0")
        measured.seconds(x, 1, 0.0)
        counted.append(measured.ops(x))
    (forward_1, backward_1), (forward_2, backward_2) = counted
    assert 0 < forward_1 < forward_2 and 0 < backward_1 < backward_2, counted
    assert backward_1 > forward_1  # a Dense's gradients (its kernel's, its bias', its input's) outnumber its forward


def test_the_first_trace_of_the_process_is_paid_before_any_unit_is_traced(monkeypatch):
    order = []
    real_pay, real_costs = profile_lib._pay_first_trace, profile_lib._unit_costs
    monkeypatch.setattr(profile_lib, "_pay_first_trace", lambda device: order.append("paid") or real_pay(device))
    monkeypatch.setattr(profile_lib, "_unit_costs", lambda *a, **k: order.append("unit") or real_costs(*a, **k))
    layers = [keras.layers.Dense(8), keras.layers.Dense(4)]
    measured = profile_lib.measure(layers, np.zeros((4, 8), "float32"), [2], "/CPU:0", repeats=1)
    assert order == ["paid", "unit", "unit"]
    # what each unit's tracing took is its own (no bound on it: under the suite's load a Dense's took 0.04-0.25 s)
    assert len(measured.trace_s) == 2 and all(t > 0.0 for t in measured.trace_s), measured.trace_s


def _clocked(monkeypatch):
    """Each unit's tracing and each size it is measured at take 1 s of a fake clock; its times are 1 s that does not
    scale plus units x rows / 8 (forward) and twice that (backward), not in proportion to the rows: a size not run must
    carry that. Each unit has 10 forward and 20 backward ops. Returns the rows each Dense(units) was run at, its
    warm-ups, the units of each Dense measured, and the forward shares each was timed with."""
    clock = [0.0]
    run: dict[int, list[int]] = {}
    warmed: dict[int, set[float]] = {}
    shares: dict[int, set[float | None]] = {}  # the forward shares each Dense was timed with (None: timed alone)
    traces: list[int] = []  # the units of each Dense traced (measured)

    def seconds(self, x, repeats, warm_s, forward_share=None):
        clock[0] += 1.0
        rows, units = int(x.shape[0]), self._copies[0].units
        run.setdefault(units, []).append(rows)
        warmed.setdefault(units, set()).add(warm_s)
        shares.setdefault(units, set()).add(forward_share)
        if forward_share is not None:  # the forward not timed alone: the share of the two together
            return 3 * _clocked_s(units, rows) * forward_share, 3 * _clocked_s(units, rows) * (1 - forward_share)
        return _clocked_s(units, rows), 2 * _clocked_s(units, rows)

    def traced(self, x):
        clock[0] += 1.0
        traces.append(self._copies[0].units)
        return 0.01

    monkeypatch.setattr(profile_lib, "timeit", types.SimpleNamespace(default_timer=lambda: clock[0]))
    monkeypatch.setattr(profile_lib._Measured, "seconds", seconds)
    monkeypatch.setattr(profile_lib._Measured, "traced", traced)
    monkeypatch.setattr(profile_lib._Measured, "ops", lambda self, x: (10, 20))
    monkeypatch.setattr(profile_lib, "_pay_first_trace", lambda device: None)
    return run, warmed, traces, shares


def _clocked_s(units, rows):
    return 1.0 + units * rows / 8


@pytest.mark.parametrize(
    "max_seconds, later",
    [(None, [2, 4, 8]), (39.0, [2, 8]), (29.0, [4])],  # none, then the ends, then the middle
)
def test_under_max_seconds_later_layers_are_measured_at_fewer_sizes_the_others_interpolated_or_scaled(
    monkeypatch, max_seconds, later
):
    run, warmed, _, shares = _clocked(monkeypatch)
    layers = [keras.layers.Dense(units) for units in range(8, 14)]  # six kinds: each timed
    # half of max_seconds for the layers: 4 s the first (three sizes and its tracing), 3 or 2 s each after
    progress = Progress(verbose=0, max_seconds=max_seconds)
    measured = profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=progress)
    assert run[8] == [2, 4, 8] and all(run[units] == later for units in range(9, 14)), str(run)
    # those measured at fewer sizes warmed up for less; those at one size timed their forward and backward together,
    # split by the forward's share of the first (a third)
    assert warmed[8] == {0.3} and all(warmed[u] == {0.3 if later == [2, 4, 8] else 0.1} for u in range(9, 14))
    split = [1 / 3] if len(later) == 1 else [None]
    assert shares[8] == {None} and all(list(shares[u]) == pytest.approx(split) for u in range(9, 14))
    for b, costs in measured.by_batch.items():  # each layer's own times at every size, those not run given so
        # run at 4 rows alone: the first's fixed part per op (1 s over 10 ops forward, 2 over 20 backward) and the
        # rest by the rows give the line exactly; between two sizes run, interpolated in log-log (within 4% here)
        rtol = 0.04 if b not in later else 1e-9
        np.testing.assert_allclose(costs.forward_s, [_clocked_s(units, b) for units in range(8, 14)], rtol=rtol)
        np.testing.assert_allclose(costs.backward_s, [2 * _clocked_s(units, b) for units in range(8, 14)], rtol=rtol)
    notes = [n for n in measured.not_run if "measured alone at" in n]
    if later == [2, 4, 8]:
        assert notes == []
    else:
        assert notes == [
            f"5 layer(s) ({', '.join(layer.name for layer in layers[1:4])}, ...) measured alone at {later} of [2, 4, 8]"
            " rows only, to keep the layers to 50% of the time left within max_seconds; "
            + (
                "the sizes between interpolated"
                if len(later) > 1
                else "the other sizes by the rows beyond a fixed part per op, of the layers timed at several sizes"
            )
        ]


def test_a_unit_of_many_more_ops_than_those_lined_is_timed_at_two_sizes_and_joins_them(monkeypatch):
    run, _, _, _ = _clocked(monkeypatch)
    ops = {12: (100, 200)}  # Dense(12) has ten times the ops of the others (10 forward, 20 backward)
    monkeypatch.setattr(profile_lib._Measured, "ops", lambda self, x: ops.get(self._copies[0].units, (10, 20)))
    layers = [keras.layers.Dense(units) for units in range(8, 14)]
    progress = Progress(verbose=0, max_seconds=29.0)  # the middle alone, past the first (as above)
    measured = profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=progress)
    assert [run[units] for units in range(8, 14)] == [[2, 4, 8], [4], [4], [4], [2, 8], [4]], str(run)
    # Dense(13) after it: 1 s forward fixed over 10 ops and 1 over 100 together, 2/110 s per op, times its 10 ops
    # (Dense(12)'s middle interpolated, so within 1%); 1 s of it alone (0.1 per op) would give 1 s
    forward = [measured.by_batch[b].forward_s[5] for b in (2, 4, 8)]
    fixed = 2.0 / 110 * 10
    expected = [fixed + (_clocked_s(13, 4) - fixed) * b / 4 for b in (2, 4, 8)]
    np.testing.assert_allclose(forward, expected, rtol=0.01)
    assert abs(forward[0] - (1.0 + (_clocked_s(13, 4) - 1.0) / 2)) > 0.3


@pytest.mark.parametrize("max_seconds", [None, 29.0])
def test_under_max_seconds_only_the_first_of_a_kind_is_timed(monkeypatch, max_seconds):
    _, _, traces, _ = _clocked(monkeypatch)
    layers = [keras.layers.Dense(8), keras.layers.Dense(12), keras.layers.Dense(16), keras.layers.Dense(16)]
    layers += [keras.layers.Dense(16)]  # the last three: the first reads 12 columns, the other two alike
    progress = Progress(verbose=0, max_seconds=max_seconds)
    measured = profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=progress)
    pressed = max_seconds is not None
    # Dense(16) measured for the one reading 12 columns, then for the first reading 16, and (unbounded) the second
    assert traces == [8, 12, 16, 16] + ([] if pressed else [16]), traces
    expected = "(1 given the times of the first 2 of their kind, or of the first alone to keep to max_seconds)"
    assert (expected in measured.time_source) == pressed, measured.time_source
    assert measured.by_batch[8].forward_s[3] == measured.by_batch[8].forward_s[4]


def test_under_max_seconds_auto_the_layers_keep_to_the_bound_their_own_step_gives_as_they_go(monkeypatch):
    run, _, _, _ = _clocked(monkeypatch)
    steps = []

    def auto_bound(step):  # the planner's: 200 such steps over the devices, at least 30 s; here as max_seconds=39
        steps.append(step)
        return 39.0

    layers = [keras.layers.Dense(units) for units in range(8, 14)]
    progress = Progress(verbose=0)  # "auto": no bound until the layers are measured
    x = np.zeros((8, 8), "float32")
    measured = profile_lib.measure(layers, x, [2, 4, 8], "/CPU:0", progress=progress, auto_bound=auto_bound)
    assert all(run[units] == [2, 8] for units in range(9, 14)), str(run)  # as under max_seconds=39
    # after the first layer: its step at the largest size, 8 rows, times the six layers; then the two done, ...
    np.testing.assert_allclose(steps[0], 6 * 3 * _clocked_s(8, 8))
    np.testing.assert_allclose(steps[1], 6 * 3 * (_clocked_s(8, 8) + _clocked_s(9, 8)) / 2)
    assert len(measured.by_batch[8].forward_s) == 6
    # without auto_bound, or with a bound given, auto_bound is not asked
    steps.clear()
    profile_lib.measure(
        layers, x, [2, 4, 8], "/CPU:0", progress=Progress(verbose=0, max_seconds=1e6), auto_bound=auto_bound
    )
    assert steps == []


def _sleeper(seconds: float, calls: list[int], spell: range) -> object:
    """A run that sleeps ``seconds``, 20 ms more while the count of every sleeper's runs is in ``spell``."""

    def run() -> None:
        calls[0] += 1
        time.sleep(seconds + (0.02 if calls[0] in spell else 0.0))

    return run


def test_a_difference_timed_in_pairs_keeps_out_a_slow_spell_that_two_medians_in_a_row_carry():
    # warm-up (warm_s=0): a trace run and one more each; then 9 pairs, the first five within the slow spell
    calls = [0]
    paired = profile_lib.median_difference(
        _sleeper(0.006, calls, range(5, 15)), _sleeper(0.002, calls, range(5, 15)), 9, warm_s=0.0
    )
    assert 0.002 < paired < 0.008  # 4 ms apart, spell or not
    calls = [0]  # the same spell on two medians taken one after the other: it falls on the first alone
    slow, fast = _sleeper(0.006, calls, range(3, 13)), _sleeper(0.002, calls, range(3, 13))
    in_a_row = profile_lib.median_seconds(slow, 9, warm_s=0.0) - profile_lib.median_seconds(fast, 9, warm_s=0.0)
    assert in_a_row > 0.015


def test_a_difference_at_or_under_zero_is_timed_again():
    # a spell on the base's runs of the first 9 pairs (calls 5-22: 2 warm-ups each, then base on even calls) makes
    # their median negative; the second 9 pairs see none
    calls = [0]
    spell = range(6, 23, 2)
    paired = profile_lib.median_difference(_sleeper(0.006, calls, range(0)), _sleeper(0.002, calls, spell), 9, 0.0)
    assert calls[0] == 4 + 2 * 2 * 9 and 0.002 < paired < 0.008  # 4 ms apart
    calls = [0]  # given one try, the spell's median is what comes back
    once = profile_lib.median_difference(_sleeper(0.006, calls, range(0)), _sleeper(0.002, calls, spell), 9, 0.0, 1)
    assert calls[0] == 4 + 2 * 9 and once < -0.01


def _grads(units):
    """The bytes of a chain of Dense(8), Dense(9), ... fed 8 features: Dense(units)' weights' gradients."""
    return 4.0 * units * (max(units - 1, 8) + 1)


def test_under_max_seconds_later_layers_bytes_are_their_count_times_what_those_read_showed(monkeypatch):
    run, _, _, _ = _clocked(monkeypatch)
    read: dict[int, list[int]] = {}  # per Dense(units): the rows its bytes were read at

    def held(self, x, memory):
        rows, units = int(x.shape[0]), self._copies[0].units
        read.setdefault(units, []).append(rows)
        count = units * rows * 4.0
        return 3.0 * count, count + _grads(units)  # three times its count held, once more and its gradients working

    monkeypatch.setattr(profile_lib._Measured, "held", held)
    monkeypatch.setattr(profile_lib._Measured, "counted", lambda self, rows: self._copies[0].units * rows * 4.0)
    monkeypatch.setattr(profile_lib, "stand_in", lambda device: device)
    monkeypatch.setattr(profile_lib, "memory_name", lambda device: "CPU:0")
    layers = [keras.layers.Dense(units) for units in range(8, 14)]
    progress = Progress(verbose=0, max_seconds=29.0)  # past the first, each at the middle size alone
    measured = profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=progress)
    assert run[9] == [4] and run[13] == [4], str(run)
    # read: the first at every size, the next two (too few read at 4 rows before them to go by) at 4; the rest
    # given their count times the median of what those three showed per counted byte
    assert profile_lib.COUNTED_FROM == 3 and read == {8: [2, 4, 8], 9: [4], 10: [4]}
    for b, costs in measured.by_batch.items():  # at 4 rows all; at every size the counted, by their count there
        counted = range(8, 14) if b == 4 else range(11, 14)
        np.testing.assert_allclose([costs.held_bytes[u - 8] for u in counted], [3.0 * u * b * 4 for u in counted])
        working = [u * b * 4.0 + _grads(u) for u in counted]
        np.testing.assert_allclose([costs.working_bytes[u - 8] for u in counted], working)
    assert [n for n in measured.not_run if "bytes not read" in n] == [
        f"3 layer(s) ({', '.join(layer.name for layer in layers[3:6])})' bytes not read (to keep to "
        "max_seconds): the tensors their backward reads, counted in their traces, times what the layers read before "
        "showed per counted byte"
    ]
    # without a bound every layer's bytes are read
    read.clear()
    profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=Progress(verbose=0))
    assert read == {units: [2, 4, 8] for units in range(8, 14)}


def test_counted_ratios_are_the_median_at_the_nearest_size_two_units_were_read_at():
    counted = profile_lib._Counted()
    counted.add(4, 100.0, 300.0, 50.0, 0.0)
    counted.add(4, 200.0, 400.0, 260.0, 60.0)  # working bytes less the gradients: 200
    assert counted.ratios(4) is None  # two units read are not enough to go by
    counted.add(4, 100.0, 900.0, 100.0, 0.0)
    counted.add(1, 10.0, 0.0, 10.0, 0.0)
    counted.add(1, 10.0, 0.0, 10.0, 0.0)
    # at 8 rows 4 is the nearest read; at 1 row too: two units read at 1 are not enough to go by
    assert counted.ratios(4) == counted.ratios(8) == counted.ratios(1) == (3.0, 1.0)


def test_a_stand_in_reads_no_more_units_once_three_were_read_and_their_pace_passes():
    pace = profile_lib._BytesPace([2, 4, 8], 6, until=0.0)
    assert pace.sizes() == [2, 4, 8]  # the first: at every size
    pace.took(0, 3.0, [2, 4, 8], [(1.0, 1.0)] * 3)
    for unit in range(1, profile_lib.COUNTED_FROM + 1):
        pace.done += 1
        # past the time: the middle alone while fewer were read; then none, counted on the device
        assert pace.sizes() == ([4] if unit < profile_lib.COUNTED_FROM else [])
        pace.took(unit, 1.0, [4], [(1.0, 1.0)] * 3)


def test_units_a_stand_in_left_unread_are_counted_in_their_trace_on_the_device(monkeypatch):
    _clocked(monkeypatch)
    held_calls = []
    monkeypatch.setattr(profile_lib._Measured, "held", lambda self, x, memory: held_calls.append(1))
    monkeypatch.setattr(profile_lib._Measured, "counted", lambda self, rows: self._copies[0].units * rows * 4.0)
    monkeypatch.setattr(profile_lib, "stand_in", lambda device: "/CPU:9")
    monkeypatch.setattr(profile_lib, "memory_name", lambda device: "CPU:9")
    # twice the count held; half of it working, beside the weights' gradients
    read = [[(2.0 * u * b * 4, 0.5 * u * b * 4 + _grads(u)) for b in (2, 4, 8)] for u in (8, 9, 10)]
    monkeypatch.setattr(profile_lib, "_bytes_on", lambda *a: ([(r, set()) for r in read] + [None] * 3, []))
    layers = [keras.layers.Dense(units) for units in range(8, 14)]
    measured = profile_lib.measure(layers, np.zeros((8, 8), "float32"), [2, 4, 8], "/CPU:0", progress=Progress(0))
    assert held_calls == []  # nothing read on the device itself
    for b in (2, 4, 8):
        np.testing.assert_allclose(measured.by_batch[b].held_bytes, [2.0 * u * b * 4 for u in range(8, 14)])
        working = [0.5 * u * b * 4 + _grads(u) for u in range(8, 14)]
        np.testing.assert_allclose(measured.by_batch[b].working_bytes, working)
    assert any(n.startswith("3 layer(s) (") and "' bytes not read" in n for n in measured.not_run)


def test_a_unit_timed_with_a_forward_share_never_traces_its_forward_alone():
    dense = keras.layers.Dense(1024, activation="tanh")  # milliseconds a run: well above a call's cost, under load too
    x = tf.ones((256, 1024))
    dense(x)
    measured = profile_lib._Measured([dense], "/CPU:0")
    measured.traced(x)
    forward_ops, backward_ops = measured.ops(x)  # split in the forward and backward's own trace
    assert 0 < forward_ops < backward_ops
    forward_s, backward_s = measured.seconds(x, repeats=3, warm_s=0.0, forward_share=0.25)
    assert forward_s > 0 and backward_s == pytest.approx(3 * forward_s)
    assert measured._forward.experimental_get_tracing_count() == 0
    measured.seconds(x, repeats=3, warm_s=0.0)  # timed alone: traced now
    assert measured._forward.experimental_get_tracing_count() == 1
