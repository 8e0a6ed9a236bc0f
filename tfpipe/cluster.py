"""Cells in other processes or on other hosts: start local TensorFlow worker processes, or join a cluster.

tfpipe uses TensorFlow's own distributed runtime: this process connects to the
workers with ``tf.config.experimental_connect_to_cluster`` and places each cell
on ``/job:worker/task:k/device:CPU:0`` (or ``GPU:0``); TensorFlow moves the
boundary activations over gRPC. A watchdog (``tfpipe.distributed.health``) ends the run with
a ``WorkerError`` when a worker stops answering.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from absl import logging as absl_logging

from tfpipe import _compat
from tfpipe._args import int_at_least, positive_int
from tfpipe.distributed import exposure, health, reach, sendrecv, worker
from tfpipe.distributed.faults import RECOVER, WorkerError, unwatch, watch
from tfpipe.distributed.worker import JOB

BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"  # workers use TensorFlow's BFC allocator unless this is set otherwise
START_TIMEOUT = 60.0  # seconds for a worker process to start serving
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the worker binding it: retry
DEFAULT_TIMEOUT = 180.0  # seconds a worker may not answer before the run ends (None: wait forever)

_joined: Joined | None = None  # the cluster ``connect`` joined last
_started: list[Any] = []  # the LocalClusters this process runs and the cluster it joined, the latest last
__all__ = ["LocalCluster", "WorkerError", "connect"]  # what users import from tfpipe.cluster


def restartable() -> Any:
    """The cluster this process started or joined last (a LocalCluster or a ``Joined``), if ``fit`` may still
    restart or wait for its workers; else None."""
    return _started[-1] if _started and _started[-1].restarts < _started[-1].max_restarts else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the worker: get SIGKILL when the process that started it dies, so no worker outlives it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _devices(spec: tf.train.ClusterSpec, job: str, device_type: str) -> list[str]:
    return [f"/job:{job}/task:{k}/device:{device_type}:0" for k in range(spec.num_tasks(job))]


class LocalCluster:
    """K TensorFlow worker processes on this host, reached over loopback, connected to this process; one device each.

    Use as a context manager::

        with tfpipe.cluster.LocalCluster(num_workers=2) as cluster:
            model = tfpipe.PipelineModel(layers, num_partitions=2, devices=cluster.devices)
            model.fit(...)

    Every worker it started is stopped on exit, also after an error; a worker also
    dies with this process. A worker that does not answer for ``timeout`` seconds
    (stopped, frozen) is killed, and the run ends with a ``WorkerError`` naming it;
    ``None`` waits forever (see ``tfpipe.distributed.health``). With ``max_restarts=N`` and a
    ``keras.callbacks.BackupAndRestore`` callback, ``fit`` instead replaces the workers and goes
    on from the last backup, up to N times (``tfpipe.recovery``). ``threads_per_worker`` sets each worker's intra- and
    inter-op thread pools, so a worker runs one thing at a time by default. Workers
    allocate with TensorFlow's BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``)
    unless this process's environment sets that variable; ``memory_info`` reads its counts.

    Each worker listens on every network interface, without authentication: TensorFlow's
    server binds 0.0.0.0 and cannot be confined (``tfpipe.distributed.exposure``). ``start``
    logs the ports; README's "Security" says how to close them to other hosts.
    """

    def __init__(
        self,
        num_workers: int,
        threads_per_worker: int = 1,
        start_timeout: float = START_TIMEOUT,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_restarts: int = 0,
    ):
        self.num_workers = positive_int("num_workers", num_workers)
        self.max_restarts = _check_restarts(max_restarts)
        self.restarts = 0  # how many times ``restart`` replaced the workers
        self.threads_per_worker = positive_int("threads_per_worker", threads_per_worker)
        self.start_timeout = start_timeout
        self.timeout = health.check_timeout(timeout)
        self.watchdog: health.Watchdog | None = None
        self.addresses: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self._logs: list[Any] = []  # each worker's stderr, in a file: an unread pipe would fill and block it

    @property
    def devices(self) -> list[str]:
        """One device string per worker, for ``PipelineModel(devices=...)``."""
        return [f"/job:{JOB}/task:{k}/device:CPU:0" for k in range(len(self.addresses))]

    @property
    def pids(self) -> list[int]:
        """The process ids of the workers."""
        return [p.pid for p in self.processes]

    def memory_info(self) -> list[dict[str, int]]:
        """Each worker's allocator counts as ``get_memory_info`` gives them: {"current": bytes, "peak": bytes}."""
        return [worker.ask(p, "memory") for p in self.processes]

    def reset_memory_stats(self) -> None:
        """Start each worker's peak count again from what it holds now."""
        for process in self.processes:
            worker.ask(process, "reset")

    def start(self) -> LocalCluster:
        """Start the workers, wait until each serves, connect this process to them and watch them."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._launch()
                break
            except WorkerError:
                self.stop()
                if attempt == START_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()
                raise
        # Only now: connecting before every worker serves can block without a timeout.
        with _worker_threads(self.threads_per_worker):
            tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({JOB: self.addresses}))
        sendrecv.forget()  # new workers: new incarnations
        self.watchdog = watch(self.addresses, self.timeout, self._kill_hung)
        own = _compat.own_address()
        exposure.warn_exposed(self.pids, int(own.rsplit(":", 1)[1]) if own else None)
        if self not in _started:
            _started.append(self)
        return self

    def restart(self) -> None:
        """Replace every worker by a fresh process (new ports, same device names) and connect to them again.

        What the workers held is gone: ``PipelineModel.fit`` makes their variables again and restores
        the last ``BackupAndRestore`` backup (``tfpipe.recovery``). Counts against ``max_restarts``.
        """
        if self.restarts >= self.max_restarts:
            raise WorkerError(f"LocalCluster has restarted {self.restarts} of max_restarts={self.max_restarts} times.")
        self.restarts += 1
        self.stop()
        self.start()

    def failed(self, err: BaseException | None = None) -> str | None:
        """Why the last call failed if a worker of this cluster died or hung ('task k at ...'), else None."""
        if self.watchdog is not None and self.watchdog.hung:
            return self.watchdog.hung
        dead = self._dead_after(err) if err is not None else self.dead_workers()
        return ", ".join(dead) + " died" if dead else None

    def _kill_hung(self, task: int, silent: float) -> None:
        """A silent worker cannot finish the step: kill it, so that TensorFlow's blocked call fails at once."""
        del silent
        process = self.processes[task]
        if process.poll() is None:
            process.kill()
            # the watchdog calls this once it has set ``hung``, and it is ours from start to stop
            assert self.watchdog is not None and self.watchdog.hung is not None
            self.watchdog.hung += "; it was killed"

    def _launch(self) -> None:
        self.addresses = [f"localhost:{_free_port()}" for _ in range(self.num_workers)]
        self.processes, self._logs = [], []
        spec = json.dumps({JOB: self.addresses})
        # PR_SET_PDEATHSIG fires when the *thread* that started the worker ends: only tie workers to the main thread.
        tie = _die_with_parent if threading.current_thread() is threading.main_thread() else None
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        # TensorFlow's default CPU allocator maps and unmaps every large buffer: each weight gradient of each
        # micro-batch then pays page faults on fresh pages. The BFC allocator reuses its memory, and steps are faster
        # (docs/notes/2026-11-benchmark-passes.md, "Third pass: a step graph that grows less with M").
        env.setdefault(BFC_ENV, "true")
        for task in range(self.num_workers):
            self._logs.append(tempfile.TemporaryFile(mode="w+"))
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", worker.CODE, spec, str(task), str(self.threads_per_worker)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self._logs[-1],
                    text=True,
                    preexec_fn=tie,
                    env=env,
                )
            )
        for task, process in enumerate(self.processes):
            self._wait_ready(task, process)

    def _wait_ready(self, task: int, process: subprocess.Popen) -> None:
        """Wait for the worker's READY line; it prints it once it serves, or exits on failure."""
        stdout = process.stdout
        assert stdout is not None  # _launch pipes it
        ready, _, _ = select.select([stdout], [], [], self.start_timeout)
        line = stdout.readline() if ready else ""
        if line.strip() != "READY":
            process.kill()
            process.wait(timeout=10)
            self._logs[task].seek(0)
            err = self._logs[task].read()
            why = f"exit code {process.returncode}" if ready else f"not serving after {self.start_timeout:g} s"
            tail = " | ".join(err.strip().splitlines()[-3:]) if err and err.strip() else "no output"
            raise WorkerError(
                f"Worker task {task} at {self.addresses[task]} did not start ({why}): {tail}. Check that the "
                "port is free and that TensorFlow imports in a fresh process."
            )

    def stop(self) -> None:
        """Stop every worker this cluster started (terminate, then kill)."""
        if self in _started:
            _started.remove(self)
        unwatch(self.watchdog)
        for process in self.processes:
            if process.poll() is None and self.watchdog is not None and self.watchdog.hung:
                process.kill()  # a stopped process ignores SIGTERM until continued
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
            for pipe in (process.stdin, process.stdout):
                if pipe:
                    pipe.close()
        for log in self._logs:
            log.close()

    def dead_workers(self) -> list[str]:
        """Workers whose process has exited, as 'task k at host:port (exit code c)'."""
        return [
            f"task {k} at {self.addresses[k]} (exit code {p.returncode})"
            for k, p in enumerate(self.processes)
            if p.poll() is not None
        ]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        hung = self.watchdog.hung if self.watchdog is not None and exc is not None else None
        dead = self._dead_after(exc) if exc is not None else []
        self.stop()
        if hung and not isinstance(exc, WorkerError):
            raise WorkerError(
                f"Worker {hung}: the run ended ({type(exc).__name__}). Start a new cluster and resume from the "
                "last checkpoint." + RECOVER
            ) from exc
        if dead and not isinstance(exc, WorkerError):
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            cause = lines[-1][:300] if lines else type(exc).__name__  # TensorFlow puts the RPC's error last
            raise WorkerError(
                f"Worker {', '.join(dead)} died during the run ({type(exc).__name__}: {cause}). "
                "Start a new cluster and resume from the last checkpoint." + RECOVER
            ) from exc

    def _dead_after(self, exc: BaseException) -> list[str]:
        """The dead workers; after a TensorFlow runtime error, give a just-killed worker a moment to be seen."""
        deadline = time.monotonic() + (2.0 if isinstance(exc, tf.errors.OpError) else 0.0)
        while True:
            dead = self.dead_workers()
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)


@contextlib.contextmanager
def _worker_threads(threads: int) -> Iterator[None]:
    """Connect with ``threads`` in the thread settings that the workers' eager contexts take on.

    The remote eager contexts size their thread pools from the config this process
    sends when it connects (its own settings), not from the ConfigProto each worker's
    server was started with: measured here, "single-thread" workers ran two ops at
    once. This process's own pools are already created and do not change.
    """
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.WARNING)  # TF logs the whole config at INFO when connecting
    try:
        with _compat.eager_thread_settings(threads):
            yield
    finally:
        absl_logging.set_verbosity(verbosity)


def running_worker(device: str) -> tuple[LocalCluster, int] | None:
    """The running LocalCluster whose worker ``device`` names, and that worker's index; None if none runs it."""
    for cluster in _started:
        if isinstance(cluster, LocalCluster) and device in cluster.devices:
            return cluster, cluster.devices.index(device)
    return None


def _tf_config() -> dict[str, Any]:
    """The ``TF_CONFIG`` environment variable, read; a ValueError where it is missing or has no "cluster"."""
    config = os.environ.get("TF_CONFIG")
    if not config:
        raise ValueError(
            "connect() needs a cluster: pass a tf.train.ClusterSpec or a dict, or set TF_CONFIG "
            'to {"cluster": {"worker": ["host:port", ...]}}.'
        )
    try:
        read = json.loads(config)
        read["cluster"]  # a KeyError, or a TypeError where TF_CONFIG is not an object
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f'TF_CONFIG={config!r} has no readable "cluster" entry ({err}).') from None
    return read


def connect(
    cluster: Any = None,
    job: str = JOB,
    device_type: str = "CPU",
    timeout: float | None = DEFAULT_TIMEOUT,
    max_restarts: int = 0,
    client_address: str | None = None,
) -> list[str]:
    """Join an existing cluster; return one device string per task of ``job``, in task order.

    ``cluster``: a ``tf.train.ClusterSpec``, a dict {job: [host:port, ...]}, or None to
    read the "cluster" of the ``TF_CONFIG`` environment variable. ``client_address``: "host"
    or "host:port" at which the workers reach this process (they pull the batch and the
    loss' gradient from it); default: ``TF_CONFIG``'s task when it is a "chief" or "client"
    (its address in the cluster), else this host's address on the route to the first
    worker. With workers on other hosts, every worker is checked to reach this process and
    the next worker before ``connect`` returns: a ``WorkerError`` names the pair. A task that does not
    answer for ``timeout`` seconds ends the run: gRPC's ping timeout fails the blocked
    call, and ``PipelineModel``'s fit, evaluate and predict raise a ``WorkerError`` naming
    the task. ``None`` waits forever. Calling ``connect`` again replaces the watch.
    With ``max_restarts=N`` and a ``keras.callbacks.BackupAndRestore`` callback, ``fit``
    instead waits up to ``timeout`` for every task to answer again (someone restarts it),
    connects anew and goes on from the last backup, up to N times.

    Security: each worker serves TensorFlow's gRPC on every interface of its host, without
    authentication or encryption; whoever reaches its port can run any op in it, file reads
    and writes included, and the activations cross the network in the clear (this process's
    own TensorFlow server listens too, at the port its task has). Open the
    workers' ports to the client's host only (a firewall rule, a private network or a VPN):
    README, "Security".
    """
    timeout = health.check_timeout(timeout)
    max_restarts = _check_restarts(max_restarts)
    tf_config = None
    if cluster is None:
        tf_config = _tf_config()
        cluster = tf_config["cluster"]
    spec = cluster if isinstance(cluster, tf.train.ClusterSpec) else tf.train.ClusterSpec(cluster)
    if job not in spec.jobs:
        raise ValueError(f"The cluster has no job {job!r} (jobs: {spec.jobs}); name the job that runs the cells.")
    workers = [spec.task_address(job, k) for k in range(spec.num_tasks(job))]
    address = reach.client_address(workers, client_address, tf_config)
    spec = tf.train.ClusterSpec(reach.with_client(spec.as_dict(), address))
    global _joined
    health.arm(timeout)  # before this process's first gRPC channel
    tf.config.experimental_connect_to_cluster(spec)
    sendrecv.forget()  # a worker restarted at its address has a new incarnation
    if _joined is not None:
        unwatch(_joined.watchdog)
        _started.remove(_joined)
    devices = _devices(spec, job, device_type)
    if address is not None:  # on other hosts: what the loopback cannot show, checked before any step
        reach.check_reach(devices, workers, address, min(timeout or reach.REACH_TIMEOUT, reach.REACH_TIMEOUT))
    _joined = Joined(workers, timeout, max_restarts)
    _started.append(_joined)
    return devices


def _check_restarts(max_restarts: Any) -> int:
    return int_at_least("max_restarts", max_restarts, 0, "0: a dead worker ends fit.")


class Joined:
    """A cluster ``connect`` joined: workers someone else runs, whom ``fit`` may wait for and connect to anew."""

    def __init__(self, addresses: list[str], timeout: float | None, max_restarts: int):
        self.addresses, self.timeout, self.max_restarts = addresses, timeout, max_restarts
        self.restarts = 0
        self.watchdog = watch(addresses, timeout, lambda *_: None)

    def failed(self, err: BaseException | None = None) -> str | None:
        """Why the last call failed if a task does not answer now ('task k at host:port (down)'), else None."""
        del err
        if self.watchdog is not None and self.watchdog.hung:
            return self.watchdog.hung
        states = [(k, a, health.status(a, 2.0)) for k, a in enumerate(self.addresses)]
        bad = [f"task {k} at {a} ({state})" for k, a, state in states if state != "ok"]
        return ", ".join(bad) + " did not answer" if bad else None

    def restart(self) -> None:
        """Wait up to ``timeout`` for every task to answer again, then connect anew (``fit``'s recovery)."""
        if self.restarts >= self.max_restarts:
            raise WorkerError(f"connect() has gone on {self.restarts} of max_restarts={self.max_restarts} times.")
        self.restarts += 1
        unwatch(self.watchdog)
        self.watchdog = None
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while (why := self.failed()) is not None:
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"Worker {why} within timeout={self.timeout:g} s: start it again and resume.")
            time.sleep(1.0)
        _compat.reconnect()
        sendrecv.forget()
        self.watchdog = watch(self.addresses, self.timeout, lambda *_: None)
