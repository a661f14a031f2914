"""One HTTP generation through the cluster client's async face, in the gateway's terms.

The cluster client (nodes/cluster_client: core.py decides, aio.py drives it on this asyncio
thread) picks the verifier, watches it and fails over, exactly as `specbus generate --cluster`
does. What is the gateway's own is here: the request as the OpenAI body asked it, its errors as
OpenAI error objects with their HTTP status, the `specbus` summary and the metrics.
Resuming needs the prompt's token ids, hence the gateway's own tokenizer (Plan); without it, or
with no other verifier, the stream ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from codec.chat import ChatMessage
from codec.errors import BadRequest
from codec.structs import GRAMMAR_KINDS, GenerateReq
from nodes.cluster_client import aio
from nodes.cluster_client.choice import Balancer, ClusterView
from nodes.cluster_client.failover import (
    BUSY,
    LOST,
    NO_VERIFIER,
    ClusterError,
    Failover,
    Final,
    Piece,
    Resuming,
    Started,
)
from nodes.cluster_client.received_logprobs import ReceivedLogprobs
from nodes.gateway.metrics import GatewayMetrics
from nodes.gateway.openai_schema import ApiError, ApiRequest

log = logging.getLogger(__name__)

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
#: verifier error codes that blame the request (answered 400), not the server (5xx)
CLIENT_ERRORS = ("bad_request", "generation", "too_long", "no_proposer", "unsupported")

__all__ = ["Generation", "Outcome", "Piece", "Plan", "Started", "StreamFailed"]


@dataclass(frozen=True)
class Plan:
    """A validated request bound to a model, with the prompt's token ids when known."""

    api: ApiRequest
    prompt_ids: tuple[int, ...] | None
    tokenizer: Any = None  # the gateway's own tokenizer of the model, when it has one


@dataclass
class Outcome:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    specbus: dict[str, Any] = field(default_factory=dict)
    logprobs: ReceivedLogprobs | None = None  # of the completion's tokens, when asked for
    #: prompt positions the (last) verifier started from its prefix cache
    cached_tokens: int = 0
    #: llama-server's per-response `timings` (`_timings`)
    timings: dict[str, Any] = field(default_factory=dict)


class StreamFailed(Exception):
    """The generation cannot go on (after output may have been sent)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class Generation:
    def __init__(self, node, balancer: Balancer, metrics: GatewayMetrics, plan: Plan,
                 stall_s: float, loop: asyncio.AbstractEventLoop,
                 arrived: float | None = None) -> None:
        self.node = node
        self.balancer = balancer
        self.metrics = metrics
        self.plan = plan
        self.stall_s = stall_s
        self.loop = loop
        #: when the request arrived, a verifier took it, its first token came (perf_counter)
        self.t_arrived = time.perf_counter() if arrived is None else arrived
        self.t_started: float | None = None
        self.t_first: float | None = None

    async def events(self) -> AsyncIterator[Started | Piece | Outcome]:
        """Started (again after a failover), Piece..., then Outcome; StreamFailed on an error
        (before the first event: nothing sent yet, so the handler answers its status)."""
        plan = self.plan
        core = Failover(self._request(), ClusterView(self.node), self.balancer,
                        model=plan.api.model, prompt_ids=plan.prompt_ids,
                        tokenizer=plan.tokenizer, stall_s=self.stall_s)
        try:
            async for ev in aio.events(core, self.node.client, self.loop):
                if isinstance(ev, Resuming):
                    self.metrics.failovers += 1
                elif isinstance(ev, Final):
                    yield self._final(ev)
                else:
                    if isinstance(ev, Started) and self.t_started is None:
                        self.t_started = time.perf_counter()
                    elif isinstance(ev, Piece) and self.t_first is None:
                        self.t_first = time.perf_counter()
                    yield ev
        except ClusterError as exc:
            raise StreamFailed(_api_error(exc, plan)) from None

    def _request(self) -> GenerateReq:
        """The `generate_req` through its one typed declaration (every field checked there);
        a field the wire refuses ends the request with a 400 before a slot is taken."""
        api, plan = self.plan.api, self.plan
        common: dict[str, Any] = dict(
            max_tokens=api.max_tokens, sampling=api.sampling, stop=tuple(api.stop),
            speculate=api.extra.get("speculate", True), proposers=api.extra.get("proposers"),
            logprobs=api.logprobs, grammar=api.grammar)
        try:
            if plan.prompt_ids is not None:
                return GenerateReq(tokens=np.asarray(plan.prompt_ids, dtype=np.int32),
                                   **common)
            if api.kind == "chat":
                return GenerateReq(messages=tuple(ChatMessage(m["role"], m["content"])
                                                  for m in api.messages), chat=True, **common)
            return GenerateReq(prompt=api.prompt or "", chat=False, **common)
        except BadRequest as exc:
            raise StreamFailed(ApiError(400, f"{exc.field}: {exc.reason}", param=exc.field,
                                        code="invalid_value")) from None

    def _final(self, done: Final) -> Outcome:
        stats, verifier = done.stats, done.verifiers[-1]
        drafted, accepted = _int(stats.get("drafted")), _int(stats.get("accepted"))
        completion = len(done.token_ids)
        model = self.plan.api.model
        self.metrics.count_done(verifier, done.prompt_tokens, completion, stats, model=model)
        timings, seconds = self._timings(done.prompt_tokens, completion, stats)
        self.metrics.observe_request(model, seconds)
        proposers = stats.get("proposers") if isinstance(stats.get("proposers"), dict) else {}
        return Outcome(FINISH.get(done.finish_reason, "stop"), done.prompt_tokens, completion,
                     done.text, cached_tokens=_int(stats.get("cached_tokens")),
                     timings=timings, specbus={
                         "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
                         "drafted": drafted, "accepted": accepted, "proposers": proposers,
                         "verifier": verifier, "verifiers": list(done.verifiers),
                         "failovers": done.failovers,
                         "cached_tokens": _int(stats.get("cached_tokens")),
                     }, logprobs=done.logprobs)


    def _timings(self, prompt_tokens: int, completion: int,
                 stats: dict) -> tuple[dict[str, Any], dict[str, float]]:
        """llama-server's `timings` of this response, and the request's latencies for the
        histograms, as measured here: queued until a verifier took it, the prompt phase until
        the first token, the generation phase after it. `prompt_n` counts the positions
        prefilled (the prefix cache's are `cache_n`), `draft_n` the draft tokens verified."""
        end = time.perf_counter()
        started = self.t_started if self.t_started is not None else self.t_arrived
        first = self.t_first if self.t_first is not None else end
        cached = min(_int(stats.get("cached_tokens")), prompt_tokens)
        prompt_n, prompt_ms = prompt_tokens - cached, (first - started) * 1e3
        predicted_ms = (end - first) * 1e3
        per_token = predicted_ms / (completion - 1) if completion > 1 else 0.0
        timings = {
            "cache_n": cached,
            "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": round(prompt_n / prompt_ms * 1e3, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": completion, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(per_token, 3),
            "predicted_per_second": round((completion - 1) / predicted_ms * 1e3, 3)
            if completion > 1 and predicted_ms > 0 else 0.0,
            "draft_n": _int(stats.get("drafted")),
            "draft_n_accepted": _int(stats.get("accepted")),
            "queue_ms": round((started - self.t_arrived) * 1e3, 3),
        }
        seconds = {"queue": started - self.t_arrived, "e2e": end - self.t_arrived}
        if self.t_first is not None:
            seconds["ttft"] = self.t_first - self.t_arrived
            if completion > 1:
                seconds["tpot"] = per_token / 1e3
        return timings, seconds


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _api_error(exc: ClusterError, plan: Plan) -> ApiError:
    """The cluster client's error as the OpenAI error object and status the gateway answers."""
    if exc.code == "invalid_value":
        return ApiError(400, f"{exc.field}: {exc.detail}", param=exc.field,
                        code="invalid_value")
    if exc.code == BUSY:
        return _busy(exc.detail)
    if exc.remote and exc.code in CLIENT_ERRORS:  # the request's fault: 4xx, never retried
        api = plan.api
        param = api.grammar_param if api.grammar is not None and any(
            w in exc.detail for w in ("grammar", *GRAMMAR_KINDS)) else None
        return ApiError(400, f"the verifier refused the request: {exc.detail}", param=param,
                        code=exc.code)
    if exc.remote:
        return ApiError(502, f"the verifier failed: {exc.code}: {exc.detail}",
                        type_="server_error", code=exc.code)
    if exc.code == NO_VERIFIER:
        return ApiError(503, str(exc), type_="server_error", code=NO_VERIFIER)
    if exc.code == LOST and plan.prompt_ids is None:
        return ApiError(502, f"verifier {exc.verifier} failed mid-generation ({exc.detail}); "
                        "this gateway has no local tokenizer for the model, so it cannot "
                        "resume elsewhere", type_="server_error", code=LOST)
    return ApiError(502, str(exc), type_="server_error", code=exc.code or "bad_reply")


def _busy(why: str) -> ApiError:
    return ApiError(429, f"the cluster is busy ({why}); retry shortly", type_="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": "1"})
