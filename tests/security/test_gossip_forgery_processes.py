"""Real node processes on loopback, with a cluster secret: forged `leave`/`card` messages for a
member, replays of its captured heartbeat, and a replay of its captured real `leave` after it
came back, are all dropped and counted by the node they are sent to; the member stays alive.

To deliver anything at all to a node's SUB, the sender must complete a CURVE handshake, which
only key holders can (tests/security/test_bus_secured.py): so the test plays a member that
relays traffic. Forgeries carry a MAC made with a wrong key; replays are byte-exact copies of
what the victim published.
"""

from __future__ import annotations

import os
import queue
import time

import pytest
import zmq

from bus.gossip import GossipChannel, auth_frame
from bus.loop import IOLoop
from bus.sockets import SocketFactory, bind
from bus.streams import StreamClient, StreamServer
from codec.messages import decode_header, encode, make
from discovery.cards import Card, new_node_id
from discovery.membership import topic_for
from nodes.telemetry import stats_topic
from tools.local_cluster import LocalCluster

pytestmark = pytest.mark.slow  # several node processes


def eventually(pred, timeout=20.0, every=None):
    """Generous bound for 'it happens' (never a speed verdict); `every` runs between polls."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if every is not None:
            every()
        time.sleep(0.05)
    return pred()


class Relay:
    """A key holder that publishes whatever frames the test gives it, and taps a member's PUB."""

    def __init__(self, keys, cluster: str, victim_gossip: str) -> None:
        self.loop = IOLoop(name="relay-io").start()
        self.factory = SocketFactory(security=keys)
        self.pub = self.factory.pub()  # test thread owns the raw sockets
        self.pub_endpoint = bind(self.pub, "tcp://127.0.0.1:0")
        self.tap = self.factory.sub()
        self.tap.setsockopt_string(zmq.SUBSCRIBE, topic_for(cluster))
        self.tap.connect(victim_gossip)
        self.stats: dict[str, dict] = {}
        self._stats_q: queue.SimpleQueue = queue.SimpleQueue()
        self.listener = GossipChannel(self.loop, self.factory, self._on_stats)
        self.listener.subscribe(stats_topic(cluster))
        self.server = StreamServer(self.loop, self.factory,
                                   lambda req: req.fail("unsupported", "relay"))
        self.node_id = new_node_id()
        self.client = StreamClient(self.loop, self.factory, sender=self.node_id)

    def _on_stats(self, topic, msg) -> None:
        self.stats[msg.sender] = dict(msg["stats"])

    def introduce_to(self, cluster: str, stream: str, gossip: str) -> None:
        """Become a member of `stream`'s view, so that it subscribes to our PUB."""
        self.listener.connect(gossip)
        card = Card(node_id=self.node_id, cluster=cluster, incarnation=1, version=1, roles=(),
                    endpoints={"gossip": self.pub_endpoint, "stream": self.server.endpoint},
                    observer=True)
        req = make("snapshot_req", cluster=cluster, card=card.to_map())
        assert self.client.request(stream, req, timeout=10).result(12).type == "snapshot"

    def security(self, node_id: str) -> dict:
        return self.stats.get(node_id, {}).get("security", {})

    def capture(self, msg_type: str, timeout: float = 20.0) -> list[bytes]:
        """The next message of `msg_type` the tapped member publishes, byte for byte."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.tap.poll(100):
                frames = self.tap.recv_multipart()
                if decode_header(frames[2])["t"] == msg_type:
                    return frames
        raise AssertionError(f"no {msg_type} captured")

    def send(self, frames) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self.tap.close(linger=0)
        self.pub.close(linger=0)
        self.loop.stop()
        self.factory.close()


def forged(cluster: str, msg) -> list[bytes]:
    body = [topic_for(cluster).encode(), *encode(msg)]
    return [body[0], auth_frame(os.urandom(32), time.time_ns(), 1, body), *body[1:]]


def test_forged_and_replayed_gossip_is_dropped_and_counted(tmp_path, secret_file, keys):
    env = {"SPECBUS_SECRET_FILE": str(secret_file)}
    with LocalCluster(log_dir=tmp_path / "logs", mdns=False, env=env) as c:
        a = c.start_node("a", "--role", "proposer", "--drafter", "ngram")
        b = c.start_node("b", "--role", "proposer", "--drafter", "ngram")
        assert eventually(lambda: a.view().get(b.node_id) == "alive")
        relay = Relay(keys, c.cluster, b.endpoints["gossip"])
        try:
            relay.introduce_to(c.cluster, a.stream, a.endpoints["gossip"])
            assert eventually(lambda: "forged" in relay.security(a.node_id))

            # forged leave and card for b, MACed with a wrong key
            leave = make("leave", sender=b.node_id, seq=10**6, cluster=c.cluster,
                         incarnation=10**4)
            card = make("card", sender=b.node_id, seq=10**6, cluster=c.cluster,
                        incarnation=10**4, version=1, roles=[], endpoints=b.endpoints)
            assert eventually(lambda: relay.security(a.node_id)["forged"] >= 2,
                              every=lambda: (relay.send(forged(c.cluster, leave)),
                                             relay.send(forged(c.cluster, card))))

            # a captured heartbeat of b, replayed byte for byte
            beat = relay.capture("heartbeat")
            assert eventually(lambda: relay.security(a.node_id)["replayed"] >= 1,
                              every=lambda: relay.send(beat))
            assert a.view()[b.node_id] == "alive"
            assert not any(e["event"] == "leave" and e["node_id"] == b.node_id
                           for e in a.events)

            # b's real leave, captured; b comes back (same id, a later run); the leave replayed
            b.signal(15)
            real_leave = relay.capture("leave")
            assert b.proc.wait(20) == 0
            assert eventually(lambda: any(e["event"] == "leave" and e["node_id"] == b.node_id
                                          for e in a.events))
            b2 = c.start_node("b", "--role", "proposer", "--drafter", "ngram")
            assert b2.node_id == b.node_id
            assert eventually(lambda: a.view()[b.node_id] == "alive")
            before = relay.security(a.node_id)["replayed"]
            assert eventually(lambda: relay.security(a.node_id)["replayed"] > before,
                              every=lambda: relay.send(real_leave))
            assert a.view()[b.node_id] == "alive"
        finally:
            relay.close()
