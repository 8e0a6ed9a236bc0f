"""Training that outlives a dead worker and a preemption: ``fit`` with a ``keras.callbacks.BackupAndRestore``.

- A worker of a ``LocalCluster(max_restarts=N)`` dies or hangs: the cluster starts fresh
  workers, the variables they held are made again (TensorFlow's remote variables die
  with their process), the step is traced anew, and the same ``fit`` call goes on from
  the last backup, which Keras' callback restores. After ``connect(max_restarts=N)``,
  ``fit`` waits up to the timeout for the worker to be back (someone restarts it), then
  the same.
- The process gets SIGTERM (what a cloud VM or a scheduler sends before it stops it):
  the current step ends, a backup is written, and the process exits (code 143) through
  the user's ``with LocalCluster`` block, which stops the workers; the same command
  resumes.
- A backup written inside an epoch (SIGTERM, or ``save_freq=<int>``) resumes after the
  batches it saw: the batches before it are drawn from the data and not trained on
  again, where Keras alone would restart the epoch. With data in the same order (no
  shuffling, no random layers) the result is that of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpipe import _compat
from tfpipe import cluster as cluster_lib
from tfpipe.partition import state as state_lib

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


@dataclasses.dataclass
class Skips:
    """The batches of a resumed epoch that its backup saw: drawn from the data and not trained on again."""

    left: int = 0


def fit(
    model: keras.Model,
    run: Callable[[list], keras.callbacks.History],
    callbacks: Any,
    skips: Skips,
    remake_pipeline: Callable[[], None],
) -> Any:
    """Run ``run(callbacks)`` (one Keras ``fit``); run it again after each worker failure the cluster may recover.

    ``skips`` is what the model's train function reads (``skipping``); ``remake_pipeline`` makes the model's
    pipeline and step functions anew over its variables once they are made again on the new workers.
    """
    callbacks = list(callbacks or [])
    backup = next((c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)), None)
    if backup is None:
        return run(callbacks)
    guard = Guard(backup, cluster_lib.restartable(), skips)
    with guard.armed():
        while True:
            try:
                return guard.history(run([*callbacks, guard]))
            except (cluster_lib.WorkerError, tf.errors.OpError) as err:
                cluster = guard.cluster
                why = cluster.failed(err) if cluster is not None else None
                if why is None or cluster.restarts >= cluster.max_restarts:
                    raise
                epoch, done = _compat.backup_point(backup)
                how = "restarting the workers" if isinstance(cluster, cluster_lib.LocalCluster) else "reconnecting"
                logging.warning(
                    "tfpipe: worker %s (%s); %s (restart %d of %d) and resuming from the backup in %s at epoch %d, "
                    "batch %d.",
                    why,
                    type(err).__name__,
                    how,
                    cluster.restarts + 1,
                    cluster.max_restarts,
                    backup.backup_dir,
                    epoch + 1,
                    done,
                )
                placed = variables(model)  # read before the restart: an old handle's device is gone after it
            forget_steps(model)  # outside the except: its traceback holds the old step's frames
            cluster.restart()
            remake(model, placed, guard.seeds, remake_pipeline)
            guard.restarts += 1


class Guard(keras.callbacks.Callback):
    """The callback ``fit`` adds after the user's: a backup to restart from, batches to skip, SIGTERM."""

    def __init__(self, backup: keras.callbacks.BackupAndRestore, cluster: Any, skips: Skips):
        super().__init__()
        self.backup = backup
        self.skips = skips
        self.cluster = cluster  # the LocalCluster or joined cluster whose failures fit recovers from, or None
        self.seeds: dict[int, np.ndarray] = {}  # seed states at the start: a backup does not hold them
        self.signalled = False
        self._epoch = 0  # the epoch running
        self.restarts = 0
        self._epochs: dict[int, dict] = {}  # the logs of every epoch that ended, over every restart

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Catch SIGTERM while ``fit`` runs (main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            del signum, frame
            self.signalled = True  # acted on when the current step ends

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def on_train_begin(self, logs: Any = None) -> None:
        """After Keras' callback restored the backup: skip what it saw; with no backup, write one to restart from."""
        model = self.model
        self.skips.left = _compat.backup_point(self.backup)[1]
        if self.cluster is None:
            return
        if not self.seeds:
            self.seeds = {id(v): np.array(v.numpy()) for v in state_lib.seed_states(_compat.flatten_layers(model))}
        if not _compat.has_backup(self.backup):
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            _compat.save_backup(self.backup, epoch=0, batches_done=0)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        """Keep Keras' callback's epoch right after a restore (its own saves inside an epoch record it)."""
        self._epoch = epoch
        _compat.set_backup_epoch(self.backup, epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Keep the epoch's logs, so that the History ``fit`` returns covers the epochs before a restart."""
        self._epochs[epoch] = dict(logs or {})

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """After SIGTERM: write the backup as of this batch and end the process."""
        if not self.signalled:
            return
        _compat.save_backup(self.backup, epoch=self._epoch, batches_done=batch + 1)
        epoch = self._epoch
        logging.warning(
            "tfpipe: SIGTERM: stopped after epoch %d, batch %d; the backup in %s resumes there: run the same "
            "command again.",
            epoch + 1,
            batch + 1,
            self.backup.backup_dir,
        )
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def history(self, last: keras.callbacks.History) -> keras.callbacks.History:
        """``last`` (the History of the run that finished), with the epochs of the runs a restart cut short."""
        if last is None or not self.restarts:
            return last
        last.epoch = sorted(self._epochs)
        keys = {k for logs in self._epochs.values() for k in logs}
        last.history = {k: [self._epochs[e].get(k) for e in last.epoch] for k in sorted(keys)}
        return last


class Placed(NamedTuple):
    """A variable to make again after a restart: where it lives, its optimizer's key for it, its value if kept."""

    variable: keras.Variable
    device: str
    key: Any
    value: np.ndarray | None  # read from this process's own device; a worker's variable is restored from the backup


def variables(model: keras.Model) -> list[Placed]:
    """Every variable of the model, its metrics and its optimizer, read before the workers are replaced.

    Connecting to the new workers gives TensorFlow's context a new id: this process's own
    variables then still read, but an assignment to them no longer takes (measured with TF
    2.21: ``iterations.assign(100)`` read back the old count), so they are made again too.
    """
    optimizer = model.optimizer
    found = list(model.variables) + list(model.metrics_variables)
    found += list(optimizer.variables) if optimizer is not None else []
    placed, seen = [], set()
    for v in found:
        if id(v) in seen:
            continue
        seen.add(id(v))
        device = v.value.device
        remote = f"/job:{cluster_lib.JOB}/" in device
        key = _compat.optimizer_key(optimizer, v) if optimizer is not None else None
        placed.append(Placed(v, device, key, None if remote else np.array(v.numpy())))
    return placed


def forget_steps(model: keras.Model) -> None:
    """Free the steps traced for the old workers, and whatever else is garbage, now rather than whenever Python's
    cycle collector runs.

    Where that fell during the restore, the run went wrong: under load (three runs at once beside a busy core),
    3 of 72 recoveries after ``connect()`` either failed restoring the backup (``Tried to remove non-existent
    function``) or silently kept the restarted worker's last layer at its placeholder zeros. Collected before the
    new connection, and again before the restore with every op made so far run (``remake``): 72 of 72 right.
    """
    model.train_function = model.test_function = model.predict_function = None
    gc.collect()


def remake(
    model: keras.Model, placed: list[Placed], seeds: dict[int, np.ndarray], remake_pipeline: Callable[[], None]
) -> None:
    """After the workers were replaced: make every variable again, and the pipeline and the step anew.

    A worker's variables hold placeholders until Keras' callback restores the backup: zeros, and
    seed states (which a backup does not hold) as at the start of training.
    """
    for v, device, _, value in placed:
        if value is None:
            value = seeds.get(id(v), np.zeros(v.shape, v.dtype))
        _compat.remake_variable(v, device, tf.constant(value))
    if model.optimizer is not None:
        _compat.rekey_optimizer(
            model.optimizer, {p.key: _compat.optimizer_key(model.optimizer, p.variable) for p in placed}
        )
    remake_pipeline()  # drops the step functions too
    gc.collect()  # the old variables' and pipeline's garbage, before Keras' callback restores the backup (forget_steps)
    _compat.wait_for_ops()  # and every op made so far run, the placeholders' assignments among them


def skipping(function: Callable, model: keras.Model, skips: Skips) -> Callable:
    """A Keras train function that, while ``skips`` has batches left, draws a batch and does not train on it."""

    @functools.wraps(function)
    def call(iterator: Any) -> Any:
        if skips.left <= 0:
            return function(iterator)
        for _ in range(int(model.steps_per_execution)):
            next(iterator)  # trained on before the backup
        skips.left -= int(model.steps_per_execution)
        return model.get_metrics_result()

    return call
