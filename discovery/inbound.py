"""Membership gossip coming in: `card`, `heartbeat` and `leave`, and what each one means.

Why a class of its own: these are the messages anybody on the gossip mesh can send, so this is
where they are checked (our cluster's topic, `discovery.wire`'s bounds) and where nothing may
raise; and a heartbeat means several things at once, decided here in one place: a sign of life
(the table), maybe a newer card to ask for, maybe a view digest to sync, maybe a suspicion of
us to refute. Messages claiming to come from us go to the `Refuter`, never to the table.
"""

from __future__ import annotations

import time

from codec.messages import Message
from discovery.cards import Card, CardError, printable
from discovery.counters import Counters
from discovery.introductions import DigestSync, Introducer
from discovery.refuter import Refuter
from discovery.updates import StateUpdates
from discovery.view import LocalView
from discovery.wire import Heartbeat, Leave, drop, parse_heartbeat, parse_leave

MEMBERSHIP_TYPES = ("card", "heartbeat", "leave")


class GossipIn:
    """Gossip handler for membership types, on the I/O thread."""

    def __init__(self, topic: str, view: LocalView, updates: StateUpdates, refuter: Refuter,
                 introducer: Introducer, sync: DigestSync, counters: Counters) -> None:
        self.topic = topic
        self.view = view
        self.updates = updates
        self.refuter = refuter
        self.introducer = introducer
        self.sync = sync
        self._counters = counters

    def handle(self, topic: str, msg: Message) -> bool:
        """Gossip handler for membership types; False if the type is not ours."""
        if msg.type not in MEMBERSHIP_TYPES:
            return False
        if topic != self.topic or msg.get("cluster") != self.view.own.cluster:
            self._counters.inc("foreign")
            return True
        try:
            if msg.type == "card":
                self.updates.card(Card.from_fields(msg.sender, msg.fields), time.monotonic(),
                                  direct=True)
            elif msg.type == "heartbeat":
                self._on_heartbeat(parse_heartbeat(msg))
            else:
                self._on_leave(parse_leave(msg))
        except CardError as exc:
            drop(self._counters, f"{msg.type} from {msg.sender!r}", exc)
        return True

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        now = time.monotonic()
        if hb.sender == self.view.node_id:
            self.refuter.on_own_heartbeat(hb.incarnation, hb.version)
            return
        if self.updates.heartbeat(hb.sender, hb.incarnation, hb.version, now):
            self.introducer.ask_card(hb.sender)
        else:
            self.sync.check(hb.sender, hb.peers, now)
        if self.view.node_id in hb.suspects:
            self.refuter.refute(self.view.own.incarnation,
                                f"{printable(hb.sender, 40)} listing us as suspect")

    def _on_leave(self, leave: Leave) -> None:
        if leave.sender == self.view.node_id:
            self.refuter.on_own_leave(leave.incarnation)
            return
        self.updates.leave(leave.sender, leave.incarnation, time.monotonic())
