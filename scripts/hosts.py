"""Simulated hosts: K network namespaces on one bridge, each with its own address and a worker server
(``scripts/worker.py``, as a user starts one on each worker host).

Each host is a namespace ``tfp<id>h<k>`` joined to the bridge ``tfp<id>br`` by a veth pair; the bridge holds the
training host's address (``BRIDGE``: the process outside the namespaces), the hosts ``.2``, ``.3``, ... of a /24
that no one else uses. Traffic goes only to these addresses. A host's link can be taken down and up
(``link``), its server killed and started again at the same address (``kill``, ``start``). Everything is torn down
when the block ends, also when a test fails. Needs root and ``ip``; ``available()`` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

SUBNET = "10.231.{}"  # 10.231.<n>.0/24: one per Hosts, picked free
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_tag() -> str:
    """A name part no other run's hosts use: this process's id and the time."""
    return f"{os.getpid() % 10000}{int(time.time() * 1000) % 1000:03d}"


def remove(tag: str) -> None:
    """Remove whatever a run with ``tag`` left (its process was killed before it could)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"tfp{tag}h"):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"tfp{tag}"):
            _ip("link", "del", name, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tfpprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """``num_hosts`` simulated hosts, each serving one TensorFlow worker task of job ``worker`` on ``port``."""

    def __init__(self, num_hosts: int, port: int = 2222, threads: int = 1, tag: str | None = None):
        self.num_hosts, self.port, self.threads = num_hosts, port, threads
        self._id = tag or new_tag()
        self.subnet = SUBNET.format(int(self._id) % 200 + 20)
        self.bridge = f"tfp{self._id}br"
        self.client_address = f"{self.subnet}.1"
        self.addresses = [f"{self.subnet}.{k + 2}" for k in range(num_hosts)]
        self.namespaces = [f"tfp{self._id}h{k}" for k in range(num_hosts)]
        self.processes: list[subprocess.Popen | None] = [None] * num_hosts
        self._logs: list[Any] = [None] * num_hosts

    @property
    def cluster(self) -> dict[str, list[str]]:
        """The workers' job as ``connect()`` takes it."""
        return {"worker": [f"{a}:{self.port}" for a in self.addresses]}

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.client_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k in range(self.num_hosts):
                ns, outer, inner = self.namespaces[k], f"tfp{self._id}v{k}", f"tfp{self._id}p{k}"
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            for k in range(self.num_hosts):
                self.launch(k)
            for k in range(self.num_hosts):
                self.wait_ready(k)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, k: int) -> None:
        """Start host ``k``'s worker server (again) and wait until it serves."""
        self.launch(k)
        self.wait_ready(k)

    def launch(self, k: int) -> None:
        """Start host ``k``'s worker server (``wait_ready`` waits for it)."""
        self._logs[k] = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        self.processes[k] = subprocess.Popen(  # the launcher a user runs on each worker host
            ["ip", "netns", "exec", self.namespaces[k], sys.executable, os.path.join(REPO, "scripts", "worker.py")]
            + [f"--workers={','.join(self.cluster['worker'])}", f"--task={k}", f"--threads={self.threads}"],
            stdout=subprocess.PIPE,
            stderr=self._logs[k],
            text=True,
            env=env,
        )

    def wait_ready(self, k: int) -> None:
        """Wait until host ``k``'s server says it serves."""
        line = self.processes[k].stdout.readline()
        if not line.startswith("serving worker task"):
            self._logs[k].seek(0)
            raise RuntimeError(f"host {k}'s server did not start: {self._logs[k].read()[-2000:]}")

    def kill(self, k: int) -> None:
        """Kill host ``k``'s server."""
        process = self.processes[k]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=30)

    def delay(self, k: int, ms: float) -> None:
        """Add ``ms`` of latency each way on host ``k``'s link (``netem``; a RuntimeError where the kernel lacks it)."""
        for args in (
            ["-n", self.namespaces[k], "qdisc", "add", "dev", f"tfp{self._id}p{k}"],
            ["qdisc", "add", "dev", f"tfp{self._id}v{k}"],
        ):
            done = subprocess.run(["tc", *args, "root", "netem", "delay", f"{ms}ms"], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"cannot slow host {k}'s link: tc netem: {done.stderr.strip() or done.returncode} (this kernel "
                    "may have no sch_netem module)"
                )

    def link(self, k: int, up: bool) -> None:
        """Take host ``k``'s link to the bridge down or up (its side outside the namespace)."""
        _ip("link", "set", f"tfp{self._id}v{k}", "up" if up else "down")

    def close(self) -> None:
        """Stop every server and remove the namespaces, links and bridge (what exists of them)."""
        for k in range(self.num_hosts):
            self.kill(k)
        for k, ns in enumerate(self.namespaces):
            _ip("link", "del", f"tfp{self._id}v{k}", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
