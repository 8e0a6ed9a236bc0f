"""Which TCP ports a process listens on, and which of them are open beyond loopback (read from /proc, Linux).

TensorFlow's gRPC server binds ``0.0.0.0`` whatever host its cluster spec names (the
address is written into ``libtensorflow_cc``: ``AddListeningPort("0.0.0.0:" + port)``)
and serves without authentication: whoever reaches the port can run any op in the
worker, file reads and writes included. It cannot be confined from Python, so
``LocalCluster`` names the open ports when it starts and README's "Security" says how
to close them.
"""

from __future__ import annotations

import ipaddress
import os

from absl import logging

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian 32-bit words) in its usual form."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:a.b.c.d, an IPv4 peer of an IPv6 socket
    return str(mapped if mapped is not None else address)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on over TCP, as ``ss -ltnp`` shows them; [] off Linux."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and fields[9] in inodes:
                address, port = fields[1].rsplit(":", 1)
                found.add((_address(address), int(port, 16)))
    return sorted(found)


def open_to_network(pid: int) -> list[int]:
    """The ports process ``pid`` listens on at an address other than loopback (``0.0.0.0`` and ``::`` included)."""
    return sorted({port for address, port in listening(pid) if not ipaddress.ip_address(address).is_loopback})


def warn_exposed(pids: list[int], own_port: int | None) -> None:
    """Log one line naming the ports of LocalCluster's worker processes ``pids`` that other hosts can reach, and
    this process's own (TensorFlow's server in the training process, which serves remote tensors)."""
    ports = [port for pid in pids for port in open_to_network(pid)]
    if ports:
        own = f" and this process's port {own_port}" if own_port else ""
        logging.warning(
            "tfpipe: LocalCluster's workers (port%s %s)%s listen on every network interface: TensorFlow's gRPC "
            "server binds 0.0.0.0 and has no authentication, so whoever reaches these ports can run TensorFlow "
            "ops (file reads and writes included) in these processes. Block them from other hosts with a firewall "
            "or train on a trusted network (README, 'Security').",
            "s" if len(ports) > 1 else "",
            ", ".join(map(str, ports)),
            own,
        )
