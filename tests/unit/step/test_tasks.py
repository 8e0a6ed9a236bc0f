"""An unrolled step's task bodies at their own level: F records a checkpoint, B takes it and hands gradients back."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import schedule
from tfpipe.partition.cell import Cell, tie
from tfpipe.step import microbatch
from tfpipe.step.chain import Chain
from tfpipe.step.handoff import Handoff
from tfpipe.step.tasks import Tasks
from tfpipe.step.wiring import Wiring

M = 2


def _cells() -> list[Cell]:
    keras.utils.set_random_seed(0)
    cells = [Cell(0, [keras.layers.Dense(4, activation="tanh")], "/CPU:0"), Cell(1, [keras.layers.Dense(1)], "/CPU:0")]
    x = keras.KerasTensor((None, 3))
    for cell in cells:
        x = cell.build(x)
    tie(cells)
    return cells


def _batch():
    rng = np.random.default_rng(0)
    return tf.constant(rng.normal(size=(6, 3)), tf.float32), tf.constant(rng.normal(size=(6, 1)), tf.float32)


def _run(cells, schedule_name: str, remat: str, x, y):
    """Every task of one step built by ``Tasks`` alone, in the schedule's order; the step's bookkeeping."""
    sizes = microbatch.sizes(x, M)
    xs, ys = microbatch.split(x, sizes), microbatch.split(y, sizes)
    fractions = microbatch.fractions(sizes)

    def loss_fn(j, y_pred):
        return tf.reduce_mean(tf.square(y_pred - ys[j])) * fractions[j]

    step = Handoff(xs, True, loss_fn, fractions, 1.0, [cell.read() for cell in cells])
    step.scales = [tf.constant(1.0) for _ in cells]
    step.shares["/CPU:0"] = list(fractions)
    step.reg_weights["/CPU:0"] = [tf.constant(1.0), tf.constant(0.0)]
    tasks, chain = Tasks(cells, Wiring(cells, None), schedule_name, remat, M), Chain(cells)
    order = schedule.steps(schedule_name, len(cells), M, True)
    for task in order:
        tasks.run(task, step, chain)
    return step, order


def _reference(cells, x, y):
    variables = [v for cell in cells for v in cell.trainable_variables]
    with tf.GradientTape() as tape:
        h = x
        for cell in cells:
            for layer in cell.layers:
                h = layer(h)
        loss = tf.reduce_mean(tf.square(h - y))
    return loss, tape.gradient(loss, variables)


@pytest.mark.parametrize("schedule_name, remat", [("gpipe", "never"), ("1f1b", "always"), ("zero_bubble", "always")])
def test_the_tasks_of_a_step_give_the_tapes_loss_and_gradients(schedule_name, remat):
    cells = _cells()
    x, y = _batch()

    @tf.function
    def step_fn():
        step, _ = _run(cells, schedule_name, remat, x, y)
        return tf.add_n(list(step.losses.values())), [g for grads in step.grads for g in grads]

    loss, grads = step_fn()
    want_loss, want_grads = _reference(cells, x, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_forward_records_what_its_backward_needs_and_the_backward_takes_it():
    cells = _cells()
    x, y = _batch()
    seen = {}

    @tf.function
    def step_fn():
        step, order = _run(cells, "1f1b", "always", x, y)
        seen["order"] = [schedule.task_scope_name(t) for t in order if t.cell == 0]
        seen["left"] = dict(step.records), dict(step.dys)  # every record and gradient taken by its backward
        seen["acts"] = sorted(step.acts)
        return tf.constant(0)

    step_fn()
    assert seen["order"] == ["F_0_0", "F_0_1", "B_0_0", "B_0_1"]  # 1F1B: cell 0 runs min(K, M) forwards first
    assert seen["acts"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    records, dys = seen["left"]
    assert records == {} and dys == {}  # every checkpoint and every gradient handed back was taken by its backward
