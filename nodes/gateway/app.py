"""The HTTP routes (aiohttp): OpenAI chat/completions/models, health and Prometheus metrics.

Handlers run on the gateway's asyncio thread. A client that disconnects cancels its handler
(`handler_cancellation=True` on the runner), whose `finally` cancels the generation on the
verifier. Errors are OpenAI error objects with the matching status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from nodes.client_tokenizers import TokenizerCache, encode_messages, encode_prompt
from nodes.cluster_client.choice import Balancer, verifiers_of
from nodes.gateway.generation import Generation, Outcome, Piece, Plan, Started, StreamFailed
from nodes.gateway.http_server import BODY_TIMEOUT_S, mark_request, read_body
from nodes.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from nodes.gateway.openai_logprobs import chat_logprobs, completion_logprobs
from nodes.gateway.openai_schema import ApiError, ApiRequest, parse_json, parse_request
from nodes.gateway.origins import Origins
from nodes.gateway.responses import (
    ResponseMemory,
    message_item,
    new_ids,
    parse_responses,
    remember,
    response_object,
    status_of,
)
from nodes.gateway.tools import CallStream, check_grammar

log = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024  # 1 MiB: a longer body is refused with 413
#: the allowed browser origin of a request, for a stream's headers (prepared in its handler)
CORS_ORIGIN = web.RequestKey("cors_origin", str)


class GatewayApp:
    """Routes plus the state they share (all on the asyncio thread)."""

    def __init__(self, node, balancer: Balancer, metrics: GatewayMetrics,
                 tokenizers: TokenizerCache, stall_s: float = 15.0,
                 origins: Origins | None = None, body_timeout: float = BODY_TIMEOUT_S) -> None:
        self.node = node
        self.balancer = balancer
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.stall_s = stall_s
        self.origins = origins or Origins("127.0.0.1")
        self.body_timeout = body_timeout
        self.responses_memory = ResponseMemory()  # previous_response_id (bounded)

    def build(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY,
                              middlewares=[mark_request, self._host, self._cors, self._errors,
                                           self._body])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # -- plain endpoints ------------------------------------------------------------------------
    def verifiers(self):
        return verifiers_of(self.node.membership.members(include_self=True))

    def served_models(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for v in self.verifiers():
            out.setdefault(v.model, []).append(v)
        return out

    async def models(self, request: web.Request) -> web.Response:
        data = [_model_object(model, vs) for model, vs in sorted(self.served_models().items())]
        return self._json(request, 200, {"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}` (the SDKs' `models.retrieve`)."""
        name = request.match_info["model"]
        vs = self.served_models().get(name)
        if not vs:
            raise ApiError(404, f"model {name[:200]!r} is not served by this cluster",
                           param="model", code="model_not_found")
        return self._json(request, 200, _model_object(name, vs))

    async def health(self, request: web.Request) -> web.Response:
        models = self.served_models()
        status = 200 if models else 503
        return self._json(request, status, {
            "status": "ok" if models else "no_verifier", "node_id": self.node.node_id,
            "models": sorted(models), "verifiers": sum(len(v) for v in models.values()),
            "inflight": sum(self.balancer.inflight.values()), "queued": self.balancer.waiting})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.count_request(_endpoint(request), 200)
        b = self.balancer
        body = self.metrics.render(self.verifiers(), dict(b.inflight), b.waiting, b.refused,
                                   b.affinity.routed)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    # -- generation endpoints -------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrived = time.perf_counter()
        raw = await request.read()  # already read, within its deadline (`_body`)
        api = parse_request(kind, parse_json(raw))
        if api.n > 1:
            return await self._generate_n(request, api, arrived)

        async def answer(events, first, plan):
            if api.stream:
                return await self._stream(request, api, events, first, plan.tokenizer)
            return await self._collect(request, api, events, plan.tokenizer)

        return await self._run(api, arrived, answer)

    async def _generate_n(self, request: web.Request, api: ApiRequest,
                          arrived: float) -> web.StreamResponse:
        """`n` > 1: n generations of the request, one per choice (`ApiRequest.choice`: the
        i-th seeded from the request's seed and i), run side by side (the verifiers batch
        them; their prefix caches share the prompt); choices carry their `index`, streamed
        chunks too, each choice ending with its own finish_reason."""
        if api.tools is not None and api.tools.active:
            raise ApiError(400, "'n' > 1 is not served together with tools", param="n",
                           code="unsupported_parameter")
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int):
            async def answer(events, first, plan):
                final = None
                async for ev in events:
                    if isinstance(ev, Outcome):
                        final = ev
                    elif isinstance(ev, Piece) and api.stream:
                        await queue.put((i, ev, plan.tokenizer))
                if final is None:  # pragma: no cover - events() ends with Outcome or raises
                    raise ApiError(502, "the generation ended without a result",
                                   type_="server_error")
                await queue.put((i, final, plan.tokenizer))
                return final

            return await self._run(api.choice(i), arrived, answer)

        rid, created = _ids(api.kind)
        chat = api.kind == "chat"
        if not api.stream:
            jobs = [asyncio.create_task(one(i)) for i in range(api.n)]
            try:
                finals = await asyncio.gather(*jobs)
            finally:
                for t in jobs:
                    t.cancel()
            _, _, tok = queue.get_nowait() if not queue.empty() else (0, None, None)
            choices = []
            for i, final in enumerate(finals):
                logprobs = _render_logprobs(api, tok, final.logprobs)
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant",
                                                            "content": final.text},
                                    "logprobs": logprobs, "finish_reason": final.finish_reason})
                else:
                    choices.append({"index": i, "text": final.text, "logprobs": logprobs,
                                    "finish_reason": final.finish_reason})
            usage = _usage(finals[0])
            usage["completion_tokens"] = sum(f.completion_tokens for f in finals)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return self._json(request, 200, {
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": api.model, "choices": choices, "usage": usage,
                "specbus": {"choices": [f.specbus for f in finals]}})
        tasks = [asyncio.create_task(one(i)) for i in range(api.n)]

        async def next_item():
            """The next (index, event, tokenizer); a choice's error raised as it happens."""
            getter = asyncio.ensure_future(queue.get())
            try:
                while not getter.done():
                    failed = [t for t in tasks if t.done() and not t.cancelled()
                              and t.exception() is not None]
                    if failed:
                        raise failed[0].exception()
                    await asyncio.wait({getter, *(t for t in tasks if not t.done())},
                                       return_when=asyncio.FIRST_COMPLETED)
                return getter.result()
            finally:
                getter.cancel()

        try:
            # the first event (or an error) before anything is sent: a 4xx/5xx still
            # answers with its status
            first = await next_item()
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        resp = _event_stream(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish: str | None, logprobs=None, extra=None):
            if chat:
                choice = {"index": i, "delta": {} if text is None else {"content": text},
                          "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": logprobs,
                          "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": api.model,
                    "choices": [choice], **(extra or {})}

        async def send(data: dict | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await resp.write(f"data: {text}\n\n".encode())

        try:
            await resp.prepare(request)
            self.metrics.count_request(_endpoint(request), 200)
            if chat:
                for i in range(api.n):
                    c = chunk(i, None, None)
                    c["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    await send(c)
            sent = [0] * api.n
            finals: dict[int, Outcome] = {}
            item = first
            while True:
                i, ev, tok = item
                if isinstance(ev, Outcome):
                    finals[i] = ev
                    await send(chunk(i, None if chat else "", ev.finish_reason,
                                     extra={"specbus": ev.specbus}))
                    if len(finals) == api.n:
                        break
                else:
                    await send(chunk(i, ev.text, None,
                                     _render_logprobs(api, tok, ev.logprobs, sent[i])))
                    sent[i] += len(ev.text)
                item = await next_item()
            if api.include_usage:
                usage = _usage(finals[0])
                usage["completion_tokens"] = sum(f.completion_tokens for f in finals.values())
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                await send({"id": rid, "object": obj, "created": created, "model": api.model,
                            "choices": [], "usage": usage})
        except (ApiError, StreamFailed) as exc:
            self.metrics.stream_errors += 1
            err = exc.error if isinstance(exc, StreamFailed) else exc
            await send(err.body())
        finally:
            for t in tasks:
                t.cancel()
        await send("[DONE]")
        await resp.write_eof()
        return resp

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/responses` (responses.py): text, plain or streamed."""
        arrived = time.perf_counter()
        req = parse_responses(parse_json(await request.read()), self.responses_memory)

        async def answer(events, first, plan):
            if req.api.stream:
                return await self._responses_stream(request, req, events)
            final = None
            async for ev in events:
                if isinstance(ev, Outcome):
                    final = ev
            if final is None:  # pragma: no cover - events() ends with Outcome or raises
                raise ApiError(502, "the generation ended without a result",
                               type_="server_error")
            rid, msg_id, created = new_ids()
            remember(self.responses_memory, req, rid, final.text)
            return self._json(request, 200, response_object(
                req, rid, created, status_of(final), [message_item(msg_id, final.text)], final))

        return await self._run(req.api, arrived, answer)

    async def _run(self, api: ApiRequest, arrived: float, answer) -> web.StreamResponse:
        """One generation: planned, queued for a verifier, then `answer(events, first, plan)`
        writes the response; a client leaving cancels the verifier's work."""
        plan = await self._plan(api)
        gen = Generation(self.node, self.balancer, self.metrics, plan, self.stall_s,
                         asyncio.get_running_loop(), arrived=arrived)
        events = gen.events()
        try:
            # picks the verifier, waiting in the queue while every one is full: 429/503
            # before any byte is sent; a client leaving meanwhile gives its place up
            first = await anext(events)
        except StreamFailed as exc:
            raise exc.error from None
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.cancelled += 1  # the client went away while queued
            await events.aclose()
            raise
        try:
            return await answer(events, first, plan)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.cancelled += 1  # the client went away
            raise
        finally:
            await events.aclose()  # its `finally` cancels the verifier's work

    async def _responses_stream(self, request: web.Request, req,
                                events) -> web.StreamResponse:
        """The Responses API's streamed events (responses.py), ending with the response."""
        resp = _event_stream(request)
        await resp.prepare(request)
        self.metrics.count_request(_endpoint(request), 200)
        rid, msg_id, created = new_ids()
        seq = 0

        async def send(kind: str, **fields) -> None:
            nonlocal seq
            data = json.dumps({"type": kind, "sequence_number": seq, **fields},
                              separators=(",", ":"))
            seq += 1
            await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        await send("response.created",
                   response=response_object(req, rid, created, "in_progress", []))
        await send("response.in_progress",
                   response=response_object(req, rid, created, "in_progress", []))
        await send("response.output_item.added", output_index=0,
                   item=message_item(msg_id, None, "in_progress"))
        await send("response.content_part.added", **where,
                   part={"type": "output_text", "text": "", "annotations": []})
        text = []
        try:
            async for ev in events:
                if isinstance(ev, Piece) and ev.text:
                    text.append(ev.text)
                    await send("response.output_text.delta", **where, delta=ev.text,
                               logprobs=[])
                elif isinstance(ev, Outcome):
                    done = "".join(text)
                    status = status_of(ev)
                    await send("response.output_text.done", **where, text=done, logprobs=[])
                    await send("response.content_part.done", **where,
                               part={"type": "output_text", "text": done, "annotations": []})
                    item = message_item(msg_id, done, status)
                    await send("response.output_item.done", output_index=0, item=item)
                    remember(self.responses_memory, req, rid, done)
                    await send(f"response.{status}", response=response_object(
                        req, rid, created, status, [item], ev))
        except StreamFailed as exc:
            self.metrics.stream_errors += 1
            log.warning("gateway: response %s ended by an error: %s", rid, exc.error.message)
            err = {"code": exc.error.code or "server_error", "message": exc.error.message}
            await send("response.failed", response=response_object(
                req, rid, created, "failed", [], error=err))
        await resp.write_eof()
        return resp

    async def _plan(self, api: ApiRequest) -> Plan:
        if api.grammar is not None:  # a bad schema: its 400 before anything else (a few ms,
            await asyncio.to_thread(check_grammar, api.grammar, api.grammar_param)  # cached)
        models = self.served_models()
        vs = models.get(api.model)
        if not models:  # nothing is up: the service is unavailable, not the model unknown
            raise ApiError(503, f"no verifier is up to serve {api.model!r}; retry shortly",
                           type_="server_error", code="no_verifier",
                           headers={"Retry-After": "1"})
        if not vs:
            raise ApiError(404, f"model {api.model!r} is not served by this cluster "
                           f"(models: {', '.join(sorted(models))})", param="model",
                           code="model_not_found")
        tok = await asyncio.to_thread(self.tokenizers.get, api.model, vs[0].tokenizer)
        ids: tuple[int, ...] | None = api.prompt_ids
        if tok is not None and ids is None:
            try:
                ids = tuple(await asyncio.to_thread(
                    encode_messages if api.kind == "chat" else encode_prompt, tok,
                    api.messages if api.kind == "chat" else api.prompt))
            except (ValueError, TypeError) as exc:
                raise ApiError(400, f"cannot render the prompt: {exc}",
                               param="messages" if api.kind == "chat" else "prompt") from None
            if not ids:
                raise ApiError(400, "the prompt is empty once tokenized", param="prompt")
        if api.logprobs is not None and tok is None:
            raise ApiError(400, f"log probabilities need the tokenizer of {api.model!r}, "
                           "which this gateway does not have", param="logprobs",
                           code="unsupported_parameter")
        return Plan(api, ids, tok)

    async def _collect(self, request: web.Request, api: ApiRequest, events,
                       tok) -> web.Response:
        final = None
        async for ev in events:
            if isinstance(ev, Outcome):
                final = ev
        if final is None:  # pragma: no cover - events() always ends with Outcome or raises
            raise ApiError(502, "the generation ended without a result", type_="server_error")
        rid, created = _ids(api.kind)
        logprobs = _render_logprobs(api, tok, final.logprobs)
        if api.kind == "chat":
            calls = _tool_calls(api, final.text)
            message: dict[str, Any] = {"role": "assistant", "content": final.text}
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": "tool_calls" if calls else final.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": final.text, "logprobs": logprobs,
                      "finish_reason": final.finish_reason}
            obj = "text_completion"
        return self._json(request, 200, {
            "id": rid, "object": obj, "created": created, "model": api.model,
            "choices": [choice], "usage": _usage(final), "timings": final.timings,
            "specbus": final.specbus})

    async def _stream(self, request: web.Request, api: ApiRequest, events,
                      first: Started, tok) -> web.StreamResponse:
        resp = _event_stream(request)
        await resp.prepare(request)
        self.metrics.count_request(_endpoint(request), 200)
        rid, created = _ids(api.kind)
        chat = api.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_null = {"usage": None} if api.include_usage else {}

        sent_chars = 0  # completions: where the next chunk's tokens start in the text

        def chunk(text: str | None, finish: str | None, extra: dict | None = None,
                  logprobs: dict | None = None) -> dict:
            if chat:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                          "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": api.model,
                    "choices": [choice], **usage_null, **(extra or {})}

        async def send(obj_: dict | str) -> None:
            data = obj_ if isinstance(obj_, str) else json.dumps(obj_, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        verifier = {"specbus": {"verifier": first.verifier}}
        if chat:
            first_chunk = chunk(None, None, verifier)
            first_chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await send(first_chunk)
            verifier = None
        # tools: an answer that is calls streams as `tool_calls` deltas (CallStream: name
        # first, then argument fragments); under tool_choice auto its first characters are
        # held until they tell calls ("<t", the only way the grammar lets an answer start
        # with "<t") from text, which then streams as content
        tools_on = chat and api.tools is not None and api.tools.active
        held: str | None = "" if tools_on and api.tools.choice == "auto" else None
        calls_stream = CallStream() if tools_on and held is None else None

        async def send_calls(deltas: list[dict]) -> None:
            for d in deltas:
                c = chunk(None, None)
                c["choices"][0]["delta"] = {"tool_calls": [d]}
                await send(c)

        try:
            async for ev in events:
                if isinstance(ev, Started):
                    verifier = {"specbus": {"verifier": ev.verifier}}
                elif isinstance(ev, Piece) and calls_stream is not None:
                    await send_calls(calls_stream.feed(ev.text))
                elif isinstance(ev, Piece) and held is not None:
                    text = held + ev.text
                    if text.startswith("<t"):
                        calls_stream, held = CallStream(), None
                        await send_calls(calls_stream.feed(text))
                    elif text and (text[0] != "<" or len(text) >= 2):
                        held = None
                        await send(chunk(text, None))
                    else:
                        held = text
                elif isinstance(ev, Outcome) and tools_on and (calls_stream is not None or
                                                                  held is not None):
                    text = calls_stream.text if calls_stream is not None else held or ""
                    calls = _tool_calls(api, text)
                    if calls and (calls_stream is None or calls_stream.fallback):
                        await send_calls([{"index": i, **call} for i, call in enumerate(calls)])
                    elif not calls and text and (calls_stream is None or not calls_stream.calls):
                        await send(chunk(text, None))  # (calls cut by max_tokens: none sent)
                    await send(chunk(None, "tool_calls" if calls else ev.finish_reason,
                                     {"timings": ev.timings, "specbus": ev.specbus}))
                    if api.include_usage:
                        await send({"id": rid, "object": obj, "created": created,
                                    "model": api.model, "choices": [], "usage": _usage(ev),
                                    "specbus": ev.specbus})
                elif isinstance(ev, Piece):
                    await send(chunk(ev.text, None, verifier,
                                     _render_logprobs(api, tok, ev.logprobs, sent_chars)))
                    sent_chars += len(ev.text)
                    verifier = None
                elif isinstance(ev, Outcome):
                    await send(chunk(None if chat else "", ev.finish_reason,
                                     {"timings": ev.timings, "specbus": ev.specbus}))
                    if api.include_usage:
                        await send({"id": rid, "object": obj, "created": created,
                                    "model": api.model, "choices": [], "usage": _usage(ev),
                                    "specbus": ev.specbus})
        except StreamFailed as exc:
            self.metrics.stream_errors += 1
            log.warning("gateway: stream %s ended by an error: %s", rid, exc.error.message)
            await send(exc.error.body())
        await send("[DONE]")
        await resp.write_eof()
        return resp

    # -- plumbing -------------------------------------------------------------------------------
    def _json(self, request: web.Request, status: int, body: dict,
              headers: dict[str, str] | None = None) -> web.Response:
        if request.path != "/metrics":
            self.metrics.count_request(_endpoint(request), status)
        return web.json_response(body, status=status, headers=headers,
                                 dumps=lambda o: json.dumps(o, separators=(",", ":")))

    @web.middleware
    async def _host(self, request: web.Request, handler) -> web.StreamResponse:
        """`Host` must name an address this gateway serves (origins.py: DNS rebinding)."""
        host = request.headers.get("Host")
        if not self.origins.host_allowed(host):
            err = ApiError(403, f"Host {host[:100]!r} is not an address this gateway serves; "
                           "a name that reaches it legitimately can be allowed with "
                           "--allow-host NAME", param=None, code="host_not_allowed")
            resp = self._json(request, 403, err.body())
            resp.force_close()
            return resp
        return await handler(request)

    @web.middleware
    async def _cors(self, request: web.Request, handler) -> web.StreamResponse:
        """Browser pages: on a loopback gateway those of this machine (`http://localhost:*`,
        `http://127.0.0.1:*`), and origins named with `--cors-origin`, get the preflight
        answered and `Access-Control-Allow-Origin` on every response; a request from any other
        origin is refused before it runs, with a 403 naming the flag."""
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        if not self.origins.origin_allowed(origin):
            err = ApiError(403, f"origin {origin[:100]!r} may not call this gateway; start it "
                           f"with --cors-origin {origin[:100]} (repeatable; * for any) to "
                           "allow it", code="origin_not_allowed")
            return self._json(request, 403, err.body())
        if request.method == "OPTIONS":
            self.metrics.count_request("preflight", 204)
            return web.Response(status=204, headers={
                **_cors_headers(origin),
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        request[CORS_ORIGIN] = origin  # a stream is prepared inside its handler
        resp = await handler(request)
        if not resp.prepared:
            resp.headers.update(_cors_headers(origin))
        return resp

    @web.middleware
    async def _body(self, request: web.Request, handler) -> web.StreamResponse:
        """Every request's whole body within `body_timeout` of its head (http_server.py), and
        at most MAX_BODY bytes, before its handler runs."""
        if request.content_length is not None and request.content_length > MAX_BODY:
            # its body is never read: the connection closes once answered (and LINGER_S)
            raise ApiError(413, f"request body over {MAX_BODY} bytes", code="body_too_large")
        try:
            await read_body(request, self.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body over {MAX_BODY} bytes",
                           code="body_too_large") from None
        except TimeoutError:
            self.metrics.body_timeouts += 1
            raise ApiError(408, f"the request body did not arrive within "
                           f"{self.body_timeout:g}s of its headers", code="body_timeout") from None
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return self._json(request, exc.status, exc.body(), exc.headers)
        except StreamFailed as exc:
            return self._json(request, exc.error.status, exc.error.body(), exc.error.headers)
        except web.HTTPException as exc:  # routing: 404 unknown path, 405 wrong method
            err = ApiError(exc.status, f"{exc.reason}: {request.method} {request.path[:200]}",
                           code="not_found" if exc.status == 404 else "bad_request")
            return self._json(request, exc.status, err.body(), None)
        except ConnectionResetError:  # the client went away: nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers one request, not the server
            log.exception("gateway: %s %r failed", request.method, request.path[:200])
            err = ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                           code="internal")
            return self._json(request, 500, err.body(), None)


def _model_object(model: str, vs: list) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "specbus",
            "specbus": {"verifiers": [v.node_id for v in vs], "tokenizer": vs[0].tokenizer}}


def _event_stream(request: web.Request) -> web.StreamResponse:
    """A 200 server-sent-events response (not yet prepared), CORS headers where the request's
    origin is allowed."""
    origin = request.get(CORS_ORIGIN)
    return web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **(_cors_headers(origin) if origin else {})})


def _cors_headers(origin: str) -> dict[str, str]:
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def _endpoint(request: web.Request) -> str:
    """The route a request matched (`/v1/completions`), or `other`: a metric label must not
    take whatever path a client makes up (each would be a new series)."""
    route = getattr(request.match_info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "other"


def _tool_calls(api: ApiRequest, text: str | None) -> list[dict[str, Any]] | None:
    """The answer's tool calls when the request has tools and the answer is calls."""
    if api.tools is None or not api.tools.active or not text:
        return None
    from nodes.gateway.tools import parse_calls

    return parse_calls(text)


def _ids(kind: str) -> tuple[str, int]:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


def _usage(final: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _render_logprobs(api: ApiRequest, tok, lp, offset: int = 0) -> dict | None:
    """`choices[0].logprobs` in the endpoint's OpenAI shape; None when not asked for."""
    if api.logprobs is None or lp is None:
        return None
    if api.kind == "chat":
        return chat_logprobs(tok, lp, api.logprobs)
    return completion_logprobs(tok, lp, api.logprobs, offset)
