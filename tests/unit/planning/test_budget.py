"""Per-device memory budgets: parsed per device, each cell's state counted exactly, refusals that name the fix."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices
from tfpipe.partition import deferred
from tfpipe.planning import budget


def test_budgets_one_for_all_one_per_cell_or_by_device():
    devices = ["/CPU:0", "/CPU:1"]
    assert budget.budgets("1KiB", devices) == [1024.0, 1024.0]
    assert budget.budgets([100, "1 KiB"], devices) == [100.0, 1024.0]
    assert budget.budgets({"/CPU:1": 5, "/CPU:0": 7}, devices) == [7.0, 5.0]
    with pytest.raises(ValueError, match=r"3 entries for 2 cells' devices"):
        budget.budgets([1, 2, 3], devices)
    with pytest.raises(ValueError, match=r"leaves out \['/CPU:1'\]"):
        budget.budgets({"/CPU:0": 5}, devices)
    with pytest.raises(ValueError, match=r"memory_budget\[1\] must be a number of bytes"):
        budget.budgets([1, "lots"], devices)


def test_cell_state_counts_gradients_of_what_it_trains_and_slots_of_what_it_owns():
    layer = keras.layers.Dense(4)  # kernel 3x4 + bias 4 = 16 floats = 64 bytes
    layer.build((None, 3))
    mine = budget.cell_state("/CPU:0", layer.weights, layer.trainable_weights, set(), slots=2)
    assert (mine.weights, mine.gradients, mine.slots, mine.total) == (64.0, 64.0, 128.0, 256.0)
    tied = budget.cell_state("/CPU:1", layer.weights, layer.trainable_weights, {id(layer.kernel)}, slots=2)
    assert (tied.weights, tied.gradients, tied.slots) == (64.0, 64.0, 32.0)  # the kernel's slots live with its owner


def test_smallest_cut_is_the_fewest_cells_whose_state_fits():
    assert budget.smallest_cut([4, 4, 4, 4], 8) == (2, [2, 2])
    assert budget.smallest_cut([4, 4, 4, 4], 16) == (1, [4])
    assert budget.smallest_cut([4, 9, 4], 8) is None


def _dense_model() -> keras.Model:
    inputs = keras.Input((256,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(256)(h)  # 257 KiB of weights each
    return keras.Model(inputs, h)


def test_a_deferred_model_over_budget_is_refused_before_any_weight_is_made():
    with tfpipe.deferred_weights():
        model = _dense_model()
    with pytest.raises(ValueError) as refused:
        tfpipe.PipelineModel(model, num_partitions=2, devices=cpu_devices(2), memory_budget="600KiB")
    message = str(refused.value)
    assert "Cell 0 on /CPU:0 needs at least 1.01 MiB" in message and "memory_budget of 600 KiB" in message
    assert "K=4 cells cut by state (balance=[1, 1, 1, 1])" in message and "at least 1.01 MiB" in message
    assert all(deferred.waiting(v) for v in model.weights)


def test_the_compiled_optimizers_slots_are_counted_before_the_first_step():
    layers = [keras.layers.Dense(256) for _ in range(4)]
    model = tfpipe.PipelineModel(layers, num_partitions=2, devices=cpu_devices(2), memory_budget=["3MiB", "1.5MiB"])
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((8, 256), "float32")
    with pytest.raises(ValueError, match=r"Cell 1 on /CPU:1 needs at least 2.01 MiB .*adam's slots 1 MiB.*fewer slots"):
        model.fit(x, x, verbose=0)
    model.compile(optimizer="sgd", loss="mse")  # no slots: 1.01 MiB fits
    model.fit(x, x, verbose=0)


def test_a_budget_with_a_plan_belongs_to_the_planner():
    plan = object()
    with pytest.raises(ValueError, match="give the budget to tfpipe.plan"):
        tfpipe.PipelineModel([keras.layers.Dense(2)], plan=plan, memory_budget="1GiB")


def test_cells_sharing_a_device_are_held_to_its_budget_together():
    # Each cell alone (1.01 MiB with Adam's slots) fits 1.5 MiB; cells 0 and 2 on /CPU:0 together do not.
    layers = [keras.layers.Dense(256) for _ in range(4)]
    model = tfpipe.PipelineModel(
        layers, num_partitions=4, devices=cpu_devices(2), schedule="interleaved_1f1b", memory_budget="1.5MiB"
    )
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((8, 256), "float32")
    with pytest.raises(ValueError, match=r"Cells 0 and 2 on /CPU:0 need at least 2.01 MiB for their state") as err:
        model.fit(x, x, verbose=0)
    # the hint counts devices of two cells each, not cells: no number of them holds two 1.01 MiB cells in 1.5 MiB
    assert "no number of devices of 2 cells each holds it within 1.5 MiB" in str(err.value)


def test_the_fewest_devices_of_several_cells_each():
    # eight equal units, two cells a device: each device holds a quarter of the units at 2 devices, an eighth at 4
    assert budget.smallest_shared_cut([1.0] * 8, 2.5, 2) == (4, [1] * 8)
    assert budget.smallest_shared_cut([1.0] * 8, 4.0, 2) == (2, [2] * 4)
    assert budget.smallest_shared_cut([3.0] + [1.0] * 7, 2.5, 2) is None  # one unit alone is over
