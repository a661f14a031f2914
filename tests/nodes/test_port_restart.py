"""A node restarted on the same `--port` right after a SIGKILL starts (issue 47).

The start-up port check once bound without SO_REUSEADDR, which the real (ZeroMQ) bind sets, so
the killed node's connections in TIME-WAIT / FIN-WAIT made it refuse the port for a minute
although the node itself could have bound it. A port some process listens on is still refused.
"""

from __future__ import annotations

import signal
import socket
from types import SimpleNamespace

import pytest

from nodes.cmd_node import _check_addresses
from tools.local_cluster import LocalCluster


def _two_free_ports() -> int:
    """P such that P and P + 1 are both free now (the node needs both)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def _time_wait_on(port: int) -> None:
    """Leave a connection whose local port is `port` in TIME-WAIT (the server closed first)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server's side closes first: it goes through TIME-WAIT
    listener.close()
    client.recv(1)
    client.close()


def test_the_port_check_binds_as_the_real_bind_does():
    port = _two_free_ports()
    _time_wait_on(port)
    with socket.socket() as plain:  # what the old check did: refused during TIME-WAIT
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    config = SimpleNamespace(interface="127.0.0.1", port=port)
    _check_addresses(config)  # the real bind succeeds here, so the check lets it through
    with socket.socket() as taken:  # a port someone listens on is still refused
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port + 1))
        taken.listen(1)
        with pytest.raises(ValueError, match=f"cannot use port {port + 1}"):
            _check_addresses(config)


@pytest.mark.slow
def test_a_node_restarts_on_its_port_right_after_a_sigkill(tmp_path):
    port = _two_free_ports()
    with LocalCluster(log_dir=tmp_path, mdns=False) as cluster:
        first = cluster.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0",
                                   "--port", str(port), wait=120)
        # a peer connected to both of its ports, so the kill leaves their connections behind
        peers = [socket.create_connection(("127.0.0.1", p)) for p in (port, port + 1)]
        first.signal(signal.SIGKILL)
        first.proc.wait(30)
        for p in peers:
            p.close()
        again = cluster.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0",
                                   "--port", str(port), wait=120)
        assert again.stream.endswith(f":{port}")
