"""What StreamClient and DirectClient both promise, each test run against both clients.

The two differ in who owns the sockets and who keeps time (bus/calls.py), not in what a call
is: an `error` reply raises RemoteError, a deadline ends a call (never early) and a reply after
it is counted as late, a cancel reaches the server's handler, ipc:// works, and large tensors
arrive zero-copy. What only one of them does stays in tests/bus/test_streams.py and
tests/bus/test_direct.py.

Timeouts here are only "it happens" bounds: no verdict depends on how fast anything is.
"""

import threading
import time

import numpy as np
import pytest

from bus.direct import DirectClient
from bus.streams import RemoteError, RequestCancelled, RequestTimeout, StreamClient, StreamServer
from codec.messages import make
from tests.bus.stream_server import handler

BOUND = 10.0  # generous "it happens" bound on a loaded machine; never a performance verdict


@pytest.fixture(params=["stream", "direct"])
def client(request, loop, factory):
    if request.param == "stream":
        yield StreamClient(loop, factory, sender="cli")
    else:
        cli = DirectClient(factory, sender="cli")
        yield cli
        cli.close()


def take_in(client) -> None:
    """Give the client a moment to read what has arrived: a DirectClient reads when its owner
    polls (and here nothing is for any call), a StreamClient on its I/O thread."""
    if isinstance(client, DirectClient):
        assert client.poll(timeout=0.1) == []
    else:
        time.sleep(0.01)


def test_error_reply_raises_remote_error(loop, factory, client):
    server = StreamServer(loop, factory, handler, sender="srv")
    with pytest.raises(RemoteError) as info:
        client.request(server.endpoint, make("session_close"), timeout=BOUND).result()
    assert info.value.code == "unsupported"


def test_deadline_expires_and_the_late_reply_is_counted(loop, factory, client):
    held = []
    silent = StreamServer(loop, factory, held.append)
    t0 = time.monotonic()
    call = client.request(silent.endpoint, make("ping"), timeout=0.2)
    with pytest.raises(RequestTimeout):
        call.result()  # no wait bound: the call's own deadline ends it
    assert time.monotonic() - t0 >= 0.2  # a deadline never fires early
    assert call.done and client.in_flight == 0
    assert held, "the server got the request"
    held[0].reply(make("pong"))  # the late answer is counted, not delivered to anyone
    end = time.monotonic() + BOUND
    while client.late == 0 and time.monotonic() < end:
        take_in(client)
    assert client.late == 1


def test_cancel_reaches_the_server_handler(loop, factory, client):
    held = []
    cancelled = threading.Event()

    def on_request(req):
        held.append(req)
        req.on_cancel(cancelled.set)

    srv = StreamServer(loop, factory, on_request)
    call = client.request(srv.endpoint, make("generate_req", prompt="long"), timeout=BOUND)
    end = time.monotonic() + BOUND
    while not held and time.monotonic() < end:
        time.sleep(0.01)
    call.cancel()
    with pytest.raises(RequestCancelled):
        call.result(BOUND)
    assert cancelled.wait(BOUND)
    assert held[0].cancelled.is_set()
    assert srv.in_flight == 0 and client.in_flight == 0


def test_ipc_transport(loop, factory, client, tmp_path):
    srv = StreamServer(loop, factory, handler, bind_endpoint=f"ipc://{tmp_path}/s.ipc")
    assert srv.endpoint.startswith("ipc://")
    assert client.request(srv.endpoint, make("ping"), timeout=BOUND).result().type == "pong"


def test_zero_copy_large_tensor_through_the_bus(loop, factory, client):
    got = {}

    def on_request(req):
        got["arr"] = req.message.tensors[1]
        req.reply(make("done", finish_reason="ok"))

    srv = StreamServer(loop, factory, on_request)
    probs = np.arange(2 * 65536, dtype=np.float32).reshape(2, 65536)
    msg = make("blob", tensors=[np.array([1, 2], np.int32), probs])
    assert client.request(srv.endpoint, msg, timeout=BOUND).result().type == "done"
    assert np.array_equal(got["arr"], probs)
    assert not got["arr"].flags.owndata  # a view over the received frame
