"""Membership's parts, and their wiring, without sockets or threads (fakes for bus and loop).

The split of `Membership` (issue 22) made each part usable alone: these tests drive the
introduction bound, the snapshot size bound and the order of side effects deterministically,
where the process tests can only watch them under load.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgpack

from bus.streams import RequestTimeout
from codec.messages import make
from discovery.announcer import Announcer
from discovery.cards import Card
from discovery.counters import Counters
from discovery.identity import acquire_identity
from discovery.introductions import MAX_INTRODUCING, SNAPSHOT_TIMEOUT_S, Introducer
from discovery.membership import CARD_REPUBLISH_S, COUNTERS, Membership, topic_for
from discovery.seeds import SEED_RETRY_S
from discovery.snapshots import SNAPSHOT_BYTES, SnapshotServer
from discovery.table import State, Timeouts
from discovery.view import LocalView

T = Timeouts()


def card(node_id: str, port: int, inc: int = 1, ver: int = 1, **kw) -> Card:
    eps = {"gossip": f"tcp://127.0.0.1:{port + 1}", "stream": f"tcp://127.0.0.1:{port}"}
    return Card(node_id=node_id, cluster="c", incarnation=inc, version=ver,
                roles=("proposer",), endpoints=eps, **kw)


class Bus:
    """Gossip channel and stream client in one fake, recording every call in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.requests: list[tuple] = []  # (endpoint, message, timeout, on_reply)

    def publish(self, topic, msg):
        self.log.append(("publish", msg.type))
        self.last = msg

    def subscribe(self, topic):
        self.log.append(("subscribe", topic))

    def connect(self, ep):
        self.log.append(("connect", ep))

    def disconnect(self, ep):
        self.log.append(("disconnect", ep))

    def request(self, ep, msg, timeout, on_reply):
        self.log.append(("request", ep))
        self.requests.append((ep, msg, timeout, on_reply))

    def release(self, ep):
        self.log.append(("release", ep))

    def forget(self, ep):
        self.log.append(("forget", ep))


class Loop:
    """Runs posted work at once, on the caller's thread (which owns the counters)."""

    def __init__(self) -> None:
        self.every: list[tuple[float, object]] = []

    def in_loop(self) -> bool:
        return True

    def call_soon(self, fn) -> None:
        fn()

    def run_sync(self, fn):
        return fn()

    def call_every(self, interval, fn, first=None):
        timer = SimpleNamespace(interval=interval, fn=fn, cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.every.append(timer)
        return timer

    def call_later(self, delay, fn):
        return self.call_every(delay, fn)


class Req:
    def __init__(self, msg) -> None:
        self.message = msg
        self.replies: list = []
        self.failed: tuple | None = None

    def reply(self, msg) -> None:
        self.replies.append(msg)

    def fail(self, code, text) -> None:
        self.failed = (code, text)


def parts(me: Card):
    bus = Bus()
    view = LocalView(me, T)
    counters = Counters(COUNTERS, is_owner=lambda: True)
    taken: list[tuple[str, bool]] = []
    intro = Introducer(bus, view, Announcer(bus, topic_for("c"), view), counters,
                       lambda c, now, direct: taken.append((c.node_id, direct)))
    return bus, view, counters, intro, taken


def test_introductions_in_flight_are_bounded_and_queued_in_order():
    bus, view, counters, intro, _ = parts(card("me", 1000))
    eps = [f"tcp://127.0.0.1:{2000 + 2 * i}" for i in range(MAX_INTRODUCING + 3)]
    for ep in eps:
        intro.introduce(ep)
    intro.introduce(eps[0])  # already in flight
    intro.introduce("tcp://127.0.0.1:1000")  # ourselves
    assert [r[0] for r in bus.requests] == eps[:MAX_INTRODUCING]
    ep, msg, timeout, on_reply = bus.requests[0]
    assert msg.type == "snapshot_req" and msg["card"] == view.own.to_map()
    assert timeout == SNAPSHOT_TIMEOUT_S and counters.snapshot()["introductions"] == 16
    # a failure frees a slot for the oldest waiting; nobody lives there, so it is forgotten
    on_reply(SimpleNamespace(endpoint=ep), RequestTimeout("late"))
    assert bus.requests[-1][0] == eps[MAX_INTRODUCING]
    assert bus.log[-2:] == [("release", ep), ("forget", ep)]


def test_a_snapshot_is_read_within_bounds():
    bus, view, counters, intro, taken = parts(card("me", 1000))
    intro.introduce("tcp://127.0.0.1:3000")
    ep, _, _, on_reply = bus.requests[0]
    entries = [{**card("b", 3000).to_map(), "state": "alive"},
               {**card("c", 3002).to_map(), "state": "suspect"},
               {**card("d", 3004).to_map(), "state": "dead"},  # not taken
               {"node_id": "e"},  # malformed: dropped
               {**card("me", 1000, inc=3).to_map(), "state": "dead"}]  # our past: taken
    on_reply(SimpleNamespace(endpoint=ep), make("snapshot", sender="b", cards=entries))
    assert taken == [("b", True), ("c", False), ("me", False)]
    got = counters.snapshot()
    assert got["snapshots_received"] == 1 and got["dropped"] == 1


def test_a_snapshot_is_cut_to_what_one_header_carries():
    _, view, counters, intro, taken = parts(card("me", 1000))
    big = {"blob": "x" * 2000}
    n = SNAPSHOT_BYTES // 2000 + 5
    for i in range(n):
        view.change(lambda t, i=i: t.on_card(card(f"n{i}", 4000 + 2 * i, extras=big), i, True))
    server = SnapshotServer(view, intro, counters, lambda *a: None)
    maps = server.maps()
    assert maps[0]["node_id"] == "me" and maps[1]["node_id"] == "n0"  # longest known first
    assert len(msgpack.packb(maps)) <= SNAPSHOT_BYTES and len(maps) < n + 1
    assert counters.snapshot()["snapshot_cut"] == 1


def test_membership_wiring_without_sockets(tmp_path):
    """Every input goes through the same door: table, then links, then introductions."""
    loop, bus = Loop(), Bus()
    ident = acquire_identity("c", None)
    me = card(ident.node_id, 1000)
    m = Membership(loop, bus, bus, ident, me, T, seeds=("tcp://127.0.0.1:9000",))
    m.start()
    topic = topic_for("c")
    assert bus.log[:2] == [("subscribe", topic), ("publish", "card")]
    assert sorted(t.interval for t in loop.every) == sorted(
        [T.heartbeat, T.check_every, SEED_RETRY_S, CARD_REPUBLISH_S])

    b = card("b", 2000)
    bus.log.clear()
    assert m.handle_gossip(topic, make("card", sender="b", **b.wire_fields()))
    assert bus.log == [("connect", "tcp://127.0.0.1:2001"), ("request", "tcp://127.0.0.1:2000")]
    assert m.get("b").state is State.ALIVE

    # an introduction is answered with a snapshot, and the introducer is not introduced to
    c = card("c", 2002)
    bus.log.clear()
    req = Req(make("snapshot_req", sender="c", cluster="c", card=c.to_map()))
    assert m.handle_request(req)
    assert [e["node_id"] for e in req.replies[0]["cards"]] == [me.node_id, "b", "c"]
    assert bus.log == [("connect", "tcp://127.0.0.1:2003")]

    # suspected by b: refute with a higher incarnation, card then heartbeat
    bus.log.clear()
    m.handle_gossip(topic, make("heartbeat", sender="b", cluster="c", incarnation=1,
                                version=1, suspects=[me.node_id]))
    assert m.card.incarnation == 2 and m.counters["refutations"] == 1
    assert bus.log == [("publish", "card"), ("publish", "heartbeat")]

    # b leaves: stop hearing it
    bus.log.clear()
    m.handle_gossip(topic, make("leave", sender="b", cluster="c", incarnation=1))
    assert bus.log == [("disconnect", "tcp://127.0.0.1:2001")]
    assert m.get("b").state is State.LEFT

    # our leave: said once, timers stopped, nothing said after it
    bus.log.clear()
    m.leave()
    m.leave()
    assert bus.log == [("publish", "leave")] and all(t.cancelled for t in loop.every)
    m.close()
