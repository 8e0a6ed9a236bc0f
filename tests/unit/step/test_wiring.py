"""An unrolled step's wiring at its own level: what each task reads, where outputs and input gradients go."""

import types

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.partition.routes import MODEL_INPUT, Routes
from tfpipe.step.handoff import Handoff
from tfpipe.step.wiring import Wiring

A, B = "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"


def _cells(*devices: str) -> list:
    return [types.SimpleNamespace(index=i, device=d) for i, d in enumerate(devices)]


def _step(inputs, cells: int) -> Handoff:
    return Handoff(inputs, True, None, None, 1.0, [([], [])] * cells)


def _routes() -> Routes:
    # cell 0 reads the model's input; cell 1 reads cell 0's leaf 0; cell 2 reads cell 1's leaf 0 and, skipping
    # cell 1, cell 0's leaf 1; the model's output is cell 2's leaf 0
    return Routes(
        feeds=[[(MODEL_INPUT, 0)], [(0, 0)], [(1, 0), (0, 1)]],
        results=[(2, 0)],
        flatten_inputs=lambda x: [x],
        pack_outputs=lambda leaves: leaves[0],
    )


def test_a_sequence_reads_the_previous_cell_and_crosses_only_between_devices():
    wiring = Wiring(_cells(A, A, B), None)
    assert wiring.pairs() == [(A, B), (B, A)]  # both ways, a device with itself left out
    step = _step(["x0", "x1"], 3)
    step.acts[(0, 1)] = "y01"
    assert wiring.input_of(0, 1, step) == "x1" and wiring.input_of(1, 1, step) == "y01"
    assert wiring.constants(0, 2) == 2 and wiring.constants(1, 2) == 0  # the first cell's inputs need no gradient
    assert wiring.summed(["g"]) == ["g"]


def test_a_sequence_hands_input_gradients_to_the_previous_cell():
    wiring = Wiring(_cells(A, A), None)
    step = _step(["x0"], 2)
    task = types.SimpleNamespace(cell=1, micro_batch=0)
    wiring.pass_back(task, ["dx"], step, [])
    assert wiring.output_gradients(0, 0, step) == ["dx"]
    with pytest.raises(KeyError):  # taken once
        wiring.output_gradients(0, 0, step)


def test_routes_read_from_every_producer_and_sum_what_readers_send_back():
    wiring = Wiring(_cells(A, B, A), _routes())
    assert wiring.pairs() == [(A, B), (B, A)]
    assert [wiring.constants(i, 1) for i in range(3)] == [1, 0, 0]
    step = _step([tf.constant(1.0)], 3)
    wiring.begin(step)
    step.acts[(0, 0)] = (tf.constant(2.0), tf.constant(3.0))
    step.acts[(1, 0)] = (tf.constant(4.0),)
    assert [float(t) for t in wiring.input_of(2, 0, step)] == [4.0, 3.0]  # the skipped-over leaf straight from 0
    assert float(wiring.input_of(0, 0, step)[0]) == 1.0
    summed = wiring.summed([[tf.constant(1.0), tf.constant(2.0)], None, [tf.constant(5.0)]])
    assert float(summed[0]) == 3.0 and summed[1] is None and float(summed[2]) == 5.0


def test_routes_deliver_the_loss_gradient_to_the_outputs_producer():
    wiring = Wiring(_cells(A, A, A), _routes())
    step = _step([tf.constant(1.0)], 3)
    step.acts[(2, 0)] = (tf.constant(7.0),)
    wiring.loss_gradients(2, 0, [tf.constant(0.5)], step)
    got = wiring.output_gradients(2, 0, step)
    np.testing.assert_allclose([float(g) for g in got[0]], [0.5])
