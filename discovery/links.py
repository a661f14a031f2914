"""The sockets membership holds towards members, and when it lets them go.

Every member costs sockets: our SUB connects to its PUB (that is how we hear its heartbeats,
so failure detection needs it), and the stream client may keep a request connection to it.
Why a class of its own: whoever connects must also disconnect, and a table that forgets a
member (dead or left for `forget_after`, or evicted under `MAX_TABLE`) produces no event, so
the release has to be swept for. Keeping both ends here means a forged or departed member
never holds a socket for longer than the table remembers it.
"""

from __future__ import annotations

from collections.abc import Callable

from bus.gossip import GossipChannel
from bus.streams import StreamClient
from discovery.cards import Card
from discovery.table import Event


class Links:
    """Gossip subscriptions and request connections per member (I/O thread only)."""

    def __init__(self, gossip: GossipChannel, client: StreamClient) -> None:
        self.gossip = gossip
        self.client = client
        self._gossip_eps: dict[str, str] = {}  # node id -> PUB endpoint we subscribe to
        self._streams: dict[str, str] = {}  # node id -> its request endpoint (for release)

    def on_event(self, ev: Event) -> None:
        """A member joined or changed its card: hear it; it left: stop hearing it."""
        if ev.kind in ("join", "update"):
            self._connect(ev.member.card)
        if ev.kind == "leave":
            self._disconnect(ev.node_id)

    def listen_early(self, gossip_ep: str) -> None:
        """Hear a discovered endpoint before its snapshot (and so its card) arrives."""
        self.gossip.connect(gossip_ep)

    def stop_early(self, gossip_ep: str) -> None:
        """Stop hearing a discovered endpoint that never answered, unless a member uses it."""
        if gossip_ep not in self._gossip_eps.values():
            self.gossip.disconnect(gossip_ep)

    def forget_gone(self, is_member: Callable[[str], bool]) -> None:
        """Release what we hold for members the table no longer has."""
        for node_id in [n for n in self._gossip_eps if not is_member(n)]:
            self._disconnect(node_id)  # forgotten after dead/left for forget_after, or evicted
        for node_id in [n for n in self._streams if not is_member(n)]:
            self.client.release(self._streams.pop(node_id))  # its request connection, if idle

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
