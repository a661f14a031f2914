"""Joining: introducing ourselves to peers and reading the snapshots they answer with.

An introduction is a `snapshot_req` carrying our card to a peer's StreamServer; the peer adds
us and replies with a `snapshot` of every live card it knows (ZeroMQ guide "Clone" pattern).
Cards in the snapshot we did not know join the table, and the table's "join" events make us
introduce ourselves to them in turn, so a node that can see one peer still reaches everyone.

Why a class of its own: introductions are the one place membership opens request connections
on its own, to endpoints anybody may name (seeds, mDNS, cards in a snapshot), so their number
in flight, their queue and their clean-up after a failure are bounded here, whatever asked.
`DigestSync` decides when a heartbeat's view digest is worth another introduction.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from bus.streams import BusError, Call, StreamClient
from codec.messages import Message, make
from discovery.announcer import Announcer
from discovery.cards import Card, CardError
from discovery.counters import Counters
from discovery.limits import MAX_MEMBERS, MAX_TABLE
from discovery.table import Event, State
from discovery.view import LocalView
from discovery.wire import drop

log = logging.getLogger("discovery.membership")

SNAPSHOT_TIMEOUT_S = 2.0
MAX_INTRODUCING = 16  # introductions (snapshot requests) in flight at once
SYNC_MIN_INTERVAL_S = 1.0  # digest mismatch: at most one snapshot request per peer per second

TakeCard = Callable[[Card, float, bool], None]  # StateUpdates.card


class Introducer:
    """Sends our card to peers, at most `MAX_INTRODUCING` at once, and reads their snapshots."""

    def __init__(self, client: StreamClient, view: LocalView, announcer: Announcer,
                 counters: Counters, take_card: TakeCard) -> None:
        self.client = client
        self.view = view
        self.announcer = announcer
        self._counters = counters
        self._take_card = take_card
        self._inflight: set[str] = set()  # stream endpoints with a snapshot_req in flight
        self._queued: OrderedDict[str, None] = OrderedDict()  # waiting for a turn
        self._introduced: dict[str, int] = {}  # node id -> incarnation we exchanged cards with
        self._refused: set[str] = set()  # endpoints that answered our introduction with an error

    def introduce(self, stream: str) -> None:
        """Send our card to a peer's StreamServer and ask for its snapshot. At most
        `MAX_INTRODUCING` at once (each holds a connection, three sockets, for up to
        `SNAPSHOT_TIMEOUT_S`); the rest wait their turn: a burst of forged cards once opened
        hundreds at once and ran the node out of ZeroMQ sockets."""
        own = self.view.own
        if self.announcer.left or stream in self._inflight or stream == own.endpoints["stream"]:
            return
        if len(self._inflight) >= MAX_INTRODUCING:
            if len(self._queued) < MAX_TABLE:
                self._queued[stream] = None
            return
        self._inflight.add(stream)
        self._counters.inc("introductions")
        req = make("snapshot_req", cluster=own.cluster, card=own.to_map())
        self.client.request(stream, req, timeout=SNAPSHOT_TIMEOUT_S,
                            on_reply=lambda call, reply: self._on_reply(call, reply))

    def ask_card(self, node_id: str) -> None:
        """Introduce ourselves again to a member, for its newer card (or its view)."""
        m = self.view.table.get(node_id)
        if m is not None:
            self.introduce(m.card.endpoints["stream"])

    def introduced_by(self, card: Card) -> None:
        """The owner of `card` introduced itself to us: it knows us, no need to introduce."""
        self._introduced[card.node_id] = card.incarnation

    def on_event(self, ev: Event) -> None:
        """A member joined: introduce ourselves unless we exchanged cards at this incarnation."""
        m = ev.member
        if ev.kind == "join" and self._introduced.get(m.node_id) != m.incarnation:
            self.introduce(m.card.endpoints["stream"])

    def forget_gone(self, is_member: Callable[[str], bool]) -> None:
        for node_id in [n for n in self._introduced if not is_member(n)]:
            del self._introduced[node_id]

    def _on_reply(self, call: Call, reply: Message | BusError) -> None:
        self._inflight.discard(call.endpoint)
        while self._queued and len(self._inflight) < MAX_INTRODUCING:
            stream, _ = self._queued.popitem(last=False)
            self.introduce(stream)
        # connect lazily: the introduction's DEALER is closed once nothing else uses it, so a
        # member costs a request connection only while a role (or a later introduction) does
        # (forged members once held 2,000 DEALERs redialling bogus endpoints forever)
        self.client.release(call.endpoint)
        if isinstance(reply, BusError):
            self._failed(call, reply)
        elif reply.type == "error":
            first = call.endpoint not in self._refused
            self._refused.add(call.endpoint)  # seeds are retried every second: warn once
            log.log(logging.WARNING if first else logging.DEBUG,
                    "peer %s refused our introduction: %s: %s", call.endpoint,
                    reply.get("code"), reply.get("message"))
        elif reply.type != "snapshot":
            self._counters.inc("dropped")
        else:
            self._read_snapshot(call, reply)

    def _failed(self, call: Call, err: BusError) -> None:
        log.debug("snapshot from %s failed: %s", call.endpoint, err)
        owners = [m for m in self.view.table.members()
                  if m.card.endpoints["stream"] == call.endpoint
                  and m.state in (State.ALIVE, State.SUSPECT)]
        if not owners:
            # nobody alive there (a dead seed): drop the requests queued for it. A live or
            # merely suspected member's connection is left alone: roles may have calls in
            # flight on it, and a member suspected on a loaded machine (so re-introduced as
            # a seed, and too slow to answer the snapshot) is not dead; forgetting it here
            # failed a generation in flight to it ("was forgotten")
            self.client.forget(call.endpoint)

    def _read_snapshot(self, call: Call, reply: Message) -> None:
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
                drop(self._counters, f"snapshot entry from {call.endpoint}", exc)
                continue
            if card.node_id == self.view.node_id:  # our past, whatever its state: outgrow it
                before = self.view.own.incarnation
                self._take_card(card, now, False)
                if self.view.own.incarnation != before:
                    self.introduce(call.endpoint)  # it ignored our stale card: show the new one
                continue
            if entry.get("state") not in (State.ALIVE.value, State.SUSPECT.value):
                continue
            direct = card.node_id == reply.sender
            if direct:
                self._introduced[card.node_id] = card.incarnation
            self._take_card(card, now, direct)


class DigestSync:
    """Anti-entropy: ask a peer for a snapshot when its heartbeat says it knows more.

    Heartbeats carry [count, crc32 of the sorted ids] of the sender's live view, itself
    included. A node whose own view is smaller, or as large but different, asks that peer for
    a snapshot, at most once a second per peer. Why: members learned late (a snapshot cut
    short, an introduction lost) still spread, even when nobody runs mDNS.
    """

    def __init__(self, view: LocalView, introducer: Introducer) -> None:
        self.view = view
        self.introducer = introducer
        self._last_sync: dict[str, float] = {}  # node id -> when we last asked it to sync

    def check(self, sender: str, peers: tuple[int, int] | None, now: float) -> None:
        """Ask `sender` for a snapshot if it seems to know members we do not."""
        if peers is None:
            return
        count, crc = self.view.digest()
        if peers[0] < count or (peers[0] == count and peers[1] == crc):
            return
        if now - self._last_sync.get(sender, -1e9) < SYNC_MIN_INTERVAL_S:
            return
        self._last_sync[sender] = now
        self.introducer.ask_card(sender)

    def forget_gone(self, is_member: Callable[[str], bool]) -> None:
        for node_id in [n for n in self._last_sync if not is_member(n)]:
            del self._last_sync[node_id]
