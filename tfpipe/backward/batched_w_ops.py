"""The op-by-op rules of one batched W: where each output of an op of W holds the examples, from its inputs'.

``tfpipe.backward.batched_w`` walks W traced with the rows of all micro-batches and labels each tensor:

- ``BATCHED``: axis 0 holds whole examples in order (r rows each), computed example by example;
- ``SUMMED``: a sum over the examples, or linear in such sums;
- ``CONST``: the same in every micro-batch (weights, and what only they make);
- ``SHAPE``: the shape of a batched tensor, which only reshapes may read;
- ``COLUMNS``: a matrix with the examples' rows as its columns (``W @ dy^T``,
  tfpipe.graph.cpu_gradients), to be transposed.

``label_op`` gives an op's outputs theirs, or raises ``Unbatchable`` where running the op once on
the rows of all micro-batches would change W (batch statistics, an op it does not know).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorflow as tf

BATCHED, SUMMED, CONST, SHAPE, COLUMNS = "batched", "summed", "const", "shape", "columns"

SHAPE_OPS = ("Shape", "ShapeN")
_PASS = ("Identity", "IdentityN", "StopGradient", "Snapshot", "Cast", "Neg")  # linear, one input, same layout
_LINEAR_SUMS = ("Add", "AddV2", "AddN", "Sub", "BiasAdd")  # linear in all their inputs together
# Ops that work element by element (with broadcasting): on batched inputs, still example by example.
# fmt: off
_ELEMENTWISE = frozenset({
    "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Cast", "DivNoNan", "Elu", "EluGrad", "Equal", "Erf", "Exp", "Expm1",
    "Gelu", "Greater", "GreaterEqual", "Identity", "LeakyRelu", "LeakyReluGrad", "Less", "LessEqual", "Log",
    "Log1p", "LogicalAnd", "LogicalNot", "LogicalOr", "Maximum", "Minimum", "Mul", "MulNoNan", "Neg", "NotEqual",
    "OnesLike", "Pow", "RealDiv", "Reciprocal", "ReciprocalGrad", "Relu", "Relu6", "Relu6Grad", "ReluGrad",
    "Rsqrt", "RsqrtGrad", "Select", "SelectV2", "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Softplus",
    "SoftplusGrad", "Softsign", "SoftsignGrad", "Sqrt", "SqrtGrad", "Square", "SquaredDifference", "Sub", "Tanh",
    "TanhGrad", "ZerosLike",
})
# fmt: on
# Ops linear in their first input where the others are the same in every micro-batch.
# fmt: off
_LINEAR_IN_FIRST = frozenset({
    "Sum", "Mean", "Reshape", "ExpandDims", "Squeeze", "Transpose", "Tile", "StridedSlice", "Slice", "Pad", "MatMul",
    "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
})
# fmt: on
# Ops that work within each example (the batch is axis 0 of NHWC and NCHW alike), other inputs the same for all.
# fmt: off
_WITHIN_EXAMPLES = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNativeBackpropInput", "MaxPool", "MaxPoolGrad", "AvgPool", "AvgPoolGrad", "MaxPool3D",
    "MaxPool3DGrad", "AvgPool3D", "AvgPool3DGrad", "ResizeNearestNeighbor", "ResizeNearestNeighborGrad",
    "ResizeBilinear", "ResizeBilinearGrad", "Softmax", "LogSoftmax",
})
# fmt: on
_FILTER_GRADIENTS = ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter")


class Unbatchable(Exception):
    """W cannot run once over all micro-batches; the message says which tensor or op keeps it from it."""


def _value(tensor: tf.Tensor) -> list[int] | None:
    """The integers of a tensor known when the graph is built (shapes, axes), or None."""
    if tensor.op.type == "BroadcastGradientArgs":  # the axes a broadcast gradient sums, from two static shapes
        shapes = [_value(t) for t in tensor.op.inputs]
        return None if None in shapes else _broadcast_axes(shapes[tensor.value_index], shapes[1 - tensor.value_index])
    if tensor.op.type == "InvertPermutation":  # a transpose's gradient
        perm = _value(tensor.op.inputs[0])
        return None if perm is None else [perm.index(i) for i in range(len(perm))]
    value = tf.get_static_value(tensor)
    if value is None and tensor.op.type == "StridedSlice":  # of a static shape, which get_static_value leaves
        return _sliced(tensor.op)
    return None if value is None else [int(v) for v in (value.ravel() if hasattr(value, "ravel") else [value])]


def _sliced(op: tf.Operation) -> list[int] | None:
    """A one-axis strided slice of a known vector (``shape[:-2]``), or None if not that."""
    vector, begin, end, strides = (_value(t) for t in op.inputs)
    if (
        vector is None
        or begin is None
        or end is None
        or strides is None
        or len(begin) != 1
        or op.get_attr("ellipsis_mask")
        or op.get_attr("new_axis_mask")
    ):
        return None
    start = None if op.get_attr("begin_mask") & 1 else begin[0]
    stop = None if op.get_attr("end_mask") & 1 else end[0]
    if op.get_attr("shrink_axis_mask") & 1:
        return [vector[begin[0]]]
    return vector[start : stop : strides[0]]


def _broadcast_axes(mine: list[int], other: list[int]) -> list[int]:
    """The axes of the broadcast of shapes ``mine`` and ``other`` along which ``mine`` was repeated."""
    rank = max(len(mine), len(other))
    mine, other = [1] * (rank - len(mine)) + mine, [1] * (rank - len(other)) + other
    return [i for i in range(rank) if mine[i] == 1 and other[i] != 1]


def _axes(op: tf.Operation, index: int = 1) -> list[int] | None:
    """The reduction axes an op reads at input ``index``, made non-negative, or None if not static."""
    axes, rank = _value(op.inputs[index]), op.inputs[0].shape.rank
    if axes is None or rank is None:
        return None
    return [a % rank for a in axes]


def fail(op: tf.Operation, ins: Sequence[str]) -> Unbatchable:
    """Why ``op`` on inputs labelled ``ins`` keeps W from running once."""
    return Unbatchable(f"W's op {op.name} ({op.type}) on {'/'.join(ins)} inputs is not known to batch")


def label_op(op: tf.Operation, ins: list[str], examples: int | None) -> str:
    """The label of ``op``'s outputs from its inputs'; raises ``Unbatchable`` where batching would change W."""
    t = op.type
    if op.op_def.is_stateful:
        raise Unbatchable(f"W's op {op.name} ({t}) is stateful")
    kinds = set(ins)
    if kinds <= {CONST}:
        return CONST
    if t in SHAPE_OPS:
        if kinds == {SUMMED}:
            return CONST  # a sum's shape does not grow with the batch
        if kinds == {BATCHED}:
            return SHAPE
        raise fail(op, ins)
    if SHAPE in kinds:
        return _label_shape(op, ins, examples)
    if t in _PASS:
        if len(kinds) > 1:
            raise fail(op, ins)
        return ins[0]
    if t in ("ZerosLike", "OnesLike"):
        return BATCHED if ins[0] == BATCHED else CONST
    if t in _ELEMENTWISE:
        return _label_elementwise(op, ins, kinds)
    return _label_structured(op, ins, examples)


def _label_elementwise(op: tf.Operation, ins: list[str], kinds: set[str]) -> str:
    if kinds <= {BATCHED, CONST}:
        rank = op.outputs[0].shape.rank
        for label, t in zip(ins, op.inputs):
            broadcast = t.shape.rank is not None and rank is not None and (t.shape.rank < rank or t.shape[0] == 1)
            if label == CONST and not broadcast:
                raise Unbatchable(f"W's op {op.name} ({op.type}) pairs examples with a tensor {t.shape} of their own")
        return BATCHED
    if kinds <= {SUMMED, CONST}:  # linear in the sums only
        if op.type in _LINEAR_SUMS and CONST not in kinds:
            return SUMMED
        if op.type in ("Mul", "MulNoNan") and ins.count(SUMMED) == 1:
            return SUMMED
        if op.type in ("RealDiv", "DivNoNan") and ins == [SUMMED, CONST]:
            return SUMMED
    raise fail(op, ins)


def _label_shape(op: tf.Operation, ins: list[str], examples: int | None) -> str:
    """Ops that read the shape of a batched tensor: shape arithmetic, and the reshapes and fills it is for."""
    t = op.type
    if t in ("ConcatV2", "Pack", "StridedSlice", "Cast", "Identity") and set(ins) <= {SHAPE, CONST}:
        return SHAPE
    if t == "Reshape" and ins == [BATCHED, SHAPE]:
        return _reshaped(op, examples)
    if t in ("Fill", "BroadcastTo") and ins == ([SHAPE, CONST] if t == "Fill" else [CONST, SHAPE]):
        return BATCHED
    if t in _WITHIN_EXAMPLES and ins[0] == SHAPE and set(ins[1:]) <= {BATCHED, CONST} and BATCHED in ins[1:]:
        return BATCHED  # an input gradient given the input's shape (a convolution's, a pooling's)
    raise fail(op, ins)


def _reshaped(op: tf.Operation, examples: int | None) -> str:
    """A batched tensor reshaped: still batched if each example becomes whole rows of the result.

    Each example's elements are contiguous; with ``examples`` (the rows of the sources) known,
    they make whole rows where the row length divides their count. Otherwise where it divides
    the length of an input row.
    """
    before, after = op.inputs[0].shape, op.outputs[0].shape
    per_out = math.prod(after[1:]) if after.rank and after[1:].is_fully_defined() else None
    if before.is_fully_defined() and examples and before[0] % examples == 0:
        per_example = math.prod(before) // examples
    else:
        per_example = math.prod(before[1:]) if before.rank and before[1:].is_fully_defined() else None
    if per_example is not None and per_out and per_example % per_out == 0:
        return BATCHED
    raise Unbatchable(f"W's op {op.name} reshapes {before} to {after}, which mixes examples in rows")


def _keeps_rows(op: tf.Operation, strides_at: int) -> bool:
    """Whether a strided slice (or its gradient) takes all of axis 0, in order."""
    if op.get_attr("ellipsis_mask") & 1:
        return True
    strides = _value(op.inputs[strides_at])
    full = op.get_attr("begin_mask") & 1 and op.get_attr("end_mask") & 1
    new_or_shrunk = (op.get_attr("new_axis_mask") | op.get_attr("shrink_axis_mask")) & 1
    return bool(full and not new_or_shrunk and strides and strides[0] == 1)


def _label_structured(op: tf.Operation, ins: list[str], examples: int | None) -> str:
    """Reductions, products and layout ops: where the batch axis goes decides."""
    t, first = op.type, ins[0]
    if first == SUMMED and all(label == CONST for label in ins[1:]) and t in _LINEAR_IN_FIRST:
        return SUMMED
    if t in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") and ins == [CONST, SUMMED]:
        return SUMMED  # linear in the second factor too
    if t == "Einsum" and SUMMED in ins and ins.count(SUMMED) == 1 and set(ins) <= {SUMMED, CONST}:
        return SUMMED
    if t == "ConcatV2" and set(ins[:-1]) == {SUMMED} and ins[-1] == CONST:
        return SUMMED
    if t == "StridedSliceGrad" and ins == [CONST] * 4 + [SUMMED]:
        return SUMMED  # a sum put back in place in zeros: linear
    if SUMMED in ins:
        raise fail(op, ins)
    if COLUMNS in ins:
        if t == "Transpose" and ins == [COLUMNS, CONST] and _value(op.inputs[1]) == [1, 0]:
            return BATCHED
        raise fail(op, ins)
    # From here on: batched inputs (and constant ones).
    if t in ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin") and ins[1] == CONST:
        axes = _axes(op)
        if axes is not None and 0 not in axes:
            return BATCHED
        if axes is not None and t == "Sum":
            return SUMMED
    elif t == "BiasAddGrad":
        return SUMMED
    elif t == "MatMul":
        return _label_matmul(op, ins, op.get_attr("transpose_a"), op.get_attr("transpose_b"))
    elif t in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        return _label_batch_matmul(op, ins)
    elif t == "Einsum":
        return _label_einsum(op, ins)
    elif t in _FILTER_GRADIENTS and ins == [BATCHED, CONST, BATCHED]:
        return SUMMED
    elif t in _WITHIN_EXAMPLES and BATCHED in ins and set(ins) <= {BATCHED, CONST} and _keeps_examples(op):
        return BATCHED
    elif t == "UnsortedSegmentSum" and ins == [BATCHED, BATCHED, CONST]:
        return SUMMED
    elif t == "Reshape" and ins == [BATCHED, CONST]:
        return _reshaped(op, examples)
    elif t in ("ExpandDims", "Transpose", "Tile", "Slice", "Pad", "ConcatV2", "Squeeze", "StridedSlice"):
        if _layout_keeps_rows(op, ins):
            return BATCHED
    elif t == "StridedSliceGrad" and ins[4] == BATCHED and set(ins[:4]) <= {CONST} and _keeps_rows(op, 3):
        return BATCHED
    raise fail(op, ins)


def _keeps_examples(op: tf.Operation) -> bool:
    """Whether an op of ``_WITHIN_EXAMPLES`` leaves axis 0 alone: a softmax needs an axis beside it."""
    return op.type not in ("Softmax", "LogSoftmax") or (op.inputs[0].shape.rank or 0) >= 2


def _layout_keeps_rows(op: tf.Operation, ins: list[str]) -> bool:
    """Whether a layout op on a batched tensor leaves axis 0 where it was, whole."""
    t, rank = op.type, op.inputs[0].shape.rank
    if rank is None:
        return False
    if t == "ConcatV2":
        axis = _value(op.inputs[-1])
        return set(ins[:-1]) == {BATCHED} and axis is not None and axis[0] % rank != 0
    if set(ins[1:]) - {CONST} or ins[0] != BATCHED:
        return False
    if t == "Squeeze":
        dims = [d % rank for d in op.get_attr("squeeze_dims")]
        return 0 not in dims and (bool(dims) or op.inputs[0].shape[0] not in (1, None))
    if t == "StridedSlice":
        return _keeps_rows(op, 3)
    value = _value(op.inputs[1])
    if value is None:
        return False
    if t == "ExpandDims":
        return value[0] % (rank + 1) != 0
    if t == "Transpose":
        return value[0] == 0
    if t == "Tile":
        return value[0] == 1
    if t == "Pad":
        return value[:2] == [0, 0]
    sizes = _value(op.inputs[2])  # Slice: begin, size
    return value[0] == 0 and sizes is not None and sizes[0] == -1


def _label_matmul(op: tf.Operation, ins: list[str], transpose_a: bool, transpose_b: bool) -> str:
    if ins == [BATCHED, CONST] and not transpose_a:
        return BATCHED  # rows stay rows
    if ins == [BATCHED, BATCHED] and transpose_a and not transpose_b:
        return SUMMED  # x^T dy: a sum over the rows of both
    if ins == [CONST, BATCHED] and not transpose_a and transpose_b:
        return COLUMNS  # W @ dy^T
    raise fail(op, ins)


def _label_batch_matmul(op: tf.Operation, ins: list[str]) -> str:
    x, y = op.inputs[0].shape.rank, op.inputs[1].shape.rank
    if x is None or y is None:
        raise fail(op, ins)
    if x == 2 and y == 2:
        return _label_matmul(op, ins, op.get_attr("adj_x"), op.get_attr("adj_y"))
    for label, t, rank in zip(ins, op.inputs, (x, y)):
        if label == CONST and rank > 2 and t.shape[0] != 1:
            raise fail(op, ins)  # a constant's own batch of matrices, not broadcast over the examples
        if label == BATCHED and rank < 3:
            raise fail(op, ins)  # the examples would be a matrix axis
    return BATCHED  # one product per example (its matrices on axis 0)


def _label_einsum(op: tf.Operation, ins: list[str]) -> str:
    equation = op.get_attr("equation").decode()
    inputs, _, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if "." in equation or len(terms) != len(ins):
        raise fail(op, ins)
    letters = {term[0] for term, label in zip(terms, ins) if label == BATCHED and term}
    if len(letters) != 1:
        raise fail(op, ins)
    (batch,) = letters
    if any(batch in term for term, label in zip(terms, ins) if label == CONST):
        raise fail(op, ins)
    if output.startswith(batch):
        return BATCHED
    if batch not in output:
        return SUMMED  # summed over the examples (and whatever else it contracts)
    raise fail(op, ins)
