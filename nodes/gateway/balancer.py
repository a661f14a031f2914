"""Pick the verifier for a request: same model, alive, least loaded; refuse when all are full.

Load is what the verifier last reported in its telemetry (active + queued, about once a second)
or what this gateway has in flight on it, whichever is larger: our own count is exact and fresh,
the report also counts other clients. Each verifier takes at most `max_inflight` requests from
this gateway (its running one plus a bounded queue), so a burst waits in no unbounded backlog:
the request beyond that gets a 429 with Retry-After. Owned by the gateway's asyncio thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from discovery.table import Member, State
from nodes.gateway.metrics import MAX_TRACKED, Bounded


@dataclass(frozen=True)
class VerifierInfo:
    """What the gateway needs of a verifier's card (a snapshot, safe to keep)."""

    node_id: str
    name: str
    endpoint: str
    model: str
    tokenizer: str
    tok_s: float


def verifiers_of(members: Iterable[Member]) -> list[VerifierInfo]:
    """The alive verifiers among `members` (the gateway's own node included)."""
    out = []
    for m in members:
        card = m.card
        if m.state is not State.ALIVE or "verifier" not in card.roles or not card.is_worker:
            continue
        endpoint = card.endpoints.get("stream", "")
        if not endpoint or not card.model:
            continue
        out.append(VerifierInfo(card.node_id, card.name, endpoint, card.model, card.tokenizer,
                                card.tok_s))
    return out


class NoCapacity(Exception):
    """Every verifier of the model is at its in-flight limit."""


class Balancer:
    def __init__(self, max_inflight: int = 8) -> None:
        if max_inflight < 1:
            raise ValueError(f"max in-flight per verifier must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.inflight: dict[str, int] = {}
        #: node id -> active + queued from its telemetry (members only, bounded)
        self.reported: dict[str, int] = Bounded(MAX_TRACKED)

    def load(self, node_id: str) -> int:
        return max(self.inflight.get(node_id, 0), self.reported.get(node_id, 0))

    def pick(self, candidates: list[VerifierInfo], exclude: set[str] = frozenset()
             ) -> VerifierInfo:
        """The least loaded candidate with room; raises NoCapacity (LookupError if none)."""
        usable = [v for v in candidates if v.node_id not in exclude]
        if not usable:
            raise LookupError("no verifier")
        free = [v for v in usable if self.inflight.get(v.node_id, 0) < self.max_inflight]
        if not free:
            raise NoCapacity(f"all {len(usable)} verifier(s) have {self.max_inflight} "
                             "requests in flight")
        return min(free, key=lambda v: (self.load(v.node_id), -v.tok_s, v.node_id))

    def acquire(self, v: VerifierInfo) -> None:
        self.inflight[v.node_id] = self.inflight.get(v.node_id, 0) + 1

    def release(self, v: VerifierInfo) -> None:
        n = self.inflight.get(v.node_id, 0) - 1
        if n > 0:
            self.inflight[v.node_id] = n
        else:
            self.inflight.pop(v.node_id, None)

    def report(self, node_id: str, active: int, queued: int) -> None:
        self.reported[node_id] = max(0, active) + max(0, queued)
