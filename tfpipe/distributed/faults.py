"""A worker that failed: the watches of this process's clusters, and the ``WorkerError`` that names the worker."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tfpipe.distributed import health


class WorkerError(RuntimeError):
    """A worker process failed to start, died, or stopped answering."""


# How to make fit recover by itself, said in each WorkerError that ends a run.
RECOVER = (
    " For fit to restart the workers and go on by itself, start them with LocalCluster(..., max_restarts=N) "
    "and pass keras.callbacks.BackupAndRestore(backup_dir) to fit."
)


_WATCHDOGS: list[health.Watchdog] = []  # one per cluster this process is connected to now


def watch(addresses: list[str], timeout: float | None, on_hung: Any) -> health.Watchdog | None:
    """Start a watchdog over ``addresses`` that ``hung_worker`` consults (None: ``timeout`` None, no watch)."""
    if timeout is None:
        return None
    watchdog = health.Watchdog(addresses, timeout, on_hung)
    watchdog.start()
    _WATCHDOGS.append(watchdog)
    return watchdog


def unwatch(watchdog: health.Watchdog | None) -> None:
    """Stop ``watchdog`` and forget it."""
    if watchdog is not None:
        watchdog.stop()
        if watchdog in _WATCHDOGS:
            _WATCHDOGS.remove(watchdog)


def hung_worker(err: BaseException | None = None) -> str | None:
    """The worker that a watchdog found silent ('task k at host:port did not answer ...'), else None.

    After a TensorFlow ``UnavailableError`` (gRPC's ping timeout can end a blocked call before
    the watchdog's timeout), the workers are asked once more, with a 2 s deadline.
    """
    for watchdog in _WATCHDOGS:
        if watchdog.hung:
            return watchdog.hung
    if isinstance(err, tf.errors.UnavailableError):
        for watchdog in _WATCHDOGS:
            silent = watchdog.silent_now()
            if silent:
                return f"{', '.join(silent)} did not answer"
    return None


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Turn a TensorFlow error that a silent worker caused into a ``WorkerError`` that names the worker."""
    try:
        yield
    except tf.errors.OpError as err:
        why = hung_worker(err)
        if why is None:
            raise
        raise WorkerError(
            f"Worker {why}: the run ended ({type(err).__name__}). A stopped, frozen or cut-off worker cannot "
            "finish the step; start a new cluster (or call connect() again once it answers) and resume from "
            "the last checkpoint." + RECOVER
        ) from err
