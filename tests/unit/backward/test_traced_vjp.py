"""The traced-VJP cache at its own level: one trace per outer graph and key, sums traced once, shared empties."""

import contextlib

import numpy as np
import tensorflow as tf

from tfpipe.backward.traced_vjp import Traced, TracedVJPs


def _vjps(entered: list | None = None) -> TracedVJPs:
    def scope():
        if entered is not None:
            entered.append(True)
        return contextlib.nullcontext()

    return TracedVJPs(scope, lambda: {"experimental_attributes": None, "jit_compile": None})


def test_lookup_builds_once_per_graph_and_key_and_remembers_sparse_positions():
    vjps = _vjps()
    built = []

    def build(positions):
        built.append(positions)
        return Traced(function=None, sparse=frozenset(positions))

    @tf.function
    def step():
        a = vjps.lookup("cell 0", lambda: build({1}))
        assert vjps.lookup("cell 0", lambda: build({2})) is a  # the same graph: the first one
        vjps.lookup("cell 1", lambda: build(set()))
        return tf.constant(0)

    step()
    assert built == [{1}, set()]
    assert vjps.sparse("cell 0") == frozenset({1}) and vjps.sparse("unknown") == frozenset()
    # another outer graph traces anew
    tf.function(lambda: (vjps.lookup("cell 0", lambda: build({1})), tf.constant(0))[1])()
    assert built == [{1}, set(), {1}]


def test_sum_adds_pairwise_through_one_function_traced_once_per_signature():
    vjps = _vjps()
    a = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
    b = [tf.constant([10.0, 20.0]), tf.constant([[30.0]])]

    @tf.function
    def step(a, b):
        first = vjps.sum(a, b)
        second = vjps.sum(first, b)
        return second

    got = step(a, b)
    np.testing.assert_allclose(got[0], [21.0, 42.0])
    np.testing.assert_allclose(got[1], [[63.0]])
    graph = step.get_concrete_function(a, b).graph
    called = [op.get_attr("f").name for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    assert len(called) == 2 and len(set(called)) == 1  # both call sites call one traced function


def test_placeholder_is_one_node_per_graph_dtype_and_rank():
    vjps = _vjps()

    @tf.function
    def step():
        x = vjps.placeholder(tf.zeros([4, 3]))
        assert vjps.placeholder(tf.ones([2, 5])) is x  # same dtype and rank
        y = vjps.placeholder(tf.zeros([4], tf.int64))
        assert y is not x and y.shape.rank == 1 and y.dtype == tf.int64
        return tf.shape(x)

    np.testing.assert_array_equal(step(), [0, 0])


def test_traced_bodies_run_within_the_cells_scope():
    entered: list = []
    vjps = _vjps(entered)
    with vjps.tracing():
        pass
    spec = [tf.TensorSpec([2], tf.float32)]
    wrapped = vjps.wrap(lambda x: [x * 2.0], spec, "input")
    np.testing.assert_allclose(wrapped(tf.constant([1.0, 2.0]))[0], [2.0, 4.0])
    assert len(entered) == 2  # entered once by tracing(), once to trace the wrapped part
