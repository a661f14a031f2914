"""Hostile numbers cannot kill a node (issue 12).

A raw PUB socket, subscribed to by two real nodes over loopback, forges heartbeats, cards and
leaves carrying absurd incarnations and versions (2**64 - 1, negatives, huge jumps) and
oversized lists, for the nodes' own ids and for each other's. Afterwards both nodes still
gossip and see each other alive, the drops are counted as hostile, and the persisted
incarnation is still one a card can carry.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from discovery.counters import Counters, WrongThread
from discovery.identity import IncarnationExhausted, acquire_identity
from discovery.limits import MAX_COUNTER, MAX_JUMP
from discovery.mdns import PeerAd
from tests.discovery.conftest import gossip_frames


def attach(sock, endpoint, nodes, wait_until):
    """Connect the nodes' SUBs to the raw PUB and wait until each receives from it."""
    probe = gossip_frames("stats", "probe", cluster="specbus", incarnation=1, stats={})
    for n in nodes:
        n.gossip.connect(endpoint)
        before = n.gossip.received

        def connected(n=n, before=before) -> bool:
            sock.send_multipart(probe)
            return n.gossip.received > before

        assert wait_until(connected, timeout=10, step=0.05)


def persisted(tmp_path, node) -> int:
    text = (tmp_path / "nodes" / node.node_id / "incarnation").read_text().strip()
    assert text.isascii() and text.isdigit()
    return int(text)


def test_absurd_numbers_are_dropped_and_nobody_dies(make_node, seed_of, view, wait_until,
                                                     raw_pub, tmp_path):
    sock, endpoint = raw_pub
    a = make_node(name="a")
    b = make_node(name="b", peers=(seed_of(a),))
    assert wait_until(lambda: view(a).get(b.node_id) == "alive"
                      and view(b).get(a.node_id) == "alive")
    bad_events = []
    for watcher, other in ((a, b), (b, a)):
        watcher.membership.subscribe(
            lambda ev, other=other: ev.node_id == other.node_id
            and ev.kind in ("suspect", "dead", "leave") and bad_events.append(ev))
    attach(sock, endpoint, (a, b), wait_until)
    inc_a, inc_b = a.membership.card.incarnation, b.membership.card.incarnation
    card_a, card_b = a.membership.card, b.membership.card
    hostile_a, hostile_b = a.membership.counters["hostile"], b.membership.counters["hostile"]

    def hb(node_id, incarnation, version=1, **extra):
        return gossip_frames("heartbeat", node_id, cluster="specbus", incarnation=incarnation,
                             version=version, **extra)

    def card(c, **changes):
        return gossip_frames("card", c.node_id, **{**c.wire_fields(), **changes})

    # each of these is hostile for both nodes (their own id at one, a peer's at the other)
    forged = []
    for c, inc in ((card_a, inc_a), (card_b, inc_b)):
        n = c.node_id
        forged += [
            hb(n, 2**64 - 1),  # the probe from the issue
            hb(n, MAX_COUNTER + 1),
            hb(n, -1),
            hb(n, inc, version=-5),
            hb(n, inc + MAX_JUMP + 1),  # implausible jump, though encodable
            hb(n, inc, version=c.version + MAX_JUMP + 1),
            card(c, incarnation=2**64 - 1),
            card(c, incarnation=-1),
            card(c, incarnation=inc + MAX_JUMP + 1),
            card(c, version=2**63),
            card(c, vocab=2**62),
            card(c, free_mem=-1),
            card(c, extras={"blob": "x" * 10_000}),
            gossip_frames("leave", n, cluster="specbus", incarnation=2**64 - 1),
            gossip_frames("leave", n, cluster="specbus", incarnation=-7),
            gossip_frames("leave", n, cluster="specbus", incarnation=inc + MAX_JUMP + 1),
            hb(n, inc, peers=[2**40, 5]),
            hb(n, inc, peers=[3, 2**40]),
        ]
    forged.append(hb("stranger", 1, suspects=[format(i, "x") for i in range(10_001)]))
    per_node = len(forged)  # each message is one hostile drop at each node
    for f in forged:
        sock.send_multipart(f)
    assert wait_until(lambda: a.membership.counters["hostile"] - hostile_a >= per_node
                      and b.membership.counters["hostile"] - hostile_b >= per_node,
                      ), (a.membership.counters, b.membership.counters)
    # nobody refuted an absurd claim; incarnations and the files stay in range
    assert a.membership.card.incarnation == inc_a and b.membership.card.incarnation == inc_b
    assert persisted(tmp_path, a) == inc_a and persisted(tmp_path, b) == inc_b
    assert a.membership.counters["refutations"] == 0
    # both keep gossiping: each hears the other for longer than it takes to declare death
    t0 = time.monotonic()
    horizon = t0 + a.membership.timeouts.dead_after + 0.2
    assert wait_until(lambda: a.membership.get(b.node_id).last_heard > horizon
                      and b.membership.get(a.node_id).last_heard > horizon)
    assert view(a)[b.node_id] == "alive" and view(b)[a.node_id] == "alive"
    assert bad_events == []
    assert a.membership.get(b.node_id).card == card_b
    assert b.membership.get(a.node_id).card == card_a
    assert a.loop.errors == 0 and b.loop.errors == 0


def test_plausible_claims_still_refute_within_bounds(make_node, seed_of, view, wait_until,
                                                     raw_pub, tmp_path):
    """A claim of our id one step ahead (an old run) is outgrown, and persisted."""
    sock, endpoint = raw_pub
    a = make_node(name="a")
    b = make_node(peers=(seed_of(a),))
    assert wait_until(lambda: view(b).get(a.node_id) == "alive")
    attach(sock, endpoint, (a,), wait_until)
    inc = a.membership.card.incarnation
    sock.send_multipart(gossip_frames("heartbeat", a.node_id, cluster="specbus",
                                      incarnation=inc + 5, version=1))
    assert wait_until(lambda: a.membership.card.incarnation == inc + 6)
    assert persisted(tmp_path, a) == inc + 6
    assert wait_until(lambda: b.membership.get(a.node_id).incarnation == inc + 6)
    # a forged leave of a's own id: a outgrows it, so peers keep (or take back) a
    sock.send_multipart(gossip_frames("leave", a.node_id, cluster="specbus", incarnation=inc + 6))
    assert wait_until(lambda: a.membership.card.incarnation == inc + 7)
    assert wait_until(lambda: view(b).get(a.node_id) == "alive"
                      and b.membership.get(a.node_id).incarnation == inc + 7)


@pytest.mark.parametrize("content", ["18446744073709551616", str(MAX_COUNTER), "garbage",
                                     "\u00b2", "-5", "", "12 13", "1" * 5000])
def test_corrupt_or_out_of_range_counter_is_a_warning_and_a_fresh_start(tmp_path, caplog,
                                                                         content):
    first = acquire_identity("specbus", "n", tmp_path)
    first.release()
    counter = tmp_path / "nodes" / first.node_id / "incarnation"
    counter.write_text(content + "\n")
    with caplog.at_level(logging.WARNING, logger="discovery.identity"):
        again = acquire_identity("specbus", "n", tmp_path)
    again.release()
    assert again.node_id == first.node_id and again.incarnation == 1
    assert counter.read_text() == "1\n"
    assert any("corrupt or out of range" in r.getMessage() for r in caplog.records)


def test_largest_valid_counter_is_kept(tmp_path):
    first = acquire_identity("specbus", "n", tmp_path)
    first.release()
    (tmp_path / "nodes" / first.node_id / "incarnation").write_text(f"{MAX_COUNTER - 1}\n")
    again = acquire_identity("specbus", "n", tmp_path)
    assert again.incarnation == MAX_COUNTER
    with pytest.raises(IncarnationExhausted):
        again.bump()
    assert again.incarnation == MAX_COUNTER  # unchanged, here and on disk
    assert (tmp_path / "nodes" / first.node_id / "incarnation").read_text() == \
        f"{MAX_COUNTER}\n"
    again.release()


def test_restart_over_a_corrupt_state_file_rejoins(make_node, seed_of, view, wait_until,
                                                   tmp_path, caplog):
    """The issue's failure: a poisoned counter file must not keep `--name a` from starting.

    `a` restarts at incarnation 1, below what `b` still holds for it (dead); `b` answers the
    introduction with that old card, and `a` outgrows it at once.
    """
    b = make_node(name="b")
    a = make_node(name="a", peers=(seed_of(b),))
    assert wait_until(lambda: view(b).get(a.node_id) == "alive")
    for _ in range(3):  # some history: a's incarnation is well above 1
        a.membership.loop.run_sync(
            lambda: a.membership._refuter.refute(a.membership.card.incarnation))
        time.sleep(a.membership.timeouts.heartbeat)
    old_inc = a.membership.card.incarnation
    assert wait_until(lambda: b.membership.get(a.node_id).incarnation == old_inc)
    a.stop(leave=False)
    assert wait_until(lambda: view(b).get(a.node_id) == "dead")
    (tmp_path / "nodes" / a.node_id / "incarnation").write_text(f"{2**64}\n")
    with caplog.at_level(logging.WARNING, logger="discovery.identity"):
        a2 = make_node(name="a", peers=(seed_of(b),))
    assert a2.node_id == a.node_id
    assert any("corrupt or out of range" in r.getMessage() for r in caplog.records)
    assert wait_until(lambda: view(b).get(a2.node_id) == "alive"
                      and b.membership.get(a2.node_id).incarnation == old_inc + 1), view(b)
    assert a2.membership.card.incarnation == old_inc + 1
    assert persisted(tmp_path, a2) == old_inc + 1


def _spy_on(counters: Counters) -> list[str]:
    """Record which thread writes each counter. Every part of a node's membership counts into
    the same `Counters`, so its `inc` is wrapped in place (the real check still raises)."""
    writers: list[str] = []
    real_inc = counters.inc

    def inc(name: str, n: int = 1) -> None:
        writers.append(threading.current_thread().name)
        real_inc(name, n)

    counters.inc = inc
    return writers


def test_counters_are_written_by_the_io_thread_only(make_node, seed_of, wait_until):
    """zeroconf calls `on_mdns_peer` on its own threads; the counting must happen on the loop.

    The old code incremented `counters["foreign"]` right there, racing the I/O thread's own
    increments of the same dict: the spy would record a foreign writer (and the real
    `Counters.inc` raises WrongThread).
    """
    a = make_node()
    writers = _spy_on(a.membership._counters)
    b = make_node(peers=(seed_of(a),))  # real traffic: introductions, snapshots
    errors = []

    def zeroconf_like() -> None:
        try:
            for _ in range(200):
                a.membership.on_mdns_peer(PeerAd("x" * 8, "elsewhere", 1,
                                                 "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"))
                a.membership.on_mdns_peer(PeerAd(b.node_id, "specbus", 99,
                                                 "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=zeroconf_like, name=f"zeroconf-like-{i}")
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert wait_until(lambda: a.membership.counters["foreign"] == 1200)
    assert wait_until(lambda: a.membership.counters["snapshots_served"] >= 1)
    assert set(writers) == {a.loop._thread.name}
    snap = a.membership.counters
    snap["foreign"] = -1  # readers get copies
    assert a.membership.counters["foreign"] == 1200


def test_counters_refuse_a_foreign_writer():
    owner = threading.current_thread()
    c = Counters(("x",), is_owner=lambda: threading.current_thread() is owner)
    c.inc("x")
    errors = []

    def other() -> None:
        try:
            c.inc("x")
        except WrongThread as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and c.snapshot() == {"x": 1}
