"""Counting the floating-point operations of a traced graph op by op, from static shapes."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfpipe import _compat


def graph_flops(graph: tf.Graph | None) -> tuple[float, set[str]]:
    """FLOPs of every op of a graph, looking into loops, branches and function calls; unknown op types."""
    total, unknown = 0.0, set()
    if graph is None:
        return total, {"a function call whose graph was not found"}
    for op in graph.get_operations():
        if op.type in ("While", "StatelessWhile"):
            trips = _static_value(op.inputs[1])  # while_v2's loop vars start with (counter, maximum_iterations)
            body, inner = graph_flops(_function_graph(op, "body"))
            if trips is None or int(trips) < 0:
                unknown.add(f"{op.type} (trip count unknown, body counted once)")
                count = 1
            else:
                count = int(trips)
            total, unknown = total + count * body, unknown | inner
            continue
        branches = [name for name in ("f", "then_branch", "else_branch") if name in op.node_def.attr]
        if branches:
            counted = [graph_flops(_function_graph(op, name)) for name in branches]
            total += max(flops for flops, _ in counted)  # a call runs its function; an If runs one branch
            unknown = unknown.union(*(inner for _, inner in counted))
            continue
        flops = op_flops(op)
        if flops is None:
            unknown.add(op.type)
            flops = sum(_elements(o.shape) or 0 for o in op.outputs)
        total += flops
    return total, unknown


def _function_graph(op: tf.Operation, attr: str) -> tf.Graph | None:
    """The graph of the function an op's attribute names, looked up from the op's graph outwards."""
    name, graph = op.get_attr(attr).name, op.graph
    while graph is not None:
        found = _compat.function_graph(graph, name)
        if found is not None:
            return found
        graph = getattr(graph, "outer_graph", None)
    return None


def _static_value(t: tf.Tensor) -> np.ndarray | None:
    """A tensor's value when the graph fixes it: constants, and max/min over constants (loop trip counts)."""
    value = tf.get_static_value(t)
    if value is None and t.op.type in ("Max", "Min"):
        x, axis = (tf.get_static_value(i) for i in t.op.inputs)
        if x is not None and axis is not None:
            reduce = np.max if t.op.type == "Max" else np.min
            value = reduce(x, axis=tuple(np.atleast_1d(axis).tolist()))
    return value


def _elements(shape: tf.TensorShape) -> int | None:
    if shape.rank is None or any(d is None for d in shape):
        return None
    return math.prod(shape)


# Ops that move or describe data: no arithmetic.
_FREE = {
    "Const",
    "Placeholder",
    "ReadVariableOp",
    "Identity",
    "IdentityN",
    "NoOp",
    "Reshape",
    "Shape",
    "ShapeN",
    "Size",
    "Rank",
    "StridedSlice",
    "Slice",
    "Pack",
    "Unpack",
    "ConcatV2",
    "Concat",
    "Split",
    "SplitV",
    "Transpose",
    "ExpandDims",
    "Squeeze",
    "GatherV2",
    "ResourceGather",
    "GatherNd",
    "Fill",
    "ZerosLike",
    "OnesLike",
    "StopGradient",
    "AssignVariableOp",
    "AssignAddVariableOp",
    "AssignSubVariableOp",
    "VarHandleOp",
    "Cast",
    "Tile",
    "BroadcastTo",
    "BroadcastArgs",
    "Range",
    "Pad",
    "PadV2",
    "MirrorPad",
    "OneHot",
    "MatrixBandPart",
    "StatelessRandomUniformV2",
    "StatelessRandomNormalV2",
    "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg",
    "StatelessRandomUniformIntV2",
    "RandomUniform",
    "RandomStandardNormal",
    "StatelessRandomUniform",
    "StatelessRandomNormal",
    "Bitcast",
    "LogicalAnd",
    "LogicalOr",
    "LogicalNot",
    "Equal",
    "NotEqual",
    "Less",
    "LessEqual",
    "Greater",
    "GreaterEqual",
    "PreventGradient",
    "EnsureShape",
    "CheckNumerics",
    "Assert",
    "ArgMax",
    "ArgMin",
    "Where",
}
# One FLOP per output element.
_ELEMENTWISE = {
    "Add",
    "AddV2",
    "AddN",
    "Sub",
    "Mul",
    "RealDiv",
    "Div",
    "DivNoNan",
    "FloorDiv",
    "FloorMod",
    "Mod",
    "Maximum",
    "Minimum",
    "Neg",
    "Abs",
    "Sign",
    "Square",
    "SquaredDifference",
    "Sqrt",
    "Rsqrt",
    "Reciprocal",
    "Inv",
    "Exp",
    "Expm1",
    "Log",
    "Log1p",
    "Pow",
    "Tanh",
    "Sigmoid",
    "Relu",
    "Relu6",
    "Elu",
    "Selu",
    "LeakyRelu",
    "Softplus",
    "Softsign",
    "Erf",
    "Erfc",
    "BiasAdd",
    "Select",
    "SelectV2",
    "Floor",
    "Ceil",
    "Round",
    "ClipByValue",
    "Sin",
    "Cos",
    "Softmax",
    "LogSoftmax",
    "Gelu",
}
_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"}
_POOLS = {"MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D"}


def op_flops(op: tf.Operation) -> float | None:
    """Floating-point operations of one graph op from its static shapes; ``None`` if it cannot count them.

    Integer and boolean ops (index arithmetic, masks) count nothing.
    """
    kind = op.type
    if (
        kind in _FREE
        or kind.startswith("TensorList")
        or not any(o.dtype.is_floating or o.dtype.is_complex for o in op.outputs)
    ):
        return 0.0
    out = _elements(op.outputs[0].shape) if op.outputs else 0
    if out is None:
        return None
    if kind in _ELEMENTWISE:
        return float(out)
    if kind in _REDUCTIONS:
        return float(_elements(op.inputs[0].shape) or 0)
    if kind == "MatMul":  # the inner dimension may be unknown where the output's is not (a weight's gradient)
        a = op.inputs[0].shape
        return _times_inner(out, a[0] if op.get_attr("transpose_a") else a[1])
    if kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = op.inputs[0].shape
        return _times_inner(out, a[-2] if op.get_attr("adj_x") else a[-1])
    if kind == "Einsum":
        return _einsum_flops(op)
    if kind in ("Conv2D", "Conv3D"):  # Conv1D is a Conv2D in the graph
        return 2.0 * out * math.prod(op.inputs[1].shape[:-1])  # spatial kernel x input channels per group
    if kind == "DepthwiseConv2dNative":
        return 2.0 * out * math.prod(op.inputs[1].shape[:2])
    if kind in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):  # transposed convolution
        kernel, x = op.inputs[1].shape, op.inputs[2].shape  # kernel: spatial x out x in
        x_elements = _elements(x)
        if x_elements is None:  # the output's shape known, not the gradient's it is made from
            return None
        return 2.0 * x_elements * math.prod(kernel[:-1])
    if kind in _POOLS:
        size = op.get_attr("ksize") if "ksize" in op.node_def.attr else op.inputs[1].shape
        return float(out * math.prod(size))
    if kind == "FusedBatchNormV3":
        return 4.0 * out
    if kind in _CUDNN_RNNS:
        return _cudnn_rnn_flops(op)
    return None


# Keras' LSTM and GRU on a GPU: the whole recurrence is one cuDNN op. Gate blocks per step, by rnn_mode.
_CUDNN_RNNS = {"CudnnRNN", "CudnnRNNV2", "CudnnRNNV3"}
_CUDNN_GATES = {b"lstm": 4, b"gru": 3, b"rnn_tanh": 1, b"rnn_relu": 1}


def _cudnn_rnn_flops(op: tf.Operation) -> float | None:
    """A cuDNN recurrence: each step, layer and direction multiplies [input, state] by every gate's kernel."""
    x, h = op.inputs[0].shape, op.inputs[1].shape  # x: [T, B, in] (or [B, T, in]); h: [layers*dirs, B, H]
    gates = _CUDNN_GATES.get(op.get_attr("rnn_mode"))
    if gates is None or _elements(x) is None or _elements(h) is None:
        return None
    time_major = op.get_attr("time_major") if "time_major" in op.node_def.attr else True
    steps, batch, features = (x[0], x[1], x[2]) if time_major else (x[1], x[0], x[2])
    directions = 2 if op.get_attr("direction") == b"bidirectional" else 1
    layers, units = h[0] // directions, h[2]
    if op.get_attr("input_mode") == b"skip_input":  # the first layer adds its input instead of multiplying it
        features = 0
    total = 0.0
    for layer in range(layers):
        inputs = features if layer == 0 else units * directions
        per_step = 2 * batch * gates * units * (inputs + units) + 2 * batch * gates * units  # products, gating
        total += directions * steps * per_step
    return float(total)


def _times_inner(out: int, inner: int | None) -> float | None:
    """A product's FLOPs, two per output element and inner index; None where the inner dimension is unknown."""
    return None if inner is None else 2.0 * out * int(inner)


def _einsum_flops(op: tf.Operation) -> float | None:
    equation = op.get_attr("equation").decode()
    inputs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, tensor in zip(inputs, op.inputs):
        if "." in letters or len(letters) != tensor.shape.rank:
            return None
        for letter, dim in zip(letters, tensor.shape):
            if dim is None:
                return None
            sizes[letter] = int(dim)
    product = math.prod(sizes.values())
    return 2.0 * product if len(inputs) > 1 else float(product)
