"""Bounds on numbers from outside, unit by unit (cards, mDNS TXT, gossip parsing, table)."""

from __future__ import annotations

import pytest

from codec.messages import make
from discovery.cards import Card, CardError, OutOfRange, check_endpoint
from discovery.limits import MAX_COUNTER, MAX_JUMP, MAX_MEMBERS, parse_decimal
from discovery.mdns import parse_properties
from discovery.table import MemberTable
from discovery.wire import HostileGossip, MalformedGossip, parse_heartbeat, parse_leave

GOOD = {"node_id": "n1", "cluster": "c", "incarnation": 3, "version": 2, "roles": ["proposer"],
        "endpoints": {"gossip": "tcp://127.0.0.1:5001", "stream": "tcp://127.0.0.1:5000"}}


def test_parse_decimal_takes_ascii_digits_in_range_only():
    assert parse_decimal("65535", 65535) == 65535
    for bad in ("65536", "\u00b2", "\u0663", "-1", "+1", " 1", "", "1" * 5000, "1e3"):
        assert parse_decimal(bad, 65535) is None, bad


def test_endpoint_ports_are_checked_without_raising():
    assert check_endpoint("tcp://127.0.0.1:1")
    for bad in ("tcp://h:0", "tcp://h:65536", "tcp://h:\u00b2", "tcp://h:" + "9" * 90,
                "tcp://:80", 5):
        assert not check_endpoint(bad), bad


@pytest.mark.parametrize("changes", [
    {"incarnation": 2**64 - 1}, {"incarnation": -1}, {"incarnation": MAX_COUNTER + 1},
    {"version": 2**63}, {"vocab": 2**40}, {"free_mem": -1}, {"tok_s": float("inf")},
    {"load": float("nan")}, {"load": -0.5}, {"extras": {"x": "y" * 5000}},
])
def test_card_numbers_out_of_range_are_hostile(changes):
    with pytest.raises(OutOfRange):
        Card.from_map({**GOOD, **changes})


@pytest.mark.parametrize("endpoints", [
    {**GOOD["endpoints"], **{f"k{i}": "tcp://h:1" for i in range(8)}},
    {**GOOD["endpoints"], "other": 5},
    {**GOOD["endpoints"], "x" * 40: "tcp://h:1"},
])
def test_card_endpoints_map_is_bounded(endpoints):
    with pytest.raises(CardError, match="endpoints"):
        Card.from_map({**GOOD, "endpoints": endpoints})


def test_card_at_the_ceiling_is_valid():
    assert Card.from_map({**GOOD, "incarnation": MAX_COUNTER}).incarnation == MAX_COUNTER


def _props(**over):
    base = {"cluster": "c", "node": "n1", "proto": "1", "gossip": "tcp://127.0.0.1:5001",
            "stream": "tcp://127.0.0.1:5000"}
    return {k.encode(): v.encode() for k, v in {**base, **over}.items()}


@pytest.mark.parametrize("over", [{"proto": "\u00b2"}, {"proto": "99999999999999999999"},
                                  {"stream": "tcp://127.0.0.1:\u00b2"},
                                  {"gossip": "tcp://127.0.0.1:70000"}])
def test_mdns_txt_numbers_are_bounded(over):
    assert parse_properties(_props()).proto == 1
    with pytest.raises(CardError):
        parse_properties(_props(**over))


def hb(**fields):
    return make("heartbeat", sender=fields.pop("sender", "n1"),
                **{"cluster": "c", "incarnation": 1, "version": 1, **fields})


def test_heartbeat_parsing_bounds_every_number():
    ok = parse_heartbeat(hb(peers=[3, 2**32 - 1], suspects=["a", "b"]))
    assert ok.peers == (3, 2**32 - 1) and ok.suspects == ("a", "b")
    for fields in ({"incarnation": 2**64 - 1}, {"incarnation": -1}, {"version": -1},
                   {"version": MAX_COUNTER + 1}, {"peers": [0, 1]}, {"peers": [3, 2**32]},
                   {"peers": [MAX_MEMBERS + 1, 1]}, {"peers": [3, -1]},
                   {"suspects": ["a"] * (MAX_MEMBERS + 1)}):
        with pytest.raises(HostileGossip):
            parse_heartbeat(hb(**fields))
    for fields in ({"peers": [1]}, {"peers": [1, "x"]}, {"peers": [True, 1]},
                   {"suspects": ["bad id!"]}, {"sender": ""}):
        with pytest.raises(MalformedGossip) as info:
            parse_heartbeat(hb(**fields))
        assert not info.value.hostile
    with pytest.raises(HostileGossip):
        parse_leave(make("leave", sender="n1", cluster="c", incarnation=2**64 - 1))


def test_table_ignores_implausible_jumps_but_takes_restarts():
    t = MemberTable("me", "c")
    card = Card.from_map(GOOD)
    assert [e.kind for e in t.on_card(card, 0.0, direct=True)] == ["join"]
    far = card.incarnation + MAX_JUMP + 1
    assert t.on_heartbeat("n1", far, 1, 0.1) == ([], False)
    assert t.on_heartbeat("n1", 3, card.version + MAX_JUMP + 1, 0.1) == ([], False)
    assert t.on_leave("n1", far, 0.1) == []
    assert t.on_card(Card.from_map({**GOOD, "incarnation": far}), 0.1, direct=True) == []
    assert t.hostile == 4 and t.get("n1").card == card and t.get("n1").state.value == "alive"
    # a restart (one step), or a lost counter outgrown by a refutation (within the window)
    restarted = Card.from_map({**GOOD, "incarnation": 4, "version": 1})
    t.on_card(restarted, 0.2, direct=True)
    assert t.get("n1").card == restarted
    jump = Card.from_map({**GOOD, "incarnation": 4 + MAX_JUMP, "version": 1})
    t.on_card(jump, 0.3, direct=True)
    assert t.get("n1").card == jump and t.hostile == 4
