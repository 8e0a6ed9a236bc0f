"""Checking a user's balance and the uniform split."""

import itertools

import numpy as np
import pytest

from tfpipe import balance


def test_uniform_split():
    assert balance.uniform(10, 4) == [3, 3, 2, 2]
    assert balance.uniform(3, 3) == [1, 1, 1]
    assert balance.uniform(5, 1) == [5]


def test_uniform_errors():
    with pytest.raises(ValueError, match="more than the 3 layers"):
        balance.uniform(3, 4)
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1"):
        balance.uniform(3, 0)


def test_check_errors():
    assert balance.check((1, 2), 3) == [1, 2]
    with pytest.raises(ValueError, match=r"sums to 4 but there are 3 layers"):
        balance.check([2, 2], 3)
    with pytest.raises(ValueError, match="at least one layer"):
        balance.check([3, 0], 3)
    with pytest.raises(TypeError, match="must be ints"):
        balance.check([1.5, 1.5], 3)
    with pytest.raises(TypeError, match="must be a list of ints"):
        balance.check(3, 3)
    with pytest.raises(ValueError, match="balance is empty"):
        balance.check([], 3)


def _brute_force(costs, k, crossing=None):
    """The best split by exhaustive search, compared as (max cost, sum of squares, crossing bytes)."""
    n = len(costs)
    crossing = crossing or [0.0] * n
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        cells = [sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        key = (max(cells), sum(c * c for c in cells), sum(crossing[c - 1] for c in cuts))
        if best is None or _better(key, best[0]):
            best = (key, [b - a for a, b in zip(bounds[:-1], bounds[1:])])
    return best


def _better(a, b):
    for x, y in zip(a, b):
        if abs(x - y) > 1e-9 * max(1.0, abs(y)):
            return x < y
    return False


def _key(costs, crossing, split):
    bounds = np.cumsum([0] + split)
    cells = [sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return (max(cells), sum(c * c for c in cells), sum(crossing[c - 1] for c in bounds[1:-1]))


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 13))
    k = int(rng.integers(1, min(n, 5) + 1))
    # integer costs from a small range make many ties, so the tie-breaks are exercised
    costs = [float(c) for c in (rng.integers(0, 4, n) if seed % 2 else rng.uniform(0, 10, n))]
    crossing = [float(c) for c in rng.integers(1, 100, n)]
    split = balance.partition(costs, k, boundary_bytes=crossing)
    assert len(split) == k and sum(split) == n and min(split) >= 1
    want_key, _ = _brute_force(costs, k, crossing)
    got_key = _key(costs, crossing, split)
    assert not _better(want_key, got_key), (costs, k, split, got_key, want_key)


def test_partition_of_a_large_model_balances_its_bottleneck():
    costs = np.random.default_rng(0).uniform(0, 1, 1000)
    split = balance.partition(costs, 64)
    assert len(split) == 64 and sum(split) == 1000
    bounds = np.cumsum([0] + split)
    worst = max(costs[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:]))
    # no contiguous split can beat the average, nor the largest single layer
    assert worst >= max(costs.sum() / 64, costs.max()) - 1e-9
    assert worst <= costs.sum() / 64 + costs.max() + 1e-9  # the greedy bound a heuristic guarantees


def test_partition_errors():
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        balance.partition([1, 2], 0)
    with pytest.raises(ValueError, match="Cannot cut 2 layers into 3 non-empty cells"):
        balance.partition([1, 2], 3)
    with pytest.raises(ValueError, match=r"costs\[1\] = -1.0; every per-layer cost must be finite and >= 0"):
        balance.partition([1, -1], 1)
    with pytest.raises(ValueError, match=r"costs\[0\] = nan"):
        balance.partition([float("nan")], 1)
    with pytest.raises(ValueError, match="boundary_bytes has 1 entries for 2 layers"):
        balance.partition([1, 2], 2, boundary_bytes=[3])


@pytest.mark.slow  # a benchmark's whole run
def test_benchmark_script_runs_in_its_smallest_mode():
    from tests.util import run_script

    proc = run_script("benchmark_balance.py", "--sizes=12:3", "--repeats=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = proc.stdout.strip().splitlines()[-1].split()
    assert row[:2] == ["12", "3"] and float(row[3]) >= 1.0


# Balancing by estimated costs -------------------------------------------------------------------------
def _uneven_layers():
    """A wide first layer, then narrow ones: FLOPs put the cut right after the first layer."""
    import keras

    return [keras.layers.Dense(256), keras.layers.Dense(4), keras.layers.Dense(4), keras.layers.Dense(4)]


def test_by_flops_and_by_params_split_at_the_expensive_layer():
    x = np.ones((8, 64), "float32")
    split, costs = balance.by_flops(_uneven_layers(), 2, x, return_costs=True)
    assert split == [1, 3] and costs[0] == 2 * 64 * 256 + 256
    assert balance.by_params(_uneven_layers(), 2, sample=x) == [1, 3]
    assert balance.by_flops(_uneven_layers(), 1, x) == [4]


def test_by_params_of_built_layers_needs_no_sample():
    import keras

    model = keras.Sequential([keras.Input((64,)), *_uneven_layers()])
    split, costs = balance.by_params(model, 2, return_costs=True)
    assert split == [1, 3] and costs == [64 * 256 + 256, 256 * 4 + 4, 20, 20]
    with pytest.raises(ValueError, match=r"not built, so they have no parameters yet; pass sample="):
        balance.by_params(_uneven_layers(), 2)


def test_by_flops_breaks_ties_by_the_bytes_crossing_the_cut():
    import keras

    # 64 FLOPs each; cutting after layer 0 sends 8 floats, after layer 1 only 4: the narrow cut wins
    layers = [
        keras.layers.Dense(8, use_bias=False),
        keras.layers.Dense(4, use_bias=False),
        keras.layers.Dense(8, use_bias=False),
    ]
    split, costs = balance.by_flops(layers, 2, np.ones((2, 4), "float32"), return_costs=True)
    assert costs == [64.0, 64.0, 64.0] and split == [2, 1]


def test_by_time_leaves_weights_optimizer_and_state_unchanged():
    import keras

    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    x, y = np.random.default_rng(0).normal(size=(2, 32, 16)).astype("float32")[0], np.zeros((32, 2), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    split, costs = balance.by_time(model, 2, x[:8], return_costs=True, repeats=2)
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert len(split) == 2 and sum(split) == 4 and len(costs) == 4 and all(c > 0 for c in costs)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_by_memory_is_refused_without_a_reporting_allocator():
    with pytest.raises(ValueError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
        balance.by_memory(_uneven_layers(), 2, np.ones((4, 64), "float32"))


def test_by_cost_errors():
    x = np.ones((4, 64), "float32")
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        balance.by_flops(_uneven_layers(), 0, x)
    with pytest.raises(ValueError, match="Cannot cut 4 layers into 5 non-empty cells"):
        balance.by_flops(_uneven_layers(), 5, x)
    with pytest.raises(ValueError, match=r"Layer 0 \(.*\) cannot take the input .* from the sample"):
        import keras

        balance.by_flops([keras.layers.Conv2D(2, 3)], 1, x)


def test_efficiency_is_the_bubble_share_times_the_evenness():
    assert balance.cell_costs([1.0, 2.0, 3.0, 4.0], [2, 2]) == [3.0, 7.0]
    assert balance.evenness([3.0, 7.0]) == pytest.approx(5.0 / 7.0)
    assert balance.efficiency([3.0, 7.0], 4) == pytest.approx(4 / 5 * 5 / 7)
    assert balance.efficiency([2.0, 2.0, 2.0], 1) == pytest.approx(1 / 3)
    assert balance.evenness([0.0, 0.0]) == 1.0
