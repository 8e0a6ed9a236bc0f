"""A matrix-product gradient laid out for CPU kernels at micro-batch sizes, used inside cells on CPU devices.

TensorFlow's MatMul gradient takes the input gradient as ``dy @ W^T``. On CPU,
Eigen re-packs the transposed weight on every call, a cost that does not shrink
with the rows, so on a micro-batch it costs several forwards ``x @ W``, while
``(W @ dy^T)^T`` gives the same numbers for little more than one
(docs/notes/2026-11-benchmark-passes.md#where-a-backward-tasks-time-goes;
benchmarks/benchmark_kernels.py). Cells on a CPU trace their layers under
``tf.Graph.gradient_override_map`` so that their MatMuls get this gradient; other
code in the process and cells on accelerators keep TensorFlow's own.

Keras' ``EinsumDense`` (every ``MultiHeadAttention`` projection) multiplies a
``(batch, seq, dim)`` input by a 2-D kernel with ``tf.matmul``: a BatchMatMulV2 that
broadcasts the kernel. TensorFlow's gradient of it forms one kernel gradient per batch
entry and sums them, and broadcasts the kernel again for the input gradient, several
times the cost of the same two products on the rows as one 2-D matrix
(docs/benchmarks.md#against-torchdistributedpipelining). Cells on a CPU give these
products that 2-D gradient.

Only weights at least ``MIN_WIDTH`` wide both ways get the layout: on narrower ones it
gains nothing or loses: a dim-64 Transformer's step was slower with it in every backward
than with TensorFlow's own
(docs/notes/2026-11-benchmark-passes.md#thirteenth-pass-what-this-machines-cores-allow-2026-11-25,
docs/notes/2026-11-benchmark-passes.md#fourteenth-pass-each-cell-traced-and-differentiated-once-2026-11-26-latest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf

from tfpipe import _compat

GRADIENT_NAME = "TfpipeCpuMatMul"
BATCH_GRADIENT_NAME = "TfpipeCpuBatchMatMul"
MIN_WIDTH = 512  # both dimensions of the weight, when known when the gradient is built


@tf.RegisterGradient(GRADIENT_NAME)
def _matmul_gradient(op: tf.Operation, grad: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """MatMul's gradient with the input gradient computed as ``(b @ grad^T)^T`` when neither operand is transposed."""
    a, b = op.inputs
    if a.dtype.is_complex:
        a, b = tf.math.conj(a), tf.math.conj(b)
    t_a, t_b = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    if not t_a and not t_b:
        if _wide(b):
            return tf.transpose(tf.matmul(b, grad, transpose_b=True)), tf.matmul(a, grad, transpose_a=True)
        return tf.matmul(grad, b, transpose_b=True), tf.matmul(a, grad, transpose_a=True)  # TensorFlow's own
    if not t_a and t_b:
        return tf.matmul(grad, b), tf.matmul(grad, a, transpose_a=True)
    if t_a and not t_b:
        return tf.matmul(b, grad, transpose_b=True), tf.matmul(a, grad)
    return (
        tf.matmul(b, grad, transpose_a=True, transpose_b=True),
        tf.matmul(grad, a, transpose_a=True, transpose_b=True),
    )


@tf.RegisterGradient(BATCH_GRADIENT_NAME)
def _batch_matmul_gradient(op: tf.Operation, grad: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """BatchMatMulV2's gradient as two 2-D products when ``y`` is a real 2-D weight shared by every batch entry."""
    x, y = op.inputs
    adj_x, adj_y = op.get_attr("adj_x"), op.get_attr("adj_y")
    if y.shape.rank != 2 or (x.shape.rank or 0) < 3 or adj_x or x.dtype.is_complex:
        return _compat.tensorflow_gradient("BatchMatMulV2")(op, grad)
    rows = tf.reshape(x, [-1, tf.shape(x)[-1]])  # every batch entry's rows as one matrix
    grad_rows = tf.reshape(grad, [-1, tf.shape(grad)[-1]])
    dx = tf.reshape(tf.matmul(grad_rows, y, transpose_b=not adj_y), tf.shape(x))
    dy = tf.matmul(grad_rows, rows, transpose_a=True) if adj_y else tf.matmul(rows, grad_rows, transpose_a=True)
    return dx, dy


def _wide(weight: tf.Tensor) -> bool:
    """Whether a product's second operand is known to be at least ``MIN_WIDTH`` wide both ways."""
    dims = weight.shape.as_list() if weight.shape.rank == 2 else [None]
    return all(d is not None and d >= MIN_WIDTH for d in dims)


def on_cpu(device: str) -> bool:
    """Whether a cell's device string names a CPU."""
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() == "CPU"


@contextlib.contextmanager
def scope(device: str) -> Iterator[None]:
    """Inside a graph, give the matrix products created here the CPU-friendly gradients if ``device`` is a CPU."""
    if not on_cpu(device) or tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.get_default_graph().gradient_override_map(
        {"MatMul": GRADIENT_NAME, "BatchMatMulV2": BATCH_GRADIENT_NAME}
    ):
        yield
