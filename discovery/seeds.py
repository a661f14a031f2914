"""Endpoints we were told about but have no live member for: `--peer` seeds, mDNS, tools.

Why a class of its own: such an endpoint is only a rumour (a stale mDNS record, a seed not
up yet, a typo), so it is introduced to every `SEED_RETRY_S` until a live member owns it;
seeds forever (a restarted cluster finds itself again), discovered endpoints for at most
`DISCOVERED_RETRY_FOR_S`, after which we also stop listening to the PUB endpoint they
named. mDNS ads of other clusters or protocol versions are counted (`foreign`) and ignored.
"""

from __future__ import annotations

import time

from codec.schema import PROTOCOL_VERSION
from discovery.cards import check_endpoint
from discovery.counters import Counters
from discovery.introductions import Introducer
from discovery.links import Links
from discovery.mdns import PeerAd
from discovery.view import LocalView

SEED_RETRY_S = 1.0
DISCOVERED_RETRY_FOR_S = 30.0  # keep retrying an mDNS-found endpoint until it answers


class Seeds:
    """Keeps introducing us to seeds and discovered endpoints until they answer (I/O thread)."""

    def __init__(self, seeds: tuple[str, ...], view: LocalView, links: Links,
                 introducer: Introducer, counters: Counters) -> None:
        self.seeds = tuple(seeds)
        self.view = view
        self.links = links
        self.introducer = introducer
        self._counters = counters
        # discovered stream endpoint -> (retry until, its PUB endpoint or None)
        self._pending: dict[str, tuple[float, str | None]] = {}

    def on_mdns_peer(self, ad: PeerAd) -> None:
        """Only peers of our cluster and protocol count."""
        own = self.view.own
        if ad.cluster != own.cluster or ad.proto != PROTOCOL_VERSION:
            self._counters.inc("foreign")
            return
        if ad.node_id != own.node_id:
            self.discovered(ad.stream, ad.gossip)

    def discovered(self, stream: str, gossip: str | None) -> None:
        if not check_endpoint(stream) or stream == self.view.own.endpoints["stream"]:
            return
        if stream in self.view.live_streams():
            return  # already a live member
        if gossip and check_endpoint(gossip):
            self.links.listen_early(gossip)  # start hearing it even before the snapshot returns
        else:
            gossip = None
        self._pending[stream] = (time.monotonic() + DISCOVERED_RETRY_FOR_S, gossip)
        self.introducer.introduce(stream)

    def contact(self) -> None:
        """Every second: seeds, and discovered endpoints, that no live member owns yet."""
        live = self.view.live_streams()
        now = time.monotonic()
        for ep, (until, gossip) in list(self._pending.items()):
            if ep in live:
                del self._pending[ep]
            elif now > until:
                del self._pending[ep]  # never answered: stop hearing that address too
                if gossip is not None:
                    self.links.stop_early(gossip)
        for ep in (*self.seeds, *self._pending):
            if ep not in live:
                self.introducer.introduce(ep)
