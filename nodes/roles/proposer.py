"""The proposer role: serve draft sessions over the node's ROUTER.

Protocol (docs/protocol.md, "Draft sessions"): `session_open` (prompt tokens, sampling params,
lease) -> `draft_req` (delta of committed tokens + k) -> `draft_reply` (0..k tokens, probs when
sampling) ... -> `session_close` or lease expiry.

The I/O thread parses each message into its typed struct and checks it against this node (token
ids in the vocabulary, context within `max_context`), answering bad input at once; then it
only enqueues. One drafting worker thread owns every session (drafters and their
KV caches are not thread-safe) and answers with `Request.reply`. Deltas are idempotent: a
`draft_req` says where its delta ends (`committed`), so a delta that arrives after its request
timed out on the verifier, or twice, is applied exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from bus.streams import Request
from codec.errors import CodecError
from codec.structs import (
    Done,
    DraftReply,
    DraftReq,
    SessionClose,
    SessionExtend,
    SessionOpen,
)
from nodes.drafters.base import Drafter, DraftSession
from nodes.engine.errors import (
    GenerationError,
    OutOfSyncError,
    UnknownSessionError,
    error_code,
)
from nodes.roles import requests
from nodes.roles.admission import FORBIDDEN, TOO_MANY_SESSIONS, AdmissionLimits, SessionBook

log = logging.getLogger(__name__)

MAX_SESSIONS = AdmissionLimits.sessions_total  # default total; see nodes/roles/admission.py
_STRUCTS = {c.TYPE: c for c in (SessionOpen, SessionExtend, DraftReq, SessionClose)}


@dataclass
class _Session:
    sid: str
    owner: str  # verifier node id
    draft: DraftSession
    committed: int
    lease_s: float
    expires: float
    want_probs: bool


@dataclass
class ProposerStats:
    sessions_opened: int = 0
    sessions_expired: int = 0
    drafts_served: int = 0
    draft_tokens: int = 0
    draft_s: float = 0.0
    stale_skipped: int = 0  # requests whose budget had passed before we got to them
    errors: int = 0
    by_verifier: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # admission code -> count

    def as_dict(self) -> dict:
        return {
            "sessions_opened": self.sessions_opened,
            "sessions_expired": self.sessions_expired,
            "drafts_served": self.drafts_served,
            "draft_tokens": self.draft_tokens,
            "draft_tok_s": self.draft_tokens / self.draft_s if self.draft_s else 0.0,
            "stale_skipped": self.stale_skipped,
            "errors": self.errors,
            "refused": dict(self.refused),
        }


class ProposerRole:
    """Draft sessions for any number of verifiers, on one worker thread."""

    TYPES = ("session_open", "session_extend", "draft_req", "session_close")

    def __init__(self, drafter: Drafter, vocab_size: int, sweep_every: float = 0.25,
                 max_context: int = 0, admission: AdmissionLimits | None = None) -> None:
        self.drafter = drafter
        #: longest context one session may hold (prompt + committed deltas)
        self.max_context = max_context or requests.DEFAULT_MAX_CONTEXT
        self.vocab_size = vocab_size
        self.stats = ProposerStats()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, _Session] = {}  # worker thread only
        self._book = SessionBook(admission or AdmissionLimits())  # worker thread only
        self.stats.refused = self._book.refused
        self._sweep_every = sweep_every
        self._stop = threading.Event()
        self._loop = None
        self._worker = threading.Thread(target=self._run, name="proposer-worker", daemon=True)

    # -- wiring -----------------------------------------------------------------------------
    def attach(self, node) -> None:
        self._loop = node.loop if hasattr(node, "loop") else None
        for t in self.TYPES:
            node.register_request(t, self.enqueue)
        self._worker.start()

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._worker.join(5)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def enqueue(self, req: Request) -> None:
        """I/O thread: parse and check (cheap, O(1) in the token count but for one min/max),
        answer bad input at once, else stamp the arrival time and hand over; never blocks."""
        arrived = time.monotonic()
        try:
            parsed = self._admit(req)
        except requests.INPUT_ERRORS as exc:
            self.stats.errors += 1
            req.fail(*requests.wire_error(exc))
            return
        self._queue.put((arrived, req, parsed))

    def _admit(self, req: Request):
        parsed = _STRUCTS[req.message.type].from_message(req.message)
        if isinstance(parsed, SessionOpen):
            requests.check_context("tokens", len(parsed.tokens), self.max_context)
        elif isinstance(parsed, SessionExtend | DraftReq):
            requests.check_context("committed", parsed.committed, self.max_context)
        if isinstance(parsed, SessionOpen | SessionExtend | DraftReq):
            requests.check_ids("tokens", parsed.tokens, self.vocab_size)
        return parsed

    # -- worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_sweep = time.monotonic() + self._sweep_every
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=self._sweep_every)
            except queue.Empty:
                item = False
            now = time.monotonic()
            if now >= next_sweep:
                self._expire(now)
                next_sweep = now + self._sweep_every
            if not item:
                continue
            arrived, req, parsed = item
            try:
                self._handle(arrived, req, parsed)
            except (GenerationError, CodecError) as exc:
                self.stats.errors += 1
                if not req.finished:
                    req.fail(error_code(exc), str(exc)[:300])
            except Exception as exc:  # noqa: BLE001 - a drafter bug fails one request only
                self.stats.errors += 1
                log.exception("drafting failed")
                if not req.finished:
                    req.fail("internal", f"{type(exc).__name__}: {exc}"[:300])
        for s in list(self._sessions.values()):
            self._close(s)

    def _handle(self, arrived: float, req: Request, parsed) -> None:
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
        if isinstance(parsed, SessionClose):
            self._close(session)
            req.reply(Done("closed").to_message())
            return
        self._extend(session, parsed.tokens, parsed.committed)
        if isinstance(parsed, SessionExtend):
            req.reply(Done("extended").to_message())
            return
        k = parsed.k
        budget = parsed.budget_s
        late = budget is not None and time.monotonic() - arrived > budget
        if late or req.cancelled.is_set():
            # the verifier has given up on this block already: don't waste a draft on it
            self.stats.stale_skipped += 1
            ids, probs = np.zeros(0, np.int32), None
            elapsed = 0.0
        else:
            t0 = time.perf_counter()
            ids, probs = session.draft.draft(k)
            elapsed = time.perf_counter() - t0
            ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int32).reshape(-1)[:k])
            self.stats.drafts_served += 1
            self.stats.draft_tokens += len(ids)
            self.stats.draft_s += elapsed
        send_probs = None
        if session.want_probs and probs is not None and len(ids):
            send_probs = np.asarray(probs, dtype=np.float32)[: len(ids)]
        reply = DraftReply(session.sid, session.committed, ids, send_probs,
                           elapsed).to_message()
        req.reply(reply)

    def _open(self, req: Request, parsed: SessionOpen) -> None:
        sid = parsed.session
        if not self._book.may_use(sid, req.peer):
            req.fail(FORBIDDEN, f"session {sid!r} belongs to another connection")
            return
        if sid in self._sessions:
            self._close(self._sessions[sid])
        why = self._book.refusal(req.peer)
        if why is not None:
            req.fail(TOO_MANY_SESSIONS, why)
            return
        if parsed.tokenizer:
            self.drafter.check_compatible(parsed.tokenizer)
        params = requests.sampling_params(parsed.sampling)
        draft = self.drafter.open(parsed.tokens.tolist(), params)
        draft.warm()  # prefill now, in parallel with the verifier's own prefill
        self._sessions[sid] = _Session(
            sid=sid, owner=req.message.sender, draft=draft, committed=len(parsed.tokens),
            lease_s=parsed.lease_s, expires=time.monotonic() + parsed.lease_s,
            want_probs=not params.greedy,
        )
        self._book.add(sid, req.peer)
        self.stats.sessions_opened += 1
        owner = req.message.sender
        self.stats.by_verifier[owner] = self.stats.by_verifier.get(owner, 0) + 1
        req.reply(Done("opened").to_message())

    def _extend(self, session: _Session, delta: np.ndarray, committed: int) -> None:
        base = committed - len(delta)
        if base > session.committed or committed < session.committed:
            raise OutOfSyncError(
                f"session {session.sid} has {session.committed} committed tokens; "
                f"delta covers {base}..{committed}"
            )
        new = delta[session.committed - base :]
        if len(new):
            session.draft.extend(new.tolist())
            session.committed = committed

    def _expire(self, now: float) -> None:
        for s in [s for s in self._sessions.values() if s.expires <= now]:
            log.info("session %s of %s expired (lease %.1fs)", s.sid, s.owner, s.lease_s)
            self.stats.sessions_expired += 1
            self._close(s)

    def _close(self, session: _Session) -> None:
        self._sessions.pop(session.sid, None)
        self._book.remove(session.sid)
        try:
            session.draft.close()
        except Exception:  # noqa: BLE001 - closing must not take the worker down
            log.exception("closing session %s", session.sid)

