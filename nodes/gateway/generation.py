"""One generation through the cluster, surviving the loss of its verifier.

`Generation.events()` picks a verifier (balancer), sends it a `generate_req` over the node's
StreamClient and turns its `token_chunk`/`done` replies into events. The replies reach this
asyncio thread through `loop.call_soon_threadsafe` from the bus I/O thread; the StreamClient's
`request` and `cancel` are its thread-safe entry points, so no socket is touched here.

Failover: when the serving verifier is dead or gone in the membership, its connection is
forgotten, or (while another verifier could take over) it is suspect or silent mid-stream for
`stall_s`, the generation resumes on another verifier of the same model with the prompt's
token ids plus every token already received as the new prompt and `max_tokens` reduced by as
many. Greedy decoding is deterministic, so the continuation is exactly what the first verifier
would have produced: the client's stream goes on with no duplicate and no missing token. (With
sampling the continuation is a fresh draw from the same model distribution given the same
prefix.) Resuming needs the prompt's token ids, hence the gateway's own tokenizer (tokens.py);
without it, or with no other verifier, the stream ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bus.streams import BusError, RemoteError
from codec.chat import ChatMessage
from codec.errors import BadRequest
from codec.messages import Message
from codec.structs import GenerateReq
from nodes.cluster_client import verifier_gone
from nodes.gateway.balancer import Balancer, NoCapacity, VerifierInfo, verifiers_of
from nodes.gateway.metrics import GatewayMetrics
from nodes.gateway.openai_schema import ApiError, ApiRequest
from nodes.gateway.text import TextAssembler

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiting generation looks at its verifier's membership state
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
#: verifier error codes that blame the request (answered 400), not the server (5xx)
CLIENT_ERRORS = ("bad_request", "generation", "too_long", "no_proposer", "unsupported")


@dataclass(frozen=True)
class Plan:
    """A validated request bound to a model, with the prompt's token ids when known."""

    api: ApiRequest
    prompt_ids: tuple[int, ...] | None
    tokenizer: Any = None  # the gateway's own tokenizer of the model, when it has one


@dataclass
class Started:
    verifier: str  # node id now serving the generation (again after a failover)


@dataclass
class Piece:
    text: str


@dataclass
class Final:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    specbus: dict[str, Any] = field(default_factory=dict)


class StreamFailed(Exception):
    """The generation cannot go on (after output may have been sent)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _Lost(Exception):
    """The serving verifier is gone or stalled: resume elsewhere."""


class Generation:
    def __init__(self, node, balancer: Balancer, metrics: GatewayMetrics, plan: Plan,
                 stall_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.balancer = balancer
        self.metrics = metrics
        self.plan = plan
        self.stall_s = stall_s
        self.loop = loop
        self.ids: list[int] = []  # every token received, over all verifiers
        self.failovers = 0
        self.busy = 0  # verifiers that refused the request because their queue was full
        self.verifiers_used: list[str] = []

    async def events(self) -> AsyncIterator[Started | Piece | Final]:
        api = self.plan.api
        asm = TextAssembler(api.stop)
        tried: set[str] = set()
        while True:
            v = self._pick(tried)
            message = self._message()  # built and checked before anything is taken
            queue: asyncio.Queue = asyncio.Queue()
            resumed = self.failovers > 0
            pieces = ""  # this verifier's text so far (as it streamed it)
            got_any = False
            call = None
            # the slot is released on every path out of here, exceptions included: a request
            # that fails while it is sent must not keep a slot (8 of them locked the gateway)
            self.balancer.acquire(v)
            try:
                self.verifiers_used.append(v.node_id)
                call = self.node.client.request(v.endpoint, message,
                                                on_reply=self._forward_to(queue))
                yield Started(v.node_id)
                while True:
                    item = await self._next(queue, v, got_any)
                    if isinstance(item, Message) and item.type == "error":
                        item = RemoteError(str(item.get("code")), str(item.get("message")))
                    if isinstance(item, RemoteError):
                        if item.code == "busy" and not got_any:
                            tried.add(v.node_id)  # its queue filled up: try another one
                            self.busy += 1
                            break
                        raise StreamFailed(_remote_error(item))
                    if isinstance(item, BusError):
                        raise _Lost(str(item))
                    got_any = True
                    if item.type == "token_chunk":
                        new = [int(t) for t in item.tensors[0]] if item.tensors else []
                        self.ids.extend(new)
                        if resumed:
                            text = self._decode()
                        else:
                            pieces += item.get("text") or ""
                            text = pieces
                        piece = asm.update(text)
                        if piece:
                            yield Piece(piece)
                        if asm.stopped:
                            yield self._final("stop", asm, {}, v.node_id)
                            return
                    elif item.type == "done":
                        stats = item.get("stats") or {}
                        final = self._decode() if resumed else item.get("text")
                        piece = asm.finish(final if isinstance(final, str) else None)
                        if piece:
                            yield Piece(piece)
                        reason = "stop" if asm.stopped else FINISH.get(
                            str(item.get("finish_reason")), "stop")
                        yield self._final(reason, asm, stats if isinstance(stats, dict) else {},
                                          v.node_id)
                        return
                    else:
                        raise StreamFailed(ApiError(
                            502, f"unexpected {item.type!r} reply from verifier {v.node_id}",
                            type_="server_error", code="bad_reply"))
            except _Lost as exc:
                tried.add(v.node_id)
                self._failover(v, str(exc))
            finally:
                self.balancer.release(v)
                if call is not None and not call.done:
                    call.cancel()  # thread-safe: tells the verifier to drop the work
            if len(self.ids) >= api.max_tokens:  # lost right after its last token
                piece = asm.finish(self._decode() if self.plan.tokenizer else None)
                if piece:
                    yield Piece(piece)
                yield self._final("length", asm, {}, v.node_id)
                return

    # -- helpers --------------------------------------------------------------------------------
    def _forward_to(self, queue: asyncio.Queue):
        """A reply callback (bus I/O thread) that hands each reply to this asyncio loop."""
        loop = self.loop

        def forward(_call, item) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, item)

        return forward

    def _pick(self, tried: set[str]) -> VerifierInfo:
        model = self.plan.api.model
        members = self.node.membership.members(include_self=True)
        candidates = [v for v in verifiers_of(members) if v.model == model]
        try:
            return self.balancer.pick(candidates, tried)
        except NoCapacity as exc:
            raise StreamFailed(_busy(str(exc))) from None
        except LookupError:
            if self.busy and not self.failovers:
                raise StreamFailed(_busy("every verifier's queue is full")) from None
            if self.failovers:
                msg = (f"verifier {self.verifiers_used[-1]} failed mid-generation and no other "
                       f"verifier of {model!r} is available")
            else:
                msg = f"no verifier of {model!r} is available now"
            raise StreamFailed(ApiError(503, msg, type_="server_error",
                                        code="no_verifier")) from None

    def _alternative(self, v: VerifierInfo) -> bool:
        """Another alive verifier of the model could resume this generation now."""
        if self.plan.prompt_ids is None:
            return False
        members = self.node.membership.members(include_self=True)
        return any(o.model == v.model and o.node_id != v.node_id
                   and self.balancer.inflight.get(o.node_id, 0) < self.balancer.max_inflight
                   for o in verifiers_of(members))

    def _failover(self, v: VerifierInfo, why: str) -> None:
        if self.plan.prompt_ids is None:
            raise StreamFailed(ApiError(
                502, f"verifier {v.node_id} failed mid-generation ({why}); this gateway has no "
                "local tokenizer for the model, so it cannot resume elsewhere",
                type_="server_error", code="verifier_lost"))
        self.failovers += 1
        self.metrics.failovers += 1
        log.warning("gateway: verifier %s lost after %d tokens (%s); resuming elsewhere",
                    v.node_id, len(self.ids), why)

    async def _next(self, queue: asyncio.Queue, v: VerifierInfo, got_any: bool):
        """The next reply; raises _Lost when the verifier is no longer alive or stalls."""
        last = time.monotonic()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), POLL_S)
            except TimeoutError:
                pass
            gone = verifier_gone(self.node, v.node_id, v.endpoint)
            if gone is not None:
                raise _Lost(gone)
            # silent but still connected (SIGSTOP, GC pause, a busy machine): move only after
            # `stall_s` and only where another verifier can take over; alone, a verifier that
            # is merely slow is better than an error
            if (got_any and time.monotonic() - last > self.stall_s
                    and self._alternative(v)):
                raise _Lost(f"no reply for {self.stall_s:g}s")

    def _message(self) -> Message:
        """The `generate_req` through its one typed declaration (every field checked there);
        a field the wire refuses ends the request with a 400 before a slot is taken."""
        api, plan = self.plan.api, self.plan
        common: dict[str, Any] = dict(
            max_tokens=api.max_tokens - len(self.ids),
            sampling=api.sampling,
            stop=tuple(api.stop), speculate=api.extra.get("speculate", True),
            proposers=api.extra.get("proposers"))
        try:
            if plan.prompt_ids is not None:
                req = GenerateReq(tokens=np.asarray([*plan.prompt_ids, *self.ids],
                                                    dtype=np.int32), **common)
            elif api.kind == "chat":
                req = GenerateReq(messages=tuple(ChatMessage(m["role"], m["content"])
                                                 for m in api.messages), chat=True, **common)
            else:
                req = GenerateReq(prompt=api.prompt or "", chat=False, **common)
        except BadRequest as exc:
            raise StreamFailed(ApiError(400, f"{exc.field}: {exc.reason}", param=exc.field,
                                        code="invalid_value")) from None
        return req.to_message()

    def _decode(self) -> str:
        return self.plan.tokenizer.decode(self.ids)

    def _final(self, reason: str, asm: TextAssembler, stats: dict, verifier: str) -> Final:
        prompt = (len(self.plan.prompt_ids) if self.plan.prompt_ids is not None
                  else _int(stats.get("prompt_tokens")))
        drafted, accepted = _int(stats.get("drafted")), _int(stats.get("accepted"))
        self.metrics.count_done(verifier, prompt, len(self.ids), stats)
        proposers = stats.get("proposers") if isinstance(stats.get("proposers"), dict) else {}
        return Final(reason, prompt, len(self.ids), asm.text, specbus={
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "drafted": drafted, "accepted": accepted, "proposers": proposers,
            "verifier": verifier, "verifiers": list(self.verifiers_used),
            "failovers": self.failovers,
        })


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _remote_error(exc: RemoteError) -> ApiError:
    if exc.code in CLIENT_ERRORS:  # the request's fault: 4xx, which SDKs do not retry
        return ApiError(400, f"the verifier refused the request: {exc.message}",
                        code=exc.code)
    if exc.code == "busy":
        return _busy(exc.message)
    return ApiError(502, f"the verifier failed: {exc.code}: {exc.message}",
                    type_="server_error", code=exc.code)


def _busy(why: str) -> ApiError:
    return ApiError(429, f"the cluster is busy ({why}); retry shortly", type_="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": "1"})
