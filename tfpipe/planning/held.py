"""What a backward reads of its forward, counted in one traced graph: the bytes a micro-batch holds, without a run.

The planner reads a layer's held bytes from the allocator by running its forward under a ``tf.GradientTape``, which
makes TensorFlow trace the layer's backward a second time (beside the trace that times it): 0.6-1.2 s for each
AmoebaNet-D cell on a 2-core CPU, a third of measuring it. Under ``max_seconds`` the layers measured late (and on
a cluster, those its stand-in left unread) are given their bytes from the tensors their forward-and-backward graph
carries from the forward to the backward instead, scaled by what the allocator showed of the layers read before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

# Ops whose output is their input's buffer (or one of them): the buffer is counted once, at its maker
_ALIASING = frozenset({"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "Snapshot", "StopGradient"})
# Tensors a backward reads that the forward did not allocate: the inputs (the caller's), variables, constants
_NOT_HELD = frozenset({"Placeholder", "ReadVariableOp", "Const", "VarHandleOp", "_Arg"})


def _maker(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor whose buffer ``tensor`` is: through ops that pass their input on."""
    while tensor.op.type in _ALIASING and tensor.op.inputs:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
    return tensor


def counted(operations: Sequence[Any], forward_ops: int, outputs: Sequence[tf.Tensor]) -> tuple[float, float] | None:
    """(bytes per row, fixed bytes) of the forward's tensors that the backward reads, the forward's ``outputs``
    included, in a graph whose ``operations`` are its first ``forward_ops`` the forward's and the rest the backward's,
    traced general in the rows (their first dimension unknown). None where a held tensor's shape is unknown beyond
    its rows: its bytes cannot be counted."""
    forward = set(operations[:forward_ops])
    held: dict[str, tf.Tensor] = {}
    read = [t for op in operations[forward_ops:] for t in op.inputs if t.op in forward]
    for tensor in [*read, *outputs]:
        tensor = _maker(tensor)
        if tensor.op.type not in _NOT_HELD and tensor.dtype not in (tf.resource, tf.variant):
            held[tensor.name] = tensor
    per_row = fixed = 0.0
    for tensor in held.values():
        dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
        if dims is None or None in dims[1:]:
            return None
        size = float(np.prod(dims[1:], dtype=np.float64)) * tensor.dtype.size
        if dims and dims[0] is None:
            per_row += size
        else:
            fixed += size * (dims[0] if dims else 1)
    return per_row, fixed
