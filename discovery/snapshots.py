"""Serving snapshots: the answer to a peer's introduction (`snapshot_req`).

The request carries the peer's card; we add it as if heard from the owner, and reply with our
card and the cards of the members we hold alive (ZeroMQ guide "Clone" pattern, memberlist's
push/pull). Why a class of its own: this is the one membership input that anybody who can
reach our StreamServer may send, and its answer is the largest message we build, so both the
checks on the way in (right cluster, a card of the sender's own) and the size bound on the way
out live here.
"""

from __future__ import annotations

import time

import msgpack

from bus.streams import Request
from codec.messages import DEFAULT_LIMITS, make
from discovery.cards import Card, CardError
from discovery.counters import Counters
from discovery.introductions import Introducer, TakeCard
from discovery.table import State
from discovery.view import LocalView
from discovery.wire import drop

#: bytes of cards one snapshot carries (under the codec's header limit, with room to spare)
SNAPSHOT_BYTES = DEFAULT_LIMITS.max_header_bytes * 3 // 4


class SnapshotServer:
    """Answers `snapshot_req` on the I/O thread."""

    def __init__(self, view: LocalView, introducer: Introducer, counters: Counters,
                 take_card: TakeCard) -> None:
        self.view = view
        self.introducer = introducer
        self._counters = counters
        self._take_card = take_card

    def handle(self, req: Request) -> bool:
        """StreamServer handler for `snapshot_req`; False if the type is not ours."""
        msg = req.message
        if msg.type != "snapshot_req":
            return False
        cluster = self.view.own.cluster
        if msg["cluster"] != cluster:
            req.fail("wrong_cluster", f"this node belongs to cluster {cluster!r}, "
                                      f"not {msg['cluster']!r}")
            return True
        peer_card = msg.get("card")
        if peer_card is not None:
            try:
                card = Card.from_map(peer_card)
                if card.node_id != msg.sender:
                    raise CardError("a node may only introduce its own card")
            except CardError as exc:
                drop(self._counters, f"introduction from {msg.sender!r}", exc)
                req.fail("bad_card", str(exc)[:300])
                return True
            self.introducer.introduced_by(card)  # it knows us: no need to reply
            self._take_card(card, time.monotonic(), True)
        self._counters.inc("snapshots_served")
        maps = self.maps()
        if peer_card is not None:
            maps += self.past_of(card)
        req.reply(make("snapshot", cards=maps))
        return True

    def maps(self) -> list[dict]:
        """Our card and the alive members' (suspects are left out: likely dead, let them prove
        it), longest-known first, within what one message header carries: a table full of
        forged members once made every snapshot too big to send, so no introduction worked."""
        out = [{**self.view.own.to_map(), "state": State.ALIVE.value}]
        room = SNAPSHOT_BYTES - len(msgpack.packb(out[0]))
        alive = sorted((m for m in self.view.table.members() if m.state is State.ALIVE),
                       key=lambda m: m.since)
        for m in alive:
            entry = {**m.card.to_map(), "state": m.state.value}
            room -= len(msgpack.packb(entry))
            if room < 0:
                self._counters.inc("snapshot_cut")
                break
            out.append(entry)
        return out

    def past_of(self, card: Card) -> list[dict]:
        """The card we hold for an introducer that came back below it (a restart whose counter
        file was lost or corrupt), whatever its state: the introducer outgrows it at once
        instead of being ignored as stale until we forget it."""
        held = self.view.table.get(card.node_id)
        if held is None or held.incarnation <= card.incarnation or held.state is State.ALIVE:
            return []  # alive cards are in the snapshot already
        return [{**held.card.to_map(), "state": held.state.value}]
