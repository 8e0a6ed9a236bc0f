"""Zero bubble's split backward: B and W give the VJP's gradients, and W redoes nothing of B."""

import contextlib
import gc

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.backward import remat


def _mlp(x, w1, w2, forward=remat.RECORDED):  # a Checkpoint says which forward runs
    """Two Dense layers, (outputs, new state, added losses) as a cell returns them."""
    return tf.tanh(tf.nn.relu(x @ w1) @ w2), [], tf.constant(0.0)


def _selected(out):
    return [out[0], out[2]]


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=s).astype("float32")) for s in [(4, 8), (8, 16), (16, 8), (4, 8)]]


def _reference(x, w1, w2, dy):
    with tf.GradientTape() as tape:
        tape.watch([x, w1, w2])
        y = _mlp(x, w1, w2)[0]
    return [y] + tape.gradient(y, [x, w1, w2], output_gradients=dy)


def _traced_vjps():
    return remat.TracedVJPs(contextlib.nullcontext, lambda: {"experimental_attributes": None, "jit_compile": None})


def _split_step(recompute, traced):
    """One forward, B and W of the MLP as a graph: (y, dx, dw1, dw2), and the Checkpoint for inspection."""
    made = {}

    @tf.function(autograph=False)
    def step(x, w1, w2, dy):
        record = remat.Checkpoint(
            _mlp, [x, w1, w2], recompute=recompute, traced=traced, key="mlp", split=(2, _selected)
        )
        made["record"] = record
        dx = record.input_vjp([dy, tf.constant(1.0)])
        assert dx[1:] == [None, None]  # B gives no weight gradients
        dw = record.weight_vjp([None, None])
        return [record.outputs[0], dx[0]] + dw

    return step, made


@pytest.mark.parametrize("recompute", [False, True])
def test_b_and_w_give_the_tapes_gradients(recompute):
    values = _values()
    step, _ = _split_step(recompute, _traced_vjps())
    for got, want in zip(step(*values), _reference(*values)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def _matmuls(record, part):
    function = record._parts.part(part, record._recompute).function  # noqa: SLF001 - the traced parts
    found = []

    def walk(graph):
        for op in graph.get_operations():
            found.extend([op.type] if op.type == "MatMul" else [])
        for f in graph._functions.values():  # noqa: SLF001 - functions the part calls
            walk(f.graph)

    walk(function.graph)
    return len(found)


@pytest.mark.parametrize("recompute,forward,inputs", [(False, 2, 2), (True, None, 4)])
def test_each_part_runs_only_its_own_matmuls(recompute, forward, inputs):
    # Forward: x@w1 and h@w2. B: dy@w2^T and dz@w1^T (and, recomputing, the forward again).
    # W: h^T dz2 and x^T dz1 only, read from what B and the forward left.
    traced = _traced_vjps()
    step, made = _split_step(recompute, traced)
    step.get_concrete_function(*[tf.TensorSpec(v.shape) for v in _values()])
    record = made["record"]
    if forward is not None:
        assert _matmuls(record, "forward") == forward
    assert _matmuls(record, "inputs") == inputs
    assert _matmuls(record, "weights") == 2


def test_sparse_weight_gradients_stay_slices():
    table = tf.constant(np.random.default_rng(1).normal(size=(10, 4)).astype("float32"))
    ids, scale = tf.constant([[1, 3], [3, 7]]), tf.constant(np.ones((2, 2, 4), "float32"))

    def embed(x, t, forward=remat.RECORDED):
        return tf.gather(t, ids) * x, [], tf.constant(0.0)

    @tf.function(autograph=False)
    def step(x, t, dy):
        record = remat.Checkpoint(
            embed, [x, t], recompute=True, traced=_traced_vjps(), key="embed", split=(1, _selected)
        )
        dx = record.input_vjp([dy, tf.constant(1.0)])[0]
        (dt,) = record.weight_vjp([None])
        assert isinstance(dt, tf.IndexedSlices)
        return dx, tf.convert_to_tensor(dt)

    dy = tf.ones((2, 2, 4))
    dx, dt = step(scale, table, dy)
    want = np.zeros((10, 4), "float32")
    for i in [1, 3, 3, 7]:
        want[i] += 1.0
    np.testing.assert_allclose(dt.numpy(), want)
    np.testing.assert_allclose(dx.numpy(), tf.gather(table, ids).numpy())


def test_eagerly_b_computes_both_and_w_adds():
    values = _values(2)
    x, w1, w2, dy = values
    record = remat.Checkpoint(_mlp, [x, w1, w2], recompute=False, traced=_traced_vjps(), split=(2, _selected))
    dx = record.input_vjp([dy, tf.constant(1.0)])
    running = [tf.ones_like(w1), tf.ones_like(w2)]
    dw = record.weight_vjp(running)
    want = _reference(*values)
    np.testing.assert_allclose(dx[0].numpy(), want[1].numpy(), rtol=1e-6, atol=1e-6)
    for got, ref in zip(dw, want[2:]):
        np.testing.assert_allclose(got.numpy(), ref.numpy() + 1.0, rtol=1e-6, atol=1e-6)


def test_input_vjp_needs_a_split_checkpoint():
    x, w1, w2, _ = _values()
    record = remat.Checkpoint(_mlp, [x, w1, w2], recompute=True)
    with pytest.raises(ValueError, match=r"input_vjp needs a Checkpoint made with split="):
        record.input_vjp([tf.ones((4, 8)), tf.constant(1.0)])


def test_only_the_parts_stay_registered_not_the_whole_they_were_cut_from():
    """The whole forward-and-VJP function is never called; kept, it outlived its step and, removed from a context
    that a reconnection had replaced, failed a restore after a worker restart (tfpipe.recovery)."""
    from tensorflow.python.eager.wrap_function import WrappedFunction  # the type wrap_function traces into

    traced = _traced_vjps()
    step, made = _split_step(False, traced)
    values = _values()
    step.get_concrete_function(*values)
    gc.collect()
    record = made["record"]
    assert record.cut
    graph = record._parts.graph  # noqa: SLF001 - the graph the parts were cut from
    assert not [o for o in gc.get_objects() if isinstance(o, WrappedFunction) and o.graph is graph]
