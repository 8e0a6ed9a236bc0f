"""Where the workers reach the training process across hosts, and a check that every task reaches every other one.

A step's graph is cut between this process and the workers, and a worker pulls what it receives from the task that
made it (TensorFlow's ``RecvTensor``): the batch and the loss' gradient from this process, activations from another
worker. So each worker must reach this process at the address the cluster gives it. Left to itself,
``tf.config.experimental_connect_to_cluster`` registers this process as ``localhost:<port>``, which from another host
is that host itself: the first step fails there. ``client_address`` finds the address the workers can reach (given,
``TF_CONFIG``'s chief or client task, or this host's address on the route to the first worker), and
``check_reach`` runs one tiny graph per pair before training, so that a firewall or a wrong address fails in one
line that names who cannot reach whom, not inside the first step.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfpipe.distributed.faults import WorkerError

CLIENT_JOBS = ("chief", "client")  # TF_CONFIG task types that name the training process's own address
CLIENT_JOB = "localhost"  # the job this process joins as: every local device keeps its name
REACH_TIMEOUT = 30.0  # seconds one pair may take to exchange a tensor before the check says it cannot


def _host_port(address: str) -> tuple[str, int | None]:
    """(host, port or None) of "host", "host:port", "[v6]" or "[v6]:port" (a bare IPv6 address has no port)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def route_to(address: str) -> str:
    """This host's own address on the route to ``address`` (host:port): what a host there reaches it at.

    A UDP socket "connected" to it picks the source address the kernel would use; nothing is sent.
    """
    host, port = _host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return s.getsockname()[0]


def free_port() -> int:
    """A TCP port free on every interface (TensorFlow's server listens on all of them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def client_address(
    workers: Sequence[str], given: str | None = None, tf_config: dict[str, Any] | None = None
) -> str | None:
    """The host:port the workers reach this process at, or None where they are on this host (TensorFlow's own
    ``localhost`` then serves).

    ``given``: "host" or "host:port" (a free port is picked for a host alone). Else ``tf_config``'s task when it is
    a chief or client, at its address in the cluster. Else this host's address on the route to the first worker.
    """
    if given is not None:
        if not isinstance(given, str) or not given.strip():
            raise ValueError(f"client_address must be 'host' or 'host:port', got {given!r}.")
        host, port = _host_port(given.strip())
        return _joined(host, port if port is not None else free_port())
    task = (tf_config or {}).get("task") or {}
    cluster = (tf_config or {}).get("cluster") or {}
    if task.get("type") in CLIENT_JOBS and task.get("type") in cluster:
        return cluster[task["type"]][int(task.get("index", 0))]
    if not workers or all(is_loopback(_host_port(w)[0]) for w in workers):
        return None
    host = route_to(workers[0])
    return None if is_loopback(host) else _joined(host, free_port())


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_client(cluster: dict[str, list[str]], address: str | None) -> dict[str, list[str]]:
    """``cluster`` as this process connects with it: its chief or client job (which is this process) replaced by
    ``CLIENT_JOB`` at ``address`` (None: left for TensorFlow to add at localhost)."""
    jobs = {job: list(tasks) for job, tasks in cluster.items() if job not in CLIENT_JOBS + (CLIENT_JOB,)}
    if address is not None:
        jobs[CLIENT_JOB] = [address]
    return jobs


def check_reach(workers: Sequence[str], addresses: Sequence[str], client: str, timeout: float = REACH_TIMEOUT) -> None:
    """Raise a ``WorkerError`` naming the first pair that cannot exchange a tensor: each worker receiving from this
    process, this process from it, and each worker from the next (a pipeline's cuts), each within ``timeout``.

    ``workers``: their device strings, ``addresses`` their host:port, ``client`` this process's address as the
    workers know it.
    """
    local = "/job:localhost/replica:0/task:0/device:CPU:0"
    names = {local: f"the training process at {client}"}
    names.update({d: f"worker task {k} at {a}" for k, (d, a) in enumerate(zip(workers, addresses))})
    pairs = [(local, w) for w in workers] + [(w, local) for w in workers]
    pairs += [(workers[k], workers[k + 1]) for k in range(len(workers) - 1)]
    for source, target in pairs:
        with _quiet():  # a graph per pair: TensorFlow's warning about tracing often is not the user's
            why = _exchange(source, target, timeout)
        if why is not None:
            raise WorkerError(
                f"{names[target]} cannot receive from {names[source]}: {why}. Every worker pulls the tensors it "
                f"receives from the task that made them, so {names[source].split(' at ')[0]} must be reachable at "
                f"{names[source].rsplit(' at ', 1)[1]} from {names[target].split(' at ')[0]}'s host (an address that "
                "host routes to, the port open); give connect(client_address=...) or TF_CONFIG's chief task."
            )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _exchange(source: str, target: str, timeout: float) -> str | None:
    """None when a tensor made on ``source`` arrives at ``target`` in one graph within ``timeout``; else why not."""

    @tf.function
    def send() -> tf.Tensor:
        with tf.device(source):  # random: not a constant that TensorFlow could fold onto the target
            made = tf.ones([2]) * 3.0 + tf.random.uniform([2], maxval=1e-6)
        with tf.device(target):
            return tf.reduce_sum(made)

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(float(send()))
        except Exception as err:  # noqa: BLE001 - whatever the runtime says, it is the answer
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True, name="tfpipe-reach")
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer within {timeout:g} s"
    if isinstance(outcome[0], BaseException):
        return " ".join(str(outcome[0]).split())[:300]
    return None if abs(outcome[0] - 6.0) < 1e-3 else f"received {outcome[0]} instead of 6.0"
