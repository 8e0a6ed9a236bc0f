"""One W over a cell's micro-batches: the bridge from re-materialization's records (``Checkpoint``) to ``BatchedW``.

Zero bubble's W of a cell (``Checkpoint.weight_vjp``) runs once per micro-batch; where every op
of it allows (``tfpipe.backward.batched_w``), the W of all the cell's micro-batches runs once on
their rows together. These functions read the records' split VJPs (``Checkpoint``'s own state).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.backward import batched_w
from tfpipe.backward.gradients import differentiable

if TYPE_CHECKING:
    from tfpipe.backward.remat import Checkpoint


def batch_weights(records: Sequence[Checkpoint], shared_grads: Sequence[bool]) -> batched_w.BatchedW | str | None:
    """Cut the W of one cell's micro-batches ``records`` (after their forwards) so that it runs once over all of them.

    ``shared_grads[k]`` says that the gradient of the k-th selected output will be the same
    tensor in every micro-batch (the loss scale, for added losses). Returns the cut, to be
    handed to each record's ``input_vjp`` and to ``batched_weight_vjp``; else why not (a
    string), or None where there is nothing to batch (one micro-batch; no traced W, as eagerly).
    """
    first = records[0]
    parts = [r._parts for r in records if r._parts is not None]
    if len(records) < 2 or len(parts) < len(records) or any(r._recompute for r in records) or first._cache is None:
        return None
    assert first._select is not None  # a record with parts was made with split=(n, select)
    given = [d for t, d in zip(first._select(first.outputs), shared_grads) if differentiable(t)]
    shared = {name for name, d in zip(parts[0].dys, given) if d}
    # The inputs fed as the same tensor to every micro-batch (a weight, a seed); a capture of the traced body is
    # not fed, and W does not read it (an activity regularizer's leaves one).
    fed = [name for name in parts[0].inputs if name in first._env]
    shared |= {name for name in fed if all(r._env.get(name) is first._env[name] for r in records)}
    try:
        key = ("batched", tuple(r._split_key() for r in records))
        big = first._cache.lookup(key, functools.partial(first._trace_split, first._cache, records))
        return batched_w.BatchedW(parts, big, shared)
    except batched_w.Unbatchable as why:
        return str(why)


def batched_weight_vjp(records: Sequence[Checkpoint], batched: batched_w.BatchedW) -> list[Any]:
    """W over all micro-batches' ``records``, each after ``input_vjp(..., batched)``: the summed weight gradients."""
    first = records[0]
    assert first._split_at is not None  # batch_weights cut the W of split records
    grads = batched.run([r._env for r in records])
    result: list[Any] = [None] * (len(first._sources) - first._split_at)
    for k, g in zip([i - first._split_at for i in first._wanted if i >= first._split_at], grads):
        result[k] = g
    for r in records:
        r._env = {}  # let go of what W read
    return result
