"""The one door into the member table, and what follows each change.

Gossip, introductions, snapshots and the failure-detection clock all change the table. Why a
class of its own: each change must be made under the view's lock, a card about ourselves must
go to the refuter instead of the table, and every event it causes must reach, in order, the
parts that react on the bus (`Links` connects or disconnects, the `Introducer` introduces us
to a new member) before it is handed to subscribers on the event thread. Doing that in one
place means no input path can forget a step. memberlist does the same in `state.go`
(`aliveNode`, `suspectNode`, `deadNode` each update the table and then notify the delegate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from discovery.cards import Card
from discovery.events import EventBus
from discovery.refuter import Refuter
from discovery.table import Event
from discovery.view import LocalView

log = logging.getLogger("discovery.membership")

Reaction = Callable[[Event], None]  # a side effect on the bus, run on the I/O thread
Sweep = Callable[[Callable[[str], bool]], None]  # drops what it holds for forgotten ids


class StateUpdates:
    """Applies inputs to the table under its lock and runs their consequences (I/O thread)."""

    def __init__(self, view: LocalView, refuter: Refuter, events: EventBus) -> None:
        self.view = view
        self.refuter = refuter
        self.events = events
        self.reactions: list[Reaction] = []  # per event, in this order
        self.sweeps: list[Sweep] = []  # after each tick, for members the table forgot

    def card(self, card: Card, now: float, direct: bool) -> None:
        """A card arrived: `direct` when its owner sent it (gossip or an introduction)."""
        if card.node_id == self.view.node_id:
            self.refuter.on_own_card(card)
            return
        self._react(self.view.change(lambda t: t.on_card(card, now, direct)))

    def heartbeat(self, sender: str, incarnation: int, version: int, now: float) -> bool:
        """A heartbeat from another member; True when we should ask it for its newer card."""
        events, need_card = self.view.change(
            lambda t: t.on_heartbeat(sender, incarnation, version, now))
        self._react(events)
        return need_card

    def leave(self, sender: str, incarnation: int, now: float) -> None:
        self._react(self.view.change(lambda t: t.on_leave(sender, incarnation, now)))

    def tick(self, now: float) -> None:
        """Advance failure detection to `now`, then release what forgotten members held."""
        self._react(self.view.change(lambda t: t.tick(now)))
        table = self.view.table
        for sweep in self.sweeps:
            sweep(table.__contains__)

    def _react(self, events: list[Event]) -> None:
        for ev in events:
            m = ev.member
            log.info("member %s %s (%s, incarnation %d)", m.node_id, ev.kind,
                     m.card.name or "-", m.incarnation)
            for react in self.reactions:
                react(ev)
        self.events.publish(events)
