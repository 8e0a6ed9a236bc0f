"""tfpipe.plan takes every model tfpipe takes: Functional graphs and keras_hub tasks, built deferred or not."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import cpu_devices, max_rel_error
from tfpipe.distributed import devices
from tfpipe.partition import deferred
from tfpipe.planning import units

DEVICES = cpu_devices(2)
# a narrow search: these tests are about which models plan, not about the search (tests/integration/test_plan.py)
# and within a few seconds: the whole-model probes are the fitting tests' (test_plan_fitting.py), not these
NARROW = dict(num_micro_batches=[1, 2], schedules=["gpipe"], remats=["never"], replicas=False, verify=0, max_seconds=5)


def _two_inputs_with_a_skip(seed: int = 0) -> keras.Model:
    """Two inputs, a skip from the first block over the next two, a nested model, two outputs."""
    keras.utils.set_random_seed(seed)
    left, right = keras.Input((16,), name="left"), keras.Input((4,), name="right")
    a = keras.layers.Dense(32, activation="tanh", name="a")(left)
    inner_in = keras.Input((32,))
    inner = keras.Model(inner_in, keras.layers.Dense(32, activation="tanh", name="inner_dense")(inner_in), name="inner")
    b = inner(keras.layers.Dense(32, activation="tanh", name="b")(a))
    joined = keras.layers.Concatenate(name="join")([keras.layers.Add(name="skip")([a, b]), right])
    main = keras.layers.Dense(3, name="main")(joined)
    aux = keras.layers.Dense(1, name="aux")(b)
    return keras.Model([left, right], {"main": main, "aux": aux})


def _data(n: int = 16) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((n, 16)).astype("float32"), rng.standard_normal((n, 4)).astype("float32")]
    return x, {"main": np.tanh(x[0][:, :3]), "aux": x[1][:, :1]}


@pytest.fixture(scope="module")
def graph_plan():
    x, _ = _data()
    return tfpipe.plan(_two_inputs_with_a_skip(), 16, DEVICES, "4MiB", sample=x, optimizer="adam", **NARROW)


@pytest.mark.heavy(seconds=40)
def test_a_functional_model_with_skips_inputs_and_outputs_is_planned_and_trains_as_keras(graph_plan):
    model = _two_inputs_with_a_skip()
    nodes = 7  # a, b, inner_dense (the nested model expanded), skip, join, main, aux
    assert sum(graph_plan.balance) == nodes and all(c.fits for c in graph_plan.candidates[:1])
    assert graph_plan.profile.output_bytes[0] == (32 + 4) * 4  # after a: a itself and the second input, unread yet
    pipelined = tfpipe.PipelineModel(model, plan=graph_plan)
    reference = _two_inputs_with_a_skip()
    x, y = _data()
    for net in (reference, pipelined):
        net.compile(optimizer=keras.optimizers.Adam(0.01), loss={"main": "mse", "aux": "mse"})
        net.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert pipelined.balance == graph_plan.balance
    assert max_rel_error(pipelined.get_weights(), reference.get_weights()) < 1e-5


@pytest.mark.heavy(seconds=40)
def test_plan_auto_plans_a_functional_model_built_deferred_and_makes_its_weights_on_the_planned_devices():
    with tfpipe.deferred_weights():
        model = _two_inputs_with_a_skip()
    pipelined = tfpipe.PipelineModel(model, plan="auto", devices=DEVICES, memory_budget="4MiB")
    assert all(deferred.waiting(v) for v in model.weights)  # not made on a placeholder cell's device
    pipelined.compile(optimizer="adam", loss={"main": "mse", "aux": "mse"})
    x, y = _data()
    pipelined.fit(x, y, batch_size=16, epochs=1, verbose=0)
    plan = pipelined.plan
    assert isinstance(plan, tfpipe.Plan) and sum(plan.balance) == 7
    assert not any(deferred.waiting(v) for v in model.weights)
    for cell in pipelined.cells:
        for variable in cell.weights:
            assert devices.matches(variable.value.device, cell.device), (variable.path, cell.device)


def test_a_tied_weight_is_counted_on_the_cell_that_reads_it():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    shared = keras.layers.Dense(64, name="shared")
    hidden = keras.layers.Dense(64, name="hidden")(shared(inputs))
    model = keras.Model(inputs, shared(hidden))
    sample = np.ones((8, 64), "float32")
    plan = tfpipe.plan(model, 8, DEVICES, sample=sample, optimizer="sgd", **{**NARROW, "num_micro_batches": [1]})
    dense = (64 * 64 + 64) * 4.0
    assert plan.profile.tied == [units.Tied(owner=0, reader=2, weight_bytes=dense, trainable_bytes=dense)]
    cut = next(c for c in plan.candidates if c.config.num_partitions == 2)
    split = cut.config.balance[0]
    # the last cell reads `shared` from the first: a copy and its gradient beside what it owns (SGD: no slots)
    weights, owned, borrowed = plan.profile.cell_weights(split, 3)
    assert (weights, borrowed) == (dense * (3 - split), dense)
    assert cut.prediction.peak_bytes[1] >= weights + owned + borrowed


keras_hub = pytest.importorskip("keras_hub")
from tfpipe.models import hub  # noqa: E402 - after the skip: it builds keras_hub tasks


@pytest.mark.heavy(seconds=60)
def test_a_keras_hub_task_built_deferred_is_planned_and_trains_like_its_own_fit():
    with tfpipe.deferred_weights():
        task = hub.task("llama", num_layers=4, sequence_length=12)
    x = hub.inputs(task, 8, 12, 97)
    plan = tfpipe.plan(task, 8, DEVICES, "8MiB", sample=x, optimizer="sgd", **NARROW)
    assert all(deferred.waiting(v) for v in task.weights)  # planning made copies, not the task's weights
    # the embedding (node 0) is tied to the output projection (the last node): counted on its reader too
    assert [(t.owner, t.reader) for t in plan.profile.tied] == [(0, len(plan.profile.weight_bytes) - 1)]
    pipelined = tfpipe.PipelineModel(task, plan=plan)
    reference = hub.task("llama", num_layers=4, sequence_length=12)
    y = np.roll(x["token_ids"], -1, axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for net in (reference, pipelined):
        net.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(pipelined.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
