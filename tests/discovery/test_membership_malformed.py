"""Hostile gossip changes nothing and crashes nothing.

A raw PUB socket (the node's SUB is connected to it) sends garbage, other clusters' cards,
stale incarnations and forged cards for a real member; afterwards the table is unchanged and
the node still hears its real peer.
"""

from __future__ import annotations

import time

import msgpack
import pytest

from codec.messages import encode, make
from discovery.cards import Card
from tests.discovery.conftest import TOPIC, gossip_frames


def send(sock, *frames) -> None:
    sock.send_multipart([f if isinstance(f, bytes) else bytes(f) for f in frames])


def test_malformed_gossip_changes_nothing(make_node, seed_of, view, wait_until, raw_pub):
    sock, endpoint = raw_pub
    a = make_node(name="a")
    b = make_node(name="b", peers=(seed_of(a),))
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")
    b.membership.update_card(model="real-model")
    assert wait_until(lambda: a.membership.get(b.node_id).card.model == "real-model")
    before = a.membership.get(b.node_id)
    a.gossip.connect(endpoint)
    # slow joiner: publish an ignored message until the node's SUB receives from us
    probe = gossip_frames("stats", "probe", cluster="specbus", incarnation=1, stats={})
    received = a.gossip.received

    def connected() -> bool:
        send(sock, *probe)
        return a.gossip.received > received

    assert wait_until(connected, timeout=10, step=0.05)

    real = b.membership.card
    forged = Card.from_map({**real.to_map(), "incarnation": real.incarnation - 1,
                            "version": real.version + 100, "model": "forged"})
    ghost = Card.from_map({**real.to_map(), "node_id": "ghost1", "cluster": "other"})
    garbage = [
        [b"garbage"],
        [TOPIC],
        [TOPIC, b"\xff\xfe not msgpack"],
        [TOPIC, msgpack.packb([1, 2, 3])],
        [TOPIC, msgpack.packb({"v": 99, "t": "card"})],
        [TOPIC, msgpack.packb({"v": 2, "t": "no_such_type"})],
        [TOPIC, msgpack.packb({"v": 2, "t": "card", "from": "x"})],  # missing fields
        [TOPIC, msgpack.packb({"v": 2, "t": "heartbeat", "from": b.node_id, "cluster": "specbus",
                               "incarnation": "one", "version": 1})],
        [TOPIC, *encode(make("ping"))], [TOPIC, b"x", b"extra frame"],
        # well-formed messages that must be ignored
        gossip_frames("card", forged.node_id, **forged.wire_fields()),  # stale incarnation
        gossip_frames("card", "ghost1", **ghost.wire_fields()),  # other cluster
        [b"specbus/other/", *encode(make("card", sender="ghost2",
                                          **{**ghost.wire_fields(), "cluster": "other"}))],
        gossip_frames("card", "ghost3", **{**real.wire_fields(),
                                           "endpoints": {"gossip": "nope", "stream": "nope"}}),
        gossip_frames("card", "bad id!", **real.wire_fields()),
        gossip_frames("heartbeat", b.node_id, cluster="specbus", incarnation=0, version=999),
        gossip_frames("leave", b.node_id, cluster="specbus", incarnation=real.incarnation - 1),
        gossip_frames("leave", b.node_id, cluster="other", incarnation=real.incarnation + 5),
        gossip_frames("heartbeat", "stranger", cluster="specbus", incarnation=1, version=1),
        gossip_frames("stats", b.node_id, cluster="specbus", incarnation=1, stats={"x": 1}),
    ]
    dropped = a.gossip.dropped
    for _ in range(3):
        for frames in garbage:
            send(sock, *frames)
    # 8 kinds fail to decode (3 rounds); the rest decode and must be ignored by membership
    assert wait_until(lambda: a.gossip.dropped - dropped >= 24, timeout=10)
    time.sleep(0.2)

    after = a.membership.get(b.node_id)
    assert after.card == before.card and after.state.value == "alive"
    assert set(view(a)) == {b.node_id}
    assert a.loop.running and a.loop.errors == 0
    # and the node still works: b's next card change arrives
    b.membership.update_card(load=0.75)
    assert wait_until(lambda: a.membership.get(b.node_id).card.load == 0.75)
    assert view(a)[b.node_id] == "alive"


def test_forged_snapshot_request_cannot_introduce_someone_else(make_node, seed_of, view):
    a = make_node()
    b = make_node()
    card = {**b.membership.card.to_map(), "node_id": "someoneelse"}
    call = b.client.request(seed_of(a), make("snapshot_req", cluster="specbus", card=card),
                            timeout=2.0)
    with pytest.raises(Exception, match="bad_card"):
        call.result(2.0)
    bad = {**b.membership.card.to_map(), "endpoints": "x"}
    call = b.client.request(seed_of(a), make("snapshot_req", cluster="specbus", card=bad),
                            timeout=2.0)
    with pytest.raises(Exception, match="bad_card"):
        call.result(2.0)
    assert view(a) == {}
    assert a.loop.running


def test_bad_cli_input_is_a_clear_error():
    import argparse

    from nodes.cluster_args import peer_arg
    from nodes.cmd_node import parse_roles

    assert parse_roles("verifier,proposer") == ("verifier", "proposer")
    assert parse_roles("observer") == ("observer",)
    for bad in ("drafter", "", "observer,verifier"):
        with pytest.raises(argparse.ArgumentTypeError, match="role"):
            parse_roles(bad)
    assert peer_arg("127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    for bad in ("127.0.0.1", "host:port", ":80", "h:70000"):
        with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT"):
            peer_arg(bad)

