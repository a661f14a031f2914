"""Membership over the bus: cards, heartbeats, snapshots, seeds and failure detection.

Runs on the node's I/O thread (every socket touch, every table change); other threads use the
thread-safe methods (`members`, `subscribe`, `update_card`, `discovered`, `leave`).

How a node joins (details in docs/discovery.md):
- It publishes its card, then a heartbeat every `heartbeat` seconds, from the I/O thread.
- For every endpoint it discovers (a `--peer` seed, an mDNS announcement, or the endpoints on
  a card it learned) it *introduces* itself: a `snapshot_req` carrying its own card to that
  peer's StreamServer. The peer adds the card, subscribes to our PUB, and replies with a
  `snapshot` of every live card it knows (ZeroMQ guide "Clone" pattern). Cards in the
  snapshot we did not know are connected and introduced to in turn, so a node that can see
  one peer still reaches everyone.
- Heartbeats carry a digest of the sender's live view (`peers`: [count, crc32 of the sorted
  ids, itself included]). A node whose own view is smaller, or as large but different, asks
  that peer for a snapshot (at most once a second per peer): members learned late still
  spread, even when nobody runs mDNS.
- Failure detection is local: every node subscribes to every member's PUB, and silence
  longer than `suspect_after` / `dead_after` makes a member suspect / dead. Heartbeats list
  the ids their sender suspects; a node that finds itself there bumps its incarnation and
  re-announces (refutation).

Every number from outside is bounded before use (`discovery.limits`, `discovery.wire`):
messages with absurd counters or sizes are dropped and counted as `hostile`, ill-shaped ones
as `dropped`; nothing from the wire can raise out of a handler. A refutation only follows a
claim within `MAX_JUMP` of our incarnation, at most once per heartbeat interval, and never
past `MAX_COUNTER`, so no forged message can push the persisted incarnation out of range.

Counters belong to the I/O thread (`discovery.counters`); `counters` hands out copies.

`Membership` itself only wires the parts together, runs their timers, and keeps the public
methods the rest of specbus calls. Each part has one job (docs/discovery.md lists them):
`LocalView` (our card and the table, behind one lock), `Announcer` (what we publish),
`Refuter` (our incarnation), `StateUpdates` (every table change and its consequences),
`Links` (sockets per member), `Introducer` and `DigestSync` (joining, anti-entropy), `Seeds`
(endpoints to keep trying), `SnapshotServer` (answering introductions), `GossipIn`
(membership gossip received) and `EventBus` (subscribers).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bus.gossip import GossipChannel
from bus.loop import IOLoop, Timer
from bus.streams import Request, StreamClient
from codec.messages import Message
from discovery.announcer import Announcer
from discovery.cards import Card, CardError
from discovery.counters import Counters
from discovery.events import EventBus, Subscriber
from discovery.identity import Identity
from discovery.inbound import MEMBERSHIP_TYPES, GossipIn
from discovery.introductions import DigestSync, Introducer
from discovery.links import Links
from discovery.mdns import PeerAd
from discovery.refuter import Refuter
from discovery.seeds import SEED_RETRY_S, Seeds
from discovery.snapshots import SnapshotServer
from discovery.table import Member, Timeouts
from discovery.updates import StateUpdates
from discovery.view import LocalView

__all__ = ["MEMBERSHIP_TYPES", "UPDATABLE", "Membership", "topic_for"]

CARD_REPUBLISH_S = 5.0  # anti-entropy for peers that missed a card update
COUNTERS = ("dropped", "hostile", "foreign", "refutations", "snapshots_served",
            "snapshots_received", "introductions", "snapshot_cut")
UPDATABLE = ("backend", "model", "tokenizer", "vocab", "tok_s", "load", "free_mem", "extras")


def topic_for(cluster: str) -> str:
    """Gossip topic prefix of a cluster (SUB filters on it, so other clusters never arrive)."""
    return f"specbus/{cluster}/"


class Membership:
    """This node's view of its cluster, kept current on the I/O thread.

    A façade: the thread-safe methods below are what nodes, roles and tools call; the work is
    done by the parts built in `__init__`, all on the I/O thread, all counting into one
    `Counters` owned by that thread.
    """

    def __init__(self, loop: IOLoop, gossip: GossipChannel, client: StreamClient,
                 identity: Identity, card: Card, timeouts: Timeouts | None = None,
                 seeds: tuple[str, ...] = (),
                 extra_counters: Callable[[], dict[str, int]] | None = None) -> None:
        if card.node_id != identity.node_id:
            raise ValueError("card and identity disagree on the node id")
        self.loop = loop
        self.gossip = gossip
        self.client = client
        self.identity = identity
        self.timeouts = timeouts or Timeouts()
        self.seeds = tuple(seeds)
        self.topic = topic_for(card.cluster)
        self._counters = Counters(COUNTERS, is_owner=loop.in_loop)  # written on the I/O thread
        self._extra_counters = extra_counters  # the node's security refusals (thread-safe)
        self._events = EventBus()
        self._timers: list[Timer] = []
        self._view = LocalView(card, self.timeouts)
        self._links = Links(gossip, client)
        self._announcer = Announcer(gossip, self.topic, self._view)
        self._refuter = Refuter(loop, self._view, identity, self._announcer, self._counters,
                                self.timeouts.heartbeat)
        self._updates = StateUpdates(self._view, self._refuter, self._events)
        self._introducer = Introducer(client, self._view, self._announcer, self._counters,
                                      self._updates.card)
        self._sync = DigestSync(self._view, self._introducer)
        self._updates.reactions += [self._links.on_event, self._introducer.on_event]
        self._updates.sweeps += [self._links.forget_gone, self._introducer.forget_gone,
                                 self._sync.forget_gone]
        self._seeds = Seeds(self.seeds, self._view, self._links, self._introducer,
                            self._counters)
        self._snapshots = SnapshotServer(self._view, self._introducer, self._counters,
                                         self._updates.card)
        self._gossip_in = GossipIn(self.topic, self._view, self._updates, self._refuter,
                                   self._introducer, self._sync, self._counters)

    # -- thread-safe API ----------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._view.node_id

    @property
    def counters(self) -> dict[str, int]:
        """A copy of the counters, with the table's `stale` and `hostile` added in."""
        out = self._counters.snapshot()
        table = self._view.table_counts()
        out["stale"] = table["stale"]
        out["hostile"] += table["hostile"]
        out["refused_joins"] = table["refused_joins"]
        if self._extra_counters is not None:
            out.update(self._extra_counters())
        return out

    @property
    def card(self) -> Card:
        return self._view.card

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(event)` on the event thread for every later event; returns unsubscribe."""
        return self._events.subscribe(fn)

    def members(self, include_self: bool = True) -> list[Member]:
        """A consistent copy of the table (self first when included)."""
        return self._view.members(include_self)

    def get(self, node_id: str) -> Member | None:
        return self._view.get(node_id)

    def workers(self) -> list[Member]:
        """Alive members that may be offered work (never observers)."""
        return self._view.workers()

    def update_card(self, **changes) -> None:
        """Publish a new version of our card (e.g. measured tok/s, load).

        Only capability fields may change (`UPDATABLE`); a bad value raises CardError here,
        in the caller's thread.
        """
        bad = [k for k in changes if k not in UPDATABLE]
        if bad:
            raise CardError(f"card fields {bad} cannot be updated (updatable: {UPDATABLE})")
        Card.from_map(self.card.evolve(**changes).to_map())  # validate before queueing
        self.loop.call_soon(
            lambda: self._announcer.set_card(self._view.own.evolve(**changes)))

    def discovered(self, stream: str, gossip: str | None = None) -> None:
        """A peer's endpoints were found (mDNS, seeds, tools); introduce ourselves."""
        self.loop.call_soon(lambda: self._seeds.discovered(stream, gossip))

    def on_mdns_peer(self, ad: PeerAd) -> None:
        """mDNS callback (zeroconf's thread): hand the ad to the I/O thread, which owns state."""
        self.loop.call_soon(lambda: self._seeds.on_mdns_peer(ad))

    def start(self) -> None:
        self.gossip.subscribe(self.topic)
        self.loop.call_soon(self._start)

    def leave(self) -> None:
        """Announce a graceful leave and stop heartbeating (blocks until it is sent)."""
        self.loop.run_sync(self._leave)

    def close(self) -> None:
        self._events.close()

    # -- I/O thread: handlers the node registers ----------------------------------------
    def handle_gossip(self, topic: str, msg: Message) -> bool:
        """Gossip handler for membership types; False if the type is not ours."""
        return self._gossip_in.handle(topic, msg)

    def handle_request(self, req: Request) -> bool:
        """StreamServer handler for `snapshot_req`; False if the type is not ours."""
        return self._snapshots.handle(req)

    # -- I/O thread: the clock ----------------------------------------------------------
    def _start(self) -> None:
        t = self.timeouts
        self._announcer.card()
        self._timers = [
            self.loop.call_every(t.heartbeat, self._announcer.heartbeat, first=0.0),
            self.loop.call_every(t.check_every, lambda: self._updates.tick(time.monotonic())),
            self.loop.call_every(SEED_RETRY_S, self._seeds.contact, first=0.0),
            self.loop.call_every(CARD_REPUBLISH_S, self._announcer.card),
        ]

    def _leave(self) -> None:
        if self._announcer.left:
            return
        for timer in self._timers:
            timer.cancel()
        self._announcer.leave()
