"""Worker health checks: what counts as silent, the gRPC options a timeout sets, the watchdog's report."""

import socket
import threading
import time

import pytest

from tfpipe.distributed import health


@pytest.fixture
def silent_address():
    """A port that accepts connections and never answers, as a stopped process's does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"localhost:{s.getsockname()[1]}"


def test_a_listening_port_that_never_answers_is_silent_and_a_closed_one_is_down(silent_address):
    start = time.monotonic()
    assert health.status(silent_address, 0.5) == "silent"
    assert 0.4 < time.monotonic() - start < 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"localhost:{s.getsockname()[1]}"
    assert health.status(closed, 2.0) == "down"


def test_the_watchdog_reports_a_silent_worker_once_after_its_timeout(silent_address):
    found, done = [], threading.Event()
    dog = health.Watchdog([silent_address], timeout=1.0, on_hung=lambda task, s: (found.append((task, s)), done.set()))
    start = time.monotonic()
    dog.start()
    assert done.wait(10)
    assert 1.0 <= time.monotonic() - start < 5 and found[0][0] == 0 and found[0][1] >= 1.0
    assert dog.hung.startswith(f"task 0 at {silent_address} did not answer for ") and "(timeout=1 s)" in dog.hung
    dog.join(5)
    assert not dog.is_alive() and len(found) == 1 and dog.silent_now(0.5) == [f"task 0 at {silent_address}"]


def test_a_timeout_sets_grpcs_ping_timeout_unless_the_user_set_the_options():
    env = {}
    assert health.arm(30.0, env) and env[health.GRPC_ENV] == health.grpc_options(30.0)
    assert "grpc.http2.ping_timeout_ms=10000" in env[health.GRPC_ENV]
    assert "grpc.keepalive_time_ms=10000" in env[health.GRPC_ENV]
    assert "grpc.http2.ping_timeout_ms=1000" in health.grpc_options(0.5)  # never below a second
    mine = {health.GRPC_ENV: "grpc.keepalive_time_ms=60000"}
    assert not health.arm(30.0, mine) and mine[health.GRPC_ENV] == "grpc.keepalive_time_ms=60000"
    assert not health.arm(None, env := {}) and not env  # None: wait forever, as TensorFlow does
