"""`POST /v1/responses` for text: the OpenAI Responses API over the same generation as chat.

A request becomes a chat request (`parse_request("chat", ...)`, every check there): `input` as a
string (one user turn) or a list of messages (`role` + `content` as a string or `input_text` /
`output_text` parts), `instructions` as the system turn, `max_output_tokens`, `temperature`,
`top_p`, `stream`. `previous_response_id` continues a conversation this gateway answered: its
turns (input and answer; not its instructions, as OpenAI does) come first. They are kept in a
bounded memory (`ResponseMemory`: the latest `MAX_REMEMBERED` responses within
`MAX_REMEMBERED_CHARS` of text; older ones are forgotten, and naming one is a 400). `store:
false` keeps a response out of it. Tools and other output types are refused by name.

Streaming sends the documented events, each an SSE `event:` + `data:` pair with its `type` and
`sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when `max_output_tokens` cut it; response.failed on an error).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nodes.gateway.openai_schema import (
    ApiError,
    ApiRequest,
    bad,
    parse_request,
    text_content,
    unsupported,
)

#: the Responses API's text parts
_TEXT_PARTS = ("input_text", "output_text", "text")

MAX_REMEMBERED = 256  # responses kept for previous_response_id
MAX_REMEMBERED_CHARS = 16 << 20  # their text in all (characters)

# fields accepted only at a value that changes nothing here
_NEUTRAL = {"tools": ([], None), "tool_choice": ("auto", "none", None),
            "parallel_tool_calls": (True, False, None), "truncation": ("disabled", None),
            "reasoning": (None,), "include": ([], None), "background": (False, None),
            "service_tier": ("auto", "default", None)}
_IGNORED = ("user", "metadata", "store", "safety_identifier", "prompt_cache_key")
_OWN = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
        "previous_response_id", "text", "specbus", "seed", "stream_options")


@dataclass
class ResponseRequest:
    api: ApiRequest  # the chat request it runs as
    turns: tuple[dict[str, str], ...]  # the conversation without instructions (for memory)
    body: dict[str, Any]  # what the response object echoes (instructions, limits, ...)
    previous: str | None
    store: bool


class ResponseMemory:
    """Conversations of answered responses, for `previous_response_id`: bounded in count and
    in characters, the oldest forgotten first (asyncio thread only)."""

    def __init__(self, limit: int = MAX_REMEMBERED, chars: int = MAX_REMEMBERED_CHARS) -> None:
        self.limit, self.max_chars = limit, chars
        self._turns: OrderedDict[str, tuple[dict[str, str], ...]] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, rid: str) -> tuple[dict[str, str], ...] | None:
        return self._turns.get(rid)

    def put(self, rid: str, turns: tuple[dict[str, str], ...]) -> None:
        size = _chars(turns)
        if size > self.max_chars:
            return
        self._turns[rid] = turns
        self.chars += size
        while len(self._turns) > self.limit or self.chars > self.max_chars:
            _, old = self._turns.popitem(last=False)
            self.chars -= _chars(old)


def _chars(turns) -> int:
    return sum(len(t["content"]) + 16 for t in turns)


def parse_responses(body: dict[str, Any], memory: ResponseMemory) -> ResponseRequest:
    for key, value in body.items():
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise unsupported(key, " (text responses only)")
        elif key not in _OWN and key not in _IGNORED:
            raise unsupported(key)
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad("store", "'store' must be a boolean", code="invalid_type")
    text = body.get("text")
    if text is not None and text not in ({}, {"format": {"type": "text"}}):
        raise unsupported("text", " (only the text format is served)")
    previous = body.get("previous_response_id")
    earlier: tuple[dict[str, str], ...] = ()
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id", "'previous_response_id' must be a string",
                      code="invalid_type")
        found = memory.get(previous)
        if found is None:
            raise ApiError(400, f"previous response {previous[:100]!r} is not known to this "
                           f"gateway (it keeps the latest {memory.limit} responses)",
                           param="previous_response_id", code="previous_response_not_found")
        earlier = found
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "'instructions' must be a string", code="invalid_type")
    turns = earlier + _input(body.get("input"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
        dict(t) for t in turns]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("stream", "stream"), ("specbus", "specbus"),
                     ("seed", "seed")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    api = parse_request("chat", chat)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": api.sampling.temperature, "top_p": api.sampling.top_p,
            "previous_response_id": previous, "store": store,
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
            "user": body.get("user")}
    return ResponseRequest(api, tuple(turns), echo, previous, store)


def _input(v: Any) -> tuple[dict[str, str], ...]:
    if isinstance(v, str):
        if not v:
            raise bad("input", "'input' must not be empty")
        return ({"role": "user", "content": v},)
    if not isinstance(v, list) or not v:
        raise bad("input", "'input' is required: a string or a non-empty list of messages",
                  code="missing_required_parameter" if v is None else "invalid_type")
    out = []
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be a message object", code="invalid_type")
        if item.get("type", "message") != "message":
            raise unsupported(f"{where}.type", " (only messages are served)")
        for key in item:
            if key not in ("type", "role", "content", "id", "status"):
                raise unsupported(f"{where}.{key}")
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad(f"{where}.role", f"{where}.role must be user, system, developer or "
                      f"assistant, got {json.dumps(role)[:40]}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": text_content(item.get("content"), where, _TEXT_PARTS)})
    return tuple(out)


# -- the response object -------------------------------------------------------------------------
def new_ids() -> tuple[str, str, int]:
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())


def message_item(msg_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(req: ResponseRequest, rid: str, created: int, status: str,
                    output: list[dict[str, Any]], final=None,
                    error: dict | None = None) -> dict[str, Any]:
    usage = None
    if final is not None:
        usage = {"input_tokens": final.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": final.cached_tokens},
                 "output_tokens": final.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": final.prompt_tokens + final.completion_tokens}
    out = {"id": rid, "object": "response", "created_at": created, "status": status,
           "error": error, "incomplete_details": {"reason": "max_output_tokens"}
           if status == "incomplete" else None,
           "model": req.api.model, "output": output, "parallel_tool_calls": True,
           "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
           "truncation": "disabled", "reasoning": None, "usage": usage, **req.body}
    if final is not None:
        out["timings"] = final.timings
        out["specbus"] = final.specbus
    return out


def status_of(final) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


def remember(memory: ResponseMemory, req: ResponseRequest, rid: str, text: str) -> None:
    if req.store:
        memory.put(rid, req.turns + ({"role": "assistant", "content": text},))
