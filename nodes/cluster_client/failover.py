"""One generation through the cluster as a state machine that does no I/O.

`Failover` decides, for every reply, quiet spell and lost verifier, what the generation does
next; the sync face (sync.py: the CLI, the benches) and the async face (aio.py: the gateway)
only send its messages, wait for replies and hand them in. So both faces have one policy:

- choice: the least loaded verifier of the model with room (choice.Balancer), or, with the
  prompt's ids known, the one that served a generation the prompt continues, load allowing
  (affinity.py: its prefix cache holds the conversation); one that answers `busy` before any
  output is left for another;
- liveness: a serving verifier is lost only when `verifier_gone` says so (dead or left in
  membership AND the connection closed), or when it is silent mid-stream for `stall_s` while
  another verifier could take over (alone, a slow verifier beats an error); `idle_s` without a
  reply ends the generation (`timeout`);
- continuity: chunk `index` counts 0, 1, 2, ... per verifier, else `broken_stream`;
- failover: the generation resumes on another verifier of the same model (and tokenizer) with
  the prompt's token ids plus every token received as the new prompt, `max_tokens` reduced
  by as many and `resumed` saying how many (the new verifier starts the request's grammar
  matcher and its presence / frequency counts after them, not at the start). Greedy decoding
  is deterministic, so the text is exactly the uninterrupted one, constrained or not (with
  sampling, a fresh draw given the same prefix unless the request fixed its seed: the noise is
  keyed by the seed and the absolute position). It needs the prompt's token ids: without
  them, or with no other verifier, the generation ends with a `ClusterError`. A verifier lost
  after its last token or its end-of-sequence token (its `done` not yet sent) is not resumed:
  the generation is over (`length`, `eos`).

Text: chunk texts as the verifier streamed them until a failover, then the client's own decode
of every token received; TextAssembler cuts stop strings over the whole text (one straddling
the point of resumption included) and never hands out what it would take back.

Slots: an attempt takes its verifier's slot only after its message is built (a request the
wire refuses must not hold one: issue 21), and the face releases it (`end`) on every path out.
When every verifier is at this client's limit, `begin` returns None and the generation waits
in the balancer's line (choice.Balancer.take): the face waits until it is woken or `wait_s`
passes and asks again; a full line, or a wait past `queue_wait_s`, is `busy`. The face gives
the place up (`close`) on every path out, so a generation cancelled while waiting leaves
nothing behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bus.streams import BusError, RemoteError
from codec.errors import BadRequest, CodecError
from codec.messages import Message
from codec.structs import Done, ErrorReply, GenerateReq, TokenChunk
from nodes.cluster_client.choice import (
    Balancer,
    ClusterView,
    NoCapacity,
    Ticket,
    VerifierInfo,
)
from nodes.cluster_client.received_logprobs import ReceivedLogprobs
from nodes.cluster_client.text import TextAssembler

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiting generation looks at its verifier's state
LOST = "verifier_lost"  # the serving verifier is gone and the generation cannot resume
NO_VERIFIER = "no_verifier"
BUSY = "busy"


class ClusterError(RuntimeError):
    """The generation cannot go on. `code`: the verifier's error code when it answered one
    (`remote` is then true: e.g. `bad_request`, `too_long`, `busy`), else this client's
    (`verifier_lost`, `no_verifier`, `busy`, `timeout`, `broken_stream`, `bad_reply`,
    `invalid_value` with `field`). `detail` is the bare reason (the verifier's message, the
    field's fault, why a verifier counts as lost) for a face that words its own error."""

    def __init__(self, message: str, code: str | None = None, *, detail: str = "",
                 verifier: str | None = None, field: str | None = None,
                 remote: bool = False, failovers: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail or message
        self.verifier = verifier
        self.field = field
        self.remote = remote
        self.failovers = failovers


# -- events a face yields ----------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    verifier: str  # node id now serving the generation (again after a failover or `busy`)


@dataclass(frozen=True)
class Piece:
    text: str  # the next piece of text, safe to show (never taken back)
    #: log probabilities of the tokens received since the last piece (when asked for)
    logprobs: ReceivedLogprobs | None = None


@dataclass(frozen=True)
class Resuming:
    lost: str  # the verifier given up on
    why: str
    tokens: int  # tokens received so far, kept as part of the new prompt


@dataclass(frozen=True)
class Final:
    finish_reason: str  # the verifier's own (`eos`, `stop`, `length`); `stop` when cut here
    text: str
    token_ids: tuple[int, ...]  # every token received, over all verifiers
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # the last verifier's `done` stats
    verifiers: tuple[str, ...] = ()
    failovers: int = 0
    logprobs: ReceivedLogprobs | None = None  # of `token_ids`, when asked for


@dataclass
class Attempt:
    """One verifier's turn at the generation."""

    verifier: VerifierInfo
    message: Message
    last: float  # monotonic time of the last reply (or of the send)
    expect: int = 0  # the next chunk index
    got_any: bool = False
    open: bool = True  # false once this verifier's turn is over (done, lost, busy)


class Failover:
    def __init__(self, req: GenerateReq, view: ClusterView, balancer: Balancer, *,
                 model: str | None = None, prompt_ids: tuple[int, ...] | None = None,
                 tokenizer: Any = None, first: VerifierInfo | None = None,
                 resume: bool = True, stall_s: float | None = None,
                 idle_s: float | None = None) -> None:
        """`req` as the caller asked it; `prompt_ids` (the prompt as the verifiers tokenize
        it) make it resumable and are sent instead of its text; `first`: the verifier to try
        first (else the balancer's pick among `model`'s, any model when None); `resume=False`:
        one verifier only, a lost or busy one ends the generation."""
        self.req = req
        self.view = view
        self.balancer = balancer
        self.model = model if first is None else first.model
        self.prompt_ids = None if prompt_ids is None else tuple(int(t) for t in prompt_ids)
        self.tokenizer = tokenizer
        self.first = first
        self.resume = resume
        self.stall_s = stall_s
        self.idle_s = idle_s
        self.asm = TextAssembler(req.stop)
        self.ids: list[int] = []  # every token received, over all verifiers
        self.pieces = ""  # chunk texts as streamed (the text while nothing was resumed)
        self.used: list[str] = []
        self.tried: set[str] = set()  # lost or busy: not asked again
        self.failovers = 0
        self.busy = 0
        self.finished = False
        #: every token's log probability, when the request asks for them
        self.logprobs = ReceivedLogprobs() if req.logprobs is not None else None
        self._unsent = ReceivedLogprobs()  # received since the last piece
        #: called (any thread) when a slot may have freed for this waiting generation
        self.wake: Any = None
        self.ticket: Ticket | None = None  # its place in the balancer's line while waiting

    # -- an attempt's life ---------------------------------------------------------------------
    def begin(self, now: float | None = None) -> Attempt | None:
        """Build the next request, then choose its verifier and take the slot (one step); None
        while every verifier is full and the generation waits in the line (ask again when
        woken or after `wait_s`)."""
        now = time.monotonic() if now is None else now
        message = self._message()
        v = self._pick(now)
        if v is None:
            return None
        self.used.append(v.node_id)
        if self.model is None:
            self.model = v.model
        return Attempt(v, message, now)

    def wait_s(self, now: float | None = None) -> float:
        """How long a waiting face sleeps before asking again (if not woken first)."""
        if self.ticket is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, min(POLL_S * 5, self.ticket.deadline - now))

    def close(self) -> None:
        """The generation is over (or abandoned): its place in the line, if any, is given up.
        Faces call it on every path out."""
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            self.balancer.leave(ticket)

    def started(self, att: Attempt) -> list:
        return [Started(att.verifier.node_id)]

    def end(self, att: Attempt) -> None:
        """The attempt is over, whichever way: its slot is free again."""
        att.open = False
        self.balancer.release(att.verifier)

    def reply(self, att: Attempt, item: Message | BusError, now: float | None = None) -> list:
        """The events a reply (or the bus's error for the call) makes."""
        att.last = time.monotonic() if now is None else now
        v = att.verifier
        if isinstance(item, Message) and item.type == ErrorReply.TYPE:
            item = RemoteError(str(item.get("code")), str(item.get("message")))
        if isinstance(item, RemoteError):
            if item.code == BUSY and not att.got_any and self.resume:
                if self.balancer.queue:  # hold it: try another, or wait in line for it
                    self.balancer.hold(v, att.last)
                else:
                    self.tried.add(v.node_id)  # its queue filled up: try another one
                self.busy += 1
                att.open = False
                return []
            raise ClusterError(f"generation on {v.node_id} failed: {item}", item.code,
                               detail=item.message, verifier=v.node_id, remote=True,
                               failovers=self.failovers)
        if isinstance(item, BusError):
            return self._lost(att, str(item) or type(item).__name__)
        att.got_any = True
        events = self._answer(att, item)
        if self.finished:
            att.open = False
        return events

    def _answer(self, att: Attempt, item: Message) -> list:
        v = att.verifier
        if item.type == TokenChunk.TYPE:
            return self._chunk(att, item)
        if item.type == Done.TYPE:
            try:
                done = Done.from_message(item)
            except CodecError as exc:
                raise self._bad(v, f"malformed done: {exc}") from exc
            final = self._decode() if self.failovers else done.text
            out = self._piece(self.asm.finish(final))
            reason = "stop" if self.asm.stopped else done.finish_reason
            return [*out, self._final(reason, dict(done.stats))]
        raise self._bad(v, f"unexpected {item.type!r} reply")

    def quiet(self, att: Attempt, now: float | None = None) -> list:
        """No reply for a poll interval: is the verifier gone, stalled or just slow?"""
        now = time.monotonic() if now is None else now
        v = att.verifier
        gone = self.view.gone(v)
        if gone is not None:
            return self._lost(att, gone)
        # silent but still connected (SIGSTOP, GC pause, a busy machine): move only after
        # `stall_s` and only where another verifier can take over
        if (self.stall_s is not None and att.got_any and now - att.last > self.stall_s
                and self._alternative(v)):
            return self._lost(att, f"no reply for {self.stall_s:g}s")
        if self.idle_s is not None and now - att.last > self.idle_s:
            raise ClusterError(f"verifier {v.node_id} sent nothing for {self.idle_s:g}s",
                               "timeout", verifier=v.node_id, failovers=self.failovers)
        return []

    # -- decisions ------------------------------------------------------------------------------
    def _chunk(self, att: Attempt, msg: Message) -> list:
        v = att.verifier
        try:
            chunk = TokenChunk.from_message(msg)
        except CodecError as exc:
            raise ClusterError(f"malformed chunk from {v.node_id}: {exc}", exc.code,
                               verifier=v.node_id, failovers=self.failovers) from exc
        if chunk.index != att.expect:
            raise ClusterError(f"stream from verifier {v.node_id} lost continuity: chunk "
                               f"{chunk.index} arrived, {att.expect} expected",
                               "broken_stream", verifier=v.node_id, failovers=self.failovers)
        att.expect += 1
        self.ids.extend(int(t) for t in chunk.tokens)
        if self.logprobs is not None and len(chunk.logprobs):
            # an end-of-sequence token ends the text without being part of it: OpenAI lists
            # no log probability for it
            eos = getattr(self.tokenizer, "eos_token_ids", frozenset())
            keep = np.asarray([int(t) not in eos for t in chunk.tokens], dtype=bool)
            top = chunk.top_n or 0
            rows = np.repeat(keep, top)
            for into in (self.logprobs, self._unsent):
                into.add(chunk.tokens[keep], chunk.logprobs[keep], chunk.top_ids[rows],
                         chunk.top_logprobs[rows], top)
        self.pieces += chunk.text
        out = self._piece(self.asm.update(self._decode() if self.failovers else self.pieces))
        if self.asm.stopped:
            out.append(self._final("stop", {}))
        return out

    def _lost(self, att: Attempt, why: str) -> list:
        """The serving verifier is gone: resume elsewhere, or end the generation."""
        v = att.verifier
        att.open = False
        if not self.resume or self.prompt_ids is None:
            raise ClusterError(f"verifier {v.node_id} died mid-generation ({why})", LOST,
                               detail=why, verifier=v.node_id, failovers=self.failovers)
        self.tried.add(v.node_id)
        self.failovers += 1
        log.warning("cluster client: verifier %s lost after %d tokens (%s); resuming elsewhere",
                    v.node_id, len(self.ids), why)
        out: list = [Resuming(v.node_id, why, len(self.ids))]
        # lost right after its last token (before its `done`): nothing to resume
        eos = getattr(self.tokenizer, "eos_token_ids", frozenset())
        ended = "eos" if self.ids and self.ids[-1] in eos else None
        if ended is None and len(self.ids) >= self.req.max_tokens:
            ended = "length"
        if ended is not None:
            out += self._piece(self.asm.finish(self._decode()))
            out.append(self._final(ended, {}))
        return out

    def _pick(self, now: float) -> VerifierInfo | None:
        """The verifier of the next attempt with its slot taken, or None: wait in the line."""
        if self.first is not None and not self.used:
            candidates = [self.first]
        else:
            candidates = [v for v in self.view.verifiers() if self._fits(v)]
        ticket = self.ticket
        if ticket is None and self.balancer.queue:
            ticket = Ticket(now + self.balancer.queue_wait_s, self._wake)
        try:
            # a first attempt goes where the prompt's beginning already is, load allowing
            v = self.balancer.take(candidates, self.tried, ticket, now,
                                   None if self.used else self.prompt_ids)
        except NoCapacity as exc:
            self.ticket = None
            raise ClusterError(f"the cluster is busy ({exc})", BUSY, detail=str(exc),
                               failovers=self.failovers) from None
        except LookupError:
            self.ticket = None
        else:
            self.ticket = ticket if v is None else None
            if v is None and now >= ticket.deadline:
                self.ticket = None
                self.balancer.expired(ticket)
                why = (f"waited {self.balancer.queue_wait_s:g}s in this client's queue and "
                       "no verifier slot freed")
                raise ClusterError(f"the cluster is busy ({why})", BUSY, detail=why,
                                   failovers=self.failovers)
            return v
        model = self.model
        if self.busy and not self.failovers:
            why = "every verifier's queue is full"
            raise ClusterError(f"the cluster is busy ({why})", BUSY, detail=why) from None
        if self.failovers:
            last = self.used[-1]
            raise ClusterError(f"verifier {last} failed mid-generation and no other verifier "
                               f"of {model!r} is available", NO_VERIFIER, verifier=last,
                               failovers=self.failovers) from None
        raise ClusterError(f"no verifier of {model!r} is available now", NO_VERIFIER) from None

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake()

    def _fits(self, v: VerifierInfo) -> bool:
        """Can `v` serve this generation: same model and, once token ids are sent, the same
        tokenizer (ids from another vocabulary would be a different prompt)."""
        if self.model is not None and v.model != self.model:
            return False
        fp = getattr(self.tokenizer, "fingerprint", None)
        return self.prompt_ids is None or fp is None or v.tokenizer == fp

    def _alternative(self, v: VerifierInfo) -> bool:
        """Another alive verifier of the model could resume this generation now."""
        if not self.resume or self.prompt_ids is None:
            return False
        return any(o.node_id != v.node_id and self._fits(o) and self.balancer.has_room(o)
                   for o in self.view.verifiers())

    def _message(self) -> Message:
        """The request for the next attempt through the one typed declaration: the prompt's
        ids plus every token received once they are known, `max_tokens` less as many."""
        try:
            if self.prompt_ids is None:
                req = self.req
            else:
                ids = np.asarray([*self.prompt_ids, *self.ids], dtype=np.int32)
                # the tokens received were generated under the request's grammar (and
                # penalties): the next verifier starts its matcher (and counts) after them
                resumed = (self.req.resumed or 0) + len(self.ids)
                req = replace(self.req, prompt=None, messages=None, tokens=ids,
                              max_tokens=self.req.max_tokens - len(self.ids),
                              resumed=resumed or None)
        except BadRequest as exc:
            raise ClusterError(str(exc), "invalid_value", detail=exc.reason,
                               field=exc.field) from None
        return req.to_message()

    def _decode(self) -> str:
        """The text of every token received, decoded here (after a failover the new verifier
        only knows its own part); without a tokenizer, the chunk texts as they came."""
        return self.tokenizer.decode(self.ids) if self.tokenizer is not None else self.pieces

    def _piece(self, text: str) -> list:
        if not text:
            return []
        sent, self._unsent = self._unsent, ReceivedLogprobs()
        return [Piece(text, sent if self.logprobs is not None else None)]

    def _final(self, reason: str, stats: dict[str, Any]) -> Final:
        self.finished = True
        prompt = stats.get("prompt_tokens")
        if self.prompt_ids is not None:
            prompt = len(self.prompt_ids)
        elif not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
            prompt = 0
        if self.prompt_ids is not None and self.used:
            self.balancer.served((*self.prompt_ids, *self.ids), self.used[-1])
        lp = self.logprobs
        if lp is not None and self.asm.stopped and self.tokenizer is not None:
            lp = lp.cut_to(self.tokenizer, self.asm.text)
        return Final(reason, self.asm.text, tuple(self.ids), prompt, stats, tuple(self.used),
                     self.failovers, lp)

    def _bad(self, v: VerifierInfo, why: str) -> ClusterError:
        return ClusterError(f"{why} from verifier {v.node_id}", "bad_reply", detail=why,
                            verifier=v.node_id, failovers=self.failovers)
