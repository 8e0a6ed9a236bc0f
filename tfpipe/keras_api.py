"""How PipelineModel's Keras step functions run: with fewer Grappler rewrites where the step calls its cells."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tfpipe import _compat


def with_fewer_rewrites(function: Callable, calls_cells: Callable[[], bool]) -> Callable:
    """``function`` (a Keras step function) called without two Grappler passes when ``calls_cells()``.

    TensorFlow's runtime inlines every call it may (``LowerFunctionalOpsPass``) before
    Grappler sees the step. What is left of an unrolled step with many tasks are the cells'
    ``_noinline`` calls, and Grappler's function optimizer rebuilds the body of each of them,
    call site by call site, before it reads the mark and leaves it alone, a cost that grows
    with the call sites of the first step. Its TFG optimizer (MLIR passes that sink ops into
    the branches of If and Case, and tidy the function library) changes nothing in such a
    step and still takes time. Both are off for the step and the functions it calls; later
    steps measured the same. With cells inlined (fewer tasks) neither rebuilds anything of
    theirs, and both stay on: across worker processes the step measured no faster with the
    function optimizer off
    (docs/notes/2026-11-benchmark-passes.md#twelfth-pass-per-call-site-costs-of-tensorflows-first-run-taken-off-2026-11-25).
    The user's other Grappler settings stay as they are.
    """

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not calls_cells():
            return function(*args, **kwargs)
        with _compat.fewer_rewrites():
            return function(*args, **kwargs)

    return call
