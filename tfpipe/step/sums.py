"""Sums across cells and replicas: a tied variable's gradients, and the step's loss terms device by device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfpipe.backward.gradients import sum_gradients
from tfpipe.distributed import devices
from tfpipe.partition import cell as cell_lib
from tfpipe.partition.cell import Cell


def tied_gradients(cells: Sequence[Cell], grads: Sequence[Any]) -> tuple[list[keras.Variable], list[Any]]:
    """Each trainable variable once with its gradient: a variable that several cells use (tied weights) gets the
    sum of their gradients, on the device of the first of them, where it lives.

    ``grads[i]`` is cell i's list aligned with its ``trainable_variables`` (None where it has none).
    """
    owned = cell_lib.owned(cells)
    per_variable: dict[int, list[Any]] = {id(v): [] for v, _ in owned}
    for cell, g in zip(cells, grads):
        for v, gv in zip(cell.trainable_variables, g or [None] * len(cell.trainable_variables)):
            per_variable[id(v)].append(gv)
    gradients = []
    for v, first in owned:
        with devices.scope(cells[first].device):
            gradients.append(sum_gradients(per_variable[id(v)]))
    return [v for v, _ in owned], gradients


def sum_on_devices(terms: Sequence[tf.Tensor]) -> tf.Tensor:
    """The sum of scalar ``terms``, each device adding up its own first.

    The step's loss has a term per micro-batch and cell (the losses, the added losses): added where they are
    read, each would cross on its own, and every crossing costs a one-thread worker part of its step.
    """
    if tf.executing_eagerly():
        return tf.add_n(list(terms))
    by_device: dict[str, list[tf.Tensor]] = {}
    for term in terms:
        by_device.setdefault(term.device, []).append(term)
    partial = []
    for device, on_device in by_device.items():
        with tf.device(device or None):
            partial.append(tf.add_n(on_device))
    return tf.add_n(partial)
