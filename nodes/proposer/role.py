"""The proposer role: serve draft sessions over the node's ROUTER, drafting ahead.

Protocol 2 (docs/protocol.md, "Draft sessions"): `session_open` (prompt tokens, sampling params,
lease, horizon) is answered by a stream of `draft_chunk` replies until `session_close` or lease
expiry; the verifier pushes every commit with `session_extend` (delta + committed total,
idempotent) and does not wait for drafts. Between commits the worker drafts past the last
commit it knows, assuming its own drafts will be accepted, up to the session's horizon, and
streams each chunk tagged with its base (that commit) and the tokens it assumed. A commit that
disagrees with what it assumed rolls the drafter back (`DraftState.truncate`, or a reopen)
and drafting continues from the correction. With a tree width above 1 a chunk also carries the
drafter's alternatives (`DraftState.draft_ahead`'s further paths: a model's runners-up,
the n-gram index's other continuations) and the drafter's probabilities, kept while the
position they compete for
is uncommitted (docs/protocol.md, "Draft trees"). Model drafters draft one token per turn, so a
commit is seen within one draft step.

The I/O thread parses each message into its typed struct and checks it against this node (token
ids in the vocabulary, context within `max_context`), answering bad input at once; then it
only enqueues. One drafting worker thread owns every session (drafters and their
KV caches are not thread-safe) and answers with `Request.reply`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from bus.streams import Request
from codec.errors import CodecError
from codec.structs import (
    MAX_ALTERNATIVES,
    Done,
    DraftChunk,
    SessionClose,
    SessionExtend,
    SessionOpen,
)
from discovery.counters import Counters
from nodes.drafters.base import Drafter, DraftState
from nodes.engine.errors import (
    GenerationError,
    OutOfSyncError,
    UnknownSessionError,
    error_code,
)
from nodes.engine.sources import class_at
from nodes.engine.tree import EMPTY_TREE, DraftTree
from nodes.node_common import requests
from nodes.node_common.admission import FORBIDDEN, TOO_MANY_SESSIONS, AdmissionLimits, SessionBook
from nodes.node_common.host import RoleHost
from nodes.node_common.liveness import ConnectionSweep

log = logging.getLogger(__name__)

MAX_SESSIONS = AdmissionLimits.sessions_total  # default total; see nodes/node_common/admission.py
DEFAULT_HORIZON = 16
_STRUCTS = {c.TYPE: c for c in (SessionOpen, SessionExtend, SessionClose)}


@dataclass
class _Session:
    sid: str
    owner: str  # verifier node id
    draft: DraftState
    params: object  # SamplingParams, to reopen the drafter when it cannot truncate
    tokens: list[int]  # committed tokens this proposer knows (prompt + deltas)
    lease_s: float
    expires: float
    stream: Request  # the session_open request; chunks are its streamed replies
    horizon: int
    #: what was drafted past `tokens`: its chain is fed to the drafter as if committed (the
    #: assumed tokens), with each chain token's class and the alternatives drafted with them
    ahead: DraftTree = EMPTY_TREE
    hidden_rows: int = 0  # the verifier's hidden-state rows received (EAGLE-3 heads)
    exhausted: bool = False  # the drafter had nothing more at this point: wait for a commit
    dirty: bool = True  # a commit arrived since the last chunk: tell the verifier even if empty
    chunks: int = 0

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def assumed(self) -> list[int]:
        """The chain drafted past the last commit, fed to the drafter as if committed."""
        return self.ahead.chain_tokens.tolist()

    def wants_drafting(self) -> bool:
        return self.dirty or (not self.exhausted and len(self.assumed) < self.horizon)


@dataclass
class ProposerStats:
    sessions_opened: int = 0
    sessions_expired: int = 0
    sessions_dropped: int = 0  # its verifier's connection went away before the lease ended
    drafts_served: int = 0  # chunks streamed
    draft_tokens: int = 0  # tokens drafted (new ones, not resent assumed ones)
    draft_s: float = 0.0
    rollbacks: int = 0  # commits that disagreed with what was assumed
    #: drafted tokens that the verifier's commits then confirmed (cumulative, every verifier's):
    #: the proposer's own view of its acceptance, `confirmed / draft_tokens`
    confirmed: int = 0
    cancelled: int = 0  # sessions whose stream the verifier cancelled
    constrained: int = 0  # sessions drafted under their generation's grammar
    errors: int = 0
    by_verifier: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # admission code -> count

    def as_dict(self) -> dict:
        return {
            "sessions_opened": self.sessions_opened,
            "sessions_expired": self.sessions_expired,
            "sessions_dropped": self.sessions_dropped,
            "drafts_served": self.drafts_served,
            "draft_tokens": self.draft_tokens,
            "draft_tok_s": self.draft_tokens / self.draft_s if self.draft_s else 0.0,
            "rollbacks": self.rollbacks,
            "confirmed": self.confirmed,
            "acceptance_cumulative": round(min(1.0, self.confirmed / self.draft_tokens), 4)
            if self.draft_tokens else 0.0,
            "errors": self.errors,
            "constrained": self.constrained,
            "refused": dict(self.refused),
        }


class ProposerRole:
    """Draft sessions for any number of verifiers, on one worker thread that drafts ahead."""

    TYPES = ("session_open", "session_extend", "session_close")

    def __init__(self, drafter: Drafter, vocab_size: int, sweep_every: float = 0.25,
                 max_context: int = 0, admission: AdmissionLimits | None = None,
                 tree_width: int | None = None) -> None:
        self.drafter = drafter
        #: candidates per drafted position streamed to the verifier (1: chains only)
        self.tree_width = drafter.tree_width if tree_width is None else tree_width
        #: longest context one session may hold (prompt + committed deltas)
        self.max_context = max_context or requests.DEFAULT_MAX_CONTEXT
        self.vocab_size = vocab_size
        self.stats = ProposerStats()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, _Session] = {}  # worker thread only
        self._book = SessionBook(admission or AdmissionLimits())  # worker thread only
        self.stats.refused = self._book.refused
        self._sweep_every = sweep_every
        self._bytes_per_token: int | None = None  # measured at the first session's open
        self._clients = None  # ConnectionSweep, once attached (I/O thread)
        #: bad input refused on the I/O thread (ProposerStats is the worker's alone)
        self.input_errors = Counters(("input_errors",), is_owner=lambda: True)
        self._stop = threading.Event()
        self._turn = 0  # round robin over sessions that want drafting
        self._grammars = None  # compiled grammars for sessions that send one (worker thread)
        self._worker = threading.Thread(target=self._run, name="proposer-worker", daemon=True)

    # -- wiring -----------------------------------------------------------------------------
    def attach(self, node: RoleHost) -> None:
        for t in self.TYPES:
            node.register_request(t, self.enqueue)
        # sessions die with their connection, member or not (a session's stream is the
        # in-flight `session_open`)
        self._clients = ConnectionSweep(node, ("session_open",))
        self.input_errors = Counters(("input_errors",), is_owner=node.loop.in_loop)
        self._worker.start()

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._worker.join(5)

    @property
    def bytes_per_token(self) -> int:
        """What a token of a session costs this drafter (`session_bytes_per_token`)."""
        if self._bytes_per_token is None:
            self._bytes_per_token = session_bytes_per_token(self.drafter, self.vocab_size)
        return self._bytes_per_token

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def session_bytes(self) -> int:
        """Estimated bytes of every open session's state (within the admission budget)."""
        return self._book.total_bytes

    @property
    def sessions_evicted(self) -> int:
        """Sessions closed to make room for a connection within its fair share."""
        return self._book.evicted

    def enqueue(self, req: Request) -> None:
        """I/O thread: parse and check (cheap, O(1) in the token count but for one min/max),
        answer bad input at once, else hand over; never blocks."""
        try:
            parsed = self._admit(req)
        except requests.INPUT_ERRORS as exc:
            self.input_errors.inc("input_errors")  # the I/O thread's own counter
            req.fail(*requests.wire_error(exc))
            return
        self._queue.put((req, parsed))
        if self._clients is not None and isinstance(parsed, SessionOpen):
            self._clients.arm()

    def _admit(self, req: Request):
        parsed = _STRUCTS[req.message.type].from_message(req.message)
        if isinstance(parsed, SessionOpen):
            requests.check_context("tokens", len(parsed.tokens), self.max_context)
        elif isinstance(parsed, SessionExtend):
            requests.check_context("committed", parsed.committed, self.max_context)
        if isinstance(parsed, SessionOpen | SessionExtend):
            requests.check_ids("tokens", parsed.tokens, self.vocab_size)
        return parsed

    # -- worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_sweep = time.monotonic() + self._sweep_every
        while not self._stop.is_set():
            busy = any(s.wants_drafting() for s in self._sessions.values())
            try:
                item = (self._queue.get_nowait() if busy
                        else self._queue.get(timeout=self._sweep_every))
            except queue.Empty:
                item = False
            while item:  # every message that is waiting, before drafting further
                self._dispatch(*item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = False
            if item is None:
                break
            now = time.monotonic()
            if now >= next_sweep:
                self._expire(now)
                next_sweep = now + self._sweep_every
            self._draft_one()
        for s in list(self._sessions.values()):
            self._close(s, "stopped")

    def _dispatch(self, req: Request, parsed) -> None:
        try:
            self._handle(req, parsed)
        except (GenerationError, CodecError) as exc:
            self.stats.errors += 1
            if not req.finished:
                req.fail(error_code(exc), str(exc)[:300])
        except Exception as exc:  # noqa: BLE001 - a drafter bug fails one request only
            self.stats.errors += 1
            log.exception("session message failed")
            if not req.finished:
                req.fail("internal", f"{type(exc).__name__}: {exc}"[:300])

    def _handle(self, req: Request, parsed) -> None:
        if isinstance(parsed, SessionOpen):
            self._open(req, parsed)
            return
        if not self._book.may_use(parsed.session, req.peer):
            req.fail(FORBIDDEN, f"session {parsed.session!r} belongs to another connection")
            return
        session = self._sessions.get(parsed.session)
        if session is None:
            raise UnknownSessionError(
                f"no open session {parsed.session!r} (expired or never opened)")
        session.expires = time.monotonic() + session.lease_s
        self._book.touch(session.sid)
        if isinstance(parsed, SessionClose):
            self._close(session, "closed")
            req.reply(Done("closed").to_message())
            return
        self._commit(session, parsed)
        req.reply(Done("extended").to_message())
        self._regrow(session, req.peer)

    def _open(self, req: Request, parsed: SessionOpen) -> None:
        sid = parsed.session
        if not self._book.may_use(sid, req.peer):
            req.fail(FORBIDDEN, f"session {sid!r} belongs to another connection")
            return
        if sid in self._sessions:
            self._close(self._sessions[sid], "reopened")
        nbytes = self._weigh(len(parsed.tokens))
        why = self._book.refusal(req.peer, nbytes)
        if why is not None:
            req.fail(TOO_MANY_SESSIONS, why)
            return
        for victim in self._book.make_room(req.peer, nbytes, opening=True):
            self._close(self._sessions[victim], "evicted")  # an over-share connection's
        total = self._book.limits.sessions_total
        if len(self._book) >= total:  # nobody held more than their share: no room made
            self._book.refused[TOO_MANY_SESSIONS] += 1
            req.fail(TOO_MANY_SESSIONS, f"proposer has {total} draft sessions open, none of "
                     "them beyond its connection's fair share")
            return
        if parsed.tokenizer:
            self.drafter.check_compatible(parsed.tokenizer)
        params = parsed.sampling
        tokens = parsed.tokens.tolist()
        draft = self.drafter.open(tokens, params)
        if parsed.tokenizer:
            draft.for_tokenizer(parsed.tokenizer)
        if parsed.grammar is not None and self.drafter.takes_grammar:
            self._constrain(sid, draft, parsed.grammar)
        draft.warm()  # prefill now, in parallel with the verifier's own prefill
        horizon = DEFAULT_HORIZON if parsed.horizon is None else parsed.horizon
        self._sessions[sid] = _Session(
            sid=sid, owner=req.message.sender, draft=draft, params=params, tokens=tokens,
            lease_s=parsed.lease_s, expires=time.monotonic() + parsed.lease_s, stream=req,
            horizon=horizon)
        self._book.add(sid, req.peer, nbytes)
        self.stats.sessions_opened += 1
        owner = req.message.sender
        self.stats.by_verifier[owner] = self.stats.by_verifier.get(owner, 0) + 1

    def _constrain(self, sid: str, draft: DraftState, grammar) -> None:
        """Draft under the session's grammar (compiled here, cached like a verifier's); one
        that does not compile here leaves the session drafting free (the verifier prunes)."""
        from nodes.engine.errors import BadRequestError
        from nodes.engine.grammar import Constraint, Grammars

        try:
            if self._grammars is None:
                self._grammars = Grammars(self.drafter.grammar_tokenizer(), self.vocab_size)
            draft.constrain(self._grammars.matcher(Constraint.from_wire(dict(grammar))))
        except BadRequestError as exc:
            log.warning("session %s drafts without its grammar: %s", sid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - llguidance cannot take this tokenizer, say
            log.warning("session %s drafts without its grammar: %s: %s", sid,
                        type(exc).__name__, exc)
            return
        self.stats.constrained += 1

    def _weigh(self, tokens: int) -> int:
        """Estimated bytes of a session's state at `tokens` tokens (plus what it drafts)."""
        return (tokens + DEFAULT_HORIZON) * self.bytes_per_token

    def _regrow(self, s: _Session, peer: bytes) -> None:
        """A commit grew the session: account it, and make room if the budget is passed."""
        nbytes = self._weigh(s.committed)
        self._book.resize(s.sid, nbytes)
        for victim in self._book.make_room(peer, 0):
            self._close(self._sessions[victim], "evicted")

    def _commit(self, s: _Session, ext: SessionExtend) -> None:
        """Apply a pushed commit exactly once; keep the assumed drafts it confirms, roll back
        the rest."""
        if ext.horizon is not None:
            s.horizon = ext.horizon
        delta, committed = ext.tokens, ext.committed
        base = committed - len(delta)
        if base > s.committed or committed < s.committed:
            raise OutOfSyncError(
                f"session {s.sid} has {s.committed} committed tokens; "
                f"delta covers {base}..{committed}")
        new = delta[s.committed - base :].tolist()
        if not new:
            return  # a duplicate
        if len(ext.hidden):  # the verifier's hidden states of what it cached (EAGLE-3 heads)
            rows = ext.hidden_rows
            if s.hidden_rows + len(rows) > committed - 1:  # more than it has cached: refused,
                raise OutOfSyncError(  # so a peer cannot grow a session past its tokens
                    f"session {s.sid}: {s.hidden_rows + len(rows)} hidden-state rows for "
                    f"{committed - 1} cached positions")
            s.draft.features(rows)  # checks their width first: refused rows are not counted
            s.hidden_rows += len(rows)
        n = 0
        while n < len(new) and n < len(s.assumed) and new[n] == s.assumed[n]:
            n += 1
        s.tokens.extend(new)
        self.stats.confirmed += n
        if n == len(new):
            # the drafter holds these already; an alternative to a token now committed is moot
            s.ahead = s.ahead.advanced(n)
        else:
            if s.assumed:  # it drafted ahead and the commit disagrees: roll that back
                self.stats.rollbacks += 1
                self._rollback(s, s.committed - len(new) + n)
            # (nothing drafted ahead, a horizon of 0: the commit only extends the drafter)
            s.draft.extend(new[n:])
            s.ahead = EMPTY_TREE
        log.debug("session %s: commit to %d (+%d), %d of them drafted here, %d drafted ahead kept",
                  s.sid, s.committed, len(new), n, len(s.assumed))
        s.exhausted = False
        s.dirty = True

    def _rollback(self, s: _Session, length: int) -> None:
        try:
            s.draft.truncate(length)
        except NotImplementedError:
            s.draft.close()
            s.draft = self.drafter.open(s.tokens[:length], s.params)

    def _draft_one(self) -> None:
        """Draft one chunk for the next session that wants one, and stream it."""
        ready = [s for s in self._sessions.values() if s.wants_drafting()]
        if not ready:
            return
        self._turn = (self._turn + 1) % len(ready)
        s = ready[self._turn]
        if s.stream.cancelled.is_set():
            self.stats.cancelled += 1
            self._close(s, "cancelled")
            return
        room = max(s.horizon - len(s.assumed), 0)
        k = min(room, self.drafter.ahead_chunk or room)
        if s.dirty and s.assumed and self.drafter.ahead_chunk:
            # a commit confirmed part of the chain drafted ahead: the rest is what the verifier
            # waits for now; a slow drafter's next token would hold it back a whole draft step
            k = 0
        ids: list[int] = []
        if k > 0:
            t0 = time.perf_counter()
            label = s.draft.draft_class() or ""  # told before drafting, as in process
            # drafts travel as point masses, also under sampling (lossless whatever we do;
            # docs/protocol.md "Why q is not sent"): model drafters propose q's mode
            tree = s.draft.draft_ahead(k, self.tree_width).cut(k)
            self.stats.draft_s += time.perf_counter() - t0
            ids = tree.chain_tokens.tolist()
            if ids:
                # each token its own class: the (j+1)-th token of a draft continuing a match
                # of L tokens continues one of L + j (`class_at`), so the verifier judges the
                # first token past its prefix by where it stands in the draft
                tree = replace(tree, classes=tuple(class_at(label, j) for j in range(len(ids))))
                s.ahead = s.ahead.then(tree)
                s.draft.extend(ids)
                self.stats.draft_tokens += len(ids)
            if not ids:
                s.exhausted = True  # nothing more from here until a commit
        if not ids and not s.dirty:
            return
        s.dirty = False
        s.chunks += 1
        self.stats.drafts_served += 1
        s.stream.reply(_chunk(s).to_message(), more=True)
        log.debug("session %s: chunk %d at %d, %d drafted ahead (%d new)", s.sid, s.chunks,
                  s.committed, len(s.assumed), len(ids))

    def _expire(self, now: float) -> None:
        for s in [s for s in self._sessions.values() if s.expires <= now]:
            log.info("session %s of %s expired (lease %.1fs)", s.sid, s.owner, s.lease_s)
            self.stats.sessions_expired += 1
            self._close(s, "expired")
        for s in [s for s in self._sessions.values() if s.stream.cancelled.is_set()]:
            if s.stream.dropped:  # its connection is gone (nodes/node_common/liveness.py)
                log.info("session %s of %s dropped: its connection is gone", s.sid, s.owner)
                self.stats.sessions_dropped += 1
            else:
                self.stats.cancelled += 1
            self._close(s, "cancelled")

    def _close(self, session: _Session, why: str) -> None:
        self._sessions.pop(session.sid, None)
        self._book.remove(session.sid)
        if not session.stream.finished and not session.stream.cancelled.is_set():
            session.stream.reply(Done(why).to_message())
        try:
            session.draft.close()
        except Exception:  # noqa: BLE001 - closing must not take the worker down
            log.exception("closing session %s", session.sid)


#: tokens of the session `measured_bytes_per_token` opens (a few tens of ms for an index)
MEASURE_TOKENS = 2048


def session_bytes_per_token(drafter: Drafter, vocab_size: int = 0) -> int:
    """What one token of a draft session costs this drafter, for the session budget: its own
    figure when it states one (`bytes_per_token`), else a model drafter's KV cache per token
    (2 x layers x KV heads x head size x 4 bytes), else what a session of a model-free drafter
    (an index) was measured to hold, worst case: 256 bytes once assumed, an n-gram session of
    8,000 tokens held ~737 B a token and 17 x 16 of them took a proposer from 48 MB to 3 GB
    against its 512 MiB budget."""
    own = getattr(drafter, "bytes_per_token", None)
    if isinstance(own, int) and own > 0:
        return own
    cfg = getattr(getattr(getattr(drafter, "backend", None), "model", None), "config", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if isinstance(layers, int) and isinstance(heads, int) and heads > 0:
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return 2 * layers * kv * head_dim * 4 + 256
    if getattr(drafter, "backend", None) is None and vocab_size > 1:
        measured = measured_bytes_per_token(drafter, vocab_size)
        if measured is not None:
            return max(256, measured)
    return 256


def measured_bytes_per_token(drafter: Drafter, vocab_size: int,
                             tokens: int = MEASURE_TOKENS) -> int | None:
    """Bytes a session of `drafter` allocates per token (Python's allocator, traced), opened
    as a proposer opens one (the committed ids as a list, then the drafter's state) on ids
    drawn at random: no repeats to share, a hostile session's worst case. The session is left
    to the collector unclosed (closing a suffix session would hand its text to the shared
    index). None when the drafter cannot be measured so."""
    import tracemalloc

    from nodes.engine.sampling import SamplingParams

    ids = np.random.default_rng(0).integers(0, vocab_size, tokens)
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        committed = ids.tolist()
        session = drafter.open(committed, SamplingParams())
        grown = tracemalloc.get_traced_memory()[0] - before
    except Exception:  # noqa: BLE001 - a drafter that cannot open this way: the default
        log.debug("cannot measure a session of %s", type(drafter).__name__, exc_info=True)
        return None
    finally:
        if started:
            tracemalloc.stop()
    del session, committed
    return max(grown, 0) // tokens


def _chunk(s: _Session) -> DraftChunk:
    """The session's draft as one chunk: its tree past the last commit as it is (the chain
    first, then the alternatives, nearest positions first, within the wire's bound), draft
    probabilities when the drafter gave them."""
    tree = s.ahead.bounded(MAX_ALTERNATIVES)
    n = tree.chain
    conf = tree.conf if len(tree) else None
    return DraftChunk(
        s.sid, s.committed, tree.tokens[:n].astype(np.int32), s.chunks,
        tree.tokens[n:].astype(np.int32), tree.parents[n:].astype(np.int32),
        None if conf is None else conf[:n].astype(np.float32),
        None if conf is None else conf[n:].astype(np.float32),
        tuple(tree.classes) if any(tree.classes) else ())
