"""Explicit transfers between processes: a ``_Send`` that the producer's next task waits for.

Across worker processes, the transfer TensorFlow inserts for a cell's output is a
``_Send`` that a one-thread worker queues behind its next forward, so the next cell
waited for most of the forwards before its first input arrived (docs/benchmarks.md#cost-of-crossing-processes).
An explicit send (the raw op ``Send``, the kernel of ``_Send``) made part of the
producing task runs before the producer moves on; the consumer's ``Recv`` waits
without holding a thread. Within one process the inserted transfers are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe import _compat

# (src, dst) -> (full send device, full receive device, the sender's incarnation), refreshed by ``discover``.
_ENDPOINTS: dict[tuple[str, str], tuple[str, str, int]] = {}
# The cluster the endpoints were found under (a user's own ``experimental_connect_to_cluster`` changes it; tfpipe's
# own connections call ``forget``). Under the same, they still hold.
_FOUND_UNDER: list[bytes | None] = [None]


def forget() -> None:
    """Drop every endpoint found: this process connected anew, or a worker restarted; ``discover`` finds them again."""
    _ENDPOINTS.clear()


def _process(device: str) -> tuple[str, int, int]:
    spec = tf.DeviceSpec.from_string(device)
    return spec.job or "localhost", spec.replica or 0, spec.task or 0


def _place(device: str) -> tuple[Any, ...]:
    spec = tf.DeviceSpec.from_string(device)
    return (*_process(device), (spec.device_type or "CPU").upper(), spec.device_index or 0)


def crosses_processes(src: str, dst: str) -> bool:
    """Whether a tensor from device ``src`` to device ``dst`` leaves its process."""
    return _process(src) != _process(dst)


def any_remote(devices: Sequence[str]) -> bool:
    """Whether any of ``devices`` is in a process other than this client's."""
    return any(crosses_processes(device, "/job:localhost") for device in devices)


def discover(pairs: list[tuple[str, str]]) -> None:
    """Learn, eagerly, the full names and the sender's incarnation for each (src, dst) pair across processes.

    Read from the transfers TensorFlow itself makes in one small function, one per pair. Called before each
    fit, evaluate, predict and ``*_on_batch`` call; found again only under another connection (a restarted worker
    has a new incarnation under the same name: its cluster calls ``forget``). Inside a trace, run metadata came
    back empty (measured with TF 2.21), hence eagerly.
    """
    wanted = [(a, b) for a, b in pairs if crosses_processes(a, b)]
    if not wanted or not tf.executing_eagerly():
        return
    under = _compat.server_def_bytes()
    if under != _FOUND_UNDER[0]:  # another connection: every endpoint found before may be stale
        _ENDPOINTS.clear()
        _FOUND_UNDER[0] = under
    elif all(pair in _ENDPOINTS for pair in wanted):
        return  # found under this connection: a train_on_batch loop does not pay for it every call (~20 ms)
    for pair in wanted:
        _ENDPOINTS.pop(pair, None)  # never a stale incarnation: a pair not found again keeps TensorFlow's transfers

    def move(x: tf.Tensor) -> list[tf.Tensor]:  # one transfer per pair, all in one function
        out = []
        for src, dst in wanted:
            with tf.device(src):
                y = x + 1.0
            with tf.device(dst):
                out.append(y * 2.0)
        return out

    # A concrete function, traced anew each time (a restarted worker has a new incarnation), is not
    # counted by tf.function's retracing warning.
    traced = tf.function(move, autograph=False).get_concrete_function(tf.TensorSpec([], tf.float32))
    places = {(_place(src), _place(dst)): (src, dst) for src, dst in wanted}
    for send_device, recv_device, incarnation in _compat.inserted_sends(traced, tf.constant(0.0)):
        sent = places.get((_place(send_device), _place(recv_device)))
        if sent is not None:
            _ENDPOINTS[sent] = (send_device, recv_device, incarnation)


def known(src: str, dst: str) -> bool:
    """Whether ``discover`` found the endpoints of (src, dst): only then can ``transfer`` send between them."""
    return (src, dst) in _ENDPOINTS


def send(tensor: tf.Tensor, name: str, src: str, dst: str) -> tf.Operation:
    """Send ``tensor`` from ``src`` (the current device scope) to ``dst`` under ``name``, unique in the step."""
    send_device, recv_device, incarnation = _ENDPOINTS[(src, dst)]
    op = _compat.send(tensor, name, send_device, incarnation, recv_device)
    _compat.run_independently(op)  # ordered by its task, not after every send and receive made before it
    return op


def recv(like: tf.Tensor, name: str, src: str, dst: str) -> tf.Tensor:
    """Receive on ``dst`` what ``send`` sent under ``name``; typed and shaped like ``like``."""
    send_device, recv_device, incarnation = _ENDPOINTS[(src, dst)]
    with tf.device(dst), tf.control_dependencies(None):  # waits for the data alone, not the producer's chain
        received = _compat.recv(like.dtype, name, send_device, incarnation, recv_device)
    _compat.run_independently(received.op)
    received.set_shape(like.shape)
    return received


def transfer(value: Any, name: str, src: str, dst: str) -> tuple[Any, list[tf.Operation]]:
    """Each tensor leaf of ``value`` sent from ``src`` and received on ``dst``: (received value, the sends)."""
    sends: list[tf.Operation] = []

    def one(path_index: int, t: Any) -> Any:
        if t is None:
            return None
        key = f"{name}_{path_index}"
        sends.append(send(t, key, src, dst))
        return recv(t, key, src, dst)

    leaves = tf.nest.flatten(value)
    received = [one(i, t) for i, t in enumerate(leaves)]
    return tf.nest.pack_sequence_as(value, received), sends
