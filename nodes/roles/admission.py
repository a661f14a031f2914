"""Admission limits: one peer (one connection) can never take a node away from the others.

Three limits, each refused with a typed error (nodes/engine/errors.py) and counted:
- messages per second per connection, a token bucket checked for every request a node
  serves (`RateLimiter`, in `Node._on_request`): `rate_limited`;
- generations queued or running per connection on a verifier (`PeerSlots`): `busy`;
- draft sessions per connection and in total on a proposer (`SessionBook`):
  `too_many_sessions`; a session belongs to the connection that opened it, and another
  connection naming its id gets `forbidden` (ids are unguessable anyway).
A "peer" is the ZeroMQ routing identity the ROUTER gave the connection. With a cluster secret
only members can connect at all; without one this is still the finest identity there is.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from nodes.engine.errors import BUSY, FORBIDDEN, RATE_LIMITED, TOO_MANY_SESSIONS

__all__ = ["BUSY", "FORBIDDEN", "RATE_LIMITED", "TOO_MANY_SESSIONS", "AdmissionLimits",
           "PeerSlots", "RateLimiter", "SessionBook", "TokenBucket"]

MAX_TRACKED_PEERS = 4096  # rate state kept for this many connections (least recent forgotten)


@dataclass(frozen=True)
class AdmissionLimits:
    """Defaults are far above what an honest verifier or client sends (a verifier sends one
    draft request per block to each proposer, tens per second)."""

    rate_per_s: float = 500.0  # requests per second per connection, sustained
    burst: int = 1000  # requests a connection may send at once
    # queued + running generations per connection: a gateway keeps up to 8 in flight per
    # verifier by default (`--gateway-max-inflight`), over its one connection
    generations_per_peer: int = 8
    sessions_per_peer: int = 16  # open draft sessions per connection
    sessions_total: int = 256  # open draft sessions per proposer

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1 and self.generations_per_peer >= 1
                and self.sessions_per_peer >= 1
                and self.sessions_total >= self.sessions_per_peer):
            raise ValueError(f"admission limits out of range: {self}")


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved; one token per message."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, float(burst), float(burst), now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class RateLimiter:
    """Per-connection token buckets; used on the I/O thread only."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self.refused = 0  # written on the I/O thread; read as a plain int elsewhere

    def allow(self, peer: bytes, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = TokenBucket(self.limits.rate_per_s,
                                                       self.limits.burst, now)
            if len(self._buckets) > MAX_TRACKED_PEERS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        if bucket.take(now):
            return True
        self.refused += 1
        return False


class PeerSlots:
    """Counted slots per connection: acquired on the I/O thread, released on a worker."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._held: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def acquire(self, peer: bytes) -> bool:
        with self._lock:
            n = self._held.get(peer, 0)
            if n >= self.per_peer:
                self.refused += 1
                return False
            self._held[peer] = n + 1
            return True

    def release(self, peer: bytes) -> None:
        with self._lock:
            n = self._held.get(peer, 0) - 1
            if n > 0:
                self._held[peer] = n
            else:
                self._held.pop(peer, None)


class SessionBook:
    """Which connection owns which draft session, and how many each holds (one owner thread:
    the proposer's worker)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._owner: dict[str, bytes] = {}
        self._count: dict[bytes, int] = {}
        self.refused = {TOO_MANY_SESSIONS: 0, FORBIDDEN: 0}

    def __len__(self) -> int:
        return len(self._owner)

    def may_use(self, sid: str, peer: bytes) -> bool:
        """False (and counted) when `sid` is open and belongs to another connection."""
        owner = self._owner.get(sid)
        if owner is None or owner == peer:
            return True
        self.refused[FORBIDDEN] += 1
        return False

    def refusal(self, peer: bytes) -> str | None:
        """Why `peer` may not open one more session (None: it may)."""
        if self._count.get(peer, 0) >= self.limits.sessions_per_peer:
            why = f"this connection has {self.limits.sessions_per_peer} draft sessions open"
        elif len(self._owner) >= self.limits.sessions_total:
            why = f"proposer has {self.limits.sessions_total} draft sessions open"
        else:
            return None
        self.refused[TOO_MANY_SESSIONS] += 1
        return why

    def add(self, sid: str, peer: bytes) -> None:
        self._owner[sid] = peer
        self._count[peer] = self._count.get(peer, 0) + 1

    def remove(self, sid: str) -> None:
        peer = self._owner.pop(sid, None)
        if peer is None:
            return
        n = self._count.get(peer, 0) - 1
        if n > 0:
            self._count[peer] = n
        else:
            self._count.pop(peer, None)
