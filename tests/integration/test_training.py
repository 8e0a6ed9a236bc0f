"""The loss around the pipeline: reductions read from compile(loss=...), and an overridden compute_loss."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices, max_rel_error, mlp_layers
from tfpipe import training


@pytest.mark.parametrize(
    "loss,reduction",
    [
        ("mse", "sum_over_batch_size"),
        ("crossentropy", "sum_over_batch_size"),
        (keras.losses.MeanSquaredError(reduction="sum"), "sum"),
        ([keras.losses.MeanAbsoluteError(reduction="sum"), None], "sum"),
        ({"a": "mae", "b": keras.losses.Huber()}, "sum_over_batch_size"),
        (None, "sum"),
    ],
)
def test_loss_reduction_from_the_compiled_losses(loss, reduction):
    assert training.loss_reduction(loss) == reduction


def test_mixed_reductions_are_refused():
    with pytest.raises(ValueError, match=r"different reductions \['sum', 'sum_over_batch_size'\]"):
        training.loss_reduction(["mse", keras.losses.MeanSquaredError(reduction="sum")])


def _with_activity_penalty(base):
    class Penalized(base):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))

    return Penalized


@pytest.mark.parametrize("m", [1, 3])
def test_an_overridden_compute_loss_trains_like_keras(m):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((20, 5)).astype("float32"), rng.standard_normal((20, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    layers = mlp_layers(width=8, depth=3)
    reference = _with_activity_penalty(keras.Sequential)([keras.Input((5,)), *layers])
    model = _with_activity_penalty(tfpipe.PipelineModel).from_sequential(
        reference, balance=[4, 3], devices=cpu_devices(2), num_micro_batches=m
    )
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)  # micro-batches 4, 3, 3 at M=3
    expected = reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(reference.evaluate(x, y, verbose=0), rel=1e-5)


def test_keras_symbolic_build_does_not_trace_the_pipeline():
    """Keras builds metrics from the model's output spec; that needs the layers once, not K x M cell traces."""
    x, y = np.zeros((8, 5), "float32"), np.zeros((8, 3), "float32")
    model = tfpipe.PipelineModel(
        mlp_layers(width=8, depth=3), balance=[4, 3], devices=cpu_devices(2), num_micro_batches=4
    )
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    training.build_before_tracing(model, x, y, None)
    assert model.compiled_metrics is not None and len(model.metrics_variables) > 2
    assert [cell.num_traces for cell in model.cells] == [0, 0]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # The training step runs each cell's layers once: the recompute-and-VJP function replays them
    # (tfpipe/backward/replay.py).
    assert [cell.num_traces for cell in model.cells] == [1, 1]
