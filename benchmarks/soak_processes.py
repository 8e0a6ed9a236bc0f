"""What the soak benchmark reads of a process (/proc: memory, threads, descriptors) and the plain servers it starts."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import collections
import ctypes
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

START_TIMEOUT = 60.0  # seconds for a connect-mode server to accept connections
# What a user runs on each worker host (docs/guide/clusters.md, "On several hosts"): a plain TensorFlow server.
SERVER_CODE = (
    "import sys, tensorflow as tf; "
    "tf.distribute.Server(tf.train.ClusterSpec({'worker': sys.argv[1].split(',')}), job_name='worker', "
    "task_index=int(sys.argv[2])).join()"
)


def sample(pid: int) -> tuple[float, int, int]:
    """(resident MB, threads, open file descriptors) of ``pid``, from Linux's /proc."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return int(status["VmRSS"][0]) / 1024, int(status["Threads"][0]), len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by what they point at: socket, pipe, anon_inode:[...], or a file's path."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        kinds[target.split(":")[0] if target.startswith(("socket:", "pipe:")) else target] += 1
    return dict(kinds)


def thread_pools(pid: int) -> dict[str, int]:
    """Threads of ``pid`` by Linux thread name, a trailing number dropped ('grpc_global_tim', 'tf_inter_op')."""
    from scripts.report import pool_name

    pools: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                pools[pool_name(f.read().strip())] += 1
        except OSError:  # the thread ended
            continue
    return dict(pools)


def _die_with_parent() -> None:
    """In a server: get SIGKILL when this script dies, so that no server outlives it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(addresses: list[str], logs: list[Any]) -> list[subprocess.Popen]:
    """Start one plain TensorFlow server per address, as a user does on each worker host; wait until each serves."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
    servers = []
    for task in range(len(addresses)):
        logs.append(tempfile.TemporaryFile(mode="w+"))
        servers.append(
            subprocess.Popen(
                [sys.executable, "-c", SERVER_CODE, ",".join(addresses), str(task)],
                stdout=subprocess.DEVNULL,
                stderr=logs[-1],
                env=env,
                preexec_fn=_die_with_parent,
            )
        )
    for task, (address, server) in enumerate(zip(addresses, servers)):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    logs[task].seek(0)
                    tail = " | ".join(logs[task].read().strip().splitlines()[-3:]) or "no output"
                    raise RuntimeError(f"Server task {task} at {address} did not start: {tail}") from None
                time.sleep(0.2)
    return servers
