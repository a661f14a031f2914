"""Admission limits over real loopback sockets: one connection opening 10,000 draft sessions or
flooding a node with requests is refused past its limit with a typed, counted error, while
another connection is still served; sessions belong to the connection that opened them."""

from __future__ import annotations

import numpy as np
import pytest

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import RemoteError, StreamClient, StreamServer
from codec.messages import make
from nodes.drafters.ngram import NgramDrafter
from nodes.node import Node, NodeConfig
from nodes.node_common.admission import AdmissionLimits, PeerSlots, RateLimiter, TokenBucket
from nodes.proposer.role import ProposerRole

PROMPT = np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], dtype=np.int32)
LIMITS = AdmissionLimits(sessions_per_peer=8, sessions_total=64)


class Host:
    """Just a ROUTER with a request registry and clients on one loop (like tests/nodes)."""

    def __init__(self, loop, factory):
        self.loop, self.factory, self._handlers = loop, factory, {}
        self.server = StreamServer(loop, factory, self._dispatch, sender="proposer")

    def register_request(self, type_, fn):
        self._handlers[type_] = fn

    def _dispatch(self, req):
        self._handlers[req.message.type](req)

    def connection(self) -> StreamClient:
        """A new client: its own DEALER, hence its own connection (routing identity)."""
        return StreamClient(self.loop, self.factory, sender="verifier")


@pytest.fixture
def host():
    loop = IOLoop(name="admission-io").start()
    h = Host(loop, SocketFactory())
    role = ProposerRole(NgramDrafter(), vocab_size=100, admission=LIMITS)
    role.attach(h)
    yield h, role
    role.close()
    loop.stop()


def ask(client, endpoint, msg, timeout=10.0):
    return client.request(endpoint, msg, timeout=timeout).result(timeout)


def opener(sid):
    return make("session_open", session=sid, lease_s=30.0, tensors=[PROMPT])


def outcome(call):
    """"ok" when served (an opened session's reply is a stream: its first chunk), else the code."""
    try:
        call.next(30)
    except RemoteError as exc:
        return exc.code
    return "ok"


def first_chunk(client, endpoint, sid):
    """Open a session (protocol 2): the first streamed draft chunk of its reply."""
    return client.request(endpoint, opener(sid), timeout=30).next(30)


def test_a_connection_opening_10000_sessions_is_refused_past_its_limit(host):
    h, role = host
    ep = h.server.endpoint
    greedy, honest = h.connection(), h.connection()
    codes: list[str] = []
    for start in range(0, 10_000, 500):  # pipelined in bounded batches
        calls = [greedy.request(ep, opener(f"g{i}"), timeout=30)
                 for i in range(start, start + 500)]
        codes += [outcome(c) for c in calls]
    assert codes.count("ok") == LIMITS.sessions_per_peer
    assert codes.count("too_many_sessions") == 10_000 - LIMITS.sessions_per_peer
    assert role.stats.as_dict()["refused"]["too_many_sessions"] == 10_000 - 8
    # the honest verifier still opens a session and gets drafts
    chunk = first_chunk(honest, ep, "h1")
    assert chunk.type == "draft_chunk" and chunk.tensors[0].tolist()[:3] == [7, 8, 5]


def test_total_sessions_are_capped_across_connections(host):
    """The total never passes its limit; once it is reached a newcomer still gets in, in place
    of the least recently used session of a connection over its fair share of the count
    (issue 47: 16 connections x 16 sessions once locked the real verifier out), while a
    connection at its share is refused."""
    h, role = host
    ep = h.server.endpoint
    clients = [h.connection() for _ in range(LIMITS.sessions_total // LIMITS.sessions_per_peer)]
    for n, c in enumerate(clients):
        for i in range(LIMITS.sessions_per_peer):
            assert first_chunk(c, ep, f"c{n}-{i}").type == "draft_chunk"
    assert first_chunk(h.connection(), ep, "newcomer").type == "draft_chunk"
    assert role.open_sessions == LIMITS.sessions_total and role.sessions_evicted == 1
    assert outcome(clients[0].request(ep, opener("one-too-many"), timeout=30)) == \
        "too_many_sessions"
    assert role.open_sessions == LIMITS.sessions_total


def test_sessions_belong_to_their_opener(host):
    h, role = host
    ep = h.server.endpoint
    owner, other = h.connection(), h.connection()
    stream = owner.request(ep, opener("mine"), timeout=30)
    assert stream.next(30).type == "draft_chunk"
    for msg in (make("session_close", session="mine"), opener("mine"),
                make("session_extend", session="mine", committed=len(PROMPT),
                     tensors=[np.zeros(0, np.int32)])):
        with pytest.raises(RemoteError) as info:
            ask(other, ep, msg)
        assert info.value.code == "forbidden"
    assert role.stats.as_dict()["refused"]["forbidden"] == 3
    # untouched: the owner commits to its own session and gets fresh drafts, then closes it
    assert ask(owner, ep, make("session_extend", session="mine", committed=len(PROMPT) + 1,
                               tensors=[np.array([7], np.int32)]))["finish_reason"]
    chunk = stream.next(30)
    for _ in range(64):  # chunks drafted before the commit arrived come first
        if chunk["base"] == len(PROMPT) + 1:
            break
        chunk = stream.next(30)
    assert chunk.type == "draft_chunk" and chunk["base"] == len(PROMPT) + 1
    assert chunk.tensors[0].tolist()[:2] == [8, 5]
    assert ask(owner, ep, make("session_close", session="mine"))["finish_reason"] == "closed"


def test_a_flooding_connection_is_rate_limited_while_others_are_served():
    limits = AdmissionLimits(rate_per_s=50.0, burst=100)
    node = Node(NodeConfig(cluster="admission", mdns=False, admission=limits)).start()
    try:
        ep = node.server.endpoint
        flood, other = (StreamClient(node.loop, node.factory) for _ in range(2))
        codes: list[str] = []
        for _ in range(20):  # 10,000 pings in bounded pipelined batches
            calls = [flood.request(ep, make("ping"), timeout=30) for _ in range(500)]
            codes += [outcome(c) for c in calls]
        assert set(codes) <= {"ok", "rate_limited"}
        assert codes[:100] == ["ok"] * 100  # the burst
        assert codes.count("rate_limited") > 0
        assert node.security_counters()["rate_limited"] == codes.count("rate_limited")
        # a fresh connection has its own bucket: served at once
        assert ask(other, ep, make("ping")).type == "pong"
    finally:
        node.stop()


def test_token_bucket_and_slots_units():
    b = TokenBucket(rate=10.0, burst=2, now=0.0)
    assert [b.take(0.0), b.take(0.0), b.take(0.0)] == [True, True, False]
    assert b.take(0.1) and not b.take(0.1)  # 0.1 s at 10/s: one more token
    r = RateLimiter(AdmissionLimits(rate_per_s=1.0, burst=1))
    assert r.allow(b"a", 0.0) and not r.allow(b"a", 0.0) and r.allow(b"b", 0.0)
    assert r.refused == 1
    s = PeerSlots(2)
    assert s.acquire(b"a") and s.acquire(b"a") and not s.acquire(b"a") and s.acquire(b"b")
    s.release(b"a")
    assert s.acquire(b"a") and s.refused == 1
    with pytest.raises(ValueError):
        AdmissionLimits(sessions_per_peer=10, sessions_total=5)


# -- issue 21: draft sessions weighed in bytes, a fair share each, dying with their connection --


def budget_host(session_mb: int):
    loop = IOLoop(name="budget-io").start()
    h = Host(loop, SocketFactory())
    limits = AdmissionLimits(sessions_per_peer=16, sessions_total=256,
                             session_bytes=session_mb << 20)
    role = ProposerRole(NgramDrafter(), vocab_size=100, admission=limits, sweep_every=0.05)
    role.attach(h)
    return loop, h, role


def big_opener(sid, tokens=4000):
    prompt = np.resize(PROMPT, tokens).astype(np.int32)
    return make("session_open", session=sid, lease_s=300.0, tensors=[prompt])


def test_a_session_hog_gets_its_share_and_the_real_verifier_gets_drafts():
    """17 connections x 16 sessions of 700 tokens against a 4 MiB budget (each session ~1 MiB
    as the n-gram drafter's cost is measured, ~1.4 KB a token): the total never passes the
    budget, hogs over their share are refused or evicted, and a verifier arriving last still
    opens a session and gets drafts."""
    loop, h, role = budget_host(4)
    try:
        ep = h.server.endpoint
        hogs = [h.connection() for _ in range(17)]
        streams, codes = [], []
        for n, c in enumerate(hogs):
            for i in range(16):
                call = c.request(ep, big_opener(f"hog{n}-{i}", 700), timeout=30)
                codes.append(outcome(call))
                streams.append(call)
                assert role.session_bytes <= 4 << 20  # the worker's book, read after a reply
        assert "too_many_sessions" in codes and codes.count("ok") >= 4
        honest = h.connection()
        chunk = first_chunk(honest, ep, "real")
        assert chunk.type == "draft_chunk" and chunk.tensors[0].tolist()[:3] == [7, 8, 5]
        assert role.session_bytes <= 4 << 20
        assert role.sessions_evicted > 0  # hogs over their share made room
    finally:
        role.close()
        loop.stop()


def test_sessions_die_with_their_connection():
    """A raw DEALER (never a member) that opens sessions and vanishes without a word loses
    them within a sweep or two, long before their 300 s lease."""
    import time

    import zmq

    from codec.messages import decode, encode

    loop, h, role = budget_host(64)
    ctx = zmq.Context()
    try:
        ep = h.server.endpoint
        raw = ctx.socket(zmq.DEALER)
        raw.connect(ep)
        for i in range(4):
            msg = big_opener(f"g{i}", 100)
            msg.rid = i + 1
            raw.send_multipart(encode(msg))
        for _ in range(4):  # each session's first chunk
            assert raw.poll(30_000), "no draft chunk"
            assert decode(raw.recv_multipart(copy=False)).type == "draft_chunk"
        assert role.open_sessions == 4
        raw.close(linger=0)  # gone: no cancel, no close, no leave
        staying = h.connection()
        assert first_chunk(staying, ep, "stay").type == "draft_chunk"
        deadline = time.monotonic() + 30
        while role.open_sessions > 1:
            assert time.monotonic() < deadline, f"{role.open_sessions} sessions still open"
            time.sleep(0.05)
        assert role.stats.sessions_expired == 0  # closed for the connection, not the lease
    finally:
        role.close()
        loop.stop()
        ctx.term()
