"""Messages to the user, written the way Keras writes its own (stdout when interactive, else absl logging)."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

import keras
from absl import logging

_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("tfpipe_quiet", default=False)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Say nothing inside: for models tfpipe builds for itself (the planner's probes), not the user's."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def say(message: str) -> None:
    """Show one line: on stdout with Keras' interactive logging (the default), else through absl's log."""
    if _QUIET.get():
        return
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()
    else:
        logging.info(message)


def building_step(
    model_name: str, num_cells: int, num_micro_batches: int, remat: str, loops: bool = False, replicas: int = 1
) -> str:
    """The line shown before a pipelined training step is traced, so that a quiet first step is not taken for a hang."""
    tasks = 2 * num_cells * num_micro_batches * replicas
    how = (
        f"as two loops over {num_micro_batches + num_cells - 1} clock cycles, recomputing every cell"
        if loops
        else f"remat={remat!r}"
    )
    return (
        f"tfpipe: building the pipelined training step of {model_name!r}: "
        + (f"R={replicas} replicas x " if replicas > 1 else "")
        + f"K={num_cells} cells x "
        f"M={num_micro_batches} micro-batches = {tasks} tasks ({how}); tracing and optimizing "
        "it makes the first step take a while."
    )
