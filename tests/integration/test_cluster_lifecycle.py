"""LocalCluster's processes: start errors; stopped on exit, after an error and with a killed client; ports; allocators.

Every test runs in a fresh process: connecting to a cluster changes TensorFlow's process-wide context.
"""

import ipaddress
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.util import REPO, run_fresh


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_gone(pids, seconds=15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def started_and_stopped():
    """Two clusters in one fresh process: one ended normally, one by an error; the workers' listening sockets."""
    proc = run_fresh("""
        import os, time
        import tensorflow as tf
        from tfpipe.distributed import exposure
        from tfpipe.cluster import LocalCluster
        os.environ.pop("TF_CPU_ALLOCATOR_USE_BFC", None)

        def bfc(pid):  # the allocator setting a worker runs with
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\\0") if b"=" in e)
            return env.get(b"TF_CPU_ALLOCATOR_USE_BFC", b"missing").decode()

        with LocalCluster(2) as cluster:
            pids = list(cluster.pids)
            print("BFC unset:", bfc(pids[0]))
            with tf.device(cluster.devices[0]):  # a remote tensor: this process's own server listens from now on
                print("VALUE", float(tf.Variable(2.0) * 2.0))
            before = cluster.memory_info()
            with tf.device(cluster.devices[1]):
                big = tf.Variable(tf.zeros([1024, 1024]))  # 4 MiB on worker 1's allocator
                float(tf.reduce_sum(tf.ones([2048, 1024])))  # 8 MiB more at its peak, freed
            for _ in range(100):  # the worker frees a remote temporary when this process's release of it arrives
                held = cluster.memory_info()
                if held[1]["current"] - before[1]["current"] < 5 * 2**20:
                    break
                time.sleep(0.05)
            cluster.reset_memory_stats()
            print("MEMORY", [before, held, cluster.memory_info()])
            print("PORTS", sorted(int(a.rsplit(":", 1)[1]) for a in cluster.addresses))
            print("LISTENING", [exposure.listening(p) for p in pids])  # as ss -ltnp shows them
            print("OWN", exposure.listening(os.getpid()))
        print("NORMAL", len(pids), [p for p in pids if os.path.exists(f"/proc/{p}")])  # checked while we live
        try:
            cluster.memory_info()
        except Exception as err:
            print("STOPPED", type(err).__name__, err)
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "false"
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # with oneDNN (the default on AVX-512 CPUs) its allocator counts too
        try:
            with LocalCluster(2) as cluster:
                pids = list(cluster.pids)
                print("BFC false:", bfc(pids[0]))
                try:
                    cluster.memory_info()
                except ValueError as err:
                    print("NO COUNTS", err)
                raise KeyError("boom")
        except KeyError:
            print("ERROR", len(pids), [p for p in pids if os.path.exists(f"/proc/{p}")])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_workers_stop_on_exit_and_after_an_error(started_and_stopped):
    assert "NORMAL 2 []" in started_and_stopped.stdout and "ERROR 2 []" in started_and_stopped.stdout


def _listening(proc):
    ports = eval(proc.stdout.split("PORTS")[1].splitlines()[0])
    listening = eval(proc.stdout.split("LISTENING")[1].splitlines()[0])
    return ports, listening


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_ports_open_to_the_network_are_named_at_start(started_and_stopped):
    # TensorFlow's server binds every interface: the one line logged at start names exactly those ports.
    ports, listening = _listening(started_and_stopped)
    assert sorted(port for sockets in listening for _, port in sockets) == ports  # one socket each, its own
    own = eval(started_and_stopped.stdout.split("OWN")[1].splitlines()[0])
    assert len(own) == 1 and not ipaddress.ip_address(own[0][0]).is_loopback  # the training process's own server
    lines = [line for line in started_and_stopped.stderr.splitlines() if "listen on every network interface" in line]
    assert len(lines) == 2  # one per cluster started
    named = re.search(r"workers \(ports (\d+), (\d+)\) and this process's port (\d+) listen", lines[0])
    assert named and sorted(map(int, named.groups()[:2])) == ports and int(named.group(3)) == own[0][1], lines[0]
    assert "no authentication" in lines[0] and "README, 'Security'" in lines[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.xfail(strict=True, reason="TensorFlow's gRPC server binds 0.0.0.0 (hard-coded); README, 'Security'")
def test_every_worker_socket_listens_on_loopback_only(started_and_stopped):
    _, listening = _listening(started_and_stopped)
    addresses = [address for sockets in listening for address, _ in sockets]
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def test_workers_use_the_bfc_allocator_unless_told_otherwise(started_and_stopped):
    assert "BFC unset: true" in started_and_stopped.stdout and "BFC false: false" in started_and_stopped.stdout


def test_memory_info_reads_each_workers_allocator(started_and_stopped):
    before, held, reset = eval(started_and_stopped.stdout.split("MEMORY")[1].splitlines()[0])
    mib = 2**20
    assert before[1]["current"] < mib
    # worker 0 untouched: its runtime may allocate a few hundred bytes of its own meanwhile
    assert abs(held[0]["current"] - before[0]["current"]) < 2**16 and held[0]["peak"] - before[0]["peak"] < 2**16
    assert 4 * mib <= held[1]["current"] - before[1]["current"] < 5 * mib  # the variable
    assert held[1]["peak"] - held[1]["current"] >= 8 * mib  # the freed temporary, in the peak only
    assert abs(reset[1]["peak"] - held[1]["current"]) < 2**16  # the peak starts again from what it holds
    # workers told not to use the BFC allocator count nothing: the error says why
    assert "NO COUNTS The worker's allocator counts no bytes" in started_and_stopped.stdout
    assert "TF_CPU_ALLOCATOR_USE_BFC" in started_and_stopped.stdout.split("NO COUNTS")[1].splitlines()[0]
    # a stopped cluster's workers cannot answer: a WorkerError, not a broken pipe
    assert "STOPPED WorkerError The worker with pid " in started_and_stopped.stdout
    assert "is not running" in started_and_stopped.stdout.split("STOPPED")[1].splitlines()[0]


def test_workers_die_with_a_killed_client():
    code = textwrap.dedent("""
        import time
        from tfpipe.cluster import LocalCluster
        cluster = LocalCluster(2).start()
        print("PIDS", *cluster.pids, flush=True)
        time.sleep(300)
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = client.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids), line
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
    assert not _wait_gone(pids)


@pytest.mark.heavy(seconds=40)
def test_a_worker_that_cannot_start_is_a_clear_error_and_a_taken_port_is_retried():
    proc = run_fresh("""
        import socket
        from tfpipe import cluster
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = cluster._free_port
        cluster._free_port = lambda: port
        cluster.START_ATTEMPTS = 2
        try:
            cluster.LocalCluster(1).start()
        except cluster.WorkerError as err:
            print("ERROR", port, err)
        ports = iter([port])  # the first pick is taken (as when another process grabs it first), the retry is free
        cluster._free_port = lambda: next(ports, None) or free()
        with cluster.LocalCluster(1) as started:
            print("STARTED", started.addresses)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = proc.stdout.split("ERROR")[1].split()[0]
    assert f"Worker task 0 at localhost:{port} did not start (exit code" in proc.stdout
    assert "Check that the port is free" in proc.stdout
    assert "STARTED ['localhost:" in proc.stdout and f"localhost:{port}'" not in proc.stdout.split("STARTED")[1]
