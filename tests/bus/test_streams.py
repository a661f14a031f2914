"""StreamClient and StreamServer in one process (what StreamClient shares with DirectClient:
tests/bus/test_request_clients.py)."""

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from bus.streams import (
    PeerUnavailable,
    RemoteError,
    RequestCancelled,
    RequestTimeout,
    StreamClient,
    StreamServer,
    serve_ping,
)
from codec.messages import decode, make

BOUND = 10.0  # generous "it happens" bound on a loaded machine; never a performance verdict


def streaming_handler(req):
    """ping -> pong; generate_req -> 3 token chunks then done; anything else -> error."""
    if serve_ping(req):
        return
    if req.message.type == "generate_req":
        for i in range(3):
            req.reply(make("token_chunk", index=i, tensors=[np.array([i], np.int32)]), more=True)
        req.reply(make("done", finish_reason="length"))
    else:
        req.fail("unsupported", req.message.type)


@pytest.fixture
def server(loop, factory):
    return StreamServer(loop, factory, streaming_handler, sender="srv")


@pytest.fixture
def client(loop, factory):
    return StreamClient(loop, factory, sender="cli")


def test_request_reply_carries_ids_and_sender(server, client):
    reply = client.request(server.endpoint, make("ping", payload="x"), timeout=BOUND).result()
    assert reply.type == "pong" and reply.get("payload") == "x" and reply.sender == "srv"


def test_streamed_replies_arrive_in_order_then_final(server, client):
    call = client.request(server.endpoint, make("generate_req", prompt="p"), timeout=BOUND)
    got = [(m.type, m.get("index"), m.more) for m in call.replies(timeout=BOUND)]
    assert got == [("token_chunk", 0, True), ("token_chunk", 1, True),
                   ("token_chunk", 2, True), ("done", None, False)]
    assert call.done


def test_many_requests_in_flight_to_one_peer(server, client):
    calls = [client.request(server.endpoint, make("ping", payload=str(i)), timeout=BOUND)
             for i in range(50)]
    assert [c.result(BOUND).get("payload") for c in calls] == [str(i) for i in range(50)]
    assert len({c.rid for c in calls}) == 50


def test_deadline_to_a_dead_endpoint_is_bounded(client):
    t0 = time.monotonic()
    call = client.request("tcp://127.0.0.1:1", make("ping"), timeout=0.3)
    with pytest.raises(RequestTimeout):
        call.result(BOUND)
    assert call.done  # the request's own deadline ended it, not the wait bound
    assert time.monotonic() - t0 >= 0.3


def test_forget_fails_pending_calls_at_once(loop, factory, client):
    srv = StreamServer(loop, factory, lambda req: None)
    call = client.request(srv.endpoint, make("ping"), timeout=10)
    time.sleep(0.1)
    client.forget(srv.endpoint)
    with pytest.raises(PeerUnavailable):
        call.result(BOUND)


def test_replies_from_a_worker_thread(loop, factory, client):
    def handler(req):
        threading.Thread(target=lambda: (time.sleep(0.05), req.reply(make("pong")))).start()

    srv = StreamServer(loop, factory, handler)
    assert client.request(srv.endpoint, make("ping"), timeout=BOUND).result().type == "pong"


def test_handler_exception_answers_internal_error_and_keeps_serving(loop, factory, client):
    def handler(req):
        if req.message.type == "ping":
            raise RuntimeError("boom")
        req.reply(make("done", finish_reason="ok"))

    srv = StreamServer(loop, factory, handler)
    with pytest.raises(RemoteError) as info:
        client.request(srv.endpoint, make("ping"), timeout=BOUND).result()
    assert info.value.code == "internal"
    assert client.request(srv.endpoint, make("generate_req"), timeout=BOUND).result().type == "done"
    assert srv.handler_errors == 1


def test_garbage_gets_a_typed_error_and_the_server_keeps_serving(server, client, factory):
    raw = factory.dealer()
    raw.connect(server.endpoint)
    try:
        bad = [
            [b"\xc1\xc1 not msgpack"],
            [msgpack.packb({"v": 2, "t": "ping", "rid": 77, "tensors": [{"dtype": "int32",
                                                                         "shape": [4]}]})],
            [msgpack.packb({"v": 9, "t": "ping"})],
            [msgpack.packb({"v": 2, "t": "session_extend", "rid": 5, "committed": 1,
                            "tensors": [{"dtype": "int32", "shape": [2**40]}]}), b""],
        ]
        codes = []
        for frames in bad:
            raw.send_multipart(frames)
            assert raw.poll(int(BOUND * 1000))
            reply = decode(raw.recv_multipart())
            assert reply.type == "error"
            codes.append((reply["code"], reply.rid))
        assert codes == [("bad_header", 0), ("frame_count", 77), ("bad_version", 0),
                         ("oversize", 5)]
        assert server.dropped == 4
        # a real client is still served
        assert client.request(server.endpoint, make("ping"), timeout=BOUND).result().type == "pong"
    finally:
        raw.close(linger=0)


def test_bad_requests_are_refused_in_the_callers_thread(client):
    with pytest.raises(Exception) as info:
        client.request("tcp://127.0.0.1:1", make("nope"), timeout=1)
    assert "unknown_type" in str(info.value)
    assert zmq  # keep import for clarity of what transport is used


def test_request_from_the_loop_thread_sends_directly_and_calls_back(server, client, loop):
    """A loop callback is already the socket's owner: no call_soon, and the reply arrives
    through on_reply on the same thread."""
    got = []
    done = threading.Event()
    queued_before = []

    def on_reply(call, item):
        got.append((threading.current_thread().name, item.type, item.get("payload")))
        done.set()

    def start():
        client.request(server.endpoint, make("ping", payload="in-loop"), timeout=BOUND,
                       on_reply=on_reply)
        queued_before.append(len(loop._calls))  # nothing handed over: the send happened here

    loop.call_soon(start)
    assert done.wait(BOUND)
    assert got == [("test-io", "pong", "in-loop")]
    assert queued_before == [0]
    assert client.sent == 1


def test_server_sees_cancel_through_lazily_made_event(loop, factory, client):
    """Request.cancelled is made on first use; a cancel that comes first still sets it."""
    seen = []

    def slow(req):
        seen.append(req)  # never answered: the client cancels

    srv = StreamServer(loop, factory, slow)
    call = client.request(srv.endpoint, make("ping"), timeout=BOUND)
    deadline = time.monotonic() + BOUND
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and not seen[0].cancelled.is_set()
    call.cancel()
    assert seen[0].cancelled.wait(BOUND)
    with pytest.raises(RequestCancelled):
        call.result(BOUND)


def test_a_dealers_monitor_is_disabled_before_its_reader_closes(loop, server, client,
                                                                  monkeypatch):
    """Closing a connection disables the DEALER's monitor before closing the PAIR that reads
    it. The other order deadlocks when an event comes in between (libzmq sends monitor events
    with a blocking send under the socket's monitor lock; disable_monitor then waits for the
    lock holding the GIL): nodes stuck at stop. The order is what this test can pin; the
    deadlock itself needs an event inside a window of microseconds."""
    assert client.request(server.endpoint, make("ping"), timeout=BOUND).result()
    steps: list[tuple[str, int]] = []
    real_disable, real_remove = zmq.Socket.disable_monitor, loop.remove_reader

    def disable(sock):
        steps.append(("disable monitor", sock.type))
        return real_disable(sock)

    def remove_reader(sock, close=True):
        if close:
            steps.append(("close", sock.type))
        return real_remove(sock, close)

    monkeypatch.setattr(zmq.Socket, "disable_monitor", disable)
    monkeypatch.setattr(loop, "remove_reader", remove_reader)
    client.forget(server.endpoint)
    loop.run_sync(lambda: None, timeout=BOUND)  # the forget ran on the loop thread
    assert steps == [("disable monitor", zmq.DEALER), ("close", zmq.PAIR),
                     ("close", zmq.DEALER)]
    assert not client.connected(server.endpoint)


def test_a_dropped_request_is_answered_with_an_error(loop, factory):
    """Issue 21: every drop answers; a client still listening learns its stream ended."""
    from bus.streams import RemoteError

    held = []
    server = StreamServer(loop, factory, held.append)
    client = StreamClient(loop, factory, sender="c")
    call = client.request(server.endpoint, make("ping", payload=""), timeout=10)
    deadline = time.monotonic() + 10
    while not held:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    req = held[0]
    loop.run_sync(lambda: server.drop(req, "client_gone", "dropped: test"))
    with pytest.raises(RemoteError) as exc:
        call.result(10)
    assert exc.value.code == "client_gone"
    assert req.cancelled.is_set()
    req.reply(make("pong", payload=""))  # a worker's late reply is discarded, not an error
