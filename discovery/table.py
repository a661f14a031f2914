"""The membership table: pure state machine, no sockets, no threads, no clocks of its own.

Every method takes `now` (a `time.monotonic()` reading) and returns the events it caused, so
the rules can be tested without processes. States and transitions:

    (unknown) --card--> alive --silence > suspect_after--> suspect --silence > dead_after--> dead
    suspect --heartbeat/newer card--> alive            (event "alive")
    dead    --heartbeat of its incarnation or newer card from the owner--> alive  ("join")
    alive/suspect/dead --leave of the current incarnation or newer--> left       ("leave")
    left    --card with a higher incarnation--> alive  ("join")
    dead/left for forget_after --> removed (no event)

Anything older than what we know (lower incarnation, or same incarnation and not a newer
version) is stale and changes nothing (counted in `stale`). Anything implausibly far ahead
of what we know (an incarnation, or a version within the same incarnation, more than
`MAX_JUMP` above ours) is hostile and changes nothing either (counted in `hostile`): a live
node only ever moves one step at a time. Only messages heard directly from the owner count as
signs of life; cards learned second-hand (snapshots) may add or update a member but never
revive a dead one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from discovery.cards import Card
from discovery.limits import MAX_TABLE, is_plausible_step


class State(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


EVENT_KINDS = ("join", "update", "suspect", "alive", "dead", "leave")


@dataclass(frozen=True)
class Timeouts:
    """Failure-detection timing in seconds (defaults: dead <= ~1.7 s after the last beat)."""

    heartbeat: float = 0.2
    suspect_after: float = 0.8
    dead_after: float = 1.6
    forget_after: float = 60.0
    check_every: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat < self.suspect_after < self.dead_after <= self.forget_after:
            raise ValueError(
                "timeouts must satisfy 0 < heartbeat < suspect_after < dead_after <= "
                f"forget_after, got {self}"
            )
        if self.check_every <= 0:
            raise ValueError(f"check_every must be positive, got {self.check_every}")


@dataclass(frozen=True)
class Member:
    """A read-only view of one member (copies are handed to other threads)."""

    card: Card
    state: State
    last_heard: float  # monotonic time of the last direct sign of life
    since: float  # monotonic time of the last state change
    is_self: bool = False

    @property
    def node_id(self) -> str:
        return self.card.node_id

    @property
    def incarnation(self) -> int:
        return self.card.incarnation


@dataclass(frozen=True)
class Event:
    """Something happened to a member. `at` is monotonic time in this process."""

    kind: str
    member: Member
    at: float

    @property
    def node_id(self) -> str:
        return self.member.node_id


@dataclass
class _Entry:
    card: Card
    state: State
    last_heard: float
    since: float
    heard_inc: int  # highest incarnation heard directly (heartbeats may run ahead of the card)

    def view(self) -> Member:
        return Member(self.card, self.state, self.last_heard, self.since)


class MemberTable:
    """Other members of one cluster, as seen by the node `self_id`."""

    def __init__(self, self_id: str, cluster: str, timeouts: Timeouts | None = None,
                 max_members: int = MAX_TABLE) -> None:
        self.self_id = self_id
        self.cluster = cluster
        self.timeouts = timeouts or Timeouts()
        self.max_members = max_members
        self._entries: dict[str, _Entry] = {}
        self.stale = 0  # stale or foreign messages ignored
        self.hostile = 0  # messages claiming an implausible jump, ignored
        self.refused = 0  # joins refused because the table was full of live members

    # -- queries ------------------------------------------------------------------------
    def get(self, node_id: str) -> Member | None:
        e = self._entries.get(node_id)
        return e.view() if e else None

    def members(self) -> list[Member]:
        return [e.view() for e in self._entries.values()]

    def suspects(self) -> list[str]:
        return [n for n, e in self._entries.items() if e.state is State.SUSPECT]

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._entries

    # -- inputs -------------------------------------------------------------------------
    def on_card(self, card: Card, now: float, direct: bool) -> list[Event]:
        """A card arrived: `direct` when the owner itself sent it (gossip or request)."""
        if card.node_id == self.self_id or card.cluster != self.cluster:
            self.stale += 1
            return []
        e = self._entries.get(card.node_id)
        if e is None:
            if len(self._entries) >= self.max_members and not self._evict_departed():
                self.refused += 1
                return []
            self._entries[card.node_id] = _Entry(card, State.ALIVE, now, now, card.incarnation)
            return [self._event("join", card.node_id, now)]
        if not self._plausible(e, card.incarnation, card.version):
            return []
        newer = card.key > e.card.key
        if e.state is State.LEFT:
            if card.incarnation <= e.card.incarnation:
                self.stale += 1
                return []
            return self._rejoin(e, card, now)
        if e.state is State.DEAD:
            if card.incarnation > e.card.incarnation or (direct and card.key >= e.card.key):
                return self._rejoin(e, card, now)
            self.stale += 1
            return []
        events: list[Event] = []
        if newer:
            changed = _content(card) != _content(e.card)
            e.card = card
            if changed:
                events.append(self._event("update", card.node_id, now))
        elif not direct or card.incarnation < e.card.incarnation:
            self.stale += 1
            return []
        if direct:
            events += self._heard(e, card.incarnation, now)
        elif e.state is State.SUSPECT and card.incarnation > e.heard_inc:
            # second-hand proof that the owner refuted its suspicion
            events += self._heard(e, card.incarnation, now)
        return events

    def on_heartbeat(self, node_id: str, incarnation: int, version: int,
                     now: float) -> tuple[list[Event], bool]:
        """A heartbeat from the owner. Returns (events, whether we need its newer card)."""
        e = self._entries.get(node_id)
        if node_id == self.self_id:
            return [], False
        if e is None:
            return [], True
        if incarnation < e.card.incarnation:
            self.stale += 1
            return [], False
        if not self._plausible(e, incarnation, version):
            return [], False
        need_card = (incarnation, version) > e.card.key
        if e.state is State.LEFT:
            return [], incarnation > e.card.incarnation
        if e.state is State.DEAD:
            if incarnation == e.card.incarnation:
                return self._rejoin(e, e.card, now), need_card
            return [], True
        return self._heard(e, incarnation, now), need_card

    def on_leave(self, node_id: str, incarnation: int, now: float) -> list[Event]:
        e = self._entries.get(node_id)
        if e is None or e.state is State.LEFT or incarnation < e.card.incarnation:
            self.stale += 1
            return []
        if not self._plausible(e, incarnation, None):
            return []
        self._set(e, State.LEFT, now)
        return [self._event("leave", node_id, now)]

    def tick(self, now: float) -> list[Event]:
        """Advance failure detection to `now`."""
        t = self.timeouts
        events: list[Event] = []
        for node_id, e in list(self._entries.items()):
            silent = now - e.last_heard
            if e.state is State.ALIVE and silent > t.suspect_after:
                self._set(e, State.SUSPECT, now)
                events.append(self._event("suspect", node_id, now))
            if e.state is State.SUSPECT and silent > t.dead_after:
                self._set(e, State.DEAD, now)
                events.append(self._event("dead", node_id, now))
            elif e.state in (State.DEAD, State.LEFT) and now - e.since > t.forget_after:
                del self._entries[node_id]
        return events

    def forget(self, node_id: str) -> None:
        self._entries.pop(node_id, None)

    def _evict_departed(self) -> bool:
        """Make room by forgetting the longest-departed dead or left member; False if none."""
        gone = [(e.since, n) for n, e in self._entries.items()
                if e.state in (State.DEAD, State.LEFT)]
        if not gone:
            return False
        del self._entries[min(gone)[1]]
        return True

    # -- helpers ------------------------------------------------------------------------
    def _plausible(self, e: _Entry, incarnation: int, version: int | None) -> bool:
        """Within reach of the card we hold (a restart or refutation is one step)."""
        known = e.card
        ok = is_plausible_step(known.incarnation, incarnation) and (
            version is None or incarnation != known.incarnation
            or is_plausible_step(known.version, version))
        if not ok:
            self.hostile += 1
        return ok

    def _heard(self, e: _Entry, incarnation: int, now: float) -> list[Event]:
        e.last_heard = now
        e.heard_inc = max(e.heard_inc, incarnation)
        if e.state is State.SUSPECT:
            self._set(e, State.ALIVE, now)
            return [self._event("alive", e.card.node_id, now)]
        return []

    def _rejoin(self, e: _Entry, card: Card, now: float) -> list[Event]:
        e.card = card
        e.last_heard = now
        e.heard_inc = card.incarnation
        self._set(e, State.ALIVE, now)
        return [self._event("join", card.node_id, now)]

    @staticmethod
    def _set(e: _Entry, state: State, now: float) -> None:
        e.state = state
        e.since = now

    def _event(self, kind: str, node_id: str, now: float) -> Event:
        return Event(kind, self._entries[node_id].view(), now)


def _content(card: Card) -> Card:
    """A card without its ordering fields, to tell a real change from a re-publish."""
    return replace(card, incarnation=0, version=0)
