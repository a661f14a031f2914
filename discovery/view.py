"""This node's view of its cluster: its own card and the member table, behind one lock.

Why a class of its own: the I/O thread is the only writer of both, but roles, telemetry and
tools read them from their own threads. Keeping the card, the table and the lock in one place
means every write is made under the lock (`change`, `set_card`) and every reader on another
thread gets copies it may keep (`members`, `get`, `workers`, `card`). The rules of the table
itself (states, incarnations, eviction, the `MAX_TABLE` bound) stay in `discovery.table`.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from discovery.cards import Card
from discovery.table import Member, MemberTable, State, Timeouts

T = TypeVar("T")


class LocalView:
    """Our card and the table of the others; written on the I/O thread, read anywhere."""

    def __init__(self, card: Card, timeouts: Timeouts) -> None:
        self._lock = threading.Lock()
        self._card = card
        self.table = MemberTable(card.node_id, card.cluster, timeouts)  # reads: I/O thread only
        self._started_at = time.monotonic()

    # -- any thread -------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._card.node_id  # never changes

    @property
    def card(self) -> Card:
        with self._lock:
            return self._card

    def members(self, include_self: bool = True) -> list[Member]:
        """A consistent copy of the table (self first when included)."""
        with self._lock:
            out = [_copy(m) for m in self.table.members()]
            if include_self:
                out.insert(0, self._self_member())
        return out

    def get(self, node_id: str) -> Member | None:
        with self._lock:
            if node_id == self._card.node_id:
                return self._self_member()
            m = self.table.get(node_id)
        return _copy(m) if m else None

    def workers(self) -> list[Member]:
        """Alive members that may be offered work (never observers)."""
        return [m for m in self.members(include_self=False)
                if m.state is State.ALIVE and m.card.is_worker]

    def table_counts(self) -> dict[str, int]:
        """The table's own counters (written under the lock, so read under it)."""
        with self._lock:
            t = self.table
            return {"stale": t.stale, "hostile": t.hostile, "refused_joins": t.refused}

    def _self_member(self) -> Member:
        now = time.monotonic()
        return _copy(Member(self._card, State.ALIVE, now, self._started_at, is_self=True))

    # -- I/O thread ---------------------------------------------------------------------
    @property
    def own(self) -> Card:
        """Our card, read on the I/O thread (its only writer), so without the lock."""
        return self._card

    def set_card(self, card: Card) -> None:
        with self._lock:
            self._card = card

    def change(self, fn: Callable[[MemberTable], T]) -> T:
        """Run one table write under the lock, so that readers never see it half done."""
        with self._lock:
            return fn(self.table)

    def live_streams(self) -> set[str]:
        """Request endpoints of the members we hold alive."""
        return {m.card.endpoints["stream"] for m in self.table.members()
                if m.state is State.ALIVE}

    def digest(self) -> tuple[int, int]:
        """[count, crc32] of the ids we hold alive, ourselves included."""
        ids = sorted([m.node_id for m in self.table.members() if m.state is State.ALIVE]
                     + [self.node_id])
        return len(ids), zlib.crc32(",".join(ids).encode())


def _copy(m: Member) -> Member:
    """Members are frozen, but their cards hold dicts: give each reader its own."""
    c = m.card
    return replace(m, card=replace(c, endpoints=dict(c.endpoints), extras=_deep(c.extras)))


def _deep(value):
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    return value
