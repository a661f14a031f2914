"""Drafts streamed ahead by proposers over the bus, as engine `DraftSource`s that never wait.

Protocol 2 (docs/protocol.md, "Draft sessions"). Per generation and proposer, one
`ProposerSource`: it opens a session whose reply is a stream of `draft_chunk`s, pushes every
commit with `session_extend` right after the step that made it (from `feedback`, waiting for
nothing), and on `propose` reads whatever chunks have arrived (`DirectClient.poll(0)`), keeps
the freshest one and offers its chain past the committed prefix, then every alternative path
of a tree chunk that still extends the prefix (with the drafter's probabilities, which the
engine's tree uses to value them). It never waits on its own: it tells the engine when the
chunk answering the last commit is due (`expected_wait`, measured while waiting: push to first
chunk based on it; a guess of a few ms before the first measurement), and the engine's cost
model decides whether a bounded wait (`wait`) pays. The other wait is forced drafting (tests
pin speculation with it): a bounded wait for a chunk that extends the current prefix, given up
at once when membership says the proposer is no longer alive. How many tokens to verify is
the engine's `CostModel`'s choice (the budget, from this proposer's own acceptance); here there
is no estimator of our own.

A proposer that is wrong (bad chunk, wrong session, position it cannot know, ids outside the
vocabulary), silent or failing is counted and, after a few failures in a row or at once for
fatal errors, dropped for the rest of the generation; one that floods (more chunks than a
proposer drafting up to its horizon can send between two steps, or past the client's bounded
reply queue) is dropped and counted. Output never depends on any of this: the verifier checks
every token.

Sockets: each `ProposerLink` owns a `DirectClient` made on the verifier's compute thread (the
only thread that touches links), kept across generations so connections persist.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bus.direct import DirectCall, DirectClient
from bus.streams import BusError, RequestTimeout
from codec.errors import CodecError
from codec.messages import Message
from codec.structs import (
    MAX_HORIZON,
    DraftChunk,
    ErrorReply,
    SessionClose,
    SessionExtend,
    SessionOpen,
)
from nodes.engine.cost import ema
from nodes.engine.errors import OutOfSyncError, TokenizerMismatchError, UnknownSessionError
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource, Feedback
from nodes.engine.tree import EMPTY_TREE, DraftTree

log = logging.getLogger(__name__)

#: round trips a link's estimate is the smallest of (see ProposerLink.observe_rtt)
RTT_WINDOW = 16
#: distinct draft classes taken from one proposer (ProposerLink.label): the engine's cost model
#: keeps an estimate per class, so a proposer inventing labels must not grow it without bound
MAX_CLASSES = 16
#: generations in a row a late proposer reading hidden states sits out (ProposerLink.sits_out)
SIT_OUT = 4
#: error codes after which a proposer cannot help this session any more
_FATAL_CODES = frozenset(
    {UnknownSessionError.code, OutOfSyncError.code, TokenizerMismatchError.code})


@dataclass
class DraftPolicy:
    """Bounds of the streamed-draft path (no cost estimates: those are the engine's)."""

    max_failures: int = 3  # consecutive failures before a proposer is dropped for a generation
    #: most chunks accepted between two steps; a proposer sends at most about
    #: horizon / chunk + 1 per commit, so more than this is a flood
    max_chunks_per_step: int = 64
    max_queued: int = 128  # streamed replies the client buffers per call (then overflow: flood)
    min_horizon: int = 4
    max_horizon: int = 64
    #: draft='force': how long to wait for a chunk extending the prefix; a proposer that
    #: leaves the alive state meanwhile is given up at once (checked every liveness_poll_s)
    forced_s: float = 120.0  # generous: a cold drafter on a loaded CI machine must not fail a test
    liveness_poll_s: float = 0.05
    commit_timeout_s: float = 10.0  # a session_extend unanswered this long counts as a timeout
    #: the wait announced for a proposer's first answer to a commit, before one was measured
    #: (a proposer on the LAN answers within a few ms); the first wait measures the real one
    first_wait_s: float = 0.005
    #: a source the engine has not asked for drafts this many steps in a row (its budget 0:
    #: the cost model says its drafts do not pay now, or come too late to be verified)
    #: pushes its commits together (an EAGLE head's hidden states with them), at most
    #: `idle_push_every` steps apart and whenever it is asked again (a probe: the engine then
    #: waits for the answer it announces, where that is due soon enough). Why: each push and
    #: the chunks answering it cost the verifier's core I/O work; next to a 7 ms quantized
    #: step that was ~7 % of a plain step on open-ended text, where no draft was taken
    #: (docs/engine/quantized.md)
    idle_after: int = 4
    idle_push_every: int = 16


@dataclass
class ProposerLink:
    """What a verifier knows about one proposer, kept across generations (compute thread)."""

    node_id: str
    endpoint: str
    name: str = ""
    drafts: int = 0  # steps whose tree included this proposer's tokens
    drafted: int = 0  # tokens offered to those trees
    accepted: int = 0  # of those tokens, accepted by the verifier
    verified: int = 0  # tokens of offered drafts that were checked
    chunks: int = 0  # valid chunks received
    stale: int = 0  # chunks that no longer extended the prefix when looked at
    timeouts: int = 0
    bad_replies: int = 0
    errors: int = 0
    flooded: int = 0  # sessions dropped for sending too many chunks
    #: the commit push round trip: the smallest of the last RTT_WINDOW readings, every
    #: reading (what the draft-ahead horizon is sized by, `ProposerSource._horizon`)
    net_s: float | None = None
    #: EMA: commit pushed -> first chunk based on it, read while waiting for it (kept across
    #: generations: it belongs to the proposer and the network, not to a prompt)
    fresh_s: float | None = None
    client: DirectClient | None = field(default=None, repr=False)
    #: the client's calls -> the source (generation) that made them: several generations of a
    #: batch share the client, and whichever polls hands the others their replies
    calls: dict = field(default_factory=dict, repr=False)
    garbage_seen: int = 0  # the client's undecodable replies already counted
    #: verifier layers whose hidden states the proposer reads (its card says; an EAGLE-3 head)
    hidden_layers: tuple[int, ...] | None = None
    #: it drafts under a generation's grammar when sent one (its card's `extras.grammar`)
    takes_grammar: bool = False
    #: the draft classes this proposer named so far (at most MAX_CLASSES are taken)
    classes: set[str] = field(default_factory=set, repr=False)
    #: generations in a row this proposer sat out (`sits_out`)
    sat_out: int = 0
    #: tokens a second it drafts, as its card says (`extras.draft_tok_s`, measured at its
    #: start); None when the card does not say
    draft_tok_s: float | None = None
    #: it drafted slower than this verifier commits when a generation last measured both
    #: (`ProposerSource.lags`)
    lags: bool = False
    _rtts: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RTT_WINDOW),
                                     repr=False)
    _timed: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RTT_WINDOW), repr=False)

    COUNTERS = ("drafts", "drafted", "accepted", "verified", "chunks", "stale",
                "timeouts", "bad_replies", "errors", "flooded")

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.COUNTERS}

    def as_dict(self, since: dict[str, int] | None = None) -> dict:
        """Counters (minus a `counters()` snapshot taken earlier, if given) and RTT."""
        out = {k: v - (since or {}).get(k, 0) for k, v in self.counters().items()}
        out["acceptance"] = round(out["accepted"] / out["verified"], 4) if out["verified"] else 0.0
        out["rtt_ms"] = _ms(self.timed_s)
        out["name"] = self.name
        return out

    def observe_rtt(self, rtt: float, timed: bool = True) -> None:
        """A commit push was answered `rtt` after it was sent, as read by the compute thread.

        The compute thread reads replies between steps, so a reply that came during a verify
        forward is read a whole forward late (40-150 ms over loopback, where the round trip is
        well under a millisecond): every reading is an upper bound of the round trip. The
        tightest of the recent ones is the estimate (a min filter, as BBR's min_rtt): replies
        read soon after they came (a waiting poll, the next step's planning) set it, late
        reads never inflate it, and an old low one ages out of the window.

        `timed`: read within a step of its arrival. A quiet source reads its replies only at
        its next push, 16 steps on, so its readings are that cadence, not the path: an idle
        int8 proposer on loopback read 162 ms. Those still size the horizon (`net_s`), as they
        always did: they give a quiet source's pushes the reach past its next push that a far
        ngram proposer's probes need (sized by timed readings alone, plus that reach, an ngram
        proposer at +5 ms read 1.35x plain on input-grounded prompts, against 1.95x and 2.26x
        as it is: one run against two on a VM that drifts, so indicative only, and kept as
        is). The round trip shown (`timed_s`, `rtt_ms`) is timed readings' alone."""
        self._rtts.append(rtt)
        self.net_s = min(self._rtts)
        if timed:
            self._timed.append(rtt)

    @property
    def timed_s(self) -> float | None:
        """The round trip over timed readings only (`ProposerSource._on_commit`): the
        `rtt_ms` shown; None until one was timed."""
        return min(self._timed) if self._timed else None

    def label(self, name: str) -> str | None:
        """The draft class `name` a chunk gave, or None: none given, or a class beyond the
        first MAX_CLASSES this proposer named (judged with its unclassed drafts)."""
        if not name:
            return None
        if name not in self.classes:
            if len(self.classes) >= MAX_CLASSES:
                return None
            self.classes.add(name)
        return name

    @property
    def source_name(self) -> str:
        """The name its `ProposerSource`s have (the cost model's key for its drafts)."""
        return f"remote:{self.name or self.node_id}"

    def sits_out(self, late: bool, every: int = SIT_OUT) -> bool:
        """Whether a generation starts without this proposer: one whose drafts came too late
        to be verified (`late`, the engine's record) sits out up to `every` generations in a
        row, then drafts in one (a probe generation, where the engine probes it as usual),
        where it reads the verifier's hidden states (an EAGLE head) or drafts slower than
        the verifier commits (`lags`). Why: such a session costs whether or not it is asked.
        An EAGLE head's costs the verifier every step: each step's hidden states captured in
        the forward and kept for it (2-5 % of a 7 ms quantized step, a head behind +50 ms on
        open-ended text, where none of its drafts was in time). A lagging proposer's costs its
        own machine, drafting what is never verified; where that machine shares caches with
        the verifier's (two cores of one chip), the verifier too (an int8 proposer, 2-3x
        slower than a q4 verifier, took 5-10 % off it on this project's 2-core VM). A late
        proposer that keeps up (a far ngram one) never sits out: whether it is in time
        depends on the text, and the next prompt may be one it can copy."""
        if not (late and (self.hidden_layers or self.lags)) or self.sat_out >= every:
            self.sat_out = 0
            return False
        self.sat_out += 1
        return True

    def observe_fresh(self, took: float) -> None:
        """A commit's answer came `took` after the push (read by a waiting poll)."""
        self.fresh_s = ema(self.fresh_s, took)

    def fresh_at_least(self, took: float) -> None:
        """A commit's answer had not come `took` after the push: it takes at least that."""
        self.fresh_s = took if self.fresh_s is None else max(self.fresh_s, took)

    def direct(self, factory, sender: str, max_queued: int) -> DirectClient:
        """This link's client, made on first use by the (compute) thread that uses it."""
        if self.client is None:
            self.client = DirectClient(factory, sender=sender, max_queued=max_queued)
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.calls.clear()
        self.garbage_seen = 0


class ProposerSource(DraftSource):
    """One proposer's streamed drafts for one generation; `propose` never blocks (but forced)."""

    streams = True

    def __init__(
        self,
        link: ProposerLink,
        client: DirectClient,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        vocab_size: int,
        fingerprint: str,
        max_draft: int,
        lease_s: float = 30.0,
        policy: DraftPolicy | None = None,
        is_alive: Callable[[str], bool] = lambda node_id: True,
        forced: bool = False,
        grammar: Mapping[str, str] | None = None,
    ) -> None:
        self.link = link
        self.client = client
        #: replies to this source's calls read by another source of the link (or by this one)
        self.inbox: collections.deque = collections.deque()
        self.name = link.source_name
        #: the engine captures these layers' hidden states; they go with each commit push
        self.hidden_layers = link.hidden_layers
        self.sid = session_id
        self.vocab_size = vocab_size
        self.policy = policy or DraftPolicy()
        self.is_alive = is_alive
        self.forced = forced
        self.max_draft = max_draft
        self.lease_s = lease_s
        self.tokens = [int(t) for t in prompt_ids]  # committed, as pushed to the proposer
        #: this generation's share of the link's counters (a batch runs several at once)
        self.counts = dict.fromkeys(ProposerLink.COUNTERS, 0)
        self.dropped = False
        self.closed = False
        self.failures = 0
        self.best: DraftChunk | None = None  # the freshest valid chunk
        self.chunks_since_step = 0
        self.proposed = 0  # tokens offered by the last propose
        self.commits: dict[DirectCall, float] = {}  # pending session_extend -> sent at
        self.step_s: float | None = None  # EMA of time between feedbacks (a verify step)
        self.per_step: float = 1.0  # EMA of tokens committed per step
        self._last_fb: float | None = None
        #: the last commit pushed (committed length, sent at) until a chunk based on it arrives
        self.awaiting: tuple[int, float] | None = None
        #: proposes in a row with no budget, and commits held back meanwhile (`policy.idle_*`)
        self.idle = 0
        self.held: list[int] = []
        #: the hidden states of the held commits (a source with `hidden_layers`), in order:
        #: the engine's tensors (its own copies), converted once when pushed
        self.held_rows: list = []
        self.horizon = self._horizon()  # (0 for one that lagged in the last generation)
        # the grammar goes only to a proposer that takes it (the others draft free and are
        # pruned here): it then drafts what the grammar allows
        opening = SessionOpen(session_id, np.asarray(self.tokens, dtype=np.int32), lease_s,
                              sampling, tokenizer=fingerprint, horizon=self.horizon,
                              grammar=grammar if link.takes_grammar else None).to_message()
        self.stream = self._send(opening, None)

    # -- DraftSource --------------------------------------------------------------------------
    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        if self.dropped:
            return EMPTY_TREE
        if budget > 0 and self._lagging():
            budget = 0  # none of its drafts could be in time: asked for none (`lags`)
        quiet = self._quiet()
        if budget <= 0 and quiet:  # read with the next push (`feedback`)
            self.idle += 1
            return EMPTY_TREE
        if not self.is_alive(self.link.node_id):
            self._drop("not alive in membership")
            return EMPTY_TREE
        self._drain()
        if budget <= 0 or self.dropped:
            self.idle += 1
            return EMPTY_TREE
        if self.held:  # asked again: the proposer catches up, the engine may wait for it
            self._push(time.monotonic())
        if self.forced:
            self._wait_for_extension(committed)
        draft = self._draft(committed, budget)
        if len(draft) or not quiet:
            # asked and heard: every commit goes to it again. A quiet source asked with
            # nothing to offer (a probe of one whose drafts come too late) stays quiet
            self.idle = 0
        self.proposed = draft.chain
        return draft

    def draft_class(self, committed: Sequence[int]) -> str | None:
        """The class the proposer gave the freshest chunk's first token past `committed`
        (`DraftChunk.classes`; the drafter's `DraftState.draft_class` when it drafted it),
        if that chunk's chain extends `committed`."""
        if self.dropped:
            return None
        if not self._quiet():
            self._drain()
        c = self.best
        if c is None or not c.classes:
            return None
        known = len(committed) - c.base
        if not 0 <= known < len(c.tokens) or not np.array_equal(
                c.tokens[:known], np.asarray(committed[c.base :], dtype=np.int64)):
            return None
        return self.link.label(c.classes[known])

    def feedback(self, fb: Feedback) -> None:
        now = time.monotonic()
        if self._last_fb is not None:
            dt = now - self._last_fb
            self.step_s = ema(self.step_s, dt)
        self._last_fb = now
        self.per_step = ema(self.per_step, len(fb.committed))
        self.link.lags = self.lags()
        if self.proposed:  # counted as proposed: the tree may have merged it with another's
            self._count("drafts", 1)
            self._count("drafted", self.proposed)
            self._count("accepted", fb.accepted)
            self._count("verified", min(self.proposed, fb.accepted + 1))
        self.proposed = 0
        self.chunks_since_step = 0
        self.tokens.extend(int(t) for t in fb.committed)
        if self.dropped or not fb.committed:
            return
        self.held.extend(int(t) for t in fb.committed)
        if self.hidden_layers and fb.hidden is not None and len(fb.hidden):
            self.held_rows.append(fb.hidden)  # held with their commits, sent with them
        if self._quiet():
            if len(self.held) < self.policy.idle_push_every * max(self.per_step, 1.0):
                return
            self._drain()  # what it sent since it was last read, before the push
            if self.dropped:
                return
        self._push(now)

    def _quiet(self) -> bool:
        """Not asked for drafts lately (`policy.idle_after` steps): its commits are held and
        pushed together, and what it sent is read when they are (`feedback`) or when it is
        asked again, not every step. Why: reading an idle proposer every step (a poll of its
        socket, the class of its last chunk) cost the verifier's core ~0.3 ms a step, 4 % of a
        quantized step for a proposer the engine had stopped asking."""
        return self.idle >= self.policy.idle_after and not self.forced

    def lags(self) -> bool:
        """It drafts fewer tokens a second (its card's `draft_tok_s`) than this verifier
        commits (tokens a step over seconds a step, measured here; before this generation
        measured a step, the link's last judgement). Such a proposer is never ahead of the
        verifier: from each commit pushed to it, the verifier has committed more by the time
        it drafted anything. Its drafts could only be used by waiting for them, and each
        costs a longer wait than the plain step it could save. So it is asked for none
        (`propose`), drafts nothing ahead (`_push`), and, late, sits out generations
        (`ProposerLink.sits_out`). Judged at every step: a loaded verifier (a batch, a longer
        context) may make it worth asking again."""
        rate = self.link.draft_tok_s
        if not rate:
            return False
        if not self.step_s:
            return self.link.lags
        return rate * self.step_s < self.per_step

    def _lagging(self) -> bool:
        """`lags`, and not forced (a forced source is asked and waited for regardless)."""
        return not self.forced and self.lags()

    def _push(self, now: float) -> None:
        """Send the commits held so far, with their hidden states (if any). A quiet source's
        pushes keep the whole horizon: a probe reads the chunk answering the last push, which
        can still extend the prefix 16 steps on only if it drafted that far (tried: the
        shortest horizon made a far ngram proposer's probes fail on prompts it could copy).
        A proposer that drafts slower than the verifier commits gets a horizon of 0
        (`_horizon`)."""
        self.horizon = self._horizon()
        rows = _hidden_rows(self.held_rows)
        push = SessionExtend(self.sid, np.asarray(self.held, dtype=np.int32),
                             len(self.tokens), self.horizon,
                             rows.shape[1] if len(rows) else None,
                             rows.reshape(-1)).to_message()
        self.held, self.held_rows = [], []
        call = self._send(push, self.policy.commit_timeout_s)
        if call is not None:
            self.commits[call] = now
            self.awaiting = (len(self.tokens), now)

    def expected_wait(self) -> float | None:
        """How long until the chunk answering the last commit is due, from how long such
        chunks took so far (round trip plus the proposer's drafting; `policy.first_wait_s`
        before any was measured, so the engine can try a first wait and learn the real figure);
        None once it came, or for a dropped proposer."""
        if self.dropped or self.awaiting is None or self._lagging():
            return None  # (a lagging proposer: nothing it drafts is worth a wait, `lags`)
        took = self.link.fresh_s
        if took is None:
            took = self.policy.first_wait_s
        return max(0.0, took - (time.monotonic() - self.awaiting[1]))

    def wait(self, timeout: float) -> bool:
        """Read replies until the chunk answering the last commit is in (or `timeout`). An
        answer that does not come in time still teaches something: it takes at least this
        long, so the next announcement is no shorter (and the cost model may stop waiting)."""
        deadline = time.monotonic() + timeout
        while self.awaiting is not None and not self.dropped:
            left = deadline - time.monotonic()
            if left <= 0:
                self.link.fresh_at_least(time.monotonic() - self.awaiting[1])
                return False
            self._drain(min(left, self.policy.liveness_poll_s))
        return not self.dropped

    def stats(self) -> dict:
        out = dict(self.counts)
        out["acceptance"] = round(out["accepted"] / out["verified"], 4) if out["verified"] else 0.0
        out["rtt_ms"] = _ms(self.link.timed_s)
        return {**out, "name": self.link.name, "dropped": self.dropped}

    def close(self) -> None:
        if self.closed:
            return
        if self.stream is not None and not self.stream.done:
            self.client.cancel(self.stream)
        if not self.dropped:
            self._send(SessionClose(self.sid).to_message(), 1.0)
        self.closed = True  # replies still on their way are ignored (by the next session too)
        self.inbox.clear()
        calls = self.link.calls
        for call in [c for c, owner in calls.items() if owner is self]:
            del calls[call]

    # -- chunks -------------------------------------------------------------------------------
    def _draft(self, committed: Sequence[int], budget: int) -> DraftTree:
        """What the best chunk's tree offers past `committed`, at most `budget` deep
        (`DraftTree.after`: its paths that continue the tokens committed since the chunk's
        base, the first of them the chain). A chunk none of whose paths extends the prefix is
        stale: dropped and counted."""
        c = self.best
        if c is None or budget <= 0:
            return EMPTY_TREE
        known = len(committed) - c.base  # tokens committed since the chunk's base
        if known < 0:
            draft, alive = EMPTY_TREE, False
        else:
            draft, alive = _tree_of(c).after(committed[c.base :], budget)
        if not alive:
            self.best = None
            self._count("stale", 1)
        if log.isEnabledFor(logging.DEBUG):  # once per step: no formatting unless asked
            log.debug("session %s: chunk base %d (+%d, %d alternatives) at %d committed: %s",
                      self.sid, c.base, len(c.tokens), len(c.alt_tokens), len(committed),
                      f"{len(draft)} nodes, chain {draft.chain}" if len(draft) else
                      "live, nothing past the prefix" if alive else "stale")
        return draft

    def _extends(self, committed: Sequence[int]) -> bool:
        """Forced drafting may stop waiting: the chunk offers tokens past the prefix (on its
        chain or an alternative), or the proposer has seen the whole prefix and that is all it
        has."""
        if len(self._draft(committed, MAX_HORIZON)):
            return True
        return self.best is not None and self.best.base == len(committed)

    def _wait_for_extension(self, committed: Sequence[int]) -> None:
        deadline = time.monotonic() + self.policy.forced_s
        while not self.dropped and not self._extends(committed):
            left = deadline - time.monotonic()
            if left <= 0:
                self._count("timeouts", 1)
                self._fail("no draft extending the prefix within the forced wait")
                return
            if not self.is_alive(self.link.node_id):
                self._count("errors", 1)
                self._drop("left the alive state while waited for")
                return
            self._drain(min(left, self.policy.liveness_poll_s))

    def _drain(self, timeout: float = 0) -> None:
        """Read every reply that has arrived (waiting at most `timeout` for the first).

        Only a waiting read (`timeout` > 0, right after a non-waiting one) times the answer to
        a commit: one read at the next step finds it a whole verify late, and timing that would
        announce every wait as a verify long, so none would ever pay."""
        timely = timeout > 0 and not self.inbox
        got = self.client.poll(timeout=0 if self.inbox else timeout)
        calls = self.link.calls
        for call, reply in got:  # the client is the link's: replies of other generations too
            owner = calls.get(call, self)
            if owner is self:
                self.inbox.append((call, reply))
            elif not owner.closed and not owner.dropped:
                owner.inbox.append((call, reply))  # a dropped one's are discarded
        for call, _ in got:
            if call.done:
                calls.pop(call, None)
        mine, self.inbox = self.inbox, collections.deque()
        for call, reply in mine:
            if call is self.stream:
                self._on_stream(reply, timely)
            elif call in self.commits:
                self._on_commit(call, reply, timely or not self._quiet())
        garbage = self.client.dropped - self.link.garbage_seen
        if garbage > 0:  # counted once, by whichever generation of the batch read it
            self.link.garbage_seen = self.client.dropped
            self._count("bad_replies", garbage)
            self._fail(f"{garbage} undecodable replies")
        if self.stream is not None and self.stream.overflowed and not self.dropped:
            self._flood(f"{self.stream.overflowed} chunks past the reply queue")

    def _on_stream(self, reply, timely: bool = False) -> None:
        if self.dropped or self.closed:
            return
        if isinstance(reply, BusError):
            self._count("errors", 1)
            self._drop(f"draft stream failed: {reply}")
            return
        msg: Message = reply
        if msg.type == ErrorReply.TYPE:
            self._count("errors", 1)
            self._drop(f"{msg.get('code')}: {msg.get('message')}")
            return
        if msg.type != DraftChunk.TYPE:
            if not msg.more:
                self._drop(f"draft stream ended ({msg.type})")
            else:
                self._count("bad_replies", 1)
                self._fail(f"unexpected {msg.type} in the draft stream")
            return
        try:
            chunk = DraftChunk.from_message(msg)
        except CodecError:
            chunk = None
        ok = (chunk is not None and chunk.session == self.sid
              and chunk.base <= len(self.tokens)
              and (len(chunk.tokens) == 0 or int(chunk.tokens.max()) < self.vocab_size)
              and (not chunk.is_tree or int(chunk.alt_tokens.max()) < self.vocab_size))
        if not ok:
            self._count("bad_replies", 1)
            self._fail("malformed or impossible draft_chunk")
            return
        self.chunks_since_step += 1
        if self.chunks_since_step > self.policy.max_chunks_per_step:
            self._flood(f"{self.chunks_since_step} chunks within one step")
            return
        self._count("chunks", 1)
        self.failures = 0
        if self.best is None or chunk.base >= self.best.base:
            self.best = chunk  # fresher: it knows at least as much
        if self.awaiting is not None and chunk.base >= self.awaiting[0]:
            if timely:
                self.link.observe_fresh(time.monotonic() - self.awaiting[1])
            self.awaiting = None
        if not msg.more:
            self._drop("draft stream ended")

    def _on_commit(self, call: DirectCall, reply, timed: bool) -> None:
        """A commit push's answer. `timed`: read by a waiting read, or by a source read every
        step, so it waited unread a step at most (`ProposerLink.observe_rtt`)."""
        sent = self.commits.pop(call)
        if isinstance(reply, RequestTimeout):
            self._count("timeouts", 1)
            self._fail("commit push timed out")
        elif isinstance(reply, BusError):
            self._count("errors", 1)
            self._fail(f"commit push failed: {reply}")
        elif reply.type == ErrorReply.TYPE:
            self._count("errors", 1)
            code = reply.get("code")
            if code in _FATAL_CODES:
                self._drop(f"{code}: {reply.get('message')}")
            else:
                self._fail(f"error {code}")
        else:
            self.link.observe_rtt(time.monotonic() - sent, timed)

    def _horizon(self) -> int:
        """Cover a round trip plus a verify: the tokens committed meanwhile, plus one budget.
        But 0 for a proposer that drafts slower than the verifier commits (`lags`, not
        forced): it follows the commits and drafts nothing ahead, since nothing it drafts
        could be in time. Measured: an int8 proposer, ~30 tok/s beside a ~75 tok/s q4
        verifier, drafted without a pause (98 % of its core) for sessions whose drafts were
        never asked for."""
        if self._lagging():
            return 0
        p = self.policy
        rtt = self.link.net_s or 0.0
        step = self.step_s or 0.0
        steps = 1.0 + (rtt / step if step > 0 else 1.0)
        want = math.ceil(self.per_step * steps) + self.max_draft
        return int(min(p.max_horizon, max(p.min_horizon, want)))

    # -- helpers ------------------------------------------------------------------------------
    def _count(self, key: str, n: int) -> None:
        """Count on the link (kept across generations) and for this generation alone."""
        setattr(self.link, key, getattr(self.link, key) + n)
        self.counts[key] += n

    def _send(self, msg: Message, timeout: float | None) -> DirectCall | None:
        try:
            call = self.client.request(self.link.endpoint, msg, timeout=timeout)
            self.link.calls[call] = self
            return call
        except (ValueError, BusError) as exc:
            log.error("cannot send %s to %s: %s", msg.type, self.link.node_id, exc)
            self._count("errors", 1)
            self._drop("send failed")
            return None

    def _flood(self, why: str) -> None:
        self._count("flooded", 1)
        self._drop(f"flooding: {why}")
        if self.stream is not None and not self.stream.done:
            self.client.cancel(self.stream)

    def _fail(self, why: str) -> None:
        self.failures += 1
        if self.failures >= self.policy.max_failures:
            self._drop(f"{self.failures} failures in a row, last: {why}")

    def _drop(self, why: str) -> None:
        if not self.dropped:
            self.dropped = True
            self.best = None
            log.info("proposer %s dropped for session %s: %s", self.link.node_id, self.sid, why)
            if self._shared():
                # batch-mates still draft with this proposer over the same connection: stop
                # only this session's stream; they read (and discard) what it still sends
                if self.stream is not None and not self.stream.done:
                    self.client.cancel(self.stream)
            else:
                # a dropped proposer is no longer read: close its connection now rather than
                # let whatever it still streams pile up against the receive high-water mark
                # (libzmq 4.3.5 can abort the process on an engine whose input stopped at the
                # HWM)
                self.client.close_peer(self.link.endpoint)

    def _shared(self) -> bool:
        """Another generation still reads this link's connection (a batch-mate's session)."""
        return any(owner is not self and not owner.dropped and not owner.closed
                   for owner in self.link.calls.values())


def _ms(seconds: float | None) -> float | None:
    """A round trip in milliseconds for stats; None until one was timed."""
    return None if seconds is None else round(seconds * 1000, 3)


def _hidden_rows(held: Sequence) -> np.ndarray:
    """The engine's captured hidden states of several commits (each [n, layers, H], a
    framework tensor), in order, as the wire's fp16 rows [sum n, layers x H]: one conversion
    for the lot (per step it cost ~0.1 ms, 1.4 % of a quantized step)."""
    if not held:
        return np.zeros((0, 0), dtype=np.float16)
    if hasattr(held[0], "detach"):  # torch tensors (the only backend that captures them)
        import torch

        hidden = torch.cat(list(held)).detach().float().cpu().numpy()
    else:
        hidden = np.concatenate([np.asarray(h) for h in held])
    arr = np.asarray(hidden, dtype=np.float32)
    return np.clip(arr, -65504, 65504).astype(np.float16).reshape(len(arr), -1)


def _tree_of(c: DraftChunk) -> DraftTree:
    """A chunk's draft as the tree it carries: the chain, then the alternatives under the
    parents the wire gives them (validated there: -1 the base, a chain token, or an earlier
    alternative), with the drafter's probabilities when it sent them."""
    n = len(c.tokens)
    conf = None
    if c.conf is not None and (c.alt_conf is not None or not len(c.alt_tokens)):
        conf = np.concatenate([c.conf, c.alt_conf if c.alt_conf is not None else []])
    return DraftTree(
        np.concatenate([c.tokens, c.alt_tokens]).astype(np.int64),
        np.concatenate([np.arange(-1, n - 1), c.alt_parents]).astype(np.int64), n,
        None if conf is None else conf.astype(np.float64))
