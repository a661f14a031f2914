import queue
import time

import pytest

from bus.gossip import GossipChannel
from codec.messages import encode, make
from tests.polling import wait_until

BOUND = 10.0  # generous "it happens" bound on a loaded machine; never a performance verdict


def wait_for(pred, timeout=BOUND):
    return wait_until(pred, timeout, step=0.01)


def hb(n):
    return make("heartbeat", cluster="c", incarnation=1, version=n, sender="a")


@pytest.fixture
def pair(loop, factory):
    got: queue.SimpleQueue = queue.SimpleQueue()
    a = GossipChannel(loop, factory, lambda t, m: None)
    b = GossipChannel(loop, factory, lambda t, m: got.put((t, m)))
    return a, b, got


def publish_until_received(a, b, got, topic, msg):
    """PUB/SUB drops until the subscription has propagated (slow joiner): retry briefly."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        a.publish(topic, msg)
        try:
            return got.get(timeout=0.05)
        except queue.Empty:
            continue
    raise AssertionError("nothing received")


def test_publish_reaches_a_subscriber_with_topic(pair):
    a, b, got = pair
    b.subscribe("c/")
    b.connect(a.endpoint)
    topic, msg = publish_until_received(a, b, got, "c/hb", hb(1))
    assert topic == "c/hb" and msg.type == "heartbeat" and msg["version"] == 1
    assert msg.sender == "a"


def test_topic_prefix_filters(pair):
    a, b, got = pair
    b.subscribe("mine/")
    b.connect(a.endpoint)
    publish_until_received(a, b, got, "mine/hb", hb(1))
    for _ in range(5):
        a.publish("other/hb", hb(2))
    a.publish("mine/hb", hb(3))
    versions = []
    while 3 not in versions:  # late retries of the first publish may come before it
        topic, msg = got.get(timeout=BOUND)
        assert topic.startswith("mine/")
        versions.append(msg["version"])
    assert set(versions) <= {1, 3}
    assert got.empty()


def test_one_subscriber_many_publishers(loop, factory):
    got: queue.SimpleQueue = queue.SimpleQueue()
    sub = GossipChannel(loop, factory, lambda t, m: got.put(m.sender))
    sub.subscribe("")
    pubs = [GossipChannel(loop, factory, lambda t, m: None) for _ in range(3)]
    for p in pubs:
        sub.connect(p.endpoint)
    seen = set()
    deadline = time.monotonic() + BOUND
    while seen != {"p0", "p1", "p2"} and time.monotonic() < deadline:
        for i, p in enumerate(pubs):
            p.publish("t", make("leave", cluster="c", incarnation=1, sender=f"p{i}"))
        time.sleep(0.02)
        while not got.empty():
            seen.add(got.get())
    assert seen == {"p0", "p1", "p2"}
    assert sub.peers == {p.endpoint for p in pubs}


def test_malformed_gossip_is_dropped_and_counted(loop, factory):
    got: queue.SimpleQueue = queue.SimpleQueue()
    b = GossipChannel(loop, factory, lambda t, m: got.put(m))
    b.subscribe("")
    raw = loop.run_sync(factory.pub)
    ep = loop.run_sync(lambda: (raw.bind("tcp://127.0.0.1:*"), raw.LAST_ENDPOINT.decode())[1])
    b.connect(ep)
    probe = [b"t", *encode(hb(0))]
    sentinel = [b"t", *encode(hb(99))]
    # PUB drops until the subscription has arrived: probe with valid messages until one does
    deadline = time.monotonic() + BOUND
    received = False
    while not received and time.monotonic() < deadline:
        loop.run_sync(lambda: raw.send_multipart(probe))
        try:
            received = got.get(timeout=0.05) is not None
        except queue.Empty:
            continue
    assert received, "subscription never arrived"
    # from now on nothing is dropped by PUB: 3 junk then a valid sentinel, in order
    loop.run_sync(lambda: [raw.send_multipart(f) for f in [[b"t", b"\xc1junk"]] * 3 + [sentinel]])
    versions = []
    while 99 not in versions:
        versions.append(got.get(timeout=BOUND)["version"])
    assert set(versions) <= {0, 99}  # late probes and the sentinel; junk never delivered
    assert b.dropped == 3
    loop.run_sync(lambda: raw.close(0))
