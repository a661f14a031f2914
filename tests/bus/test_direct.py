"""DirectClient against real StreamServers, in this process and in another one (what it
shares with StreamClient: tests/bus/test_request_clients.py).

Timeouts here are only "it happens" bounds: no verdict depends on how fast anything is.
"""

import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from bus.direct import BadReply, DirectClient, WrongThread
from bus.streams import (
    BusError,
    PeerUnavailable,
    RequestCancelled,
    RequestTimeout,
    StreamServer,
)
from codec.messages import Message, decode, encode, make
from tests.bus.stream_server import handler as proc_handler

ROOT = Path(__file__).resolve().parents[2]
BOUND = 10.0  # generous "it happens" bound on a loaded machine; never a performance verdict


@pytest.fixture
def server(loop, factory):
    return StreamServer(loop, factory, proc_handler, sender="srv")


@pytest.fixture
def remote():
    """The same handler served by a StreamServer in a separate process."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("stream_server.py"))], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        endpoint = read_line(proc)
        assert endpoint.startswith("tcp://127.0.0.1:")
        yield proc, endpoint
    finally:
        proc.stdin.close()
        try:
            proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(factory):
    cli = DirectClient(factory, sender="cli")
    yield cli
    cli.close()


def read_line(proc, bound=BOUND):
    """The server's next stdout line, or "" if none comes within `bound` (no hang)."""
    ready, _, _ = select.select([proc.stdout], [], [], bound)
    return proc.stdout.readline().strip() if ready else ""


def drain(client, calls, bound=BOUND):
    """poll() until every call has its final reply; returns {rid: [replies in order]}."""
    got: dict[int, list] = {c.rid: [] for c in calls}
    open_ = {c.rid for c in calls}
    end = time.monotonic() + bound
    while open_ and time.monotonic() < end:
        for call, item in client.poll(timeout=0.5):
            got[call.rid].append(item)
            if isinstance(item, BusError) or not item.more:
                open_.discard(call.rid)
    assert not open_, f"{len(open_)} calls never finished"
    return got


def test_request_reply_in_process_and_across_processes(client, server, remote):
    _, endpoint = remote
    for ep, sender in ((server.endpoint, "srv"), (endpoint, "proc")):
        reply = client.request(ep, make("ping", payload="x"), timeout=BOUND).result()
        assert reply.type == "pong" and reply.get("payload") == "x" and reply.sender == sender
    assert client.sent == 2 and client.in_flight == 0
    assert sorted(client.peers) == sorted([server.endpoint, endpoint])


def test_streamed_replies_arrive_in_order_then_final(client, remote):
    _, endpoint = remote
    call = client.request(endpoint, make("generate_req", max_tokens=4), timeout=BOUND)
    got = [(m.type, m.get("index"), m.more) for m in call.replies(timeout=BOUND)]
    assert got == [("token_chunk", i, True) for i in range(4)] + [("done", None, False)]
    assert call.done and call.queued == 0
    with pytest.raises(BusError):
        call.next(0)  # nothing more will come


def test_result_discards_streamed_replies(client, server):
    call = client.request(server.endpoint, make("generate_req", max_tokens=3), timeout=BOUND)
    assert call.result(BOUND).type == "done"


def test_deadline_is_reported_by_poll(client):
    call = client.request("tcp://127.0.0.1:1", make("ping"), timeout=0.1)
    events = []
    end = time.monotonic() + BOUND
    while not events and time.monotonic() < end:
        events = client.poll(timeout=1.0)
    assert len(events) == 1 and events[0][0] is call
    assert isinstance(events[0][1], RequestTimeout)


def test_a_wait_bound_does_not_end_the_call(loop, factory, client):
    silent = StreamServer(loop, factory, lambda req: None)
    call = client.request(silent.endpoint, make("ping"), timeout=BOUND)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        call.next(timeout=0.05)
    assert time.monotonic() - t0 >= 0.05  # a wait never ends before its bound
    assert not call.done and client.in_flight == 1
    call.cancel()
    with pytest.raises(RequestCancelled):
        call.result(0)


def test_cancel_reaches_a_server_in_another_process(client, remote):
    proc, endpoint = remote
    # a ping first, so the hold request surely reached the handler before we cancel
    assert client.request(endpoint, make("ping"), timeout=BOUND).result().type == "pong"
    call = client.request(endpoint, make("blob", note="hold"), timeout=BOUND)
    client.request(endpoint, make("ping"), timeout=BOUND).result()  # same pipe: hold arrived
    call.cancel()
    assert read_line(proc) == f"cancelled {call.rid}"


def test_close_cancels_pending_calls_on_the_server(client, remote):
    proc, endpoint = remote
    call = client.request(endpoint, make("blob", note="hold"), timeout=BOUND)
    client.request(endpoint, make("ping"), timeout=BOUND).result()
    client.close()
    assert read_line(proc) == f"cancelled {call.rid}"
    with pytest.raises(RequestCancelled):
        call.result(0)
    with pytest.raises(BusError):
        client.request(endpoint, make("ping"))


def test_close_peer_fails_its_calls_at_once(loop, factory, client, server):
    silent = StreamServer(loop, factory, lambda req: None)
    call = client.request(silent.endpoint, make("ping"), timeout=BOUND)
    other = client.request(server.endpoint, make("ping"), timeout=BOUND)
    client.close_peer(silent.endpoint)
    with pytest.raises(PeerUnavailable):
        call.result(0)
    assert other.result(BOUND).type == "pong"
    assert client.peers == [server.endpoint]


def fake_server(factory):
    router = factory.router()
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def serve_once(router, answer):
    """Receive one request on a bare ROUTER and send back `answer(header)` frames."""
    assert router.poll(int(BOUND * 1000))
    peer, *frames = router.recv_multipart()
    router.send_multipart([peer, *answer(decode(frames))])


def test_a_malformed_reply_fails_its_call_with_a_typed_error(client, factory):
    router, endpoint = fake_server(factory)
    try:
        call = client.request(endpoint, make("ping"), timeout=BOUND)
        # a header naming our rid that promises a tensor frame it does not carry
        serve_once(router, lambda req: [msgpack.packb(
            {"v": 2, "t": "pong", "rid": req.rid, "tensors": [{"dtype": "int32", "shape": [4]}]}
        )])
        with pytest.raises(BadReply) as info:
            call.result(BOUND)
        assert info.value.code == "frame_count"
        # garbage with no readable rid is counted and fails nobody; the deadline ends the call
        call = client.request(endpoint, make("ping"), timeout=0.3)
        serve_once(router, lambda req: [b"\xc1\xc1 not msgpack"])
        with pytest.raises(RequestTimeout):
            call.result(BOUND)
        assert client.dropped == 2
    finally:
        router.close(linger=0)


def test_use_from_another_thread_raises(client, server):
    call = client.request(server.endpoint, make("ping"), timeout=BOUND)
    errors = []

    def misuse():
        for fn in (lambda: client.request(server.endpoint, make("ping")), client.poll,
                   call.result, call.cancel, lambda: client.close_peer(server.endpoint),
                   client.close):
            try:
                fn()
            except WrongThread as exc:
                errors.append(str(exc))

    t = threading.Thread(target=misuse, name="intruder")
    t.start()
    t.join(BOUND)
    assert len(errors) == 6 and "intruder" in errors[0]
    assert call.result(BOUND).type == "pong"  # the owner is unaffected


def test_many_calls_in_flight_to_two_servers_interleave(client, server, remote):
    _, endpoint = remote
    calls, expect = [], {}
    for i in range(60):
        ep = (server.endpoint, endpoint)[i % 2]
        if i % 3:
            call = client.request(ep, make("ping", payload=str(i)), timeout=BOUND)
            expect[call.rid] = [("pong", str(i), False)]
        else:
            n = i % 5 + 1
            call = client.request(ep, make("generate_req", max_tokens=n), timeout=BOUND)
            expect[call.rid] = [("token_chunk", k, True) for k in range(n)]
            expect[call.rid].append(("done", None, False))
        calls.append(call)
    got = drain(client, calls)
    for rid, items in got.items():
        assert all(isinstance(m, Message) for m in items)
        rows = [(m.type, m.get("payload") if m.type == "pong" else m.get("index"), m.more)
                for m in items]
        assert rows == expect[rid], rid
    assert client.in_flight == 0 and client.late == 0


def test_streamed_replies_past_the_cap_are_dropped_and_counted(factory, server):
    cli = DirectClient(factory, max_queued=2)
    try:
        stream = cli.request(server.endpoint, make("generate_req", max_tokens=10), timeout=BOUND)
        # replies on one connection arrive in order: once the ping is answered, the whole
        # stream has been received, unread
        assert cli.request(server.endpoint, make("ping"), timeout=BOUND).result().type == "pong"
        assert stream.done and stream.queued == 3  # 2 chunks + the final reply, always kept
        assert stream.overflowed == 8 and cli.overflowed == 8
        got = [(m.type, m.get("index")) for m in stream.replies(0)]
        assert got == [("token_chunk", 0), ("token_chunk", 1), ("done", None)]
    finally:
        cli.close()


def test_bad_requests_are_refused_before_anything_is_sent(client, loop, factory):
    srv = StreamServer(loop, factory, proc_handler)  # (zero-copy: test_request_clients.py)
    with pytest.raises(Exception) as info:  # refused before anything is sent
        client.request(srv.endpoint, make("nope"), timeout=1)
    assert "unknown_type" in str(info.value)
    with pytest.raises(ValueError):
        client.request(srv.endpoint, make("ping"), timeout=0)
    with pytest.raises(ValueError):
        client.request("nonsense://x", make("ping"), timeout=1)


def test_the_wire_is_the_same_as_stream_client(client, factory):
    """A bare ROUTER sees exactly what StreamClient would send: header + tensors, rid set."""
    router, endpoint = fake_server(factory)
    try:
        call = client.request(endpoint, make("ping", payload="w"), timeout=BOUND)
        assert router.poll(int(BOUND * 1000))
        peer, *frames = router.recv_multipart()
        req = decode(frames)
        assert req.type == "ping" and req.rid == call.rid and req.sender == "cli"
        assert frames == [bytes(f) for f in encode(req)]
        router.send_multipart([peer, *encode(make("pong", rid=req.rid))])
        assert call.result(BOUND).type == "pong"
        assert zmq.DEALER == client._dealers[endpoint].type
    finally:
        router.close(linger=0)


def test_a_compute_thread_owns_its_client(factory, server):
    """The intended use: a worker thread makes the client and does all its I/O itself."""
    box = {}

    def compute():
        cli = DirectClient(factory, sender="compute")
        box["client"] = cli
        calls = [cli.request(server.endpoint, make("ping", payload=str(i)), timeout=BOUND)
                 for i in range(5)]
        box["payloads"] = [c.result(BOUND).get("payload") for c in calls]
        box["ready"].set()
        box["release"].wait(BOUND)
        cli.close()

    box["ready"], box["release"] = threading.Event(), threading.Event()
    t = threading.Thread(target=compute, name="verifier-compute")
    t.start()
    try:
        assert box["ready"].wait(BOUND)
        assert box["payloads"] == [str(i) for i in range(5)]
        with pytest.raises(WrongThread):
            box["client"].poll()  # the main thread is not its owner
    finally:
        box["release"].set()
        t.join(BOUND)
    assert not t.is_alive()
