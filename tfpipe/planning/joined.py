"""What one W over all micro-batches copies first: per layer, the bytes per sample its weight gradients join.

``gpipe_batched_w`` computes a cell's weight gradients once on the rows of all its micro-batches
(``tfpipe.backward.batched_w``): it first concatenates what each micro-batch's B left for W (the
inputs of the weight products and the gradients at their outputs), a copy of those bytes that
the planner charges at the device's copy speed (``Calibration.copy_s_per_byte``). Each layer is
traced alone, as the step cuts a cell, at two sizes; nothing runs.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras
import tensorflow as tf

from tfpipe import _compat
from tfpipe.backward.batched_w import BatchedW, Unbatchable
from tfpipe.backward.split_vjp import SplitVJP
from tfpipe.graph import cpu_gradients
from tfpipe.planning import units as units_lib
from tfpipe.planning.walk import same_layer_key


def bytes_per_sample(units: Any, sample: Any, device: str, rows: int = 4) -> list[float]:
    """Per unit (``planning.units``), the bytes per sample one W over all micro-batches concatenates (0 where W
    cannot run once); a unit of a kind traced before (``walk.same_layer_key``) gets that one's."""
    out: list[float] = []
    traced: dict[str, float] = {}
    for walked in units_lib.walk(units, sample, rows, device):
        kind = same_layer_key(walked.copy, walked.inputs)
        if kind is not None and kind in traced:
            out.append(traced[kind])
            continue
        out.append(_layer_bytes(walked.copy, walked.inputs, rows, device))
        if kind is not None:
            traced[kind] = out[-1]
    return out


def _layer_bytes(copy: keras.layers.Layer, x_in: Any, rows: int, device: str) -> float:
    weights = list(copy.trainable_variables)
    if not weights:
        return 0.0
    leaves = tf.nest.flatten(x_in)
    floating = [i for i, t in enumerate(leaves) if t.dtype.is_floating]
    frozen = [v.value for v in copy.non_trainable_variables]
    kwargs = {"training": True} if "training" in inspect.signature(copy.call).parameters else {}

    def body(*flat: tf.Tensor) -> tuple[Any, list[tf.Tensor], list[Any], list[Any]]:
        inputs = tf.nest.pack_sequence_as(x_in, list(flat[: len(leaves)]))
        values = list(flat[len(leaves) :])
        with cpu_gradients.scope(device):
            outputs, _ = copy.stateless_call(values, frozen, inputs, **kwargs)
            targets = [t for t in tf.nest.flatten(outputs) if t is not None and t.dtype.is_floating]
            dys = [_compat.placeholder(t.dtype, t.shape) for t in targets]
            sources = [flat[i] for i in floating] + values
            grads = tf.gradients(targets, sources, grad_ys=dys, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outputs, dys, grads[: len(floating)], grads[len(floating) :]

    def traced(n: int) -> SplitVJP:
        specs = [tf.TensorSpec([n, *t.shape[1:]], t.dtype) for t in leaves]
        specs += [tf.TensorSpec(v.shape, v.dtype) for v in weights]
        return SplitVJP(body, specs, lambda fn, specs, part: fn)

    small, big = traced(rows), traced(2 * rows)
    try:
        cut = BatchedW([small, small], big, set(big.inputs[len(leaves) :]))  # the weights: one tensor for both
    except Unbatchable:
        return 0.0
    return cut.joined_bytes() / (2 * rows)
