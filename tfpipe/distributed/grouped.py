"""A device's stateful work in a step run as one call, so that the step waits on it across processes once.

A ``tf.function`` makes its outputs wait for every stateful op it runs (automatic control
dependencies: one control edge from each op to a no-op on the training process). An op on a
worker process made its edge a transfer of its own: every step, one RecvTensor call to the
worker per weight read and per optimizer read or assignment, half to most of the client's CPU a step
(docs/benchmarks.md#cost-of-crossing-processes). Inside one function call on the worker those
ops wait for each other there, and the step waits for the call: one edge per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfpipe.distributed import devices


def elsewhere(device: str) -> bool:
    """Whether ``run_on`` groups work for ``device``: one of another process (a job other than ``localhost``),
    outside any ``tf.distribute`` strategy (a strategy places and groups its own updates)."""
    return tf.DeviceSpec.from_string(device).job not in (None, "localhost") and not tf.distribute.has_strategy()


def run_on(device: str, work: Callable[[], Any]) -> Any:
    """``work()`` in the device's scope (``devices.scope``); traced for a device of another process, as one call.

    ``work`` takes no arguments (the tensors it uses are captured) and returns tensors or nothing;
    it must not create variables.
    """
    with devices.scope(device):
        if tf.executing_eagerly() or not elsewhere(device):
            return work()
        return tf.function(work, autograph=False)()
