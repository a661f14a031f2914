"""Which verifier serves a generation, when a serving one counts as gone, and the line of
generations waiting for a verifier slot.

Load is what the verifier last reported in its telemetry (active + queued, about once a second;
the gateway feeds `Balancer.report`), else the load on its card, or what this client has in
flight on it, whichever is larger: our own count is exact and fresh, the report also counts
other clients. A client keeps at most what a verifier admits per connection in flight on it
(its card's `per_client`: the batch plus a bounded queue, nodes/verifier/role.py) and, when
asked, less (`max_inflight`, the gateway's `--gateway-max-inflight`).

Beyond that a generation waits in the client's own line (`queue` places, `queue_wait_s` at
most): first come, first served among the generations that could use the same verifier, a
place given up as soon as its generation is closed (a gateway user that disconnects). A
verifier that answers `busy` (its own queue full of other clients' work) is held: nothing more
goes to it until one of ours there ends or `HOLD_S` passes, and the generation tries another or
waits in the line. Only a full line (or a wait past its limit) is `busy`, so a gateway carrying
16 users over one connection serves them all while every queue stays bounded. `queue=0`
answers `busy` at once when every verifier is full. A lock makes all of it safe for the sync
client's threads (a bench streams from a pool); the gateway uses it from its asyncio thread
only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from discovery.table import Member, State
from nodes.cluster_client.affinity import SLACK, PrefixAffinity

MAX_REPORTED = 256  # verifiers whose telemetry is kept (a peer cannot grow it without bound)
HOLD_S = 1.0  # a verifier that answered `busy` gets nothing more from a queueing client this long


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
    #: generations it admits per connection, queued or running (its card; 0: not said)
    per_client: int = 0


def info_of(m: Member) -> VerifierInfo:
    """The snapshot of a member's card; a field its card lacks (a test's stand-in member that
    only has a stream endpoint) is left empty."""
    card = m.card
    extras = getattr(card, "extras", None)
    per_client = extras.get("per_client", 0) if isinstance(extras, dict) else 0
    if not isinstance(per_client, int) or isinstance(per_client, bool) or per_client < 1:
        per_client = 0
    return VerifierInfo(m.node_id, getattr(card, "name", ""), card.endpoints.get("stream", ""),
                        getattr(card, "model", ""), getattr(card, "tokenizer", ""),
                        getattr(card, "tok_s", 0.0), getattr(card, "load", 0.0), per_client)


def verifiers_of(members: Iterable[Member]) -> list[VerifierInfo]:
    """The alive verifiers among `members` (a gateway's own node included) and, for a model
    with none alive, its suspect ones.

    Why the suspects: a member turns suspect after 0.8 s without a heartbeat heard, and a
    flood of gossip or a loaded box can delay every verifier's heartbeats that long at once
    (seen once in the hostile soak test: 16 clients, 2,000 forged members heartbeating, both
    verifiers suspect for a moment and a legitimate request refused `no_verifier`). A suspect
    is still a member (SWIM's rule); trying it costs nothing when it is alive, and when it is
    gone its stream fails and the client's usual rules (`verifier_gone`, failover) apply, as
    for a verifier that dies mid-generation. Dead and departed ones never count."""
    alive: list[VerifierInfo] = []
    suspect: list[VerifierInfo] = []
    for m in members:
        card = m.card
        if m.state not in (State.ALIVE, State.SUSPECT):
            continue
        if "verifier" not in card.roles or not card.is_worker:
            continue
        if not card.endpoints.get("stream") or not card.model:
            continue
        (alive if m.state is State.ALIVE else suspect).append(info_of(m))
    served = {v.model for v in alive}
    return alive + [v for v in suspect if v.model not in served]


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
    """Every verifier of the model is at its in-flight limit (and the line is full)."""


@dataclass(eq=False)
class Ticket:
    """A generation's place in the line. `wake` is called (from whichever thread freed a slot)
    when it may be its turn; the waiter then asks again."""

    deadline: float
    wake: Callable[[], None] | None = None
    wanted: frozenset[str] = field(default_factory=frozenset)  # verifiers it could use
    since: float = field(default_factory=time.monotonic)


class Balancer:
    def __init__(self, max_inflight: int | None = 8, queue: int = 0,
                 queue_wait_s: float = 60.0, unknown_cap: int | None = None) -> None:
        """`max_inflight`: at most this many in flight per verifier (None: what its card
        admits per connection, else `unknown_cap`, else no cap); `queue`: places in the line
        of generations waiting for a slot (0: none, `busy` at once); `queue_wait_s`: the
        longest wait in it."""
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max in-flight per verifier must be >= 1, got {max_inflight}")
        if queue < 0 or queue_wait_s <= 0:
            raise ValueError(f"queue must be >= 0 and its wait > 0, got {queue}, "
                             f"{queue_wait_s}")
        self.max_inflight = max_inflight
        self.unknown_cap = unknown_cap
        self.queue = queue
        self.queue_wait_s = queue_wait_s
        self.inflight: dict[str, int] = {}
        #: node id -> active + queued from its telemetry (members only, bounded)
        self.reported: OrderedDict[str, int] = OrderedDict()
        self.line: list[Ticket] = []  # oldest first
        #: node id -> (monotonic time, our in-flight count then): it answered `busy` (its
        #: queue full of other clients' work); no more is sent to it until one of ours on it
        #: ends or HOLD_S passes
        self.held: dict[str, tuple[float, int]] = {}
        self.refused = 0  # generations refused because the line was full or waited too long
        #: which verifier holds which recent generation's tokens (conversations go back there)
        self.affinity = PrefixAffinity()
        self._lock = threading.Lock()

    def load(self, v: VerifierInfo) -> float:
        return max(self.inflight.get(v.node_id, 0), self.reported.get(v.node_id, v.load))

    def limit(self, v: VerifierInfo) -> int | None:
        """What this client keeps in flight on `v` at most (None: no cap)."""
        admits = v.per_client or self.unknown_cap
        caps = [c for c in (self.max_inflight, admits) if c]
        return min(caps) if caps else None

    def has_room(self, v: VerifierInfo, now: float | None = None) -> bool:
        n = self.inflight.get(v.node_id, 0)
        held = self.held.get(v.node_id)
        if held is not None and n >= held[1]:
            now = time.monotonic() if now is None else now
            if now < held[0] + HOLD_S:
                return False
        cap = self.limit(v)
        return cap is None or n < cap

    def hold(self, v: VerifierInfo, now: float | None = None) -> None:
        """`v` answered `busy` (its own queue is full): send it nothing more for HOLD_S, or
        until one of this client's generations on it ends; meanwhile waiters try others or
        wait in the line."""
        with self._lock:
            now = time.monotonic() if now is None else now
            for node_id in [k for k, (t, _) in self.held.items() if now >= t + HOLD_S]:
                del self.held[node_id]
            # ours there besides the refused one (still counted until its attempt ends)
            self.held[v.node_id] = (now, max(0, self.inflight.get(v.node_id, 0) - 1))
            while len(self.held) > MAX_REPORTED:
                self.held.pop(next(iter(self.held)))

    def pick(self, candidates: list[VerifierInfo], exclude: Iterable[str] = frozenset()
             ) -> VerifierInfo:
        """The least loaded candidate with room; raises NoCapacity (LookupError if none).
        Takes no slot and joins no line (see `take`)."""
        exclude = set(exclude)
        with self._lock:
            usable = [v for v in candidates if v.node_id not in exclude]
            if not usable:
                raise LookupError("no verifier")
            free = [v for v in usable if self.has_room(v)]
            if not free:
                raise NoCapacity(self._full(usable))
            return min(free, key=lambda v: (self.load(v), -v.tok_s, v.node_id))

    def take(self, candidates: list[VerifierInfo], exclude: Iterable[str] = frozenset(),
             ticket: Ticket | None = None, now: float | None = None,
             prompt_ids: Sequence[int] | None = None) -> VerifierInfo | None:
        """Pick a verifier and take its slot in one step (threads cannot both take the last
        one), or wait: `ticket` joins (or keeps its place in) the line and None is returned.
        With `prompt_ids`, the verifier holding their longest prefix is preferred within
        `SLACK` of the least load (affinity.py). A verifier that a generation ahead in the
        line could use is left to it. Raises
        LookupError when no candidate is left, NoCapacity when every one is full and the line
        is full (or `ticket` is None: no waiting)."""
        exclude = set(exclude)
        with self._lock:
            usable = [v for v in candidates if v.node_id not in exclude]
            if not usable:
                self._leave(ticket)
                raise LookupError("no verifier")
            ahead = self.line if ticket not in self.line else self.line[
                :self.line.index(ticket)]
            claimed = frozenset().union(*(t.wanted for t in ahead))
            free = [v for v in usable if self.has_room(v, now) and v.node_id not in claimed]
            if free:
                v = self._choose(free, prompt_ids)
                self.inflight[v.node_id] = self.inflight.get(v.node_id, 0) + 1
                self._leave(ticket)
                return v
            if ticket is None or (ticket not in self.line and len(self.line) >= self.queue):
                self.refused += 1
                why = self._full(usable)
                if ticket is not None and self.queue:
                    why += f", and {len(self.line)} requests already wait for a slot"
                raise NoCapacity(why)
            ticket.wanted = frozenset(v.node_id for v in usable)
            if ticket not in self.line:
                self.line.append(ticket)
            return None

    def leave(self, ticket: Ticket | None) -> None:
        """`ticket` gives up its place (its generation ended, was cancelled or waited too
        long); those behind it may move up."""
        with self._lock:
            left = self._leave(ticket)
        if left:
            self._wake()

    def expired(self, ticket: Ticket) -> None:
        """`ticket` waited its longest: it leaves the line, counted as refused."""
        with self._lock:
            self.refused += 1
        self.leave(ticket)

    @property
    def waiting(self) -> int:
        return len(self.line)

    def acquire(self, v: VerifierInfo) -> None:
        with self._lock:
            self.inflight[v.node_id] = self.inflight.get(v.node_id, 0) + 1

    def release(self, v: VerifierInfo) -> None:
        with self._lock:
            held = self.held.get(v.node_id)
            if held is not None and self.inflight.get(v.node_id, 0) <= held[1]:
                del self.held[v.node_id]  # another of ours there ended: its queue has room
            n = self.inflight.get(v.node_id, 0) - 1
            if n > 0:
                self.inflight[v.node_id] = n
            else:
                self.inflight.pop(v.node_id, None)
        self._wake()

    def served(self, token_ids: Sequence[int], node_id: str) -> None:
        """A generation's prompt + output ids, produced on `node_id` (which now holds them)."""
        with self._lock:
            self.affinity.served(token_ids, node_id)

    def report(self, node_id: str, active: int, queued: int) -> None:
        with self._lock:
            self.reported[node_id] = max(0, active) + max(0, queued)
            self.reported.move_to_end(node_id)
            while len(self.reported) > MAX_REPORTED:
                self.reported.popitem(last=False)

    # -- lock held ------------------------------------------------------------------------------
    def _choose(self, free: list[VerifierInfo], prompt_ids: Sequence[int] | None
                ) -> VerifierInfo:
        """The least loaded of `free`, unless the one holding the prompt's prefix has at most
        `SLACK` more load."""
        best = min(free, key=lambda v: (self.load(v), -v.tok_s, v.node_id))
        holder = None if prompt_ids is None else self.affinity.holder(prompt_ids)
        for v in free:
            if v.node_id == holder and self.load(v) <= self.load(best) + SLACK:
                self.affinity.routed += 1
                return v
        return best

    def _leave(self, ticket: Ticket | None) -> bool:
        if ticket is not None and ticket in self.line:
            self.line.remove(ticket)
            return True
        return False

    def _full(self, usable: list[VerifierInfo]) -> str:
        caps = sorted({str(self.limit(v)) for v in usable})
        return (f"all {len(usable)} verifier(s) have {'/'.join(caps)} requests of this client "
                "in flight")

    def _wake(self) -> None:
        """Every waiter asks again (the line's order decides who gets the slot)."""
        with self._lock:
            wakers = [t.wake for t in self.line if t.wake is not None]
        for wake in wakers:
            wake()
