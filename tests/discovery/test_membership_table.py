"""The membership state machine as pure logic: explicit clocks, no sockets, no threads."""

from __future__ import annotations

import pytest

from discovery.cards import Card
from discovery.table import MemberTable, State, Timeouts

T = Timeouts(heartbeat=0.2, suspect_after=0.8, dead_after=1.6, forget_after=10.0)


def card(node_id="b", inc=1, ver=1, cluster="c", **kw) -> Card:
    eps = {"gossip": "tcp://127.0.0.1:1001", "stream": "tcp://127.0.0.1:1002"}
    return Card(node_id=node_id, cluster=cluster, incarnation=inc, version=ver,
                roles=kw.pop("roles", ("proposer",)), endpoints=eps, **kw)


def kinds(events) -> list[str]:
    return [e.kind for e in events]


@pytest.fixture
def table() -> MemberTable:
    return MemberTable("a", "c", T)


def test_join_then_silence_suspect_then_dead(table):
    assert kinds(table.on_card(card(), 0.0, direct=True)) == ["join"]
    assert table.tick(0.7) == []
    ev = table.tick(0.81)
    assert kinds(ev) == ["suspect"] and ev[0].member.state is State.SUSPECT
    assert kinds(table.tick(1.61)) == ["dead"]
    assert table.get("b").state is State.DEAD
    assert table.tick(5.0) == []


def test_heartbeats_keep_alive_and_refute_suspicion(table):
    table.on_card(card(), 0.0, direct=True)
    for i in range(1, 20):
        events, need = table.on_heartbeat("b", 1, 1, i * 0.2)
        assert events == [] and not need
        assert table.tick(i * 0.2 + 0.1) == []
    table.tick(6.0)  # long silence: suspect, then dead in the same tick
    assert table.get("b").state is State.DEAD


def test_suspect_back_to_alive_on_heartbeat(table):
    table.on_card(card(), 0.0, direct=True)
    assert kinds(table.tick(1.0)) == ["suspect"]
    events, _ = table.on_heartbeat("b", 1, 1, 1.1)
    assert kinds(events) == ["alive"]
    assert table.get("b").state is State.ALIVE


def test_dead_and_tick_in_one_step_gives_both_events(table):
    table.on_card(card(), 0.0, direct=True)
    assert kinds(table.tick(2.0)) == ["suspect", "dead"]


def test_higher_incarnation_card_refutes_second_hand(table):
    table.on_card(card(), 0.0, direct=True)
    table.tick(1.0)
    ev = table.on_card(card(inc=2, ver=2), 1.1, direct=False)
    assert "alive" in kinds(ev)
    assert table.get("b").incarnation == 2


def test_second_hand_card_does_not_revive_the_dead(table):
    table.on_card(card(), 0.0, direct=True)
    table.tick(2.0)
    assert table.on_card(card(ver=5), 2.1, direct=False) == []
    assert table.get("b").state is State.DEAD


def test_heartbeat_of_same_incarnation_revives_dead_as_join(table):
    """A partition heals: the same process is heard again."""
    table.on_card(card(), 0.0, direct=True)
    table.tick(2.0)
    events, _ = table.on_heartbeat("b", 1, 1, 3.0)
    assert kinds(events) == ["join"]
    assert table.get("b").state is State.ALIVE


def test_restart_with_higher_incarnation_rejoins(table):
    table.on_card(card(), 0.0, direct=True)
    table.tick(2.0)
    events, need = table.on_heartbeat("b", 2, 1, 3.0)
    assert events == [] and need  # heartbeat alone: we need the new card
    ev = table.on_card(card(inc=2), 3.0, direct=True)
    assert kinds(ev) == ["join"] and ev[0].member.incarnation == 2


def test_leave_then_only_higher_incarnation_rejoins(table):
    table.on_card(card(), 0.0, direct=True)
    assert kinds(table.on_leave("b", 1, 0.5)) == ["leave"]
    assert table.get("b").state is State.LEFT
    assert table.on_leave("b", 1, 0.6) == []
    assert table.on_card(card(ver=9), 0.7, direct=True) == []
    assert table.on_heartbeat("b", 1, 9, 0.8) == ([], False)
    assert table.tick(5.0) == []  # left members are not suspected
    assert kinds(table.on_card(card(inc=2), 1.0, direct=True)) == ["join"]


def test_stale_leave_is_ignored(table):
    table.on_card(card(inc=3), 0.0, direct=True)
    assert table.on_leave("b", 2, 0.1) == []
    assert table.get("b").state is State.ALIVE


def test_forged_lower_incarnation_card_changes_nothing(table):
    table.on_card(card(inc=3, ver=4, model="real"), 0.0, direct=True)
    assert table.on_card(card(inc=2, ver=99, model="forged"), 0.1, direct=True) == []
    assert table.get("b").card.model == "real"
    events, need = table.on_heartbeat("b", 2, 99, 0.2)
    assert events == [] and not need
    assert table.stale >= 2


def test_newer_version_updates_and_same_content_does_not(table):
    table.on_card(card(ver=1, load=0.1), 0.0, direct=True)
    assert kinds(table.on_card(card(ver=2, load=0.5), 0.1, direct=True)) == ["update"]
    assert table.get("b").card.load == 0.5
    assert table.on_card(card(ver=3, load=0.5), 0.2, direct=True) == []  # re-publish
    assert table.on_card(card(ver=2, load=0.9), 0.3, direct=True) == []  # older
    assert table.get("b").card.load == 0.5


def test_heartbeat_ahead_of_card_asks_for_card(table):
    table.on_card(card(ver=1), 0.0, direct=True)
    assert table.on_heartbeat("b", 1, 2, 0.1) == ([], True)
    assert table.on_heartbeat("zz", 1, 1, 0.1) == ([], True)  # unknown node


def test_own_id_and_other_cluster_are_ignored(table):
    assert table.on_card(card(node_id="a"), 0.0, direct=True) == []
    assert table.on_card(card(cluster="other"), 0.0, direct=True) == []
    assert table.members() == []


def test_forget_after(table):
    table.on_card(card(), 0.0, direct=True)
    table.tick(2.0)
    table.tick(11.0)
    assert table.tick(12.1) == [] and "b" not in table


def test_suspects_listed(table):
    table.on_card(card("b"), 0.0, direct=True)
    table.on_card(card("c"), 0.5, direct=True)
    table.tick(0.9)
    assert table.suspects() == ["b"]


def test_timeouts_validated():
    with pytest.raises(ValueError, match="suspect_after"):
        Timeouts(heartbeat=1.0, suspect_after=0.5, dead_after=2.0)


# -- issue 21: a bounded table ------------------------------------------------------------------
def test_the_table_is_bounded_and_refusals_are_counted():
    t = MemberTable("a", "c", Timeouts(), max_members=3)
    for n in "bcd":
        assert kinds(t.on_card(card(n), 0.0, direct=True)) == ["join"]
    assert t.on_card(card("e"), 0.0, direct=True) == []  # full of live members
    assert t.refused == 1 and t.get("e") is None
    t.on_leave("c", 1, 1.0)  # a departed member makes room for the next join
    assert kinds(t.on_card(card("e"), 2.0, direct=True)) == ["join"]
    assert t.get("c") is None and {m.node_id for m in t.members()} == {"b", "d", "e"}


def test_a_card_with_control_characters_is_refused():
    from discovery.cards import CardError

    base = card("b").to_map()
    for field, value in (("name", "evil\x1b[2J"), ("name", "two\nlines"),
                         ("model", "m\u202egnp.exe"), ("backend", "\x07")):
        with pytest.raises(CardError, match="control characters"):
            Card.from_map({**base, field: value})
    assert Card.from_map({**base, "name": "Mac mini 🙂 (büro)"}).name == "Mac mini 🙂 (büro)"
