"""The delay proxy forwards every byte in order, holds it at least the delay each way, and
carries a real ZeroMQ request stream (what the latency sweep sends through it)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import zmq

from tools.delay_proxy import Delay, DelayProxy


def echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_bytes_arrive_in_order_and_never_early():
    srv, port = echo_server()
    payload = bytes(range(256)) * 4096  # 1 MiB, so chunks of every size cross the proxy
    with DelayProxy(("127.0.0.1", port), Delay(0.03, jitter_s=0.02), seed=1) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.listen_port)) as c:
            t0 = time.monotonic()
            c.sendall(b"x")
            assert c.recv(1) == b"x"
            # a lower bound holds however loaded the machine is: 30 ms each way
            assert time.monotonic() - t0 >= 0.06
            sender = threading.Thread(target=c.sendall, args=(payload,))
            sender.start()
            got = bytearray()
            while len(got) < len(payload):
                chunk = c.recv(65536)
                assert chunk
                got += chunk
            sender.join()
        assert bytes(got) == payload
        assert proxy.connections == 1
    srv.close()


def test_zeromq_request_stream_through_the_proxy():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with DelayProxy(("127.0.0.1", port), Delay(0.01)) as proxy:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(f"tcp://{proxy.address}")
        try:
            for i in range(5):
                dealer.send_multipart([b"", f"ping {i}".encode()])
                assert router.poll(10_000)
                ident, empty, body = router.recv_multipart()
                router.send_multipart([ident, empty, body.replace(b"ping", b"pong")])
                assert dealer.poll(10_000)
                assert dealer.recv_multipart() == [b"", f"pong {i}".encode()]
        finally:
            dealer.close()
    router.close()


def test_bad_settings_are_refused():
    import pytest

    with pytest.raises(ValueError, match="0..10 s"):
        Delay(-0.001)
    with pytest.raises(ValueError, match="0..10 s"):
        Delay(0.01, jitter_s=11)


def test_the_proxy_thread_can_be_pinned():
    """The latency sweep keeps the forwarding off the verifier's core; only the proxy's own
    thread is pinned, not its caller."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("thread affinity is Linux-only")
    cores = sorted(os.sched_getaffinity(0))
    mine = set(cores)
    srv, port = echo_server()
    with DelayProxy(("127.0.0.1", port), Delay(0.0), cpus={cores[-1]}) as proxy:
        assert os.sched_getaffinity(proxy._thread.native_id) == {cores[-1]}
        assert os.sched_getaffinity(0) == mine
        with socket.create_connection(("127.0.0.1", proxy.listen_port)) as c:
            c.sendall(b"ping")
            got = b""
            while len(got) < 4 and (part := c.recv(4 - len(got))):
                got += part
            assert got == b"ping"  # still forwards
    srv.close()
