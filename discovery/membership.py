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
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import msgpack

from bus.gossip import GossipChannel
from bus.loop import IOLoop, Timer
from bus.streams import BusError, Call, Request, StreamClient
from codec.messages import DEFAULT_LIMITS, Message, make
from codec.schema import PROTOCOL_VERSION
from discovery.cards import Card, CardError, check_endpoint
from discovery.counters import Counters
from discovery.events import EventBus, Subscriber
from discovery.identity import Identity, IncarnationExhausted
from discovery.limits import MAX_COUNTER, MAX_MEMBERS, MAX_TABLE, is_plausible_step
from discovery.mdns import PeerAd
from discovery.table import Event, Member, MemberTable, State, Timeouts
from discovery.wire import Heartbeat, Leave, parse_heartbeat, parse_leave

log = logging.getLogger(__name__)

MEMBERSHIP_TYPES = ("card", "heartbeat", "leave")
SNAPSHOT_TIMEOUT_S = 2.0
SEED_RETRY_S = 1.0
DISCOVERED_RETRY_FOR_S = 30.0  # keep retrying an mDNS-found endpoint until it answers
CARD_REPUBLISH_S = 5.0  # anti-entropy for peers that missed a card update
MAX_INTRODUCING = 16  # introductions (snapshot requests) in flight at once
SYNC_MIN_INTERVAL_S = 1.0  # digest mismatch: at most one snapshot request per peer per second
COUNTERS = ("dropped", "hostile", "foreign", "refutations", "snapshots_served",
            "snapshots_received", "introductions", "snapshot_cut")
#: bytes of cards one snapshot carries (under the codec's header limit, with room to spare)
SNAPSHOT_BYTES = DEFAULT_LIMITS.max_header_bytes * 3 // 4
UPDATABLE = ("backend", "model", "tokenizer", "vocab", "tok_s", "load", "free_mem", "extras")


def topic_for(cluster: str) -> str:
    """Gossip topic prefix of a cluster (SUB filters on it, so other clusters never arrive)."""
    return f"specbus/{cluster}/"


class Membership:
    """This node's view of its cluster, kept current on the I/O thread."""

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
        self._card = card
        self._lock = threading.Lock()  # guards _table and _card for readers on other threads
        self._table = MemberTable(card.node_id, card.cluster, self.timeouts)
        self._events = EventBus()
        self._started_at = time.monotonic()
        self._seq = 0
        self._timers: list[Timer] = []
        self._inflight: set[str] = set()  # stream endpoints with a snapshot_req in flight
        self._queued_intros: OrderedDict[str, None] = OrderedDict()  # waiting for a turn
        self._introduced: dict[str, int] = {}  # node id -> incarnation we exchanged cards with
        self._gossip_eps: dict[str, str] = {}  # node id -> PUB endpoint we subscribe to
        self._streams: dict[str, str] = {}  # node id -> its request endpoint (for release)
        self._last_refute = -1e9
        self._deferred_claim: int | None = None  # a claim to refute once the rate limit allows
        self._last_sync: dict[str, float] = {}  # node id -> when we last asked it to sync
        # discovered stream endpoint -> (retry until, its PUB endpoint or None)
        self._pending: dict[str, tuple[float, str | None]] = {}
        self._left = False
        self._refused: set[str] = set()  # endpoints that answered our introduction with an error
        self._counters = Counters(COUNTERS, is_owner=loop.in_loop)  # written on the I/O thread
        self._extra_counters = extra_counters  # the node's security refusals (thread-safe)

    # -- thread-safe API ----------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._card.node_id

    @property
    def counters(self) -> dict[str, int]:
        """A copy of the counters, with the table's `stale` and `hostile` added in."""
        out = self._counters.snapshot()
        with self._lock:
            out["stale"] = self._table.stale
            out["hostile"] += self._table.hostile
            out["refused_joins"] = self._table.refused
        if self._extra_counters is not None:
            out.update(self._extra_counters())
        return out

    @property
    def card(self) -> Card:
        with self._lock:
            return self._card

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(event)` on the event thread for every later event; returns unsubscribe."""
        return self._events.subscribe(fn)

    def members(self, include_self: bool = True) -> list[Member]:
        """A consistent copy of the table (self first when included)."""
        with self._lock:
            out = [_copy(m) for m in self._table.members()]
            if include_self:
                out.insert(0, self._self_member())
        return out

    def get(self, node_id: str) -> Member | None:
        with self._lock:
            if node_id == self._card.node_id:
                return self._self_member()
            m = self._table.get(node_id)
        return _copy(m) if m else None

    def workers(self) -> list[Member]:
        """Alive members that may be offered work (never observers)."""
        return [m for m in self.members(include_self=False)
                if m.state is State.ALIVE and m.card.is_worker]

    def update_card(self, **changes) -> None:
        """Publish a new version of our card (e.g. measured tok/s, load).

        Only capability fields may change (`UPDATABLE`); a bad value raises CardError here,
        in the caller's thread.
        """
        bad = [k for k in changes if k not in UPDATABLE]
        if bad:
            raise CardError(f"card fields {bad} cannot be updated (updatable: {UPDATABLE})")
        Card.from_map(self.card.evolve(**changes).to_map())  # validate before queueing
        self.loop.call_soon(lambda: self._set_card(self._card.evolve(**changes)))

    def discovered(self, stream: str, gossip: str | None = None) -> None:
        """A peer's endpoints were found (mDNS, seeds, tools); introduce ourselves."""
        self.loop.call_soon(lambda: self._discovered(stream, gossip))

    def on_mdns_peer(self, ad: PeerAd) -> None:
        """mDNS callback (zeroconf's thread): hand the ad to the I/O thread, which owns state."""
        self.loop.call_soon(lambda: self._on_mdns_peer(ad))

    def start(self) -> None:
        self.gossip.subscribe(self.topic)
        self.loop.call_soon(self._start)

    def leave(self) -> None:
        """Announce a graceful leave and stop heartbeating (blocks until it is sent)."""
        self.loop.run_sync(self._leave)

    def close(self) -> None:
        self._events.close()

    def _self_member(self) -> Member:
        now = time.monotonic()
        return _copy(Member(self._card, State.ALIVE, now, self._started_at, is_self=True))

    # -- loop thread: lifecycle ---------------------------------------------------------
    def _on_mdns_peer(self, ad: PeerAd) -> None:
        """Only peers of our cluster and protocol count."""
        if ad.cluster != self._card.cluster or ad.proto != PROTOCOL_VERSION:
            self._counters.inc("foreign")
            return
        if ad.node_id != self._card.node_id:
            self._discovered(ad.stream, ad.gossip)

    def _start(self) -> None:
        t = self.timeouts
        self._publish_card()
        self._timers = [
            self.loop.call_every(t.heartbeat, self._heartbeat, first=0.0),
            self.loop.call_every(t.check_every, self._check),
            self.loop.call_every(SEED_RETRY_S, self._contact_seeds, first=0.0),
            self.loop.call_every(CARD_REPUBLISH_S, self._publish_card),
        ]

    def _leave(self) -> None:
        if self._left:
            return
        self._left = True
        for timer in self._timers:
            timer.cancel()
        self._publish("leave", cluster=self._card.cluster, incarnation=self._card.incarnation)

    # -- loop thread: publishing ----------------------------------------------------------
    def _publish(self, type_: str, **fields) -> None:
        self._seq += 1
        self.gossip.publish(self.topic, make(type_, sender=self.node_id, seq=self._seq, **fields))

    def _publish_card(self) -> None:
        if not self._left:
            self._publish("card", **self._card.wire_fields())

    def _heartbeat(self) -> None:
        c = self._card
        fields = {"cluster": c.cluster, "incarnation": c.incarnation, "version": c.version}
        suspects = self._table.suspects()
        if suspects:
            fields["suspects"] = suspects
        fields["peers"] = list(self._digest())
        self._publish("heartbeat", **fields)

    def _digest(self) -> tuple[int, int]:
        """[count, crc32] of the ids we hold alive, ourselves included."""
        ids = sorted([m.node_id for m in self._table.members() if m.state is State.ALIVE]
                     + [self.node_id])
        return len(ids), zlib.crc32(",".join(ids).encode())

    def _check_digest(self, sender: str, peers: tuple[int, int] | None, now: float) -> None:
        """Ask `sender` for a snapshot if it seems to know members we do not."""
        if peers is None:
            return
        count, crc = self._digest()
        if peers[0] < count or (peers[0] == count and peers[1] == crc):
            return
        if now - self._last_sync.get(sender, -1e9) < SYNC_MIN_INTERVAL_S:
            return
        self._last_sync[sender] = now
        self._ask_card(sender)

    def _set_card(self, card: Card) -> None:
        with self._lock:
            self._card = card
        self._publish_card()
        self._heartbeat()

    def _refute(self, at_least: int) -> None:
        """Someone thinks we are suspect (or knows a later incarnation of us): outgrow it.

        Bumps to max(own, at_least) + 1, at most once per heartbeat interval (one bump is
        enough; more only burn incarnations), and only for a claim a node of ours could have
        made: within MAX_JUMP of our incarnation (a restart with a lost counter file is one
        step per earlier start) and below MAX_COUNTER. Anything else is hostile: dropped.
        """
        own = self._card.incarnation
        if not is_plausible_step(own, at_least) or max(own, at_least) >= MAX_COUNTER:
            self._counters.inc("hostile")
            log.debug("ignoring an implausible claim of our incarnation: %d (ours %d)",
                      at_least, own)
            return
        now = time.monotonic()
        wait = self._last_refute + self.timeouts.heartbeat - now
        if wait > 0:  # too soon: one deferred refutation covers every claim until then
            if self._deferred_claim is None:
                self.loop.call_later(wait, self._deferred_refute)
            self._deferred_claim = max(self._deferred_claim or 0, at_least)
            return
        try:
            new = self.identity.bump(at_least)
        except (IncarnationExhausted, OSError) as exc:
            log.warning("cannot refute: %s", exc)
            return
        self._last_refute = now
        self._counters.inc("refutations")
        log.info("refuting: incarnation %d -> %d", own, new)
        self._set_card(replace(self._card, incarnation=new, version=self._card.version + 1))

    def _deferred_refute(self) -> None:
        claim, self._deferred_claim = self._deferred_claim, None
        if claim is not None and claim >= self._card.incarnation and not self._left:
            self._refute(claim)  # not outgrown meanwhile

    # -- loop thread: inputs ------------------------------------------------------------
    def handle_gossip(self, topic: str, msg: Message) -> bool:
        """Gossip handler for membership types; False if the type is not ours."""
        if msg.type not in MEMBERSHIP_TYPES:
            return False
        if topic != self.topic or msg.get("cluster") != self._card.cluster:
            self._counters.inc("foreign")
            return True
        try:
            if msg.type == "card":
                self._on_card(Card.from_fields(msg.sender, msg.fields), time.monotonic(),
                              direct=True)
            elif msg.type == "heartbeat":
                self._on_heartbeat(parse_heartbeat(msg))
            else:
                self._on_leave(parse_leave(msg))
        except CardError as exc:
            self._drop(f"{msg.type} from {msg.sender!r}", exc)
        return True

    def _drop(self, what: str, exc: CardError) -> None:
        """Count a message we refuse: `hostile` for absurd numbers, else `dropped`."""
        self._counters.inc("hostile" if exc.hostile else "dropped")
        log.debug("dropped %s: %s", what, exc)

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        now = time.monotonic()
        if hb.sender == self.node_id:
            self._on_self_report(hb.incarnation, hb.version)
            return
        with self._lock:
            events, need_card = self._table.on_heartbeat(hb.sender, hb.incarnation, hb.version,
                                                         now)
        self._after(events)
        if need_card:
            self._ask_card(hb.sender)
        else:
            self._check_digest(hb.sender, hb.peers, now)
        if self.node_id in hb.suspects:
            self._refute(self._card.incarnation)

    def _on_leave(self, leave: Leave) -> None:
        if leave.sender == self.node_id:
            # someone announces our leave: outgrow that incarnation so peers take us back
            if leave.incarnation >= self._card.incarnation:
                self._refute(leave.incarnation)
            return
        with self._lock:
            events = self._table.on_leave(leave.sender, leave.incarnation, time.monotonic())
        self._after(events)

    def handle_request(self, req: Request) -> bool:
        """StreamServer handler for `snapshot_req`; False if the type is not ours."""
        msg = req.message
        if msg.type != "snapshot_req":
            return False
        if msg["cluster"] != self._card.cluster:
            req.fail("wrong_cluster", f"this node belongs to cluster {self._card.cluster!r}, "
                                      f"not {msg['cluster']!r}")
            return True
        peer_card = msg.get("card")
        if peer_card is not None:
            try:
                card = Card.from_map(peer_card)
                if card.node_id != msg.sender:
                    raise CardError("a node may only introduce its own card")
            except CardError as exc:
                self._drop(f"introduction from {msg.sender!r}", exc)
                req.fail("bad_card", str(exc)[:300])
                return True
            self._introduced[card.node_id] = card.incarnation  # it knows us: no need to reply
            self._on_card(card, time.monotonic(), direct=True)
        self._counters.inc("snapshots_served")
        maps = self._snapshot_maps()
        if peer_card is not None:
            maps += self._past_of(card)
        req.reply(make("snapshot", cards=maps))
        return True

    def _past_of(self, card: Card) -> list[dict]:
        """The card we hold for an introducer that came back below it (a restart whose counter
        file was lost or corrupt), whatever its state: the introducer outgrows it at once
        instead of being ignored as stale until we forget it."""
        held = self._table.get(card.node_id)
        if held is None or held.incarnation <= card.incarnation or held.state is State.ALIVE:
            return []  # alive cards are in the snapshot already
        return [{**held.card.to_map(), "state": held.state.value}]

    def _snapshot_maps(self) -> list[dict]:
        """Our card and the alive members' (suspects are left out: likely dead, let them prove
        it), longest-known first, within what one message header carries: a table full of
        forged members once made every snapshot too big to send, so no introduction worked."""
        out = [{**self._card.to_map(), "state": State.ALIVE.value}]
        room = SNAPSHOT_BYTES - len(msgpack.packb(out[0]))
        alive = sorted((m for m in self._table.members() if m.state is State.ALIVE),
                       key=lambda m: m.since)
        for m in alive:
            entry = {**m.card.to_map(), "state": m.state.value}
            room -= len(msgpack.packb(entry))
            if room < 0:
                self._counters.inc("snapshot_cut")
                break
            out.append(entry)
        return out

    def _on_self_report(self, incarnation: int, version: int) -> None:
        """A heartbeat claiming to be us: another process or an old run. Stay ahead of it."""
        own = self._card
        if incarnation > own.incarnation:
            self._refute(incarnation)
        elif incarnation == own.incarnation and not is_plausible_step(own.version, version):
            self._counters.inc("hostile")

    def _on_card(self, card: Card, now: float, direct: bool) -> None:
        if card.node_id == self.node_id:
            if card.incarnation > self._card.incarnation:
                self._refute(card.incarnation)
            return
        with self._lock:
            events = self._table.on_card(card, now, direct)
        self._after(events)

    def _after(self, events: list[Event]) -> None:
        """Side effects of table events on the bus, then hand them to subscribers."""
        for ev in events:
            m = ev.member
            log.info("member %s %s (%s, incarnation %d)", m.node_id, ev.kind,
                     m.card.name or "-", m.incarnation)
            if ev.kind in ("join", "update"):
                self._connect(m.card)
            if ev.kind == "join" and self._introduced.get(m.node_id) != m.incarnation:
                self._introduce(m.card.endpoints["stream"])
            if ev.kind == "leave":
                self._disconnect(m.node_id)
        self._events.publish(events)

    def _connect(self, card: Card) -> None:
        self._streams[card.node_id] = card.endpoints["stream"]
        ep = card.endpoints["gossip"]
        old = self._gossip_eps.get(card.node_id)
        if old == ep:
            return
        if old is not None:
            self.gossip.disconnect(old)
        self._gossip_eps[card.node_id] = ep
        self.gossip.connect(ep)

    def _disconnect(self, node_id: str) -> None:
        ep = self._gossip_eps.pop(node_id, None)
        if ep is not None and ep not in self._gossip_eps.values():
            self.gossip.disconnect(ep)

    def _check(self) -> None:
        with self._lock:
            events = self._table.tick(time.monotonic())
        self._after(events)
        for node_id in [n for n in self._gossip_eps if n not in self._table]:
            self._disconnect(node_id)  # forgotten after dead/left for forget_after, or evicted
        for node_id in [n for n in self._streams if n not in self._table]:
            self.client.release(self._streams.pop(node_id))  # its request connection, if idle
        for book in (self._introduced, self._last_sync):
            for node_id in [n for n in book if n not in self._table]:
                del book[node_id]

    # -- loop thread: snapshots ---------------------------------------------------------
    def _discovered(self, stream: str, gossip: str | None) -> None:
        if not check_endpoint(stream) or stream == self._card.endpoints["stream"]:
            return
        for m in self._table.members():
            if m.card.endpoints["stream"] == stream and m.state is State.ALIVE:
                return  # already a live member
        if gossip and check_endpoint(gossip):
            self.gossip.connect(gossip)  # start hearing it even before the snapshot returns
        else:
            gossip = None
        self._pending[stream] = (time.monotonic() + DISCOVERED_RETRY_FOR_S, gossip)
        self._introduce(stream)

    def _contact_seeds(self) -> None:
        """Every second: seeds, and discovered endpoints, that no live member owns yet."""
        live = {m.card.endpoints["stream"] for m in self._table.members()
                if m.state is State.ALIVE}
        now = time.monotonic()
        for ep, (until, gossip) in list(self._pending.items()):
            if ep in live:
                del self._pending[ep]
            elif now > until:
                del self._pending[ep]  # never answered: stop hearing that address too
                if gossip is not None and gossip not in self._gossip_eps.values():
                    self.gossip.disconnect(gossip)
        for ep in (*self.seeds, *self._pending):
            if ep not in live:
                self._introduce(ep)

    def _ask_card(self, node_id: str) -> None:
        m = self._table.get(node_id)
        if m is not None:
            self._introduce(m.card.endpoints["stream"])

    def _introduce(self, stream: str) -> None:
        """Send our card to a peer's StreamServer and ask for its snapshot. At most
        `MAX_INTRODUCING` at once (each holds a connection, three sockets, for up to
        `SNAPSHOT_TIMEOUT_S`); the rest wait their turn: a burst of forged cards once opened
        hundreds at once and ran the node out of ZeroMQ sockets."""
        if self._left or stream in self._inflight or stream == self._card.endpoints["stream"]:
            return
        if len(self._inflight) >= MAX_INTRODUCING:
            if len(self._queued_intros) < MAX_TABLE:
                self._queued_intros[stream] = None
            return
        self._inflight.add(stream)
        self._counters.inc("introductions")
        req = make("snapshot_req", cluster=self._card.cluster, card=self._card.to_map())
        self.client.request(stream, req, timeout=SNAPSHOT_TIMEOUT_S,
                            on_reply=lambda call, reply: self._on_snapshot(call, reply))

    def _on_snapshot(self, call: Call, reply: Message | BusError) -> None:
        self._inflight.discard(call.endpoint)
        while self._queued_intros and len(self._inflight) < MAX_INTRODUCING:
            stream, _ = self._queued_intros.popitem(last=False)
            self._introduce(stream)
        # connect lazily: the introduction's DEALER is closed once nothing else uses it, so a
        # member costs a request connection only while a role (or a later introduction) does
        # (forged members once held 2,000 DEALERs redialling bogus endpoints forever)
        self.client.release(call.endpoint)
        if isinstance(reply, BusError):
            log.debug("snapshot from %s failed: %s", call.endpoint, reply)
            owners = [m for m in self._table.members()
                      if m.card.endpoints["stream"] == call.endpoint
                      and m.state in (State.ALIVE, State.SUSPECT)]
            if not owners:
                # nobody alive there (a dead seed): drop the requests queued for it. A live or
                # merely suspected member's connection is left alone: roles may have calls in
                # flight on it, and a member suspected on a loaded machine (so re-introduced as
                # a seed, and too slow to answer the snapshot) is not dead; forgetting it here
                # failed a generation in flight to it ("was forgotten")
                self.client.forget(call.endpoint)
            return
        if reply.type == "error":
            first = call.endpoint not in self._refused
            self._refused.add(call.endpoint)  # seeds are retried every second: warn once
            log.log(logging.WARNING if first else logging.DEBUG,
                    "peer %s refused our introduction: %s: %s", call.endpoint,
                    reply.get("code"), reply.get("message"))
            return
        if reply.type != "snapshot":
            self._counters.inc("dropped")
            return
        self._counters.inc("snapshots_received")
        now = time.monotonic()
        entries = reply["cards"]
        if len(entries) > MAX_MEMBERS + 1:  # + 1: the sender's own card
            self._counters.inc("hostile")
            log.debug("snapshot from %s lists %d cards; reading the first %d", call.endpoint,
                      len(entries), MAX_MEMBERS + 1)
        for entry in entries[:MAX_MEMBERS + 1]:
            try:
                card = Card.from_map(entry)
            except CardError as exc:
                self._drop(f"snapshot entry from {call.endpoint}", exc)
                continue
            if card.node_id == self.node_id:  # our past, whatever its state: outgrow it
                before = self._card.incarnation
                self._on_card(card, now, direct=False)
                if self._card.incarnation != before:
                    self._introduce(call.endpoint)  # it ignored our stale card: show the new one
                continue
            if entry.get("state") not in (State.ALIVE.value, State.SUSPECT.value):
                continue
            direct = card.node_id == reply.sender
            if direct:
                self._introduced[card.node_id] = card.incarnation
            self._on_card(card, now, direct)


def _copy(m: Member) -> Member:
    """Members are frozen, but their cards hold dicts: give each reader its own."""
    c = m.card
    return replace(m, card=replace(c, endpoints=dict(c.endpoints), extras=_deep(c.extras)))


def _deep(value):
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    return value
