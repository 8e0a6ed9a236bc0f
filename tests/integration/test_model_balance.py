"""PipelineModel(num_partitions=K, cost=...): when and how the cells are balanced, and what summary shows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, mlp_layers


def _uneven_layers():
    return [keras.layers.Dense(256), keras.layers.Dense(4), keras.layers.Dense(4), keras.layers.Dense(4)]


def _lines(model):
    lines = []
    model.summary(print_fn=lines.append)
    return lines


def test_flops_balance_is_decided_at_build_on_copies():
    model = tfpipe.PipelineModel(_uneven_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2)
    assert model.balance is None and model.cells == [] and model.cost == "flops"
    assert any("decided at build, from cost='flops'" in line for line in _lines(model))
    model.build((None, 64))
    assert model.balance == [1, 3]
    assert model.balance == tfpipe.balance.by_flops(_uneven_layers(), 2, np.ones((4, 64), "float32"))
    # variables were created once, on their cells' devices (the estimate worked on copies)
    assert model.pipeline_layers[0].kernel.value.device.endswith("CPU:0")
    assert model.pipeline_layers[1].kernel.value.device.endswith("CPU:1")


def test_fit_builds_and_balances_inside_keras_traced_step():
    model = tfpipe.PipelineModel(
        _uneven_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2, cost="time"
    )
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 64), "float32"), np.ones((16, 4), "float32")
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    assert len(model.balance) == 2 and sum(model.balance) == 4
    assert np.isfinite(history.history["loss"]).all()


def test_params_cost_and_a_built_sequential_balance_at_once():
    sequential = keras.Sequential([keras.Input((64,)), *_uneven_layers()])
    model = tfpipe.PipelineModel(sequential, num_partitions=2, devices=cpu_devices(2), cost="params")
    assert model.balance == [1, 3]  # the input shape is known, so no build is needed


def test_callable_cost_balances_at_construction():
    widths = [2, 2, 2, 6]
    layers = [keras.layers.Dense(w) for w in widths]
    model = tfpipe.PipelineModel(layers, num_partitions=2, devices=cpu_devices(2), cost=lambda layer: layer.units)
    assert model.balance == [3, 1]


def test_forced_splits_need_no_estimate():
    layers = [keras.layers.Embedding(10, 4), keras.layers.Dense(2)]  # unknown sequence length is fine here
    assert tfpipe.PipelineModel(layers, num_partitions=2, devices=cpu_devices(2)).balance == [1, 1]
    assert tfpipe.PipelineModel(mlp_layers(), num_partitions=1, devices=cpu_devices(1)).balance == [10]


def test_cost_errors():
    with pytest.raises(ValueError, match=r"Unknown cost='speed'"):
        tfpipe.PipelineModel(_uneven_layers(), num_partitions=2, devices=cpu_devices(2), cost="speed")
    with pytest.raises(ValueError, match=r"cost='memory' needs a measurement .* balance=tfpipe.balance.by_memory"):
        tfpipe.PipelineModel(_uneven_layers(), num_partitions=2, devices=cpu_devices(2), cost="memory")
    with pytest.raises(ValueError, match=r"The cost of layer 0 \(.*\) is nan; costs must be finite"):
        tfpipe.PipelineModel(
            _uneven_layers(), num_partitions=2, devices=cpu_devices(2), cost=lambda layer: float("nan")
        )
    model = tfpipe.PipelineModel(
        [keras.layers.Embedding(10, 4), keras.layers.Dense(3), keras.layers.Dense(2)],
        num_partitions=2,
        devices=cpu_devices(2),
    )
    with pytest.raises(ValueError, match=r"needs the input's full shape .* model.build\(\(None, 128\)\)"):
        model.build((None, None))


def test_summary_shows_costs_shares_bytes_and_predicted_efficiency():
    units = {"a": 4.0, "b": 1.0, "c": 1.0, "d": 2.0}
    layers = [keras.layers.Dense(8, name=n) for n in units]
    model = tfpipe.PipelineModel(
        layers, num_partitions=2, devices=cpu_devices(2), num_micro_batches=4, cost=lambda layer: units[layer.name]
    )
    assert model.balance == [1, 3]
    model.build((None, 3))
    text = "\n".join(_lines(model))
    assert "cost='custom'" in text and "Cost (cost)" in text
    assert text.count("50.0%") == 2
    # M/(M+K-1) = 4/5, cells cost 4 and 4: perfectly even
    assert "Predicted pipeline efficiency: 80.0% = M/(M+K-1) 80.0% x mean/max cell cost 100.0%" in text


def test_summary_of_an_explicit_balance_estimates_flops_once_built():
    model = tfpipe.PipelineModel(_uneven_layers(), balance=[2, 2], devices=cpu_devices(2), num_micro_batches=2)
    model.build((None, 64))
    lines = _lines(model)
    rows = [line for line in lines if line.startswith(("0 ", "1 "))]
    first, second = 2 * 64 * 256 + 256 + 2 * 256 * 4 + 4, 2 * (2 * 4 * 4 + 4)
    assert "Cost (FLOPs/sample)" in lines[2]
    assert f"{first / 1e3:.3g} k" in rows[0] and f"{first / (first + second) * 100:.1f}%" in rows[0]
    assert f"{second:.3g}" in rows[1] and "16 B" in rows[1]  # the last cell hands on 4 floats per sample
    assert "16 B" in rows[0]  # layer 1 (Dense(4)) ends the first cell
    efficiency = 2 / 3 * ((first + second) / 2) / first
    assert any(f"Predicted pipeline efficiency: {100 * efficiency:.1f}%" in line for line in lines)


def test_summary_says_why_costs_are_missing():
    class NoCopy(keras.layers.Dense):
        def get_config(self):
            raise NotImplementedError("no config")

    model = tfpipe.PipelineModel([NoCopy(4, name="nc"), keras.layers.Dense(2)], balance=[1, 1], devices=cpu_devices(2))
    model.build((None, 3))
    text = "\n".join(_lines(model))
    assert "Costs not estimated: Cannot copy layer 'nc' (NoCopy)" in text
    assert "Total params: 26" in text and "Predicted pipeline efficiency" not in text
