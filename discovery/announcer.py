"""What this node says about itself on gossip: its card, its heartbeats, its leave.

Why a class of its own: every membership message we publish carries the same sender and one
sequence of `seq` numbers, and after a leave nothing more may go out (peers would take us
back). One publisher holding the sequence and the `left` flag keeps both true whoever asks
it to speak (the heartbeat timer, a card update, a refutation).

A heartbeat carries our incarnation and card version (so peers notice a newer card and ask
for it), the ids we suspect (so a suspect can refute), and a digest of our live view (so a
peer that knows more members than we do is asked for them; see `introductions.DigestSync`).
"""

from __future__ import annotations

from bus.gossip import GossipChannel
from codec.messages import make
from discovery.cards import Card
from discovery.view import LocalView


class Announcer:
    """Publishes our membership messages on the I/O thread."""

    def __init__(self, gossip: GossipChannel, topic: str, view: LocalView) -> None:
        self.gossip = gossip
        self.topic = topic
        self.view = view
        self.left = False  # after our leave, nothing more is said
        self._seq = 0

    def publish(self, type_: str, **fields) -> None:
        self._seq += 1
        self.gossip.publish(self.topic, make(type_, sender=self.view.node_id, seq=self._seq,
                                             **fields))

    def card(self) -> None:
        if not self.left:
            self.publish("card", **self.view.own.wire_fields())

    def heartbeat(self) -> None:
        c = self.view.own
        fields = {"cluster": c.cluster, "incarnation": c.incarnation, "version": c.version}
        suspects = self.view.table.suspects()
        if suspects:
            fields["suspects"] = suspects
        fields["peers"] = list(self.view.digest())
        self.publish("heartbeat", **fields)

    def set_card(self, card: Card) -> None:
        """Adopt a new version of our card and say so at once (card, then a heartbeat)."""
        self.view.set_card(card)
        self.card()
        self.heartbeat()

    def leave(self) -> None:
        """Say goodbye once; later calls, and later cards, say nothing."""
        if self.left:
            return
        self.left = True
        c = self.view.own
        self.publish("leave", cluster=c.cluster, incarnation=c.incarnation)
