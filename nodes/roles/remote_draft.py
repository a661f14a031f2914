"""Drafts from proposers over the bus, as a `DraftSession` the engine can use unchanged.

Every block, each usable proposer gets one `draft_req` carrying the tokens committed since it
last confirmed, and a deadline derived from what we measured of it. Replies that arrive in time
and pass validation compete; the one with the most expected accepted tokens wins. A proposer
that is late, silent, wrong or dead costs at most its deadline, and after a few failures in a
row it is dropped for the rest of the generation; with no usable proposer left the engine gets
empty drafts and decodes on its own. Output never depends on any of this: the verifier checks
every token.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bus.streams import BusError, Call, StreamClient
from codec.errors import CodecError
from codec.messages import Message
from codec.structs import DraftReply, DraftReq, ErrorReply, SessionClose, SessionOpen
from nodes.drafters.base import DraftSession
from nodes.engine.errors import OutOfSyncError, TokenizerMismatchError, UnknownSessionError
from nodes.engine.sampling import SamplingParams
from nodes.roles.requests import wire_sampling

log = logging.getLogger(__name__)

_EMA = 0.3
_DECAY = 0.8  # per verified draft block
EMPTY = np.zeros(0, dtype=np.int32)
#: error codes after which a proposer cannot help this session any more
_FATAL_CODES = frozenset(
    {UnknownSessionError.code, OutOfSyncError.code, TokenizerMismatchError.code})


@dataclass
class DeadlinePolicy:
    """How long to wait for a proposer: a multiple of what it usually takes, within bounds."""

    first_s: float = 0.5  # nothing measured yet (connection set-up, drafter warm-up)
    min_s: float = 0.004
    max_s: float = 0.5
    factor: float = 2.0
    slack_s: float = 0.003
    max_failures: int = 3  # consecutive failures before a proposer is dropped for a generation
    explore_every: int = 8  # at least this many plain steps between tries of a proposer...
    explore_factor: float = 50.0  # ...and at least this many times what a try costs (<= 2 %)
    prior_step_s: float = 0.06  # plain verifier step before one is measured
    prior_slope: float = 0.08  # relative verify cost per extra fed token before measuring
    #: draft='force': how long to wait for each proposer (at least max_s); a proposer that
    #: leaves the alive state meanwhile is given up at once (checked every liveness_poll_s)
    forced_s: float = 120.0
    liveness_poll_s: float = 0.05


@dataclass
class ProposerLink:
    """What a verifier knows about one proposer, kept across generations."""

    node_id: str
    endpoint: str
    name: str = ""
    drafts: int = 0  # replies used
    drafted: int = 0  # tokens received in used replies
    chosen: int = 0  # replies whose tokens were verified
    accepted: int = 0  # of those tokens, accepted by the verifier
    verified: int = 0  # tokens of chosen replies that were checked
    timeouts: int = 0
    bad_replies: int = 0
    errors: int = 0
    tokens_per_reply: float | None = None  # EMA of draft length per request (misses count 0)
    recent_accepted: float = 0.0  # decayed counts behind `acceptance`: recent blocks weigh
    recent_verified: float = 0.0  # most, so a drafter good on one text is not trusted forever
    net_s: float | None = None  # EMA of round trip minus the proposer's own drafting time
    per_token_s: float = 0.0  # EMA of the proposer's drafting time per requested token

    def deadline(self, k: int, policy: DeadlinePolicy) -> float:
        if self.net_s is None:
            return policy.first_s
        expect = self.net_s + self.per_token_s * k
        return min(policy.max_s, max(policy.min_s, policy.factor * expect + policy.slack_s))

    def observe(self, rtt: float, drafting: float, k: int) -> None:
        net = max(rtt - drafting, 0.0)
        per_tok = drafting / k if k else 0.0
        if self.net_s is None:
            self.net_s, self.per_token_s = net, per_tok
        else:
            self.net_s += _EMA * (net - self.net_s)
            self.per_token_s += _EMA * (per_tok - self.per_token_s)

    def count_reply(self, n: int) -> None:
        """Track how many tokens a request yields (0 for empty replies and misses)."""
        old = self.tokens_per_reply
        self.tokens_per_reply = float(n) if old is None else old + _EMA * (n - old)

    def count_verified(self, accepted: int, verified: int) -> None:
        self.accepted += accepted
        self.verified += verified
        self.recent_accepted = _DECAY * self.recent_accepted + accepted
        self.recent_verified = _DECAY * self.recent_verified + verified

    @property
    def acceptance(self) -> float:
        """Recent per-token acceptance with a weak prior, so new proposers get tried."""
        return (self.recent_accepted + 1.0) / (self.recent_verified + 2.0)

    COUNTERS = ("drafts", "drafted", "chosen", "accepted", "verified", "timeouts",
                "bad_replies", "errors")

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.COUNTERS}

    def as_dict(self, since: dict[str, int] | None = None) -> dict:
        """Counters (minus a `counters()` snapshot taken earlier, if given) and RTT."""
        out = {k: v - (since or {}).get(k, 0) for k, v in self.counters().items()}
        out["acceptance"] = round(out["accepted"] / out["verified"], 4) if out["verified"] else 0.0
        out["rtt_ms"] = round((self.net_s or 0.0) * 1000, 3)
        out["name"] = self.name
        return out


@dataclass
class _Peer:
    """Per-session state of one proposer link."""

    link: ProposerLink
    acked: int  # committed length the proposer has confirmed
    start: dict[str, int]  # the link's counters when this session began
    failures: int = 0
    dropped: bool = False
    asked_at: float = 0.0  # monotonic time it was last asked
    replied: bool = False  # a valid reply arrived in this session


class RemoteDraftSession(DraftSession):
    """One generation's draft sessions on several proposers, behind the engine's interface."""

    def __init__(
        self,
        client: StreamClient,
        links: Sequence[ProposerLink],
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        vocab_size: int,
        fingerprint: str,
        lease_s: float = 30.0,
        policy: DeadlinePolicy | None = None,
        is_alive: Callable[[str], bool] = lambda node_id: True,
        forced: bool = False,
    ) -> None:
        self.client = client
        self.sid = session_id
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.policy = policy or DeadlinePolicy()
        self.is_alive = is_alive
        #: pinned speculation (tests): ask every proposer every block, wait the full deadline
        #: (`policy.max_s`), never skip one as slow or unpromising; failures still drop it
        self.forced = forced
        self.tokens = [int(t) for t in prompt_ids]
        now = time.monotonic()
        # a known proposer is not re-probed at once: exploration runs on its time budget
        self.peers = [_Peer(link, len(self.tokens), link.counters(), asked_at=now)
                      for link in links]
        self._last: tuple[_Peer, np.ndarray] | None = None
        self._mark: tuple[int, float] | None = None  # (tokens fed next, when) for costs
        self.costs = _VerifyCosts(self.policy)
        self.deadline_misses = 0
        self.waited_s = 0.0
        prompt = np.asarray(self.tokens, dtype=np.int32)
        opening = SessionOpen(session_id, prompt, lease_s, wire_sampling(sampling),
                              tokenizer=fingerprint).to_message()
        # forced drafting must survive a slow open (a cold drafter on a loaded machine): a
        # timed-out open is cancelled on the proposer, and every draft then fails
        open_s = self.policy.forced_s if forced else self.policy.first_s * 4
        for peer in self.peers:
            # not awaited: the first draft_req follows on the same connection, so the proposer
            # sees the open first; a failed open surfaces as an error reply to that draft_req
            self._send(peer, opening, open_s, lambda call, item: None)

    # -- DraftSession -------------------------------------------------------------------------
    def extend(self, delta: Sequence[int]) -> None:
        now = time.monotonic()
        if self._mark is not None:
            fed, since = self._mark
            self.costs.record(fed, now - since)
        self._mark = (1, now)  # unless a draft follows, the next forward is a plain step
        delta = [int(t) for t in delta]
        if self._last is not None and delta:
            peer, ids = self._last
            n = 0
            while n < len(ids) and n < len(delta) and ids[n] == delta[n]:
                n += 1
            peer.link.count_verified(n, min(len(ids), n + 1))
            self._last = None
        self.tokens.extend(delta)

    def draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        ids, probs = self._draft(k)
        self._mark = (len(ids) + 1, time.monotonic())  # the forward that follows feeds these
        return ids, probs

    def _draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        self._last = None
        for p in self.peers:
            if not p.dropped and not self.is_alive(p.link.node_id):
                self._drop(p, "not alive in membership")
        ask = self._worth_asking(k)
        if k <= 0 or not ask:
            return EMPTY, None
        committed = len(self.tokens)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        t0 = time.monotonic()
        deadlines: dict[int, float] = {}
        calls: dict[int, Call] = {}
        for p in ask:
            wait = (max(self.policy.forced_s, self.policy.max_s) if self.forced
                    else p.link.deadline(k, self.policy))
            deadlines[id(p)] = t0 + wait
            delta = np.asarray(self.tokens[p.acked :], dtype=np.int32)
            req = DraftReq(self.sid, k, committed, delta, want_probs=not self.sampling.greedy,
                           budget_s=wait).to_message()
            call = self._send(p, req, wait,
                              lambda call, item, p=p: inbox.put((p, item, time.monotonic())))
            if call is not None:
                calls[id(p)] = call
        replies: list[tuple[_Peer, np.ndarray, np.ndarray | None]] = []
        pending = {id(p): p for p in ask if id(p) in calls}
        while pending:
            best = max((_expected_accepted(r[0].link, len(r[1])) for r in replies), default=0.0)
            worth = [p for p in pending.values() if self._worth_waiting(p, k, best, t0)]
            if not worth:
                break
            remaining = max(deadlines[id(p)] for p in worth) - time.monotonic()
            if self.forced:  # a long wait: notice a proposer dying meanwhile
                remaining = min(remaining, self.policy.liveness_poll_s)
            try:
                p, item, at = inbox.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                if self.forced and time.monotonic() < max(deadlines[id(p)] for p in worth):
                    self._abandon_dead(pending, calls)
                    continue
                break
            if pending.pop(id(p), None) is None:
                continue
            got = self._check(p, item, k, committed, at - t0)
            if got is not None:
                replies.append((p, *got))
        now = time.monotonic()
        for key, p in pending.items():
            calls[key].cancel()  # tell the proposer to skip it if it has not started
            if now >= deadlines[key]:
                p.link.count_reply(0)
                p.link.timeouts += 1
                self.deadline_misses += 1
                self._fail(p, "deadline")
        self.waited_s += now - t0
        if not replies:
            return EMPTY, None
        p, ids, probs = max(replies, key=lambda r: _expected_accepted(r[0].link, len(r[1])))
        p.link.chosen += 1
        self._last = (p, ids)
        return ids, probs

    def _abandon_dead(self, pending: dict[int, _Peer], calls: dict[int, Call]) -> None:
        """Forced drafting: stop waiting for proposers that are no longer alive."""
        for key, p in list(pending.items()):
            if not self.is_alive(p.link.node_id):
                del pending[key]
                calls[key].cancel()
                p.link.errors += 1
                self._drop(p, "left the alive state while asked")

    def _worth_asking(self, k: int) -> list[_Peer]:
        """Proposers expected to beat plain decoding at k, plus any due for exploration.

        Exploration is budgeted in time, not blocks: a proposer that does not look worth it is
        re-tried once the time since it was last asked is `explore_factor` times what asking
        it costs, so probing a far-away proposer never costs more than a few percent.
        """
        live = [p for p in self.peers if not p.dropped]
        if self.forced:
            return live
        step = self.costs.cost(1)
        now = time.monotonic()
        out = []
        for p in live:
            link = p.link
            if link.net_s is None:
                out.append(p)  # never measured: ask once
                continue
            tokens = link.tokens_per_reply if link.tokens_per_reply is not None else k
            n = min(k, max(0, round(tokens)))
            a = min(link.acceptance, 0.999)
            accepted = sum(a ** i for i in range(1, n + 1))
            cost = link.net_s + link.per_token_s * k + self.costs.cost(n + 1)
            ask_cost = link.net_s + link.per_token_s * k
            if (1 + accepted) / cost > 1.0 / step:
                out.append(p)
            elif now - p.asked_at >= max(self.policy.explore_factor * ask_cost,
                                         self.policy.explore_every * step):
                out.append(p)
        for p in out:
            p.asked_at = now
        return out

    def _worth_waiting(self, p: _Peer, k: int, best: float, t0: float) -> bool:
        """Wait for p if its expected extra accepted tokens beat what the wait costs."""
        link = p.link
        if self.forced:
            return True
        if link.net_s is None:
            return best <= 0.0  # unmeasured: wait (up to its deadline) unless we have a draft
        eta = t0 + link.net_s + link.per_token_s * k
        lost = max(eta - time.monotonic(), 0.0) / self.costs.cost(1)
        return _expected_accepted(link, k) - best > lost

    def stats(self) -> dict[str, dict]:
        """Per-proposer figures for this session only."""
        return {p.link.node_id: {**p.link.as_dict(since=p.start), "dropped": p.dropped}
                for p in self.peers}

    def close(self) -> None:
        for p in self.peers:
            if not p.dropped:
                self._send(p, SessionClose(self.sid).to_message(), 1.0,
                           lambda call, item: None)

    # -- helpers ------------------------------------------------------------------------------
    def _send(self, peer: _Peer, msg: Message, timeout: float,
              on_reply: Callable[[Call, object], None]) -> Call | None:
        try:
            return self.client.request(peer.link.endpoint, msg, timeout=timeout,
                                       on_reply=on_reply)
        except ValueError as exc:  # encoding refused: a bug on our side, not the proposer's
            log.error("cannot send %s to %s: %s", msg.type, peer.link.node_id, exc)
            self._drop(peer, "encode error")
            return None

    def _check(self, p: _Peer, item, k: int, committed: int, rtt: float):
        """A usable (ids, probs) from a reply, or None (counted)."""
        if isinstance(item, BusError):
            p.link.errors += 1
            self._fail(p, str(item))
            return None
        msg: Message = item
        if msg.type == ErrorReply.TYPE:
            p.link.errors += 1
            code = msg.get("code")
            if code in _FATAL_CODES:
                self._drop(p, f"{code}: {msg.get('message')}")
            else:
                self._fail(p, f"error {code}")
            return None
        try:
            reply = DraftReply.from_message(msg) if msg.type == DraftReply.TYPE else None
        except CodecError:
            reply = None
        ok = (
            reply is not None
            and reply.session == self.sid
            and reply.committed == committed
            and len(reply.tokens) <= k
            and (len(reply.tokens) == 0 or int(reply.tokens.max()) < self.vocab_size)
        )
        ids = reply.tokens if ok else None
        probs = None
        if ok and not self.sampling.greedy and len(ids):
            probs = reply.probs
            ok = probs is not None and probs.shape == (len(ids), self.vocab_size)
            if ok:
                probs = np.asarray(probs, dtype=np.float32)
                ok = bool(np.isfinite(probs).all() and (probs >= 0).all())
        if not ok:
            p.link.bad_replies += 1
            self._fail(p, f"malformed {msg.type}")
            return None
        p.acked = committed
        p.failures = 0
        p.link.drafts += 1
        p.link.drafted += len(ids)
        p.link.count_reply(len(ids))
        if p.replied:
            # not the first reply of a session: that one also waited for the session's
            # warm-up (a model drafter's prefill) and says little about later round trips
            p.link.observe(rtt, reply.elapsed_s, k)
        p.replied = True
        return np.asarray(ids, dtype=np.int64), probs

    def _fail(self, p: _Peer, why: str) -> None:
        p.failures += 1
        if p.failures >= self.policy.max_failures:
            self._drop(p, f"{p.failures} failures in a row, last: {why}")

    def _drop(self, p: _Peer, why: str) -> None:
        if not p.dropped:
            p.dropped = True
            log.info("proposer %s dropped for session %s: %s", p.link.node_id, self.sid, why)


class _VerifyCosts:
    """Verifier forward time per fed-token count, measured between the engine's calls.

    The engine calls `extend` right after each forward, so the time from the previous call
    (draft return, or extend when no draft was asked) to `extend` is that forward.
    """

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self._ema: dict[int, float] = {}

    def record(self, fed: int, seconds: float) -> None:
        old = self._ema.get(fed)
        self._ema[fed] = seconds if old is None else old + _EMA * (seconds - old)

    def cost(self, fed: int) -> float:
        if fed in self._ema:
            return self._ema[fed]
        base = self._ema.get(1, self.policy.prior_step_s)
        if self._ema:
            n, t = max(self._ema.items())
            if n > 1 and fed > 1:
                return t * (1 + self.policy.prior_slope * (fed - 1)) / (
                    1 + self.policy.prior_slope * (n - 1))
        return base * (1 + self.policy.prior_slope * (fed - 1))


def _expected_accepted(link: ProposerLink, n: int) -> float:
    a = min(link.acceptance, 0.999)
    return sum(a ** i for i in range(1, n + 1))

