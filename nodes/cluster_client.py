"""Generate through a cluster: join as an observer, find a verifier, stream its tokens.

Used by `specbus generate` (without `--local`), the demo and the benchmarks. The observer never
counts as a worker and is never offered work.

Failure rule while streaming (docs/nodes.md "Stalls and deaths"): the client gives up on its
verifier only when membership says it is dead or left AND the stream connection to it is down.
A killed process's connection closes at once, so the error comes as soon as membership declares
it dead (~1.6 s); a stalled one (SIGSTOP, GC pause, VM hiccup) keeps its connection, so the
client keeps waiting (bounded by `idle_timeout`, and by the bus's 30 s ZMTP heartbeat timeout,
after which a silent connection is dropped) and the stream resumes where it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bus.streams import BusError, Call, RequestTimeout
from codec.errors import CodecError
from codec.messages import Message
from codec.sampling import SamplingParams
from codec.structs import FORCE, Done, GenerateReq, TokenChunk
from discovery.interfaces import DEFAULT_INTERFACE
from discovery.table import Member, State

WATCH_EVERY_S = 0.2  # how often a waiting stream looks at its verifier's state
LOST = "verifier_lost"  # ClusterError code: the serving verifier is gone (failover may follow)


def verifier_gone(node, node_id: str, endpoint: str) -> str | None:
    """Why the verifier `node_id` serving a stream on `endpoint` is gone for good, or None.

    The one liveness rule of every cluster client (this one, the gateway): gone only when
    membership no longer counts it alive (dead, left or forgotten) AND our connection to it is
    down. A stalled process (SIGSTOP, GC pause, VM hiccup) keeps its connection, so it is
    waited for; a killed one's connection closes at once.
    """
    m = node.membership.get(node_id)
    state = "forgotten" if m is None else m.state.value
    if m is not None and m.state not in (State.DEAD, State.LEFT):
        return None
    if node.client.connected(endpoint):
        return None
    return f"membership says {state}; connection closed"


class ClusterError(RuntimeError):
    """No verifier could be found or the generation failed on the cluster; `code` is the
    verifier's error code when it answered one (e.g. `bad_request`, `too_long`)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class GenerateRequest:
    """A generation to ask a verifier for: a text `prompt`, or chat `messages`, or `tokens`.

    `sampling` is the wire's own `SamplingParams` (checked with the rest by `typed()`).
    `force_draft` (with `proposers`) pins speculation: the verifier asks exactly those
    proposers every block with its full deadline, whatever it thinks of their speed (tests).
    `message()` validates through `codec.structs.GenerateReq` and raises its `BadRequest`
    (a ValueError naming the field) before anything is sent.
    """

    prompt: str | None = None
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    chat: bool = True
    speculate: bool = True
    proposers: list[str] | None = None
    force_draft: bool = False
    messages: list[dict[str, str]] | None = None
    tokens: Sequence[int] | None = None

    def typed(self) -> GenerateReq:
        return GenerateReq(
            prompt=self.prompt, messages=self.messages,
            tokens=None if self.tokens is None else np.asarray(self.tokens, dtype=np.int32),
            max_tokens=self.max_tokens, sampling=self.sampling, stop=tuple(self.stop),
            chat=self.chat, speculate=self.speculate,
            proposers=None if self.proposers is None else tuple(self.proposers),
            draft=FORCE if self.force_draft else None,
        )

    def message(self) -> Message:
        return self.typed().to_message()


@dataclass
class Result:
    text: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "finish_reason": self.finish_reason, **self.stats}


class ClusterClient:
    """An observer node that sends generation requests to the cluster's verifiers."""

    def __init__(self, cluster: str, interface: str = DEFAULT_INTERFACE,
                 peers: tuple[str, ...] = (), mdns: bool = True,
                 secret_file: str | None = None, insecure: bool = False) -> None:
        from nodes.node import Node, NodeConfig

        self._tokenizers = None  # TokenizerCache, made on the first failover-ready request
        self.node = Node(NodeConfig(cluster=cluster, observer=True, interface=interface,
                                    peers=peers, mdns=mdns, secret_file=secret_file,
                                    insecure=insecure))

    def __enter__(self) -> ClusterClient:
        self.node.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.node.client is not None:
            self.node.client.close()  # cancel what is still running: no orphans on verifiers
        self.node.stop(leave=True)

    def wait_for(self, pred: Callable[[list[Member]], bool], timeout: float) -> list[Member]:
        deadline = time.monotonic() + timeout
        while True:
            members = [m for m in self.node.membership.members(include_self=False)
                       if m.state is State.ALIVE]
            if pred(members):
                return members
            if time.monotonic() >= deadline:
                return members
            time.sleep(0.05)

    def verifiers(self, timeout: float = 10.0) -> list[Member]:
        members = self.wait_for(lambda ms: any("verifier" in m.card.roles for m in ms), timeout)
        found = [m for m in members if "verifier" in m.card.roles and m.card.is_worker]
        if not found:
            raise ClusterError(
                f"no verifier found in cluster {self.node.config.cluster!r} within {timeout:g}s "
                f"(members seen: {len(members)}); start one with "
                f"`specbus node --role verifier --cluster {self.node.config.cluster}`"
            )
        return sorted(found, key=lambda m: (m.card.load, m.node_id))

    def stream(self, req: GenerateRequest, verifier: Member | None = None,
               idle_timeout: float = 120.0) -> Iterator[Message]:
        """Yield `token_chunk` messages, then the final `done`.

        Raises ClusterError as soon as the verifier is known to be gone (dead or left in
        membership, and its connection closed), after `idle_timeout` seconds without a reply,
        or if a chunk is missing or repeated (chunk `index` must count 0, 1, 2, ...).
        """
        target = verifier or self.verifiers()[0]
        endpoint = target.card.endpoints["stream"]
        call = self.node.client.request(endpoint, req.message())
        expect = 0
        try:
            while True:
                msg = self._next_reply(call, target, idle_timeout)
                if msg.type == TokenChunk.TYPE:
                    try:
                        index = TokenChunk.from_message(msg).index
                    except CodecError as exc:
                        raise ClusterError(f"malformed chunk from {target.node_id}: {exc}",
                                           exc.code) from exc
                    if index != expect:
                        raise ClusterError(
                            f"stream from verifier {target.node_id} lost continuity: chunk "
                            f"{index} arrived, {expect} expected", "broken_stream")
                    expect += 1
                yield msg
                if not msg.more:
                    return
        except BusError as exc:  # a verifier's error reply keeps its code; the bus's own is a loss
            raise ClusterError(f"generation on {target.node_id} failed: {exc}",
                               getattr(exc, "code", None) or LOST) from exc
        finally:
            if not call.done:
                call.cancel()

    def _next_reply(self, call: Call, target: Member, idle_timeout: float) -> Message:
        """The next reply, watching the verifier while waiting (see the module docstring)."""
        endpoint = target.card.endpoints["stream"]
        deadline = time.monotonic() + idle_timeout
        while True:
            wait = min(WATCH_EVERY_S, deadline - time.monotonic())
            if wait <= 0:
                raise ClusterError(f"verifier {target.node_id} sent nothing for "
                                   f"{idle_timeout:g}s", "timeout")
            try:
                return call.next(timeout=wait)
            except RequestTimeout:
                pass
            gone = verifier_gone(self.node, target.node_id, endpoint)
            if gone is not None:
                raise ClusterError(f"verifier {target.node_id} died mid-generation ({gone})",
                                   LOST)

    def generate(self, req: GenerateRequest, verifier: Member | None = None,
                 on_text: Callable[[str], None] | None = None,
                 failover: bool = True) -> Result:
        """Generate through `verifier` (default: the least loaded), handing text to `on_text`
        as it is committed.

        Failover, as the gateway does: when the serving verifier is lost mid-generation (the
        liveness rule of `verifier_gone`), the generation resumes on another verifier of the
        same model from the prompt's token ids plus every token received, with `max_tokens`
        reduced by as many. Greedy decoding is deterministic, so the text is exactly the
        uninterrupted one. It needs the prompt's token ids: this client tokenizes with the
        model's own tokenizer when it resolves here with the verifiers' fingerprint
        (nodes/client_tokenizers.py); without one a lost verifier is an error, as before. (A
        stop string that straddles the point of resumption is not seen.)
        """
        target = verifier or self.verifiers()[0]
        tok = self._tokenizer(target) if failover else None
        prompt_ids = _prompt_ids(req, tok)
        work = req if prompt_ids is None else replace(
            req, prompt=None, messages=None, tokens=list(prompt_ids))
        ids: list[int] = []
        used: list[str] = []
        shown = ""
        while True:
            used.append(target.node_id)
            last = None
            try:
                for msg in self.stream(work, target):
                    if msg.type == TokenChunk.TYPE and msg.tensors:
                        ids.extend(int(t) for t in msg.tensors[0])
                    if msg.type == TokenChunk.TYPE and on_text is not None:
                        shown = _show(on_text, msg, tok, ids, shown, len(used) > 1)
                    last = msg
            except ClusterError as exc:
                if exc.code != LOST or prompt_ids is None:
                    raise
                left = req.max_tokens - len(ids)
                if left <= 0:  # lost right after its last token
                    return self._result(tok, ids, "length", {}, used, on_text, shown)
                target = self._another(target, used, exc)
                work = replace(work, tokens=[*prompt_ids, *ids], max_tokens=left)
                continue
            if last is None or last.type != Done.TYPE:
                raise ClusterError("the verifier ended the stream without a final result")
            done = Done.from_message(last)
            if len(used) == 1:
                if on_text is not None and tok is not None:
                    _show(on_text, last, tok, ids, shown, True)
                return Result(done.text or "", done.finish_reason,
                              {**done.stats, "failovers": 0, "verifiers": used})
            return self._result(tok, ids, done.finish_reason, dict(done.stats), used, on_text,
                                shown)

    def _result(self, tok, ids, finish, stats, used, on_text, shown) -> Result:
        text = tok.decode(ids)
        if on_text is not None and text.startswith(shown) and len(text) > len(shown):
            on_text(text[len(shown):])
        return Result(text, finish, {**stats, "token_ids": list(ids),
                                     "failovers": len(used) - 1, "verifiers": used})

    def _another(self, lost: Member, used: list[str], why: ClusterError) -> Member:
        """An alive verifier of the lost one's model not tried yet, or the error."""
        others = [m for m in self.node.membership.workers()
                  if "verifier" in m.card.roles and m.card.model == lost.card.model
                  and m.card.tokenizer == lost.card.tokenizer and m.node_id not in used]
        if not others:
            raise ClusterError(f"{why} and no other verifier of {lost.card.model!r} is "
                               "available", LOST)
        return min(others, key=lambda m: (m.card.load, m.node_id))

    def _tokenizer(self, target: Member):
        if self._tokenizers is None:
            from nodes.client_tokenizers import TokenizerCache

            self._tokenizers = TokenizerCache()
        return self._tokenizers.get(target.card.model, target.card.tokenizer)


def _prompt_ids(req: GenerateRequest, tok) -> list[int] | None:
    """The prompt as the verifier would tokenize it, when this client can (else None)."""
    if req.tokens is not None:
        return [int(t) for t in req.tokens]
    if tok is None:
        return None
    if req.messages is not None:
        return tok.encode_messages(req.messages)
    return tok.encode(req.prompt, chat=req.chat)


def _show(on_text, msg: Message, tok, ids: list[int], shown: str, decode: bool) -> str:
    """Hand the new text to `on_text`; returns the text shown so far. Before a failover the
    verifier's own pieces are shown; after one (or at the end, with a tokenizer) the text is
    decoded here, holding back a trailing half character."""
    if not decode or tok is None:
        piece = msg.get("text") or ""
        if piece:
            on_text(piece)
        return shown + piece
    text = tok.decode(ids)
    if msg.more and text.endswith("\ufffd"):
        return shown
    if text.startswith(shown) and len(text) > len(shown):
        on_text(text[len(shown):])
        return text
    return shown
