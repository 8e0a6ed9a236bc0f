"""Every schedule trains exactly as GPipe does: only the order of the tasks changes."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error, mlp_layers, per_layer_error, stateful_layers, unet_error
from tfpipe.models.transformer import transformer_lm


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _train(net, n, optimizer="adam"):
    x, y = _data(n)
    net.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}), loss="mse"
    )
    net.fit(x, y, batch_size=n, epochs=2, shuffle=False, verbose=0)
    return net


def _pipelined(layers, k, m, schedule, remat):
    model = tfpipe.PipelineModel(
        layers, num_partitions=k, devices=cpu_devices(k), num_micro_batches=m, remat=remat, schedule=schedule
    )
    model.build((None, 8))
    return model


SCHEDULES = ["1f1b", "zero_bubble"]


@pytest.mark.parametrize(
    "schedule,k,m,n,remat",
    covering(
        [
            (schedule, *shape)
            for schedule in SCHEDULES
            for shape in [(2, 3, 7, "never"), (2, 5, 10, "except_last"), (4, 3, 8, "always"), (4, 6, 13, "except_last")]
            + [(4, 1, 4, "never")]
        ],
        [("1f1b", 2, 3, 7, "never"), ("1f1b", 4, 3, 8, "always"), ("1f1b", 4, 1, 4, "never")]
        + [("zero_bubble", 2, 5, 10, "except_last"), ("zero_bubble", 4, 6, 13, "except_last")],
    ),
)
def test_schedule_trains_like_plain_keras(schedule, k, m, n, remat):  # M < K, M not a multiple of K, uneven batches
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = _pipelined(mlp_layers(), k, m, schedule, remat)
    model.set_weights(plain.get_weights())
    _train(plain, n)
    _train(model, n)
    assert model.schedule == schedule
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


@pytest.mark.parametrize(
    "schedule,remat",
    covering([(s, r) for s in SCHEDULES for r in ("always", "never")], [("1f1b", "always"), ("zero_bubble", "never")]),
)
def test_schedule_gives_gpipes_weights_with_dropout_and_batchnorm(schedule, remat):
    # The first Dense's bias feeds only BatchNormalization: its gradient is zero in exact arithmetic, and
    # float noise that differs with the order of the sums. Adam would scale that noise to full steps; SGD
    # keeps it noise, and the error is taken per layer.
    keras.utils.set_random_seed(5)
    gpipe = _train(_pipelined(stateful_layers(), 3, 4, "gpipe", remat), 9, "sgd")
    keras.utils.set_random_seed(5)
    other = _train(_pipelined(stateful_layers(), 3, 4, schedule, remat), 9, "sgd")
    assert per_layer_error(other.pipeline_layers, gpipe.pipeline_layers) < 1e-5


@pytest.mark.parametrize("schedule", covering(SCHEDULES, ["zero_bubble"]))
def test_schedule_trains_a_functional_unet_like_the_model(schedule):
    assert unet_error(cpu_devices(4), 5, schedule) < 1e-5


def test_the_schedule_is_checked_saved_and_shown(tmp_path):
    with pytest.raises(ValueError, match="Unknown schedule='zb'"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), schedule="zb")
    with pytest.raises(ValueError, match="schedule='1f1b' needs unroll=True"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), schedule="1f1b", unroll=False)
    model = tfpipe.PipelineModel(mlp_layers(), balance=[5, 5], devices=cpu_devices(2), schedule="1f1b")
    model.build((None, 8))
    lines = []
    model.summary(print_fn=lines.append)
    assert "schedule='1f1b'" in lines[0]
    model.compile(optimizer="sgd", loss="mse")
    model.save(str(tmp_path / "m.keras"))
    assert keras.models.load_model(str(tmp_path / "m.keras")).schedule == "1f1b"


def test_zero_bubble_is_saved_and_shown_with_its_own_bubble(tmp_path):
    model = tfpipe.PipelineModel(
        mlp_layers(), balance=[5, 5], devices=cpu_devices(2), num_micro_batches=8, schedule="zero_bubble"
    )
    model.build((None, 8))
    lines = []
    model.summary(print_fn=lines.append)
    assert "schedule='zero_bubble' (bubble 4.0%)" in lines[0]  # (K-1)/(3M+K-1) = 1/25
    # (K-1)/(3M+K-1) = 1/25 idle with W half of a backward twice the forward; the cells' costs are uneven.
    assert any(
        line.startswith("Predicted pipeline efficiency:") and "1 - bubble of 'zero_bubble' 96.0%" in line
        for line in lines
    ), lines
    model.compile(optimizer="sgd", loss="mse")
    model.save(str(tmp_path / "m.keras"))
    assert keras.models.load_model(str(tmp_path / "m.keras")).schedule == "zero_bubble"


@pytest.mark.slow  # attention and LayerNorm split into B and W: the keras_hub BERT test
@pytest.mark.parametrize("remat", ["except_last", "never"])
def test_zero_bubble_trains_a_transformer_like_gpipe(remat):
    # Embedding gradients are slices (W sums them as such); attention and LayerNorm split into B and W.
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(6, 12))

    def train(schedule):
        keras.utils.set_random_seed(7)
        model = tfpipe.PipelineModel(
            transformer_lm(50, 12, num_blocks=2, dim=16, hidden=32, heads=2),
            num_partitions=3,
            devices=cpu_devices(3),
            num_micro_batches=4,
            remat=remat,
            schedule=schedule,
        )
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=6, epochs=2, shuffle=False, verbose=0)
        return model

    # Per layer: an attention key bias shifts each query's logits by one constant, which the softmax
    # cancels; its gradient is zero in exact arithmetic and float noise (1e-11) here.
    assert per_layer_error(train("zero_bubble").pipeline_layers, train("gpipe").pipeline_layers) < 1e-5
