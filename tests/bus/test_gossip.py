import queue
import time

import pytest

from bus.gossip import GossipChannel
from codec.messages import make


def wait_for(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


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
    deadline = time.monotonic() + 3
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
    assert got.get(timeout=2)[1]["version"] == 3
    assert got.empty()


def test_one_subscriber_many_publishers(loop, factory):
    got: queue.SimpleQueue = queue.SimpleQueue()
    sub = GossipChannel(loop, factory, lambda t, m: got.put(m.sender))
    sub.subscribe("")
    pubs = [GossipChannel(loop, factory, lambda t, m: None) for _ in range(3)]
    for p in pubs:
        sub.connect(p.endpoint)
    seen = set()
    deadline = time.monotonic() + 3
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
    time.sleep(0.3)
    loop.run_sync(lambda: [raw.send_multipart([b"t", b"\xc1junk"]) for _ in range(3)])
    assert wait_for(lambda: b.dropped == 3)
    assert got.empty()
    loop.run_sync(lambda: raw.close(0))
