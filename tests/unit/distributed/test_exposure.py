"""Reading a process's listening TCP sockets from /proc, as ``ss -ltnp`` shows them."""

import os
import socket
import sys

import pytest

from tfpipe.distributed import exposure

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_listening_sockets_and_which_are_open_beyond_loopback():
    # Only loopback sockets are opened here; the wildcard addresses are checked through the parser below.
    servers = []
    for family, address in [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1")]:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind((address, 0))
        s.listen()
        servers.append(s)
    connected = socket.create_connection(("127.0.0.1", servers[0].getsockname()[1]))  # not listening: not listed
    try:
        found = exposure.listening(os.getpid())
        expected = [(s.getsockname()[0], s.getsockname()[1]) for s in servers]
        assert set(expected) <= set(found)
        assert connected.getsockname()[1] not in {port for _, port in found}
        assert not set(exposure.open_to_network(os.getpid())) & {port for _, port in expected}
    finally:
        connected.close()
        for s in servers:
            s.close()
    assert not {port for _, port in exposure.listening(os.getpid())} & {port for _, port in expected}


@pytest.mark.parametrize(
    "hex_address,address",
    [
        ("00000000", "0.0.0.0"),
        ("0100007F", "127.0.0.1"),
        ("0101A8C0", "192.168.1.1"),
        ("00000000000000000000000000000000", "::"),
        ("00000000000000000000000001000000", "::1"),
        ("0000000000000000FFFF00000100007F", "127.0.0.1"),
    ],
)
def test_addresses_as_proc_net_tcp_writes_them(hex_address, address):
    assert exposure._address(hex_address) == address


def test_a_process_that_is_gone_listens_on_nothing():
    assert exposure.listening(2**22 + 12345) == [] and exposure.open_to_network(2**22 + 12345) == []
