"""Membership between in-process nodes over real loopback ZeroMQ (seeds + gossip, no mDNS)."""

from __future__ import annotations

import threading

from bus.streams import RemoteError
from codec.messages import make


def test_seed_join_is_mutual_and_events_flow(make_node, seed_of, view, wait_until):
    a = make_node(name="a")
    seen = []
    a.membership.subscribe(lambda ev: seen.append((ev.kind, ev.node_id,
                                                   threading.current_thread().name)))
    b = make_node(name="b", peers=(seed_of(a),))
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")
    assert wait_until(lambda: view(b).get(a.node_id) == "alive")
    assert wait_until(lambda: ("join", b.node_id, "specbus-events") in seen)
    me = a.membership.members()[0]
    assert me.is_self and me.node_id == a.node_id


def test_one_seed_is_enough_to_reach_everyone(make_node, seed_of, view, wait_until):
    """C only knows B, B only knows A: snapshots and introductions connect all three."""
    a = make_node()
    b = make_node(peers=(seed_of(a),))
    c = make_node(peers=(seed_of(b),))
    ids = {a.node_id, b.node_id, c.node_id}
    for n in (a, b, c):
        assert wait_until(lambda n=n: set(view(n)) | {n.node_id} == ids
                          and all(s == "alive" for s in view(n).values())), view(n)


def test_card_updates_spread(make_node, seed_of, view, wait_until):
    a = make_node()
    b = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: a.node_id in view(b))
    a.membership.update_card(tok_s=42.0, load=0.5, extras={"k": 1})
    assert wait_until(lambda: b.membership.get(a.node_id).card.tok_s == 42.0)
    got = b.membership.get(a.node_id).card
    assert got.version == 2 and got.extras == {"k": 1}
    import pytest

    from discovery.cards import CardError

    with pytest.raises(CardError, match="cannot be updated"):
        a.membership.update_card(incarnation=99)
    with pytest.raises(CardError, match="vocab"):
        a.membership.update_card(vocab="lots")


def test_leave_and_silent_death(make_node, seed_of, view, wait_until):
    a = make_node()
    b = make_node(peers=(seed_of(a),))
    c = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: len(view(a)) == 2 and all(s == "alive" for s in view(a).values()))
    b.stop(leave=True)
    assert wait_until(lambda: view(a).get(b.node_id) == "left")
    c.stop(leave=False)  # silence: suspect, then dead
    assert wait_until(lambda: view(a).get(c.node_id) == "dead")


def test_observer_is_listed_but_never_a_worker(make_node, seed_of, view, wait_until):
    a = make_node()
    o = make_node(roles=(), observer=True, peers=(seed_of(a),))
    assert wait_until(lambda: view(a).get(o.node_id) == "alive")
    assert [m.node_id for m in a.membership.workers()] == []
    assert wait_until(lambda: [m.node_id for m in o.membership.workers()] == [a.node_id])


def test_other_cluster_seed_is_refused_and_never_listed(make_node, seed_of, view, wait_until):
    a = make_node(cluster="red")
    b = make_node(cluster="blue", peers=(seed_of(a),))
    call = b.client.request(seed_of(a), make("snapshot_req", cluster="blue"), timeout=10.0)
    try:
        call.result(2.0)
        raise AssertionError("expected a wrong_cluster error")
    except RemoteError as exc:
        assert exc.code == "wrong_cluster"
    assert view(a) == {} and view(b) == {}


def test_refutation_bumps_incarnation(make_node, tmp_path, seed_of, view, wait_until):
    a = make_node(name="a")
    b = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: a.node_id in view(b))
    inc = a.membership.card.incarnation
    # b claims to suspect a: a must answer with a higher incarnation
    b.membership._announcer.publish("heartbeat", cluster="specbus", incarnation=1,
                                    version=1, suspects=[a.node_id])
    assert wait_until(lambda: a.membership.card.incarnation > inc)
    assert wait_until(lambda: b.membership.get(a.node_id).incarnation > inc)
    assert a.membership.counters["refutations"] >= 1
    # and the bump is persisted for the next start
    counter = tmp_path / "nodes" / a.node_id / "incarnation"
    assert int(counter.read_text()) == a.membership.card.incarnation


def test_unknown_request_type_gets_a_clear_error(make_node, seed_of, view, wait_until):
    a = make_node()
    b = make_node()
    call = b.client.request(seed_of(a), make("session_close"), timeout=10.0)
    try:
        call.result(2.0)
        raise AssertionError("expected an error")
    except RemoteError as exc:
        assert exc.code == "unsupported"


def test_mdns_on_loopback_alone_finds_peers(make_node, view, wait_until):
    """No seeds: multicast mDNS between sockets bound to 127.0.0.1 does the discovery."""
    import uuid

    cluster = f"t-{uuid.uuid4().hex[:8]}"
    a = make_node(cluster=cluster, mdns=True)
    b = make_node(cluster=cluster, mdns=True)
    other = make_node(cluster=cluster + "-x", mdns=True)
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")
    assert wait_until(lambda: view(b).get(a.node_id) == "alive")
    assert a.mdns.self_seen.wait(5)  # the self-check: our own multicast comes back
    # a saw the other cluster's announcement, and ignored it
    assert wait_until(lambda: a.membership.counters["foreign"] >= 1)
    assert other.node_id not in view(a) and view(other) == {}


def test_roles_fill_the_first_card(make_node, seed_of, wait_until):
    import pytest

    a = make_node()
    b = make_node(peers=(seed_of(a),), drafter="ngram", backend="none",
                  card_fields={"tokenizer": "fp1", "vocab": 49152, "tok_s": 23.0,
                               "extras": {"draft_tok_s": 900.0}})
    assert wait_until(lambda: a.membership.get(b.node_id) is not None)
    c = a.membership.get(b.node_id).card
    assert (c.tokenizer, c.vocab, c.tok_s, c.backend) == ("fp1", 49152, 23.0, "none")
    assert c.extras == {"drafter": "ngram", "draft_tok_s": 900.0}
    with pytest.raises(ValueError, match="cannot be set"):
        make_node(card_fields={"incarnation": 99})


def test_members_command_prints_table_and_json(make_node, seed_of, capsys):
    import argparse
    import json

    from tools import members

    a = make_node(name="alpha", backend="torch", model="smollm2")
    parser = argparse.ArgumentParser()
    members.add_arguments(parser)
    peer = seed_of(a).removeprefix("tcp://")
    args = parser.parse_args(["--peer", peer, "--no-mdns", "--wait", "0.5"])
    assert members.run(args) == 0
    out = capsys.readouterr().out
    assert "NODE_ID" in out and a.node_id in out and "alpha" in out and "smollm2" in out
    args = parser.parse_args(["--peer", peer, "--no-mdns", "--wait", "0.5", "--json"])
    assert members.run(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["node_id"] for r in rows] == [a.node_id]
    assert rows[0]["roles"] == ["proposer"] and rows[0]["state"] == "alive"
    args = parser.parse_args(["--cluster", "empty-x", "--no-mdns", "--wait", "0.2"])
    assert members.run(args) == 0
    assert "no members" in capsys.readouterr().out


def test_view_digest_spreads_a_member_learned_late(make_node, seed_of, view, wait_until):
    """C's first snapshot from B lacks A; B's heartbeat digest makes C ask again and find A."""
    a = make_node()
    b = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: a.node_id in view(b))
    real = b.membership._snapshots.maps
    calls = []

    def first_one_only_b():
        calls.append(1)
        if len(calls) == 1:
            return real()[:1]  # only b's own card
        return real()

    b.membership._snapshots.maps = first_one_only_b
    c = make_node(peers=(seed_of(b),))
    assert wait_until(lambda: set(view(c)) == {a.node_id, b.node_id}), view(c)
    assert wait_until(lambda: c.node_id in view(a))
    assert len(calls) >= 2


def test_discovered_endpoint_is_retried_until_it_answers(make_node, view, wait_until):
    """An endpoint found before its node listens (e.g. a stale or early mDNS record)."""
    import socket

    def free_pair() -> int:
        """A port P with P and P + 1 free (request and gossip)."""
        for _ in range(50):
            with socket.socket() as s1, socket.socket() as s2:
                s1.bind(("127.0.0.1", 0))
                p = s1.getsockname()[1]
                try:
                    s2.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
        raise AssertionError("no free port pair")

    port = free_pair()
    a = make_node()
    a.membership.discovered(f"tcp://127.0.0.1:{port}")
    import time

    time.sleep(2.5)  # the first introduction times out (2 s)
    b = make_node(port=port)
    assert b.server.endpoint == f"tcp://127.0.0.1:{port}"
    assert b.gossip.endpoint == f"tcp://127.0.0.1:{port + 1}"
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")


def test_a_suspected_seed_too_slow_for_a_snapshot_keeps_its_calls(make_node, seed_of, view,
                                                                  wait_until):
    """A member stalled long enough to be suspected (not dead) is re-introduced as a seed; the
    snapshot request times out. That must not forget its endpoint: a call in flight to it (a
    generation, here a ping) is answered once it resumes."""
    import time

    from bus.streams import BusError
    from codec.messages import make
    from discovery.table import Timeouts

    slow = Timeouts(heartbeat=0.05, suspect_after=0.5, dead_after=60.0, forget_after=120.0,
                    check_every=0.02)
    b = make_node(timeouts=slow)
    a = make_node(timeouts=slow, peers=(seed_of(b),))
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")
    suspected = []  # an event record, not a poll of the view: no window to miss
    a.membership.subscribe(lambda e: e.kind == "suspect" and e.node_id == b.node_id
                           and suspected.append(e))
    b.loop.call_soon(lambda: time.sleep(3.5))  # B's I/O thread stalls: no heartbeat, no answer
    call = a.client.request(seed_of(b), make("ping"), timeout=30)
    assert wait_until(lambda: bool(suspected), 10)
    try:
        reply = call.result()
    except BusError as exc:
        raise AssertionError(f"the call to a suspected (not dead) member failed: {exc}") from exc
    assert reply.type == "pong"
    assert wait_until(lambda: view(a).get(b.node_id) == "alive")


def test_request_connections_are_made_lazily_and_let_go(make_node, seed_of, view, wait_until):
    """Issue 21: the DEALER an introduction opens is closed once it is idle, so a member costs
    no request connection until a role uses it (forged members once held 2,000)."""
    a = make_node()
    b = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: view(a).get(b.node_id) == "alive"
                      and view(b).get(a.node_id) == "alive")
    ep_b = b.membership.card.endpoints["stream"]
    ep_a = a.membership.card.endpoints["stream"]
    assert wait_until(lambda: not a.client.connected(ep_b) and not b.client.connected(ep_a))
    # a role's request still reaches it (a new connection, made on demand)
    reply = a.client.request(ep_b, make("ping", payload="x"), timeout=10).result(10)
    assert reply.type == "pong"
