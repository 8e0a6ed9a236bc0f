"""A hand-made profile and calibration for the planner's tests: per-layer costs given, predictions checked by hand."""

from tfpipe.planning.predict import Calibration
from tfpipe.planning.profile import LayerCosts, Profile

DEVICES = ["/CPU:0", "/CPU:1"]


def calibration(parallelism=1.5, bandwidth=4000.0):
    """A hand-made calibration: 0.1 s a task, 0.25 s a step, 0.01 s of update per byte of weights."""
    return Calibration(
        task_s=0.1,
        step_s=0.25,
        bandwidth=bandwidth,
        parallelism=parallelism,
        update_s_per_byte=0.01,
        source="by hand",
    )


def profile(
    forward=(1.0, 2.0, 3.0),
    backward=(2.0, 4.0, 6.0),
    weights=(10.0, 20.0, 30.0),
    trainable=(10.0, 20.0, 30.0),
    outputs=(100.0, 50.0, 10.0),
    held=(40.0, 30.0, 20.0),
    working=(5.0, 7.0, 3.0),
    input_bytes=8.0,
    sizes=(1, 2, 4, 8),
):
    """A hand-made profile whose per-layer seconds and held bytes scale with the micro-batch size (given at 4)."""
    by_batch = {
        b: LayerCosts(
            [f * b / 4 for f in forward],
            [x * b / 4 for x in backward],
            [h * b / 4 for h in held],
            [w * b / 4 for w in working],
        )
        for b in sizes
    }
    return Profile(
        "/CPU:0", list(weights), list(trainable), input_bytes, list(outputs), by_batch, "held bytes given by hand"
    )


def memory_bound_profile():
    """Four layers of equal time; the last two hold 600 bytes of weights each, the first two none."""
    return profile(
        forward=(1.0, 1.0, 1.0, 1.0),
        backward=(2.0, 2.0, 2.0, 2.0),
        weights=(0.0, 0.0, 600.0, 600.0),
        trainable=(0.0, 0.0, 0.0, 0.0),
        outputs=(1.0, 1.0, 1.0, 1.0),
        held=(1.0, 1.0, 1.0, 1.0),
        working=(1.0, 1.0, 1.0, 1.0),
        input_bytes=1.0,
    )
