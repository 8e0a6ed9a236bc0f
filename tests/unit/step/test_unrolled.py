"""The core on its own: Checkpoint.vjp against tf.GradientTape, and Pipeline driving small fake cells."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import schedule
from tfpipe.analysis import graph_tasks as tasks
from tfpipe.backward import remat
from tfpipe.step.chain import Chain
from tfpipe.step.unrolled import (
    NOINLINE_TASKS,
    NOINLINE_TASKS_ACROSS_PROCESSES,
    TASK_START,
    Pipeline,
    noinline_tasks,
    task_scope_name,
)


def _fn(x, w, b, forward=remat.RECORDED):  # a Checkpoint says which forward runs
    h = tf.tanh(tf.matmul(x, w) + b)
    return h, tf.reduce_sum(h * h)


def _reference(sources, dy, dsum):
    x, w, b = sources
    with tf.GradientTape() as tape:
        tape.watch([x, w, b])
        h, s = _fn(x, w, b)
        target = tf.reduce_sum(h * dy) + s * dsum
    return tape.gradient(target, [x, w, b])


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("in_graph", [True, False])
def test_checkpoint_vjp_matches_gradient_tape(recompute, in_graph):
    rng = np.random.default_rng(0)
    sources = [tf.constant(rng.standard_normal(s), tf.float32) for s in ((5, 3), (3, 4), (4,))]
    dy, dsum = tf.constant(rng.standard_normal((5, 4)), tf.float32), tf.constant(0.5)

    def run():
        record = remat.Checkpoint(_fn, sources, recompute=recompute)
        return record.vjp(lambda out: list(out), [dy, dsum])

    got = tf.function(run, autograph=False)() if in_graph else run()
    for g, r in zip(got, _reference(sources, dy, dsum)):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)


def test_checkpoint_recompute_runs_the_function_again_and_keep_runs_it_once():
    calls = []

    def fn(x, forward):
        calls.append(1)
        return x * 3.0

    x = tf.constant([1.0, 2.0])
    kept = remat.Checkpoint(fn, [x], recompute=False)
    assert kept.vjp(lambda out: [out], [tf.ones(2)])[0].numpy().tolist() == [3.0, 3.0] and len(calls) == 1
    again = remat.Checkpoint(fn, [x], recompute=True)
    assert again.vjp(lambda out: [out], [tf.ones(2)])[0].numpy().tolist() == [3.0, 3.0] and len(calls) == 3


def test_checkpoint_integer_and_leading_constant_sources_get_no_gradient():
    x, ids, w = tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([[2.0], [3.0]])

    def fn(x, ids, w, forward):
        return tf.matmul(x, w) * tf.cast(ids, tf.float32)[:, None]

    grads = remat.Checkpoint(fn, [x, ids, w], recompute=True, constant=1).vjp(lambda out: [out], [tf.ones((1, 1))])
    assert grads[0] is None and grads[1] is None  # x is a constant source, ids are integers
    np.testing.assert_allclose(grads[2].numpy(), [[1.0], [2.0]])


def test_checkpoint_without_output_gradients_gives_zeros():
    x = tf.constant([1.0, 2.0])
    grads = remat.Checkpoint(lambda x, forward: x * 2.0, [x], recompute=False).vjp(lambda out: [out], [None])
    assert grads[0].numpy().tolist() == [0.0, 0.0]


def _embed_dense(ids, table, w, scale, forward=remat.RECORDED):
    """An embedding lookup (sparse gradient for ``table``) then a dense layer; ``scale`` is an extra input."""
    return tf.reduce_sum(tf.tanh(tf.matmul(tf.gather(table, ids), w)) * scale, axis=1)


@pytest.mark.parametrize("recompute", [True, False])
def test_traced_vjp_sums_micro_batches_like_the_tape_with_one_call_each(recompute):
    """Three micro-batches' VJPs summed into running sums: traced once, one call per VJP, exact, embeddings sparse."""
    rng = np.random.default_rng(1)
    table = tf.constant(rng.standard_normal((7, 3)), tf.float32)
    w = tf.constant(rng.standard_normal((3, 4)), tf.float32)
    ids = [tf.constant(rng.integers(0, 7, size=5), tf.int32) for _ in range(3)]
    dys = [tf.constant(rng.standard_normal(5), tf.float32) for _ in range(3)]
    scales = [tf.constant(s) for s in (0.5, 1.0, 2.0)]
    vjps = remat.TracedVJPs(
        lambda: tf.name_scope("cell"), lambda: {"experimental_attributes": {"_noinline": True}, "jit_compile": None}
    )

    def step():
        running = [None, None]
        for j in range(3):
            record = remat.Checkpoint(
                _embed_dense, [ids[j], table, w], recompute, constant=1, extras=[scales[j]], traced=vjps, key="k"
            )
            grads = record.vjp(lambda out: [out], [dys[j]], accumulate=running)
            running = grads[1:]
        assert isinstance(running[0], tf.IndexedSlices)  # the embedding's gradient stays sparse
        graph = tf.compat.v1.get_default_graph()
        calls = [op for op in graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
        return tf.convert_to_tensor(running[0]), running[1], len(calls)

    got_table, got_w, calls = tf.function(step, autograph=False)()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([table, w])
        total = tf.add_n([tf.reduce_sum(_embed_dense(i, table, w, s) * dy) for i, s, dy in zip(ids, scales, dys)])
    np.testing.assert_allclose(got_table.numpy(), tf.convert_to_tensor(tape.gradient(total, table)).numpy(), rtol=1e-5)
    np.testing.assert_allclose(got_w.numpy(), tape.gradient(total, w).numpy(), rtol=1e-5)
    if recompute:
        assert vjps.num_traces == 1 and int(calls) == 3  # one function for the three micro-batches, one call each
    else:
        assert vjps.num_traces == 0 and int(calls) == 2  # kept tapes; the two sums are one call each


def test_recomputes_follows_the_mode():
    assert [remat.recomputes("except_last", j, 3) for j in range(3)] == [True, True, False]
    assert not any(remat.recomputes("never", j, 3) for j in range(3))
    assert all(remat.recomputes("always", j, 3) for j in range(3))
    with pytest.raises(ValueError, match="Unknown remat='some'; use one of 'always'"):
        remat.check_mode("some")


class _NoState:
    def merge(self, variables, old, new, fractions):
        return []


class FakeCell:
    """y = x * w on a device: one scalar weight, no state, no added losses; logs each forward it runs."""

    def __init__(self, index: int, device: str, log: list):
        self.index, self.device, self.log = index, device, log
        with tf.device(device):
            self.w = keras.Variable(float(index + 2), name=f"w{index}")
        self.noinline = False
        self.merger = _NoState()
        self.traceable, self.vjps, self.has_regularizers = False, None, False

    @property
    def trainable_variables(self):
        return [self.w]

    @property
    def non_trainable_variables(self):
        return []

    def read(self):
        return [tf.identity(self.w.value)], []

    def regularization_loss(self, trainable):
        return tf.constant(0.0)

    def run_traced(self, trainable, non_trainable, x, training, forward=remat.RECORDED):
        self.log.append(self.index)
        return x * trainable[0], [], tf.constant(0.0)


def _train_graph(k, m, remat):
    log: list = []
    cells = [FakeCell(i, f"/CPU:{i}", log) for i in range(k)]
    pipeline = Pipeline(cells, m, remat)
    x = np.arange(2.0 * m, dtype="float32").reshape(m, 2)

    @tf.function(autograph=False)
    def step():
        result = pipeline.train(
            [tf.constant(x[j : j + 1]) for j in range(m)], lambda j, y: tf.reduce_sum(y), [tf.constant(1.0 / m)] * m
        )
        return result.loss, result.gradients

    return step, x, log


@pytest.mark.parametrize("remat", ["never", "always"])
def test_pipeline_loss_and_gradients_of_fake_cells(remat):
    k, m = 3, 4
    step, x, log = _train_graph(k, m, remat)
    loss, grads = step()
    w = [2.0, 3.0, 4.0]
    assert float(loss) == pytest.approx(x.sum() * np.prod(w))
    for i, g in enumerate(grads):
        assert float(g) == pytest.approx(x.sum() * np.prod(w) / w[i])
    forwards = [t.cell for t in schedule.flatten(schedule.gpipe(k, m, backward=True)) if t.kind == "F"]
    assert log[: len(forwards)] == forwards  # forward tasks are built in schedule order
    assert len(log) == len(forwards) * (2 if remat == "always" else 1)  # remat runs each forward again


def test_cells_stop_being_inlined_later_where_they_are_in_other_processes():
    assert noinline_tasks(["/CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]) == NOINLINE_TASKS == 64
    assert noinline_tasks(["/CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"]) == NOINLINE_TASKS_ACROSS_PROCESSES
    assert NOINLINE_TASKS_ACROSS_PROCESSES == 128
    for m, called in [(15, False), (16, True)]:  # 2 K M tasks: 60, 64
        cells = [FakeCell(i, f"/CPU:{i}", []) for i in range(2)]
        Pipeline(cells, m, "never")
        assert [cell.noinline for cell in cells] == [called, called]


def test_pipeline_chains_each_devices_tasks_in_schedule_order():
    k, m = 2, 3
    step, _, _ = _train_graph(k, m, "except_last")
    graph = step.get_concrete_function().graph
    all_ops = graph.get_operations()
    owner = dict(zip(all_ops, tasks.assign_tasks([op.name for op in all_ops])))
    ops = {op.name: op for op in graph.get_operations()}
    for device in range(k):
        order = [t for t in schedule.flatten(schedule.gpipe(k, m, backward=True)) if t.cell == device]
        for before, after in zip(order, order[1:]):
            start = ops[f"{task_scope_name(after)}/{TASK_START}"]
            waits_for = {owner[op] for op in _ancestors(start)}
            assert task_scope_name(before) in waits_for, (before, after)  # ``after`` starts once ``before`` ran


def _ancestors(op):
    """Every op that ``op`` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_a_tasks_checks_are_ordered_by_its_chain_not_after_every_check_traced_before():
    class OnDevice:
        def __init__(self, device):
            self.device = device

    def check(x):  # what a loss traced without a function checks where the batch size is known at run time only
        return tf.debugging.assert_positive(tf.size(x), message="empty batch")

    chain = Chain([OnDevice("/CPU:0"), OnDevice("/CPU:1")])

    @tf.function
    def step(x):
        for cell in (0, 1):  # two devices' tasks: one needs nothing of the other
            with chain.task(schedule.Task("F", cell, 0)) as produced:
                with tf.control_dependencies([check(x)]):
                    produced.append(tf.identity(x * 2.0))
        return produced[0]

    graph = step.get_concrete_function(tf.TensorSpec([None])).graph
    first, second = [op for op in graph.get_operations() if op.type == "Assert"]
    assert first not in second.control_inputs
    np.testing.assert_array_equal(step(tf.constant([1.0])).numpy(), [2.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty batch"):  # each still runs before the step returns
        step(tf.zeros([0]))
