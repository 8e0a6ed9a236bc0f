"""Re-materialization: run a cell so that its vector-Jacobian product can be taken later.

A recomputed cell keeps no activations after its forward task; its backward task
runs the pure cell function again under a tape (same inputs, same seeds, so the
same result) and differentiates that. A kept cell records its forward on a tape.
Because cells are pure functions of tensors, recomputation changes no result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

REMAT_MODES = ("always", "except_last", "never")


def check_mode(remat: str) -> str:
    """Validate a re-materialization mode."""
    if remat not in REMAT_MODES:
        raise ValueError(f"Unknown remat={remat!r}; use one of {', '.join(repr(m) for m in REMAT_MODES)}.")
    return remat


def recomputes(remat: str, micro_batch: int, num_micro_batches: int) -> bool:
    """Whether micro-batch j is recomputed in the backward pass (torchgpipe's checkpoint_stop)."""
    if remat == "always":
        return True
    if remat == "except_last":
        return micro_batch < num_micro_batches - 1
    return False


def _differentiable(t: Any) -> bool:
    return t is not None and t.dtype.is_floating


class Checkpoint:
    """The forward of a pure function ``fn(*sources)`` whose VJP is taken later by ``vjp``."""

    def __init__(self, fn: Callable[..., Any], sources: Sequence[tf.Tensor], recompute: bool, constant: int = 0):
        """``constant``: how many leading sources need no gradient (the inputs of the first cell)."""
        self._fn = fn
        self._sources = list(sources)
        self._recompute = recompute
        self._wanted = [i for i, s in enumerate(self._sources) if i >= constant and _differentiable(s)]
        self._tape: tf.GradientTape | None = None
        if recompute:
            self.outputs = fn(*self._sources)
        else:
            self._tape, self.outputs = self._record()

    def _record(self):
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            for i in self._wanted:
                tape.watch(self._sources[i])
            outputs = self._fn(*self._sources)
        return tape, outputs

    def vjp(
        self, select: Callable[[Any], Sequence[tf.Tensor]], output_grads: Sequence[tf.Tensor]
    ) -> list[tf.Tensor | None]:
        """Gradients of the sources for the given gradients of ``select(outputs)``.

        Call it inside the backward task's device and control-dependency scope: a
        recomputation then runs there, after the incoming gradients exist.
        """
        tape, outputs = self._record() if self._recompute else (self._tape, self.outputs)
        self._tape = None  # a kept tape is used once; let its activations go
        targets = list(select(outputs))
        pairs = [(t, g) for t, g in zip(targets, output_grads) if _differentiable(t) and g is not None]
        wanted = self._wanted
        grads = (
            tape.gradient(
                [t for t, _ in pairs],
                [self._sources[i] for i in wanted],
                output_gradients=[g for _, g in pairs],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            if pairs
            else [tf.zeros_like(self._sources[i]) for i in wanted]
        )
        result: list[tf.Tensor | None] = [None] * len(self._sources)
        for i, g in zip(wanted, grads):
            result[i] = g
        return result
