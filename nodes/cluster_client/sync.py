"""The cluster client's sync face: an observer node that generates on the cluster's verifiers.

Used by `specbus generate` (without `--local`), the demo and the benchmarks; the observer never
counts as a worker and is never offered work. Every decision (which verifier, lost or only
stalled, resume where) is `failover.Failover`'s; this face sends, waits on the call and hands
replies in, so `specbus generate --cluster` fails over exactly as the gateway does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bus.streams import BusError, RequestTimeout
from codec.messages import Message
from codec.structs import GenerateReq
from discovery.interfaces import DEFAULT_INTERFACE
from discovery.table import Member, State
from nodes.cluster_client.choice import Balancer, ClusterView, info_of
from nodes.cluster_client.failover import POLL_S, ClusterError, Failover, Final, Piece

#: the CLI and benches wait for a verifier that is silent but still connected (a forced draft
#: waits for its proposers, a loaded machine pauses: seen in CI, a 15 s rule moved a forced
#: generation away from its pinned verifier); one that is gone is resumed elsewhere. The
#: gateway, which has users waiting, moves after its --stall seconds.
STALL_S: float | None = None
IDLE_S = 120.0  # silent this long: give up (`timeout`)
#: generations of this client waiting for a verifier slot (a bench's pool, a program's threads)
QUEUE = 256
QUEUE_WAIT_S = 120.0  # the longest such a wait lasts before `busy`


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
                 secret_file: str | None = None, insecure: bool = False,
                 stall_s: float | None = STALL_S, queue: int = QUEUE,
                 queue_wait_s: float = QUEUE_WAIT_S) -> None:
        from nodes.node import Node, NodeConfig

        self._tokenizers = None  # TokenizerCache, made on the first failover-ready request
        self.stall_s = stall_s
        # at most what each verifier admits per connection (its card) in flight on it; more
        # wait in this client's line (`queue` places, `queue_wait_s` each), then `busy`
        self.balancer = Balancer(max_inflight=None, queue=queue, queue_wait_s=queue_wait_s)
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
        """The alive verifiers, least loaded first (by their cards); waits up to `timeout`
        for one to appear."""
        members = self.wait_for(lambda ms: any("verifier" in m.card.roles for m in ms), timeout)
        found = [m for m in members if "verifier" in m.card.roles and m.card.is_worker]
        if not found:
            raise ClusterError(
                f"no verifier found in cluster {self.node.config.cluster!r} within {timeout:g}s "
                f"(members seen: {len(members)}); start one with "
                f"`specbus node --role verifier --cluster {self.node.config.cluster}`",
                "no_verifier")
        return sorted(found, key=lambda m: (m.card.load, m.node_id))

    # -- generating -----------------------------------------------------------------------------
    def stream(self, req: GenerateReq, verifier: Member | None = None,
               idle_timeout: float = IDLE_S) -> Iterator[Message]:
        """One verifier's raw replies: `token_chunk` messages, then the final `done`.

        Raises ClusterError as soon as the verifier is known to be gone (`verifier_lost`),
        after `idle_timeout` seconds without a reply (`timeout`), if a chunk is missing or
        repeated (`broken_stream`), or with the verifier's own error code. No failover: the
        caller asked this verifier."""
        core = Failover(req, ClusterView(self.node), self.balancer, first=self._first(verifier),
                        resume=False, idle_s=idle_timeout)
        yield from self._drive(core, raw=True)

    def events(self, req: GenerateReq, verifier: Member | None = None, failover: bool = True,
               idle_timeout: float = IDLE_S) -> Iterator[Any]:
        """The generation as events (failover.Started, Piece, Resuming, then Final), through
        `verifier` (default: the least loaded) and, when it is lost, another verifier of the
        model: with `failover` the prompt is tokenized here when the model's tokenizer
        resolves locally with the verifiers' fingerprint (nodes/client_tokenizers.py); without
        one a lost verifier is an error."""
        first = self._first(verifier)
        tok = self._tokenizer(first) if failover else None
        # not pinned: the balancer picks among the model's verifiers (waiting when all are
        # full), `first` only names the model and tokenizer
        core = Failover(req, ClusterView(self.node), self.balancer,
                        first=first if verifier is not None else None, model=first.model,
                        prompt_ids=_prompt_ids(req, tok), tokenizer=tok, resume=failover,
                        stall_s=self.stall_s, idle_s=idle_timeout)
        yield from self._drive(core, raw=False)

    def generate(self, req: GenerateReq, verifier: Member | None = None,
                 on_text: Callable[[str], None] | None = None,
                 failover: bool = True) -> Result:
        """Generate, handing text to `on_text` as it is committed (see `events`)."""
        final = None
        for ev in self.events(req, verifier, failover):
            if isinstance(ev, Piece) and on_text is not None:
                on_text(ev.text)
            elif isinstance(ev, Final):
                final = ev
        if final is None:  # pragma: no cover - the core ends with Final or raises
            raise ClusterError("the verifier ended the stream without a final result")
        stats = {**final.stats, "failovers": final.failovers,
                 "verifiers": list(final.verifiers)}
        if final.failovers:  # the last verifier's ids are only its own part
            stats["token_ids"] = list(final.token_ids)
        return Result(final.text, final.finish_reason, stats)

    # -- the loop -------------------------------------------------------------------------------
    def _drive(self, core: Failover, raw: bool) -> Iterator[Any]:
        """Run `core` over the node's StreamClient: one call per attempt, cancelled on every
        path out (no orphan on a verifier), the slot released."""
        woken = threading.Event()
        core.wake = woken.set  # a slot freed (any thread): ask again now
        try:
            while not core.finished:
                woken.clear()
                att = core.begin()
                if att is None:  # every verifier is full: wait in the balancer's line
                    woken.wait(core.wait_s())
                    continue
                call = None
                try:
                    call = self.node.client.request(att.verifier.endpoint, att.message)
                    if not raw:
                        yield from core.started(att)
                    while att.open:
                        item = _next(call)
                        events = core.quiet(att) if item is None else core.reply(att, item)
                        if raw and item is not None:
                            yield item
                        else:
                            yield from events
                finally:
                    core.end(att)
                    if call is not None and not call.done:
                        call.cancel()
        finally:
            core.close()  # a place still held in the line is given up

    def _first(self, verifier: Member | None):
        """The verifier asked for, else the least loaded one (whose model and tokenizer the
        generation then keeps; a full one is waited for in the line, see `events`)."""
        if verifier is not None:
            return info_of(verifier)
        infos = [info_of(m) for m in self.verifiers()]
        return min(infos, key=lambda v: (self.balancer.load(v), -v.tok_s, v.node_id))

    def _tokenizer(self, target):
        if self._tokenizers is None:
            from nodes.client_tokenizers import TokenizerCache

            self._tokenizers = TokenizerCache()
        return self._tokenizers.get(target.model, target.tokenizer)


def _next(call) -> Message | BusError | None:
    """The call's next reply, its bus error, or None after a quiet poll interval."""
    try:
        return call.next(timeout=POLL_S)
    except RequestTimeout:
        return None
    except BusError as exc:
        return exc


def _prompt_ids(req: GenerateReq, tok) -> list[int] | None:
    """The prompt as the verifier would tokenize it, when this client can (else None)."""
    if req.tokens is not None:
        return [int(t) for t in req.tokens]
    if tok is None:
        return None
    if req.messages is not None:
        from nodes.client_tokenizers import encode_messages

        return encode_messages(tok, [m.as_dict() for m in req.messages])
    return [int(t) for t in tok.encode(req.prompt, chat=req.chat)]

