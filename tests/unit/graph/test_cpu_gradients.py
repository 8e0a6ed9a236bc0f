"""The CPU MatMul gradient: TensorFlow's numbers for every operand layout, used only inside CPU cells' graphs."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.graph import cpu_gradients


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gradient_matches_tensorflows(transpose_a, transpose_b):
    rng = np.random.default_rng(0)
    a = tf.constant(rng.standard_normal((3, 5) if not transpose_a else (5, 3)), tf.float32)
    b = tf.constant(rng.standard_normal((5, 4) if not transpose_b else (4, 5)), tf.float32)
    dy = tf.constant(rng.standard_normal((3, 4)), tf.float32)

    def grads(device):
        @tf.function(autograph=False)
        def run():
            with cpu_gradients.scope(device):
                y = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
            return tf.gradients(y, [a, b], grad_ys=dy)

        graph = run.get_concrete_function().graph
        kinds = {
            op.get_attr("_gradient_op_type")
            for op in graph.get_operations()
            if op.type == "MatMul" and "_gradient_op_type" in op.node_def.attr
        }
        return run(), kinds

    (ga, gb), ours = grads("/CPU:0")
    (ra, rb), theirs = grads("/GPU:0")  # not a CPU: TensorFlow's own gradient (the graph is not run on a GPU)
    assert ours == {cpu_gradients.GRADIENT_NAME.encode()} and theirs == set()
    np.testing.assert_allclose(ga.numpy(), ra.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gb.numpy(), rb.numpy(), rtol=1e-6, atol=1e-6)


def test_only_cpu_devices_get_it():
    assert cpu_gradients.on_cpu("/CPU:1") and cpu_gradients.on_cpu("/job:worker/task:1/device:CPU:0")
    assert not cpu_gradients.on_cpu("/GPU:0") and not cpu_gradients.on_cpu("/job:worker/replica:0/task:0/device:TPU:1")


@pytest.mark.parametrize("width, laid_out", [(64, False), (cpu_gradients.MIN_WIDTH, True)])
def test_only_wide_weights_get_the_layout(width, laid_out):
    """``(W @ dy^T)^T`` (a Transpose) from MIN_WIDTH up; below it TensorFlow's ``dy @ W^T``; the same numbers."""
    rng = np.random.default_rng(0)
    a = tf.constant(rng.standard_normal((8, width)), tf.float32)
    b = tf.constant(rng.standard_normal((width, width)) / width, tf.float32)

    @tf.function(autograph=False)
    def run():
        with cpu_gradients.scope("/CPU:0"):
            y = tf.matmul(a, b)
        return tf.gradients(y, [a], grad_ys=tf.ones_like(y))[0]

    graph = run.get_concrete_function().graph
    assert any(op.type == "Transpose" for op in graph.get_operations()) == laid_out
    np.testing.assert_allclose(run().numpy(), tf.ones((8, width)) @ tf.transpose(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape", [(2, 3, 5), (2, 2, 3, 5)])
@pytest.mark.parametrize("adj_y", [False, True])
def test_broadcast_weight_gradient_is_two_2d_products_with_tensorflows_numbers(x_shape, adj_y):
    """A BatchMatMulV2 of a batch by a shared 2-D weight (EinsumDense): no per-batch weight gradients to sum."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(x_shape), tf.float32)
    w = tf.constant(rng.standard_normal((4, 5) if adj_y else (5, 4)), tf.float32)
    dy = tf.constant(rng.standard_normal(x_shape[:-1] + (4,)), tf.float32)

    def grads(device):
        @tf.function(autograph=False)
        def run():
            with cpu_gradients.scope(device):
                y = tf.linalg.matmul(x, w, adjoint_b=adj_y)
            return tf.gradients(y, [x, w], grad_ys=dy)

        types = [op.type for op in run.get_concrete_function().graph.get_operations()]
        return run(), types

    (gx, gw), ours = grads("/CPU:0")
    (rx, rw), theirs = grads("/GPU:0")
    assert ours.count("BatchMatMulV2") == 1 and ours.count("MatMul") == 2  # the forward, then two 2-D products
    assert theirs.count("BatchMatMulV2") == 3
    np.testing.assert_allclose(gx.numpy(), rx.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), rw.numpy(), rtol=1e-5, atol=1e-5)


def test_batched_products_of_two_batches_keep_tensorflows_gradient():
    """Attention's ``q @ k^T``: both operands batched, TensorFlow's own gradient (its batched products)."""
    rng = np.random.default_rng(0)
    q = tf.constant(rng.standard_normal((2, 3, 4)), tf.float32)
    k = tf.constant(rng.standard_normal((2, 5, 4)), tf.float32)

    @tf.function(autograph=False)
    def run():
        with cpu_gradients.scope("/CPU:0"):
            y = tf.linalg.matmul(q, k, adjoint_b=True)
        return tf.gradients(y, [q, k])

    gq, gk = run()
    types = [op.type for op in run.get_concrete_function().graph.get_operations()]
    assert types.count("BatchMatMulV2") == 3 and "MatMul" not in types
    np.testing.assert_allclose(gq.numpy(), tf.reduce_sum(k, axis=1, keepdims=True).numpy().repeat(3, 1), rtol=1e-5)
    np.testing.assert_allclose(gk.numpy(), tf.reduce_sum(q, axis=1, keepdims=True).numpy().repeat(5, 1), rtol=1e-5)
