"""Which verifier serves a generation, and when a serving one counts as gone.

Load is what the verifier last reported in its telemetry (active + queued, about once a second;
the gateway feeds `Balancer.report`), else the load on its card, or what this client has in
flight on it, whichever is larger: our own count is exact and fresh, the report also counts
other clients. A client may cap what it sends each verifier (`max_inflight`: the gateway takes
at most its running request plus a bounded queue, so a burst waits in no unbounded backlog and
the one beyond gets a 429); the CLI and the benches leave it uncapped and let the verifier's
own queue answer `busy`. A lock makes the counts safe for the sync client's threads (a bench
streams from a pool); the gateway uses it from its asyncio thread only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from discovery.table import Member, State

MAX_REPORTED = 256  # verifiers whose telemetry is kept (a peer cannot grow it without bound)


@dataclass(frozen=True)
class VerifierInfo:
    """What a client needs of a verifier's card (a snapshot, safe to keep)."""

    node_id: str
    name: str
    endpoint: str
    model: str
    tokenizer: str
    tok_s: float
    load: float = 0.0  # active + queued as the card last said (gossip: may lag telemetry)


def info_of(m: Member) -> VerifierInfo:
    """The snapshot of a member's card; a field its card lacks (a test's stand-in member that
    only has a stream endpoint) is left empty."""
    card = m.card
    return VerifierInfo(m.node_id, getattr(card, "name", ""), card.endpoints.get("stream", ""),
                        getattr(card, "model", ""), getattr(card, "tokenizer", ""),
                        getattr(card, "tok_s", 0.0), getattr(card, "load", 0.0))


def verifiers_of(members: Iterable[Member]) -> list[VerifierInfo]:
    """The alive verifiers among `members` (a gateway's own node included)."""
    out = []
    for m in members:
        card = m.card
        if m.state is not State.ALIVE or "verifier" not in card.roles or not card.is_worker:
            continue
        if not card.endpoints.get("stream") or not card.model:
            continue
        out.append(info_of(m))
    return out


def verifier_gone(node, node_id: str, endpoint: str) -> str | None:
    """Why the verifier `node_id` serving a stream on `endpoint` is gone for good, or None.

    The one liveness rule of the cluster client: gone only when membership no longer counts it
    alive (dead, left or forgotten) AND our connection to it is down. A stalled process
    (SIGSTOP, GC pause, VM hiccup) keeps its connection, so it is waited for; a killed one's
    connection closes at once, so its loss is known as soon as membership declares it dead.
    """
    m = node.membership.get(node_id)
    state = "forgotten" if m is None else m.state.value
    if m is not None and m.state not in (State.DEAD, State.LEFT):
        return None
    if node.client.connected(endpoint):
        return None
    return f"membership says {state}; connection closed"


class ClusterView:
    """The membership questions a generation asks, over a running node (its I/O thread keeps
    membership; reading it from another thread is what every client does)."""

    def __init__(self, node) -> None:
        self.node = node

    def verifiers(self) -> list[VerifierInfo]:
        return verifiers_of(self.node.membership.members(include_self=True))

    def gone(self, v: VerifierInfo) -> str | None:
        return verifier_gone(self.node, v.node_id, v.endpoint)


class NoCapacity(Exception):
    """Every verifier of the model is at its in-flight limit."""


class Balancer:
    def __init__(self, max_inflight: int | None = 8) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max in-flight per verifier must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.inflight: dict[str, int] = {}
        #: node id -> active + queued from its telemetry (members only, bounded)
        self.reported: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, v: VerifierInfo) -> float:
        return max(self.inflight.get(v.node_id, 0), self.reported.get(v.node_id, v.load))

    def has_room(self, v: VerifierInfo) -> bool:
        return self.max_inflight is None or self.inflight.get(v.node_id, 0) < self.max_inflight

    def pick(self, candidates: list[VerifierInfo], exclude: Iterable[str] = frozenset()
             ) -> VerifierInfo:
        """The least loaded candidate with room; raises NoCapacity (LookupError if none)."""
        exclude = set(exclude)
        with self._lock:
            usable = [v for v in candidates if v.node_id not in exclude]
            if not usable:
                raise LookupError("no verifier")
            free = [v for v in usable if self.has_room(v)]
            if not free:
                raise NoCapacity(f"all {len(usable)} verifier(s) have {self.max_inflight} "
                                 "requests in flight")
            return min(free, key=lambda v: (self.load(v), -v.tok_s, v.node_id))

    def acquire(self, v: VerifierInfo) -> None:
        with self._lock:
            self.inflight[v.node_id] = self.inflight.get(v.node_id, 0) + 1

    def release(self, v: VerifierInfo) -> None:
        with self._lock:
            n = self.inflight.get(v.node_id, 0) - 1
            if n > 0:
                self.inflight[v.node_id] = n
            else:
                self.inflight.pop(v.node_id, None)

    def report(self, node_id: str, active: int, queued: int) -> None:
        with self._lock:
            self.reported[node_id] = max(0, active) + max(0, queued)
            self.reported.move_to_end(node_id)
            while len(self.reported) > MAX_REPORTED:
                self.reported.popitem(last=False)
