"""The verifier role: serve `generate_req` by speculative decoding with proposers on the bus.

Requests queue (bounded) for one compute thread that owns the model. It runs up to
`max_batch` generations together: between steps queued requests join the batch and finished or
cancelled ones leave it, and each step is one `Engine.step_batch` (one verifier forward for all
of them, each with its own tree, sources and stop rules). Each generation streams each
committed block back as a `token_chunk` and ends with `done` (text, token ids, figures,
per-proposer stats). `max_batch=1` serves one generation at a time, as before batching.
Drafts come from the cluster's compatible proposers (alive, same tokenizer fingerprint or
tokenizer-agnostic), one `ProposerSource` each per generation: they stream drafts ahead and are
pushed every commit, and the engine merges their chains into one tree per forward; with none,
from the node's own drafter if it has one, else plain decoding.

Each request is parsed into `codec.structs.GenerateReq` and checked against this node
(`nodes/node_common/requests.py`) on the I/O thread, so bad or over-long input is refused before it
is queued. The proposer links belong to the compute thread; telemetry reads the immutable
`proposer_snapshot` it publishes after each block and generation.

Client liveness: work whose client is gone is dropped, and every drop is answered with an
`error` (`client_gone`), so a client that is in fact still listening learns its stream ended.
A client that cancels (or closes) has its queued request removed and its running one stopped
within a block. Whether a client is gone is decided by its connection alone: while any
generation is queued or running, the I/O thread probes each requesting connection every
two seconds (`nodes/node_common/liveness.py`) and drops the work of those that are gone, so
an anonymous client (a raw DEALER that never joined) that queues work and vanishes costs at
most one sweep. Membership only makes it sooner: when the sender of a request leaves or is
declared dead, its connections are probed at once. A client membership calls dead or left but
whose connection is alive (a stall: SIGSTOP, GC pause; or a forged `leave` naming it) keeps
its work.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from bus.streams import Request
from codec.envelope import Message
from codec.errors import CodecError
from codec.structs import Done, GenerateReq, TokenChunk
from discovery.counters import Counters
from nodes.backends.base import Backend
from nodes.engine.core import Block, Engine, SequenceState, Stats
from nodes.engine.errors import BUSY, GenerationError, NoProposerError, error_code
from nodes.engine.grammar import Constraint
from nodes.node_common import requests
from nodes.node_common.admission import AdmissionLimits, PeerSlots
from nodes.node_common.host import RoleHost
from nodes.node_common.liveness import ConnectionSweep
from nodes.verifier.proposer_client import DraftPolicy, ProposerLink, ProposerSource

log = logging.getLogger(__name__)

ANY_TOKENIZER = "any"  # card value of tokenizer-agnostic drafters (ngram)
MAX_PROPOSERS_USED = 8  # proposers one generation drafts with (a tree merges them all)
PRUNE_IDLE_S = 2.0  # an idle verifier closes the links of departed proposers this often
_IDLE = object()  # `_next` while nothing is queued for PRUNE_IDLE_S
MAX_TOKENS_LIMIT = requests.MAX_TOKENS_LIMIT


@dataclass
class VerifierStats:
    """What the compute thread counts (its only writer); the I/O thread's own counts are in
    `VerifierRole.admission` (one writing thread per counter; telemetry merges the two)."""

    generations: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # summed per generation (overlapping ones in a batch each count)
    last_tok_s: float = 0.0
    last_acceptance: float = 0.0
    steps: int = 0  # batched engine steps (each one forward per engine in the batch)
    stepped: int = 0  # sequences those steps carried (stepped / steps: mean batch size)
    rows: int = 0  # positions those steps fed (prompts, pending tokens, draft nodes)
    #: tokens those steps committed (committed / stepped: tokens per forward per sequence)
    committed: int = 0
    #: prompt positions started from the prefix cache instead of prefilled
    reused: int = 0
    #: cumulative over every generation it served, any client's (issue 47): draft tokens
    #: verified, accepted, and accepted per draft depth (vLLM's per-position counter)
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_cumulative(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _Job:
    """One running generation of the batch: its request, engine sequence and what it has
    streamed so far (compute thread only)."""

    req: Request
    parsed: GenerateReq
    prompt_ids: list[int]
    engine: Engine
    seq: SequenceState
    sources: list
    remote: list[ProposerSource]
    stats: Stats
    t0: float
    generated: list[int] = field(default_factory=list)
    sent_text: str = ""
    blocks: int = 0


#: counted on the I/O thread: refused for a full queue or connection, dropped for a gone client
ADMISSION_COUNTERS = ("rejected_busy", "orphans_dropped")


class VerifierRole:
    """Owns the engine (model + caches) on one compute thread; up to `max_batch` generations
    step together."""

    def __init__(self, engine: Engine, max_queue: int = 16,
                 policy: DraftPolicy | None = None, lease_s: float = 30.0,
                 max_context: int = 0, admission: AdmissionLimits | None = None,
                 max_batch: int = 1) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self._jobs: list[_Job] = []  # the running batch (compute thread only)
        self.policy = policy or DraftPolicy()
        self.lease_s = lease_s
        #: longest prompt + max_tokens served (0: the model's own context)
        self.max_context = max_context or requests.model_context(engine.backend)
        self.stats = VerifierStats()
        #: compute thread, after each generation that finished: (prompt ids, generated ids)
        self.on_finished: Callable[[list[int], list[int]], None] | None = None
        self.admission = Counters(ADMISSION_COUNTERS, is_owner=lambda: True)  # until attached
        self.links: dict[str, ProposerLink] = {}  # compute thread only
        #: what telemetry (I/O thread) may read: an immutable view the compute thread replaces
        self.proposer_snapshot: Mapping[str, dict] = MappingProxyType({})
        self._forced_engine: Engine | None = None
        self.max_queue = max_queue
        #: requests waiting for the compute thread: (request, parsed); guarded by _cv
        self._waiting: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._watching = False  # subscribed to membership events (I/O thread)
        self._clients: ConnectionSweep | None = None  # probes requesting connections (I/O)
        #: queued + running generations per connection (admission.py): a connection may fill
        #: the batch and queue `generations_per_peer` more (one gateway carrying many users)
        self.slots = PeerSlots(per_connection(max_batch, admission or AdmissionLimits()))
        self._node = None
        self.active = 0
        self._worker = threading.Thread(target=self._run, name="verifier-compute", daemon=True)

    def attach(self, node: RoleHost) -> None:
        self._node = node
        self.admission = Counters(ADMISSION_COUNTERS, is_owner=node.loop.in_loop)
        node.register_request("generate_req", self.enqueue)
        self._worker.start()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._worker.join(5)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def enqueue(self, req: Request) -> None:
        """I/O thread: parse and check the request, then queue it, or refuse it at once
        (bad input, too long, queue full) before any model work."""
        try:
            parsed = requests.admit_generate(req.message, self.engine.backend.vocab_size,
                                             self.max_context)
            constraint = self._constraint(parsed)
        except requests.INPUT_ERRORS as exc:
            req.fail(*requests.wire_error(exc))
            return
        if not self.slots.acquire(req.peer):
            self.admission.inc("rejected_busy")
            req.fail(BUSY, f"this connection has {self.slots.per_peer} generations queued or "
                           "running; wait for one to finish")
            return
        with self._cv:  # (this thread alone appends: the queue only shrinks meanwhile)
            full = len(self._waiting) >= self.max_queue
        if full:
            self.slots.release(req.peer)
            self.admission.inc("rejected_busy")
            req.fail(BUSY, f"verifier queue is full ({self.max_queue} waiting)")
            return
        # compiles start only for admitted work: a refused request queues none on the
        # grammar thread, so compiles pending are bounded by the queue and the batch
        grammar = None if constraint is None else self.engine.grammars.prepare(constraint)
        item = (req, parsed, grammar)
        with self._cv:
            self._waiting.append(item)
            self._cv.notify()
        req.on_cancel(lambda: self._unqueue(item))  # a cancelled request leaves the queue
        if grammar is not None and not grammar.done():
            grammar.add_done_callback(lambda _: self._wake())  # ready to start: tell the
            # compute thread (its queue skips it meanwhile)
        self._watch_clients()
        self._sweep().arm()

    def _constraint(self, parsed: GenerateReq) -> Constraint | None:
        """I/O thread: the request's grammar, checked against its limits, to compile on the
        grammar thread once the request is queued (`Grammars.prepare`: the compute thread
        takes it only once compiled, so a compile never stalls the running batch); None
        without one (or with forced drafting, whose own engine compiles at start)."""
        if parsed.grammar is None or parsed.force_draft:
            return None
        constraint = Constraint.from_wire(dict(parsed.grammar))
        constraint.check()
        return constraint

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _unqueue(self, item) -> bool:
        with self._cv:
            try:
                self._waiting.remove(item)
            except ValueError:
                return False  # already taken by the compute thread (it sees `cancelled`)
        self.slots.release(item[0].peer)
        return True

    # -- client liveness (I/O thread; membership events hand over to it) ----------------------
    def _watch_clients(self) -> None:
        """I/O thread: subscribe to membership once it exists (it does not at attach time)."""
        node = self._node
        subscribe = getattr(getattr(node, "membership", None), "subscribe", None)
        if self._watching or subscribe is None:  # no membership: a bare bus host (tests)
            return
        self._watching = True
        subscribe(self._on_member_event)

    def _on_member_event(self, ev) -> None:
        """Events thread: a departure makes the I/O thread probe that sender's connections."""
        if ev.kind in ("dead", "leave"):
            self._node.loop.call_soon(lambda: self._check_client(ev.node_id))

    def _check_client(self, sender: str) -> None:
        """I/O thread: a sender membership calls dead or left: probe its connections now."""
        self._sweep().check(sender)

    def _sweep(self) -> ConnectionSweep:
        if self._clients is None:
            self._clients = ConnectionSweep(self._node, ("generate_req",), on_drop=self._orphan)
        return self._clients

    def _orphan(self, _req) -> None:
        self.admission.inc("orphans_dropped")

    # -- compute thread -----------------------------------------------------------------------
    def _next(self):
        """The next request; while idle, every `PRUNE_IDLE_S` the links of proposers that
        are no longer workers are closed (their sockets belong to this thread)."""
        with self._cv:
            while not self._closing and (at := self._first_ready()) is None:
                if not self._cv.wait(PRUNE_IDLE_S):
                    return _IDLE
            if self._closing:
                return None
            item = self._waiting[at]
            del self._waiting[at]
            return item

    def _first_ready(self, rank=None) -> int | None:
        """With `_cv` held: the queued request to take next among those whose grammar, if
        any, is compiled (by `rank`, else the oldest); None when none is ready."""
        ready = [i for i, (_, _, g) in enumerate(self._waiting) if g is None or g.done()]
        if not ready:
            return None
        return min(ready, key=rank) if rank is not None else ready[0]

    def _next_nowait(self):
        """A queued request if there is one (None otherwise, or when closing): the oldest of
        the connection with the fewest generations in the batch, so a connection that fills
        the queue cannot keep another's request waiting behind all of its own."""
        with self._cv:
            if self._closing or not self._waiting:
                return None
            running = collections.Counter(job.req.peer for job in self._jobs)
            best = self._first_ready(lambda i: (running[self._waiting[i][0].peer], i))
            if best is None:
                return None
            item = self._waiting[best]
            del self._waiting[best]
            return item

    def _prune_links(self, workers=None) -> None:
        """Compute thread: close the links of proposers that are no longer workers."""
        if self._node is None or self._node.membership is None or not self.links:
            return
        if workers is None:
            workers = self._node.membership.workers()
        present = {m.node_id for m in workers}
        gone = [n for n in self.links if n not in present]
        for node_id in gone:
            self.links.pop(node_id).close()
        if gone:
            self._publish()

    def _run(self) -> None:
        """Admit requests into the batch between steps (block only while it is empty), then
        step it; on close, drop what runs and close the links (their sockets are ours)."""
        while True:
            if not self._jobs:
                item = self._next()
                if item is _IDLE:
                    self._prune_links()
                    continue
                if item is not None:
                    self._admit(item)
            while len(self._jobs) < self.max_batch:
                item = self._next_nowait()
                if item is None:
                    break
                self._admit(item)
            if self._closing:
                for job in list(self._jobs):
                    self._end(job)
                for link in self.links.values():
                    link.close()
                return
            if self._jobs:
                self._step()

    def _admit(self, item) -> None:
        """Start a queued request's generation (its sources opened, its prompt checked), or
        answer it with the error that stops it."""
        req, parsed, grammar = item
        if req.cancelled.is_set():
            self.slots.release(req.peer)
            return
        try:
            if grammar is not None:
                grammar.result()  # compiled (cached: the start finds it), or why it is not
            self._jobs.append(self._begin(req, parsed))
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the node
            self._fail(req, exc)
            self.slots.release(req.peer)
            self._publish()
        self.active = len(self._jobs)

    def _fail(self, req: Request, exc: Exception) -> None:
        """Answer `req` with the error that ended its generation (typed, or `internal`)."""
        if isinstance(exc, (GenerationError, CodecError)):
            code, text = error_code(exc), str(exc)
        else:
            log.error("generation failed", exc_info=exc)
            code, text = "internal", f"{type(exc).__name__}: {exc}"
        if not req.finished:
            req.fail(code, text[:300])

    def _step(self) -> None:
        """One engine step of every running generation (one forward per engine: the forced-
        draft engine's sequences go in their own), then stream each one's block."""
        for job in [j for j in self._jobs if j.req.cancelled.is_set()]:
            self._end(job)
        groups: dict[int, list[_Job]] = {}
        for job in self._jobs:
            groups.setdefault(id(job.engine), []).append(job)
        for jobs in groups.values():
            try:
                blocks = jobs[0].engine.step_batch([j.seq for j in jobs])
            except Exception as exc:  # noqa: BLE001 - the batch's caches are now unknown
                for job in jobs:
                    self._fail(job.req, exc)
                    self._end(job, keep=False)
                continue
            self.stats.steps += 1
            self.stats.stepped += len(jobs)
            self.stats.rows += sum(block.fed for block in blocks)
            self.stats.committed += sum(len(block.token_ids) for block in blocks)
            for job, block in zip(jobs, blocks, strict=True):
                try:
                    self._deliver(job, block)
                except Exception as exc:  # noqa: BLE001 - as above, for this request alone
                    self._fail(job.req, exc)
                    self._end(job)

    def _begin(self, req: Request, parsed: GenerateReq) -> _Job:
        """A request's generation, ready for its first (prefill) step."""
        params = requests.generation_params(parsed).seeded()  # its sources see the seed
        prompt_ids = self._prompt_ids(parsed)
        engine = self._engine_for(parsed)
        remote = self._remote_sources(parsed, prompt_ids, params.sampling, engine)
        sources = remote if remote or not parsed.speculate else self._local_sources(
            engine, prompt_ids, params.sampling)
        stats = Stats()
        try:
            seq = engine.start(prompt_ids, params, stats=stats, sources=sources,
                               draft=parsed.speculate)
        except Exception:
            for source in sources:
                source.close()
            raise
        return _Job(req, parsed, prompt_ids, engine, seq, sources, remote, stats,
                    time.perf_counter())

    def _deliver(self, job: _Job, block: Block) -> None:
        """Stream a committed block; after the last one, answer `done` and end the job."""
        if job.req.cancelled.is_set():
            self._end(job)
            return
        if not block.token_ids and block.finish_reason is None:
            return  # a prefill chunk (or a turn to wait for one): nothing to stream yet
        job.generated.extend(block.token_ids)
        tok = self.engine.backend.tokenizer
        text = block.text if block.text is not None else tok.decode(job.generated)
        piece = text[len(job.sent_text):] if text.startswith(job.sent_text) else ""
        if piece.endswith("\ufffd") and block.finish_reason is None:
            piece = ""  # half of a multi-byte character: wait for the rest
        else:
            job.sent_text = text
        job.req.reply(_token_chunk(job.blocks, block, piece), more=True)
        job.blocks += 1
        if job.remote:
            self._publish()
        if block.finish_reason is not None:
            self._end(job)
            self._done(job, block.finish_reason, text)

    def _end(self, job: _Job, *, keep: bool = True) -> None:
        """Take a job out of the batch: close its sources and sequence (its cache goes to the
        prefix cache unless `keep` is False: a step that raised left it unknown), free its
        slot."""
        if job not in self._jobs:
            return
        self._jobs.remove(job)
        self.active = len(self._jobs)
        self.stats.reused += job.seq.reused
        job.engine.release(job.seq, keep=keep)
        for source in job.sources:
            source.close()
        self.slots.release(job.req.peer)
        self._publish()

    def _done(self, job: _Job, finish: str, text: str) -> None:
        """The finished generation's `done` reply, its accounting and its publication."""
        tok, stats, generated = self.engine.backend.tokenizer, job.stats, job.generated
        elapsed = time.perf_counter() - job.t0
        self._account(generated, elapsed, stats)
        if self.on_finished is not None:  # e.g. the shared suffix index (suffix_share.py)
            try:
                self.on_finished(job.prompt_ids, generated)
            except Exception:  # noqa: BLE001 - sharing must never fail a generation
                log.exception("publishing a finished generation failed")
        job.req.reply(Done(finish, text, {
            "token_ids": generated,
            "tokens": tok.token_strings(generated),
            "prompt_tokens": len(job.prompt_ids),
            "cached_tokens": stats.reused,
            "elapsed_s": round(elapsed, 4),
            "tok_per_s": round(len(generated) / elapsed, 3) if elapsed > 0 else 0.0,
            "acceptance": round(stats.acceptance, 4),
            "mean_accepted_len": round(stats.mean_accepted_len, 4),
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "accepted_per_pos": list(stats.accepted_per_pos),
            "blocks": stats.blocks,
            "spec_blocks": stats.spec_blocks,
            "plain_steps": stats.plain_steps,
            "tree_blocks": stats.tree_blocks,
            "waits": stats.waits,
            "model": self.engine.backend.model_name,
            "backend": self.engine.backend.name,
            "verifier": self._node.node_id if self._node else "",
            "proposers": {source.link.node_id: source.stats() for source in job.remote},
        }).to_message())

    def _prompt_ids(self, parsed: GenerateReq) -> list[int]:
        """Render the prompt to token ids and check it fits, before any model work."""
        tok = self.engine.backend.tokenizer
        if parsed.tokens is not None:
            return parsed.tokens.tolist()
        if parsed.messages is not None:
            ids, field = tok.encode_messages([m.as_dict() for m in parsed.messages]), "messages"
        else:
            ids, field = tok.encode(parsed.prompt, chat=parsed.chat), "prompt"
        requests.check_prompt_ids(field, ids, parsed, self.engine.backend.vocab_size,
                                  self.max_context)
        return ids

    def _engine_for(self, parsed: GenerateReq) -> Engine:
        """Forced drafting asks every block for a full-length draft: an engine with a fixed k
        (same backend and caches discipline; it only bypasses the adaptive draft length)."""
        if not parsed.force_draft:
            return self.engine
        if self._forced_engine is None:
            e = self.engine
            self._forced_engine = type(e)(e.backend, None, max_draft=e.max_draft,
                                          fixed_k=e.max_draft, prefill_chunk=e.prefill_chunk,
                                          prefix_cache=e.prefix_cache)
        return self._forced_engine

    def _publish(self) -> None:
        """Compute thread: hand telemetry an immutable copy of the proposer links."""
        self.proposer_snapshot = MappingProxyType(
            {k: link.as_dict() for k, link in self.links.items()})

    @staticmethod
    def _local_sources(engine: Engine, prompt_ids, sampling) -> list:
        """The verifier's own drafter, when no proposer drafts for it (none: plain)."""
        if engine.drafter is None:
            return []
        return [engine.drafter.open_source(prompt_ids, sampling)]

    def _remote_sources(self, parsed: GenerateReq, prompt_ids, sampling,
                        engine: Engine) -> list[ProposerSource]:
        """One source per compatible proposer of the cluster (none: an empty list; a request
        with `speculate: false` drafts with nothing at all)."""
        if not parsed.speculate:
            return []
        only = list(parsed.proposers) if parsed.proposers is not None else None
        links = self._compatible_links(only)
        self._publish()
        if parsed.force_draft:
            found = {n for link in links for n in (link.node_id, link.name)}
            missing = [p for p in only if p not in found]
            if missing:
                raise NoProposerError(f"proposers: {missing} not alive or not compatible "
                                      "with this verifier (draft='force')")
        elif only is None:  # proposers a request names draft with it, late or not
            links = [link for link in links
                     if not link.sits_out(engine.cost.is_late(link.source_name))]
        if links:
            node = self._node
            sid = f"{node.node_id}-{secrets.token_hex(8)}"  # unguessable
            return [ProposerSource(
                link, link.direct(node.factory, node.node_id, self.policy.max_queued),
                prompt_ids, sampling, session_id=f"{sid}-{i}",
                vocab_size=self.engine.backend.vocab_size,
                fingerprint=self.engine.backend.fingerprint, max_draft=engine.max_draft,
                lease_s=self.lease_s, policy=self.policy,
                is_alive=self._is_alive, forced=parsed.force_draft,
                # a resumed generation's grammar state starts inside its prompt: free drafts
                grammar=parsed.grammar if not parsed.resumed else None,
            ) for i, link in enumerate(links)]
        return []

    def _compatible_links(self, only: list[str] | None) -> list[ProposerLink]:
        """The proposers a generation drafts with: alive, compatible, at most
        `MAX_PROPOSERS_USED` (those whose drafts were accepted first, then the least failed).
        Each link holds a connection of its own, so a link whose proposer is no longer a
        worker is closed and forgotten: forged proposer cards cost at most that many
        connections, for as long as they stay in the (bounded) member table."""
        if self._node is None or self._node.membership is None:
            return []
        workers = self._node.membership.workers()
        self._prune_links(workers)
        out = self._links_of(workers, only)
        if only is None and len(out) > MAX_PROPOSERS_USED:
            out.sort(key=lambda k: (-k.accepted, k.errors + k.timeouts + k.bad_replies,
                                    k.node_id))
            out = out[:MAX_PROPOSERS_USED]
        return out

    def _links_of(self, workers, only: list[str] | None) -> list[ProposerLink]:
        fp = self.engine.backend.fingerprint
        out = []
        for m in workers:
            card = m.card
            if "proposer" not in card.roles or m.is_self:
                continue
            if only is not None and card.node_id not in only and card.name not in only:
                continue
            if card.tokenizer not in (fp, ANY_TOKENIZER):
                continue
            if (card.vocab and card.tokenizer != ANY_TOKENIZER
                    and card.vocab != self.engine.backend.vocab_size):
                continue
            hidden = self._hidden_wanted(card)
            if hidden is False:
                continue
            link = self.links.get(card.node_id)
            endpoint = card.endpoints.get("stream", "")
            grammar = card.extras.get("grammar") is True
            if link is None or link.endpoint != endpoint or link.hidden_layers != hidden or \
                    link.takes_grammar != grammar:
                if link is not None:
                    link.close()
                link = ProposerLink(card.node_id, endpoint, card.name, hidden_layers=hidden,
                                    takes_grammar=grammar)
                self.links[card.node_id] = link
            link.draft_tok_s = _draft_rate(card.extras.get("draft_tok_s"))
            out.append(link)
        return out

    def _hidden_wanted(self, card) -> tuple[int, ...] | None | bool:
        """The layers whose hidden states a proposer reads (its card's `hidden_layers`), None
        when it reads none, False when this verifier cannot serve them (a backend without
        capture, another width, layers it does not have): such a proposer is left out."""
        layers, size = card.extras.get("hidden_layers"), card.extras.get("hidden_size")
        if layers is None:
            return None
        backend = self.engine.backend
        fits = (isinstance(layers, list) and 0 < len(layers) <= 8
                and all(isinstance(i, int) and not isinstance(i, bool)
                        and 0 <= i < getattr(backend, "num_layers", 0) for i in layers)
                and size == getattr(backend, "hidden_size", None)
                and type(backend).capture_hidden is not Backend.capture_hidden)
        if not fits:
            log.debug("proposer %s reads hidden states %s x %s this verifier cannot send",
                      card.node_id, layers, size)
            return False
        return tuple(layers)

    def _is_alive(self, node_id: str) -> bool:
        m = self._node.membership.get(node_id) if self._node else None
        return m is not None and m.state.value == "alive"

    def _account(self, generated, elapsed, stats) -> None:
        s = self.stats
        s.generations += 1
        s.tokens += len(generated)
        s.busy_s += elapsed
        s.last_tok_s = len(generated) / elapsed if elapsed > 0 else 0.0
        s.last_acceptance = stats.acceptance
        s.drafted += stats.drafted
        s.accepted += stats.accepted
        per_pos = s.accepted_per_pos
        per_pos.extend([0] * (len(stats.accepted_per_pos) - len(per_pos)))
        for depth, n in enumerate(stats.accepted_per_pos):
            per_pos[depth] += n


def per_connection(max_batch: int, limits: AdmissionLimits) -> int:
    """Generations one connection may have queued or running: the whole batch plus
    `limits.generations_per_peer` queued. A gateway carries all its users over one connection,
    so 16 users of a `--max-batch 8` verifier fit (8 stepping, 8 waiting) while the verifier's
    queue (`max_queue`, 16 by default) still keeps half its room for other connections."""
    return max_batch + limits.generations_per_peer


def _token_chunk(index: int, block, piece: str) -> Message:
    """A block as the wire's `token_chunk`, with its tokens' log probabilities if asked."""
    tokens = np.asarray(block.token_ids, dtype=np.int32)
    lp = block.logprobs
    if lp is None:
        return TokenChunk(index, tokens, piece).to_message()
    return TokenChunk(index, tokens, piece, top_n=lp.top_ids.shape[1], logprobs=lp.logprobs,
                      top_ids=lp.top_ids.reshape(-1),
                      top_logprobs=lp.top_logprobs.reshape(-1)).to_message()


def _draft_rate(value) -> float | None:
    """A proposer card's `extras.draft_tok_s` (its drafting speed), or None where it gives no
    usable one: extras are free-form, so anything but a finite positive number (a bool, a
    string, NaN) says nothing rather than failing the generation."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0.0 < value < float("inf") else None
