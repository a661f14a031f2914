"""CURVE on every socket, over real loopback sockets: members talk; strangers with no key, a
wrong key, or only the server's public key never get a reply, and each attempt is counted;
gossip is MACed: a tampered, unsigned or replayed message is dropped and counted."""

from __future__ import annotations

import dataclasses
import queue
import time

import pytest
import zmq

from bus.gossip import GossipChannel, auth_frame
from bus.sockets import SocketFactory, bind
from bus.streams import RequestTimeout, StreamClient, StreamServer, serve_ping
from codec.messages import encode, make


def eventually(pred, timeout=20.0):
    """Generous bound for 'it happens'; never a speed verdict."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture
def factories(loop, keys):
    made = []

    def make_factory(security=keys):
        f = SocketFactory(security=security)
        made.append(f)
        return f

    yield make_factory
    loop.stop()  # sockets first, then their contexts
    for f in made:
        f.close()


def ping(loop, factory, endpoint, timeout=1.0):
    client = StreamClient(loop, factory)
    return client.request(endpoint, make("ping"), timeout=timeout).result(timeout + 1)


def test_members_are_served_and_strangers_are_refused_and_counted(loop, factories, keys,
                                                                   wrong_keys):
    server_factory = factories()
    server = StreamServer(loop, server_factory, serve_ping)
    assert ping(loop, factories(), server.endpoint).type == "pong"
    assert server_factory.handshakes.failed == 0

    plain = SocketFactory()  # no CURVE at all
    for stranger in (plain, factories(wrong_keys)):
        with pytest.raises(RequestTimeout):
            ping(loop, stranger, server.endpoint)
    assert eventually(lambda: server_factory.handshakes.failed >= 2)

    # knows the server's public key but has its own client key: the ZAP gate says no
    pub, sec = zmq.curve_keypair()
    insider_less = dataclasses.replace(keys, client_public=pub, client_secret=sec)
    with pytest.raises(RequestTimeout):
        ping(loop, factories(insider_less), server.endpoint)
    assert eventually(lambda: server_factory.gate.denied >= 1)
    assert server_factory.gate.admitted >= 1
    # and the members are still served
    assert ping(loop, factories(), server.endpoint).type == "pong"


def test_a_stranger_subscriber_hears_nothing(loop, factories, wrong_keys):
    got: queue.SimpleQueue = queue.SimpleQueue()
    pub = GossipChannel(loop, factories(), lambda t, m: None)
    member = GossipChannel(loop, factories(), lambda t, m: got.put(m))
    stranger_got: queue.SimpleQueue = queue.SimpleQueue()
    stranger = GossipChannel(loop, factories(wrong_keys), lambda t, m: stranger_got.put(m))
    for ch in (member, stranger):
        ch.subscribe("c/")
        ch.connect(pub.endpoint)
    n = 0
    while got.empty() and n < 2000:  # slow joiner: bounded
        n += 1
        pub.publish("c/hb", make("heartbeat", cluster="c", incarnation=1, version=n,
                                 sender="a"))
        time.sleep(0.01)
    assert not got.empty()
    assert stranger_got.empty() and stranger.received == 0


class RawPublisher:
    """A secured PUB the test owns: publishes exactly the frames it is given."""

    def __init__(self, factory: SocketFactory) -> None:
        self.sock = factory.pub()
        self.endpoint = bind(self.sock, "tcp://127.0.0.1:0")

    def send(self, frames) -> None:
        self.sock.send_multipart([bytes(f) if not isinstance(f, bytes) else f for f in frames])

    def close(self) -> None:
        self.sock.close(linger=0)


def test_gossip_mac_rejects_tampered_unsigned_and_replayed_messages(loop, factories, keys):
    got: queue.SimpleQueue = queue.SimpleQueue()
    receiver = GossipChannel(loop, factories(), lambda t, m: got.put(m))
    receiver.subscribe("c/")
    raw = RawPublisher(factories())
    receiver.connect(raw.endpoint)
    try:
        key, epoch = keys.gossip_key, time.time_ns()

        def signed(seq, version, sender="a"):
            body = [b"c/hb", *encode(make("heartbeat", cluster="c", incarnation=1,
                                          version=version, sender=sender))]
            return [body[0], auth_frame(key, epoch, seq, body), *body[1:]]

        seq = 0
        while got.empty() and seq < 2000:  # slow joiner: bounded
            seq += 1
            raw.send(signed(seq, seq))
            time.sleep(0.01)
        assert not got.empty()
        real = signed(seq + 1, 9999)
        raw.send(real)
        assert eventually(lambda: any(m["version"] == 9999 for m in _drain(got)))

        replayed_before, forged_before = receiver.replayed, receiver.forged
        raw.send(real)  # the same message again: a replay
        raw.send(signed(1, 1))  # an old sequence number of the same sender and epoch
        assert eventually(lambda: receiver.replayed == replayed_before + 2)

        tampered = list(real)
        tampered[2] = real[2].replace(b"\xcd\x27\x0f", b"\xcd\x27\x10")  # version 9999 -> 10000
        assert tampered[2] != real[2]
        raw.send(tampered)
        raw.send([real[0], *real[2:]])  # no authenticator frame at all
        wrong = [real[0], auth_frame(b"\x00" * 32, epoch, seq + 2, [real[0], *real[2:]]),
                 *real[2:]]
        raw.send(wrong)  # signed with another key
        assert eventually(lambda: receiver.forged == forged_before + 3)
        assert all(m["version"] != 10000 for m in _drain(got))
        # a fresh, correctly signed message still gets through
        raw.send(signed(seq + 5, 4242))
        assert eventually(lambda: any(m["version"] == 4242 for m in _drain(got)))
    finally:
        raw.close()


def _drain(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
