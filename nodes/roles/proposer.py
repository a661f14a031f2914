"""The proposer role: serve draft sessions over the node's ROUTER.

Protocol (docs/protocol.md, "Draft sessions"): `session_open` (prompt tokens, sampling params,
lease) -> `draft_req` (delta of committed tokens + k) -> `draft_reply` (0..k tokens, probs when
sampling) ... -> `session_close` or lease expiry.

The I/O thread only enqueues; one drafting worker thread owns every session (drafters and their
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
from codec.messages import make
from nodes.drafters.base import Drafter, DraftSession
from nodes.engine.errors import BadRequestError, GenerationError
from nodes.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_LEASE_S = 300.0
MAX_K = 64
MAX_SESSIONS = 256


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

    def as_dict(self) -> dict:
        return {
            "sessions_opened": self.sessions_opened,
            "sessions_expired": self.sessions_expired,
            "drafts_served": self.drafts_served,
            "draft_tokens": self.draft_tokens,
            "draft_tok_s": self.draft_tokens / self.draft_s if self.draft_s else 0.0,
            "stale_skipped": self.stale_skipped,
            "errors": self.errors,
        }


class ProposerRole:
    """Draft sessions for any number of verifiers, on one worker thread."""

    TYPES = ("session_open", "session_extend", "draft_req", "session_close")

    def __init__(self, drafter: Drafter, vocab_size: int, sweep_every: float = 0.25,
                 reply_delay_s: float = 0.0) -> None:
        self.drafter = drafter
        self.reply_delay_s = reply_delay_s  # test/bench knob: emulate a slower network
        self.vocab_size = vocab_size
        self.stats = ProposerStats()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, _Session] = {}  # worker thread only
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
        """I/O thread: stamp the arrival time and hand over; never blocks."""
        self._queue.put((time.monotonic(), req))

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
            arrived, req = item
            try:
                self._handle(arrived, req)
            except (GenerationError, ValueError) as exc:
                self.stats.errors += 1
                code = getattr(exc, "code", None) or error_code(exc)
                if not req.finished:
                    req.fail(code, str(exc)[:300])
            except Exception as exc:  # noqa: BLE001 - a drafter bug fails one request only
                self.stats.errors += 1
                log.exception("drafting failed")
                if not req.finished:
                    req.fail("internal", f"{type(exc).__name__}: {exc}"[:300])
        for s in list(self._sessions.values()):
            self._close(s)

    def _handle(self, arrived: float, req: Request) -> None:
        msg = req.message
        sid = msg.session
        if not sid:
            raise BadRequestError(f"{msg.type} needs a session id (header 'sid')")
        if msg.type == "session_open":
            self._open(req)
            return
        session = self._sessions.get(sid)
        if session is None:
            req.fail("unknown_session", f"no open session {sid!r} (expired or never opened)")
            return
        session.expires = time.monotonic() + session.lease_s
        if msg.type == "session_close":
            self._close(session)
            req.reply(make("done", finish_reason="closed"))
            return
        delta = msg.tensors[0] if msg.tensors else np.zeros(0, np.int32)
        self._extend(session, delta, int(msg["committed"]))
        if msg.type == "session_extend":
            req.reply(make("done", finish_reason="extended"))
            return
        # draft_req
        k = int(msg["k"])
        if not 0 <= k <= MAX_K:
            raise BadRequestError(f"k must be in 0..{MAX_K}, got {k}")
        budget = msg.get("budget_s")
        late = budget is not None and time.monotonic() - arrived > float(budget)
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
        tensors = [ids]
        if session.want_probs and probs is not None and len(ids):
            tensors.append(np.ascontiguousarray(np.asarray(probs, dtype=np.float32)[: len(ids)]))
        reply = make("draft_reply", committed=session.committed, elapsed_s=elapsed,
                     tensors=tensors)
        if self.reply_delay_s > 0 and self._loop is not None:
            self._loop.call_later(self.reply_delay_s, lambda: req.reply(reply))
        else:
            req.reply(reply)

    def _open(self, req: Request) -> None:
        msg = req.message
        if msg.session in self._sessions:
            self._close(self._sessions[msg.session])
        if len(self._sessions) >= MAX_SESSIONS:
            req.fail("busy", f"proposer has {MAX_SESSIONS} open sessions")
            return
        fp = msg.get("tokenizer")
        if fp:
            self.drafter.check_compatible(fp)
        lease = float(msg["lease_s"])
        if not 0 < lease <= MAX_LEASE_S:
            raise BadRequestError(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease}")
        sp = msg.get("sampling") or {}
        try:
            params = SamplingParams(
                temperature=float(sp.get("temperature", 0.0)),
                top_p=float(sp.get("top_p", 1.0)),
                top_k=int(sp.get("top_k", 0)),
                seed=None if sp.get("seed") is None else int(sp["seed"]),
            )
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"bad sampling parameters {sp!r}: {exc}") from exc
        params.validate()
        prompt = msg.tensors[0]
        if len(prompt) == 0:
            raise BadRequestError("session_open needs at least one prompt token")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size > 0:
            raise BadRequestError("prompt token ids outside the vocabulary")
        draft = self.drafter.open(prompt.tolist(), params)
        draft.warm()  # prefill now, in parallel with the verifier's own prefill
        self._sessions[msg.session] = _Session(
            sid=msg.session, owner=msg.sender, draft=draft, committed=len(prompt),
            lease_s=lease, expires=time.monotonic() + lease, want_probs=not params.greedy,
        )
        self.stats.sessions_opened += 1
        self.stats.by_verifier[msg.sender] = self.stats.by_verifier.get(msg.sender, 0) + 1
        req.reply(make("done", finish_reason="opened"))

    def _extend(self, session: _Session, delta: np.ndarray, committed: int) -> None:
        base = committed - len(delta)
        if base > session.committed or committed < session.committed:
            raise _OutOfSync(
                f"session {session.sid} has {session.committed} committed tokens; "
                f"delta covers {base}..{committed}"
            )
        new = delta[session.committed - base :]
        if len(new):
            if int(new.min()) < 0 or (self.vocab_size and int(new.max()) >= self.vocab_size):
                raise BadRequestError("delta token ids outside the vocabulary")
            session.draft.extend(new.tolist())
            session.committed = committed

    def _expire(self, now: float) -> None:
        for s in [s for s in self._sessions.values() if s.expires <= now]:
            log.info("session %s of %s expired (lease %.1fs)", s.sid, s.owner, s.lease_s)
            self.stats.sessions_expired += 1
            self._close(s)

    def _close(self, session: _Session) -> None:
        self._sessions.pop(session.sid, None)
        try:
            session.draft.close()
        except Exception:  # noqa: BLE001 - closing must not take the worker down
            log.exception("closing session %s", session.sid)


def error_code(exc: Exception) -> str:
    """`TokenizerMismatchError` -> `tokenizer_mismatch`: a stable wire code from the type."""
    name = type(exc).__name__.removesuffix("Error")
    return "".join(("_" + c.lower()) if c.isupper() else c for c in name).lstrip("_")


class _OutOfSync(BadRequestError):
    """The verifier's delta does not continue what this session has (tokens were lost)."""

    code = "out_of_sync"
