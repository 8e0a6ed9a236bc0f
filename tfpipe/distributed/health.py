"""Health checks of TensorFlow worker servers: find a worker that stops answering without dying.

TensorFlow's remote calls have no deadline, so a worker that is stopped (SIGSTOP),
frozen or cut off blocks a step forever; its TCP port still accepts connections.
A ``Watchdog`` thread asks every worker's gRPC server for its status (the
``GetStatus`` call of TensorFlow's worker service, answered by the server's own
threads, so a busy worker answers too) and calls ``on_hung`` once when a worker
has not answered for ``timeout`` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence

from absl import logging

STATUS_METHOD = "/tensorflow.WorkerService/GetStatus"  # an empty GetStatusRequest is valid
GRPC_ENV = "TF_GRPC_DEFAULT_OPTIONS"  # TensorFlow reads it once, when it makes its first gRPC channel


def check_timeout(timeout: float | None) -> float | None:
    """Validate a worker timeout: None (wait forever) or a positive number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"timeout must be a positive number of seconds, or None to wait for a worker forever; got {timeout!r}."
        )
    return float(timeout)


def grpc_options(timeout: float) -> str:
    """gRPC channel options under which a call to a silent peer fails after about ``timeout`` seconds.

    A keepalive ping every third of the timeout, each given a third to be answered; the
    ping timeout is the one that matters: without it, an unanswered flow-control ping that
    gRPC sent first holds the keepalive back (measured: it stayed blocked). With these
    options a step blocked on a SIGSTOPped worker fails shortly after ``timeout`` seconds
    (docs/notes/2026-11-benchmark-passes.md#a-worker-that-hangs).
    """
    ms = max(1000, int(timeout * 1000 / 3))
    return ",".join(
        [
            f"grpc.keepalive_time_ms={ms}",
            f"grpc.keepalive_timeout_ms={ms}",
            f"grpc.http2.ping_timeout_ms={ms}",
            "grpc.keepalive_permit_without_calls=1",
            "grpc.http2.max_pings_without_data=0",
        ]
    )


def arm(timeout: float | None, env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``TF_GRPC_DEFAULT_OPTIONS`` in ``env`` (default: this process's) for ``timeout``, unless already set.

    Returns whether it was set. In this process it must happen before TensorFlow's first
    gRPC channel: TensorFlow reads the variable once, so the first cluster's timeout holds.
    """
    env = os.environ if env is None else env
    if timeout is None or env.get(GRPC_ENV):
        return False
    env[GRPC_ENV] = grpc_options(timeout)
    return True


def status(address: str, deadline: float) -> str:
    """The worker server at ``address``: "ok" (answered within ``deadline`` s), "silent" (did not), or "down"."""
    import grpc  # installed with TensorFlow

    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(STATUS_METHOD)(b"", timeout=deadline)
        except grpc.RpcError as err:
            # A stopped process's port still accepts connections: the call runs out of time. A dead one refuses.
            return "silent" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "down"
    return "ok"


class Watchdog(threading.Thread):
    """Checks the workers every few seconds; ``on_hung(task, silent_seconds)`` once for the first that is silent.

    A check waits at most ``period`` seconds (a quarter of ``timeout``, between 0.5 and
    10 s), so a worker is declared hung between ``timeout`` and ``timeout + period``
    seconds after its last answer.
    """

    def __init__(self, addresses: Sequence[str], timeout: float, on_hung: Callable[[int, float], None]):
        super().__init__(name="tfpipe-watchdog", daemon=True)
        self.addresses = list(addresses)
        self.timeout = timeout
        self.period = min(max(timeout / 4.0, 0.5), 10.0)
        self.on_hung = on_hung
        self.checks = 0  # status calls made, for tests and for the cost in README
        self.hung: str | None = None  # 'task k at host:port did not answer for N s', once found
        self._halt = threading.Event()

    def run(self) -> None:
        last = [time.monotonic()] * len(self.addresses)
        while not self._halt.wait(self.period):
            for task, address in enumerate(self.addresses):
                self.checks += 1
                if status(address, self.period) == "ok":
                    last[task] = time.monotonic()
                elif time.monotonic() - last[task] >= self.timeout and not self._halt.is_set():
                    silent = time.monotonic() - last[task]
                    self.hung = (
                        f"task {task} at {address} did not answer for {silent:.0f} s (timeout={self.timeout:g} s)"
                    )
                    logging.error("tfpipe: worker %s; ending the run.", self.hung)
                    self.on_hung(task, silent)
                    return

    def silent_now(self, deadline: float = 2.0) -> list[str]:
        """The workers that are up but do not answer within ``deadline`` seconds now, as 'task k at host:port'."""
        return [f"task {k} at {a}" for k, a in enumerate(self.addresses) if status(a, deadline) == "silent"]

    def stop(self) -> None:
        """End the checks (the thread finishes its current call, at most ``period`` seconds)."""
        self._halt.set()
