"""Node telemetry: about once a second, publish a `stats` message on the cluster's stats topic.

Figures come from the roles (verifier: tok/s, active/queued, per-proposer acceptance, deadline
misses; proposer: sessions, drafts served, draft tok/s) plus what every node has: CPU and memory
use, bus RTT to each peer (a `ping` every few seconds), malformed messages dropped. Stats go on
their own topic prefix so only monitors subscribe to them; workers never receive them.

Everything runs on the I/O thread (timers), reading role counters that the compute threads
update; a slightly stale figure is fine for a live view.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from bus.streams import BusError, Call
from codec.messages import Message, make
from codec.structs import Ping

log = logging.getLogger(__name__)

STATS_EVERY_S = 1.0
PING_EVERY_S = 3.0


def stats_topic(cluster: str) -> str:
    """Topic prefix of a cluster's telemetry (distinct from membership gossip)."""
    return f"specbus-stats/{cluster}/"


def _count(section: Any, *keys: str) -> int:
    if not isinstance(section, dict):
        return 0
    total = 0
    for key in keys:
        n = section.get(key)
        if isinstance(n, int | float) and not isinstance(n, bool) and n > 0:
            total += int(n)
    return total


def work_in_hand(stats: dict[str, Any]) -> int:
    """The node's `load`: the work it holds now, summed over its roles. A verifier's generations
    running and queued (what cluster clients balance on, nodes/cluster_client/choice.py), a
    proposer's open draft sessions, a gateway's requests in flight (left out beside a verifier
    of its own, whose generations they are). Read fresh at every stats message; the card's
    `load` field is not re-gossiped for it (a card change costs a round of gossip to every
    member)."""
    verifier = stats.get("verifier")
    gateway = 0 if isinstance(verifier, dict) else _count(stats.get("gateway"), "inflight")
    return (_count(verifier, "active", "queued") + _count(stats.get("proposer"), "sessions_open")
            + gateway)


class Telemetry:
    """Publishes one `stats` message per interval for a started `Node`."""

    def __init__(self, node, providers: list[Callable[[], dict[str, Any]]] | None = None,
                 every: float = STATS_EVERY_S, ping_every: float = PING_EVERY_S) -> None:
        self.node = node
        self.providers = list(providers or [])
        self.every = every
        self.ping_every = ping_every
        self.rtt_ms: dict[str, float] = {}  # peer node id -> last measured RTT (I/O thread)
        self._timers: list = []
        self._seq = 0
        self._proc = None

    def start(self) -> None:
        import psutil

        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)  # first call primes the counter
        loop = self.node.loop
        self._timers = [loop.call_every(self.every, self._publish, first=self.every),
                        loop.call_every(self.ping_every, self._ping_peers, first=0.5)]

    def stop(self) -> None:
        for t in self._timers:
            t.cancel()

    def snapshot(self) -> dict[str, Any]:
        node = self.node
        mem = self._proc.memory_info().rss if self._proc else 0
        server, gossip, client = node.server, node.gossip, node.client
        out: dict[str, Any] = {
            "cpu_percent": round(self._proc.cpu_percent(None), 1) if self._proc else 0.0,
            "rss_bytes": int(mem),
            "dropped": {"gossip": gossip.dropped, "requests": server.dropped,
                        "replies": client.dropped},
            "rtt_ms": dict(self.rtt_ms),
        }
        if node.membership is not None:  # the table's size and what it refused (issue 21)
            counters = node.membership.counters
            out["membership"] = {
                "members": len(node.membership.members(include_self=False)),
                **{k: counters.get(k, 0) for k in ("refused_joins", "hostile", "dropped")}}
        for provider in self.providers:
            try:
                out.update(provider())
            except Exception:  # noqa: BLE001 - a broken figure must not stop the others
                log.exception("telemetry provider failed")
        out["load"] = work_in_hand(out)
        return out

    # -- I/O thread ---------------------------------------------------------------------------
    def _publish(self) -> None:
        card = self.node.membership.card
        self._seq += 1
        msg = make("stats", sender=self.node.node_id, seq=self._seq, cluster=card.cluster,
                   incarnation=card.incarnation, stats=self.snapshot())
        self.node.gossip.publish(stats_topic(card.cluster), msg)

    def _ping_peers(self) -> None:
        """RTT over the request connections that are up: a ping never opens one (connections
        are made when a role uses a member, and let go; pinging every member would hold one
        to each, forged members included)."""
        client = self.node.client
        for m in self.node.membership.members(include_self=False):
            endpoint = m.card.endpoints.get("stream")
            if m.state.value != "alive" or not endpoint or not client.connected(endpoint):
                self.rtt_ms.pop(m.node_id, None)
                continue
            self._ping(m.node_id, endpoint)

    def _ping(self, node_id: str, endpoint: str) -> None:
        t0 = time.perf_counter()

        def done(call: Call, item: Message | BusError) -> None:
            if isinstance(item, Message) and item.type == "pong":
                self.rtt_ms[node_id] = round((time.perf_counter() - t0) * 1000, 3)

        self.node.client.request(endpoint, Ping().to_message(), timeout=1.0, on_reply=done)


class StatsWatcher:
    """The latest gossiped `stats` of every node of a cluster, as a node of one's own hears
    them (monitors, benchmarks, tests). The node's I/O thread writes; readers get copies."""

    def __init__(self, node, cluster: str) -> None:
        self._cond = threading.Condition()
        self._latest: dict[str, dict] = {}
        node.register_gossip("stats", self._on_stats)
        node.gossip.subscribe(stats_topic(cluster))

    def _on_stats(self, topic: str, msg: Message) -> None:  # I/O thread
        stats = msg.get("stats")
        if isinstance(stats, dict):
            with self._cond:
                self._latest[msg.sender] = stats
                self._cond.notify_all()

    def latest(self, node_id: str, *path: str) -> dict:
        """A copy of `node_id`'s last stats, or of the map at `path` inside them ({}: none)."""
        with self._cond:
            got: Any = self._latest.get(node_id) or {}
            for key in path:
                got = got.get(key) if isinstance(got, dict) else None
            return dict(got) if isinstance(got, dict) else {}

    def wait(self, node_id: str, pred: Callable[[dict], bool], *path: str,
             timeout: float = 120.0) -> dict:
        """Block until `pred` holds for `latest(node_id, *path)`; AssertionError on timeout
        (with the last value seen)."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self.latest(node_id, *path)
                if got and pred(got):
                    return got
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"stats of {node_id} never matched; last: {got}")
                self._cond.wait(left)
