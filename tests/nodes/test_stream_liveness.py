"""Request streams against a real peer process that is stopped or killed, and a client that
closes: no model, real sockets. Verdicts come from what arrived, never from elapsed times."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.sockets import SocketFactory
from bus.streams import PeerUnavailable, RequestCancelled, StreamClient, StreamServer
from codec.messages import make
from tools.local_cluster import wait_all

ROOT = Path(__file__).resolve().parents[2]
REPLIES = 40  # stream_server.py sends this many, one every 50 ms


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stream_server.py"))],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    endpoint = proc.stdout.readline().strip()
    assert endpoint.startswith("tcp://"), endpoint
    yield proc, endpoint
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_a_stream_survives_a_peer_stopped_longer_than_the_old_heartbeat_timeout(loop, peer):
    """5 s of SIGSTOP (the old 3 s ZMTP timeout made the client reconnect under a new routing
    id and the resumed peer's replies were dropped): every reply arrives, once, in order."""
    proc, endpoint = peer
    client = StreamClient(loop, SocketFactory(), sender="c")
    call = client.request(endpoint, make("ping"))
    first = call.next(timeout=30)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(5.0)  # the scenario's length, not a verdict
    assert client.connected(endpoint)  # a stopped process keeps its TCP connection
    proc.send_signal(signal.SIGCONT)
    got = [first["payload"]] + [m["payload"] for m in call.replies(timeout=60)]
    assert got == [str(i) for i in range(REPLIES)]


def test_connected_goes_false_when_the_peer_is_killed(loop, peer):
    proc, endpoint = peer
    client = StreamClient(loop, SocketFactory(), sender="c")
    call = client.request(endpoint, make("ping"))
    call.next(timeout=30)
    assert wait_all(lambda: client.connected(endpoint), 30)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_all(lambda: not client.connected(endpoint), 30)


def test_close_cancels_calls_in_flight_and_the_server_can_tell_the_peer_is_gone(loop):
    factory = SocketFactory()
    seen = []
    server = StreamServer(loop, factory, seen.append)
    client = StreamClient(loop, factory, sender="closing")
    calls = [client.request(server.endpoint, make("ping")) for _ in range(3)]
    assert wait_all(lambda: len(seen) == 3, 30)
    peer = seen[0].peer
    assert loop.run_sync(lambda: server.peer_connected(peer))
    assert loop.run_sync(lambda: [r.rid for r in server.requests_from("closing")]) == [1, 2, 3]
    client.close()
    for call in calls:
        with pytest.raises(RequestCancelled):
            call.next(timeout=5)
    assert wait_all(lambda: all(r.cancelled.is_set() for r in seen), 30)
    assert server.in_flight == 0
    assert wait_all(lambda: not loop.run_sync(lambda: server.peer_connected(peer)), 30)
    with pytest.raises(PeerUnavailable):
        client.request(server.endpoint, make("ping")).next(timeout=5)


@pytest.mark.parametrize("indexes, ok", [((0, 1, 2), True), ((0, 2), False), ((0, 1, 1), False)],
                         ids=["in-order", "gap", "repeat"])
def test_the_cluster_client_checks_chunk_continuity(loop, indexes, ok):
    """A chunk missing or repeated is a `broken_stream` error, never silently wrong text."""
    from types import SimpleNamespace

    import numpy as np

    from codec.structs import Done, TokenChunk
    from nodes.cluster_client import ClusterClient, ClusterError, GenerateRequest

    def serve(req):
        for i in indexes:
            req.reply(TokenChunk(i, np.array([1], np.int32), "x").to_message(), more=True)
        req.reply(Done("length", "x" * len(indexes)).to_message())

    server = StreamServer(loop, SocketFactory(), serve)
    fake = SimpleNamespace(node_id="fake-verifier", card=SimpleNamespace(
        endpoints={"stream": server.endpoint}))
    with ClusterClient("liveness-test", mdns=False) as cc:
        stream = cc.stream(GenerateRequest("hi", max_tokens=3), fake, idle_timeout=60)
        if ok:
            assert [m.type for m in stream] == ["token_chunk"] * 3 + ["done"]
        else:
            with pytest.raises(ClusterError) as info:
                list(stream)
            assert info.value.code == "broken_stream"
