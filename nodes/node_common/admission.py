"""Admission limits: one peer (one connection) can never take a node away from the others.

Three limits, each refused with a typed error (nodes/engine/errors.py) and counted:
- messages per second per connection, a token bucket checked for every request a node
  serves (`RateLimiter`, in `Node._on_request`): `rate_limited`;
- generations queued or running per connection on a verifier (`PeerSlots`; the batch plus
  `generations_per_peer` queued): `busy`;
- draft sessions per connection and in total on a proposer, and their state in bytes, each
  with a fair share per connection (`SessionBook`): `too_many_sessions`; a session belongs to the
  connection that opened it, and another connection naming its id gets `forbidden` (ids are
  unguessable anyway). Sessions also die with their connection (nodes/node_common/liveness.py).
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
    # generations a connection may have queued on a verifier beyond its batch: a connection
    # may hold `max_batch + generations_per_peer` queued or running (a gateway carries all its
    # users over one connection; verifier.per_connection), half the verifier's queue of 16
    generations_per_peer: int = 8
    sessions_per_peer: int = 16  # open draft sessions per connection
    sessions_total: int = 256  # open draft sessions per proposer
    #: estimated bytes of all draft sessions' state on a proposer (split fairly when short)
    session_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1 and self.generations_per_peer >= 1
                and self.sessions_per_peer >= 1
                and self.sessions_total >= self.sessions_per_peer
                and self.session_bytes >= 1 << 20):
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
    """Which connection owns which draft session, what each holds, and who must make room
    (one owner thread: the proposer's worker).

    Sessions are counted (per connection, in total) and weighed in bytes (the drafter's state:
    tokens x bytes per token, measured; nodes/proposer/role.py). Both the count and the bytes
    of all sessions stay within their limits (`sessions_total`, `session_bytes`) by the same
    rule: when a new session (or a session that grew) does not fit, room is made by closing
    the least recently used sessions of connections holding more than their fair share (the
    limit split evenly between the connections holding sessions, the asking one included); a
    connection at or over its own share is refused instead. 16 connections x 16 one-token
    sessions once filled the 256 sessions and the real verifier's opens failed for the whole
    hold; 17 connections each opening 16 sessions of 8,000 tokens took a proposer from 97 MB
    to 3.67 GB and starved the real verifier.
    """

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._owner: dict[str, bytes] = {}
        self._count: dict[bytes, int] = {}
        self._bytes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._held: dict[bytes, int] = {}  # bytes per connection
        self.total_bytes = 0
        self.refused = {TOO_MANY_SESSIONS: 0, FORBIDDEN: 0}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._owner)

    def may_use(self, sid: str, peer: bytes) -> bool:
        """False (and counted) when `sid` is open and belongs to another connection."""
        owner = self._owner.get(sid)
        if owner is None or owner == peer:
            return True
        self.refused[FORBIDDEN] += 1
        return False

    def touch(self, sid: str) -> None:
        if sid in self._bytes:
            self._bytes.move_to_end(sid)

    def share(self, peer: bytes) -> int:
        """Bytes `peer` may hold when the budget is contended."""
        return self.limits.session_bytes // self._holders(peer)

    def count_share(self, peer: bytes) -> int:
        """Sessions `peer` may hold when every one of `sessions_total` is taken (at least 1)."""
        return max(1, self.limits.sessions_total // self._holders(peer))

    def _holders(self, peer: bytes) -> int:
        return len(self._count) + (peer not in self._count)

    def refusal(self, peer: bytes, nbytes: int = 0) -> str | None:
        """Why `peer` may not open one more session of `nbytes` (None: it may, possibly after
        `make_room`)."""
        held = self._count.get(peer, 0)
        if held >= self.limits.sessions_per_peer:
            why = f"this connection has {self.limits.sessions_per_peer} draft sessions open"
        elif len(self._owner) >= self.limits.sessions_total and held >= self.count_share(peer):
            why = (f"proposer has {self.limits.sessions_total} draft sessions open and this "
                   f"connection holds {held}, its fair share")
        elif (self.total_bytes + nbytes > self.limits.session_bytes
              and self._held.get(peer, 0) + nbytes > self.share(peer)):
            why = (f"draft sessions of this connection would hold "
                   f"{(self._held.get(peer, 0) + nbytes) >> 20} MiB, over its fair share "
                   f"({self.share(peer) >> 20} MiB of {self.limits.session_bytes >> 20} MiB)")
        else:
            return None
        self.refused[TOO_MANY_SESSIONS] += 1
        return why

    def make_room(self, peer: bytes, nbytes: int, opening: bool = False) -> list[str]:
        """Sessions to close (least recently used first, of connections over their fair share
        of the count or of the bytes, never `peer`'s) so that `nbytes` more, and one more
        session when `opening`, fit the limits; may fall short."""
        out: list[str] = []
        need_bytes = self.total_bytes + nbytes - self.limits.session_bytes
        need_count = len(self._owner) + 1 - self.limits.sessions_total if opening else 0
        if need_bytes <= 0 and need_count <= 0:
            return out
        held, count = dict(self._held), dict(self._count)
        share, count_share = self.share(peer), self.count_share(peer)
        for sid, size in self._bytes.items():
            owner = self._owner[sid]
            if owner == peer:
                continue
            if not ((need_count > 0 and count[owner] > count_share)
                    or (need_bytes > 0 and held[owner] > share)):
                continue
            out.append(sid)
            held[owner] -= size
            count[owner] -= 1
            need_bytes -= size
            need_count -= 1
            if need_bytes <= 0 and need_count <= 0:
                break
        self.evicted += len(out)
        return out

    def add(self, sid: str, peer: bytes, nbytes: int = 0) -> None:
        self._owner[sid] = peer
        self._count[peer] = self._count.get(peer, 0) + 1
        self._bytes[sid] = 0
        self.resize(sid, nbytes)

    def resize(self, sid: str, nbytes: int) -> None:
        """A session's state grew (or shrank) to `nbytes`; it becomes the most recent."""
        peer = self._owner.get(sid)
        if peer is None:
            return
        old = self._bytes.get(sid, 0)
        self._bytes[sid] = nbytes
        self._bytes.move_to_end(sid)
        self._held[peer] = self._held.get(peer, 0) + nbytes - old
        self.total_bytes += nbytes - old

    def remove(self, sid: str) -> None:
        peer = self._owner.pop(sid, None)
        if peer is None:
            return
        size = self._bytes.pop(sid, 0)
        self.total_bytes -= size
        n = self._count.get(peer, 0) - 1
        if n > 0:
            self._count[peer] = n
            self._held[peer] = self._held.get(peer, 0) - size
        else:
            self._count.pop(peer, None)
            self._held.pop(peer, None)
