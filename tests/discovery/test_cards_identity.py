"""Cards, identities and incarnations, interface resolution, mDNS TXT parsing (fast units)."""

from __future__ import annotations

import pytest

from codec.messages import decode, encode, make
from discovery.cards import Card, CardError, check_cluster
from discovery.identity import acquire_identity
from discovery.interfaces import resolve_interface
from discovery.mdns import parse_properties, txt_properties

EPS = {"gossip": "tcp://127.0.0.1:5001", "stream": "tcp://127.0.0.1:5002"}


def make_card(**kw) -> Card:
    base = dict(node_id="abc123", cluster="c", incarnation=3, version=7, roles=("proposer",),
                endpoints=dict(EPS), name="p", backend="torch", model="m", tokenizer="fp",
                vocab=49152, tok_s=23.5, load=0.25, free_mem=1 << 30,
                extras={"drafter": "ngram"})
    base.update(kw)
    return Card(**base)


def test_card_round_trips_through_the_codec():
    c = make_card()
    msg = decode(encode(make("card", sender=c.node_id, **c.wire_fields())))
    assert Card.from_fields(msg.sender, msg.fields) == c
    assert Card.from_map(c.to_map()) == c


def test_card_ordering_and_evolve():
    c = make_card()
    c2 = c.evolve(load=0.9)
    assert c2.key > c.key and c2.version == c.version + 1 and c2.load == 0.9
    assert make_card(incarnation=4, version=0).key > c2.key


def test_observer_is_never_a_worker():
    assert not make_card(roles=(), observer=True).is_worker
    assert make_card().is_worker


@pytest.mark.parametrize("change, match", [
    ({"node_id": "bad id!"}, "node id"),
    ({"cluster": "no spaces"}, "cluster"),
    ({"incarnation": -1}, "incarnation"),
    ({"endpoints": {"gossip": "udp://x:1", "stream": "tcp://h:2"}}, "gossip"),
    ({"roles": ["x" * 40]}, "roles"),
    ({"vocab": "many"}, "vocab"),
    ({"name": "n" * 500}, "name"),
])
def test_bad_cards_are_rejected_with_a_specific_error(change, match):
    data = make_card().to_map()
    data.update(change)
    with pytest.raises(CardError, match=match):
        Card.from_map(data)


def test_cluster_names():
    assert check_cluster("lab-1.home_x") == "lab-1.home_x"
    for bad in ("", "a/b", "-x", "x" * 64, "é"):
        with pytest.raises(CardError):
            check_cluster(bad)


def test_named_identity_is_stable_and_incarnation_grows(tmp_path):
    a = acquire_identity("c", "p1", tmp_path)
    assert a.incarnation == 1 and a.persistent
    # a second process claiming the same name while the first runs gets a fresh id
    b = acquire_identity("c", "p1", tmp_path)
    assert b.node_id != a.node_id
    assert a.bump() == 2
    a.release()
    b.release()
    again = acquire_identity("c", "p1", tmp_path)
    assert again.node_id == a.node_id and again.incarnation == 3
    assert again.bump(at_least=10) == 11
    again.release()
    assert acquire_identity("c", "p1", tmp_path).incarnation == 12


def test_same_name_in_another_cluster_is_another_node(tmp_path):
    a = acquire_identity("c1", "n", tmp_path)
    b = acquire_identity("c2", "n", tmp_path)
    assert a.node_id != b.node_id


def test_nameless_identity_is_fresh_and_writes_nothing(tmp_path):
    a = acquire_identity("c", None, tmp_path)
    b = acquire_identity("c", None, tmp_path)
    assert a.node_id != b.node_id and a.incarnation == 1 and not a.persistent
    assert list(tmp_path.iterdir()) == []


def test_bad_names_rejected(tmp_path):
    with pytest.raises(ValueError, match="plain label"):
        acquire_identity("c", "../x", tmp_path)


def test_corrupt_counter_recovers(tmp_path):
    a = acquire_identity("c", "n", tmp_path)
    a.release()
    (tmp_path / "nodes" / a.node_id / "incarnation").write_text("garbage")
    b = acquire_identity("c", "n", tmp_path)
    assert b.node_id == a.node_id and b.incarnation == 1


def test_interface_resolution():
    assert resolve_interface("127.0.0.1").bind_host == "127.0.0.1"
    assert resolve_interface("lo").bind_host == "127.0.0.1"
    assert resolve_interface("lo").mdns == ("127.0.0.1",)
    everywhere = resolve_interface("all")  # resolution only: nothing is opened
    assert everywhere.mdns is None and everywhere.bind_host != "0.0.0.0"
    for bad, match in (("nosuchif0", "no such interface"), ("0.0.0.0", "concrete"),
                       ("::1", "IPv4"), ("203.0.113.77", "not on any interface"),
                       ("", "IPv4 address")):
        with pytest.raises(ValueError, match=match):
            resolve_interface(bad)


def test_mdns_txt_round_trip_and_rejects():
    c = make_card()
    props = {k.encode(): v.encode() for k, v in txt_properties(c).items()}
    ad = parse_properties(props)
    assert (ad.node_id, ad.cluster, ad.gossip, ad.stream) == (
        c.node_id, c.cluster, EPS["gossip"], EPS["stream"])
    for key, value in ((b"cluster", b"a b"), (b"gossip", b"nonsense"), (b"proto", b"x"),
                       (b"node", None), (b"stream", b"\xff")):
        bad = dict(props)
        bad[key] = value
        with pytest.raises(CardError):
            parse_properties(bad)
