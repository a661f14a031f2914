"""OpenAI request bodies parsed, in one place, into typed `ApiRequest` objects.

Every field is type- and range-checked here; a field we cannot honour is refused with a 400
naming it (never silently ignored), so a client learns at once that e.g. `n=2` or `tools` is not
served. Responses use the OpenAI error object: `{"error": {message, type, param, code}}`.
The sampling settings become the wire's own `SamplingParams` and pass its one range check;
only `temperature` is narrower here (OpenAI's 0..2, where the wire takes 0..100).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from codec.errors import BadRequest
from codec.sampling import SamplingParams, logit_bias_pairs
from codec.structs import MAX_TOKENS_LIMIT  # the verifier's own limit, declared once there
from nodes.gateway.errors import ApiError, bad, unsupported  # noqa: F401 - ApiError re-exported
from nodes.gateway.openai_logprobs import MAX_CHAT_TOP, MAX_COMPLETION_TOP

DEFAULT_MAX_TOKENS_COMPLETION = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_TOKENS_CHAT = 256  # OpenAI has none; ours keeps an unbounded chat bounded
MAX_STOP = 4
MAX_STOP_LEN = 200
MAX_MESSAGES = 256
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI API's range, narrower than the wire's
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ApiRequest:
    """One validated generation request, chat or completion."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | None = None  # completion text
    prompt_ids: tuple[int, ...] | None = None  # completion given as token ids
    messages: tuple[dict[str, str], ...] = ()  # chat turns, content flattened to text
    max_tokens: int = DEFAULT_MAX_TOKENS_COMPLETION
    sampling: SamplingParams = SamplingParams(temperature=1.0)  # OpenAI's default: 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # specbus extension: speculate, ...
    #: None: no log probabilities; N: each token's and its N most likely alternatives'
    logprobs: int | None = None
    #: `response_format` or `tools` as the `generate_req.grammar` (None: free text)
    grammar: dict[str, str] | None = None
    #: the request field the grammar came from (its errors' `param`)
    grammar_param: str | None = None
    #: the request's tools (`nodes.gateway.tools.Tools`), None without
    tools: Any = None
    #: choices asked for (1..MAX_N): as many generations, the i-th seeded by `choice_seed`
    n: int = 1

    def choice(self, i: int) -> ApiRequest:
        """The request of choice `i` (n = 1): greedy as it is, sampled with `choice_seed`."""
        sp = self.sampling
        if not sp.greedy and sp.seed is not None:
            sp = replace(sp, seed=choice_seed(sp.seed, i))
        return replace(self, n=1, sampling=sp)


MAX_N = 8  # choices one request may ask for


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice `i` of a request seeded `seed`: the seed itself for the first (so
    n=1 is what it was), then a function of both (a golden-ratio step, within the wire's
    0..2^63-1)."""
    return seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % (2**63)


# fields accepted only at their neutral value; anything else is refused by name
_NEUTRAL: dict[str, Any] = {
    "best_of": 1, "echo": False,
    "suffix": None,
    "functions": None, "function_call": None, "audio": None, "modalities": None,
    "prediction": None, "reasoning_effort": None, "service_tier": None, "web_search_options": None,
}
_IGNORED = ("user", "store", "metadata")  # bookkeeping fields with no effect on the output
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "specbus", "logprobs", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "logit_bias", "n")
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
              "parallel_tool_calls", "response_format")
_COMPLETION_ONLY = ("prompt",)


MAX_JSON_DEPTH = 32  # far deeper than any OpenAI body; a 100k-deep one is refused, not a 500


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, refused with a 400 naming the problem when it is not valid
    UTF-8, not JSON, nested absurdly deep, or holds a string no encoder can send on (a lone
    surrogate such as `"\\ud800"`, which JSON allows and UTF-8 cannot carry)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(None, f"request body is not valid UTF-8 (byte {exc.start})",
                  code="invalid_json") from None
    if _nesting(text) > MAX_JSON_DEPTH:
        raise bad(None, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                  code="invalid_json")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise bad(None, f"request body is not valid JSON: {str(exc)[:200]}",
                  code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, f"request body must be a JSON object, got {type(body).__name__}",
                  code="invalid_json")
    where = _lone_surrogate(body, "")
    if where is not None:
        raise bad(where or None, f"{where or 'the body'} holds a lone UTF-16 surrogate, which "
                  "is not a character; send valid Unicode text", code="invalid_unicode")
    return body


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def _nesting(text: str) -> int:
    """Deepest bracket nesting of a JSON text, read as JSON: brackets inside strings (a chat
    message holding 40 `[`) are text, not nesting, so strings go first (escapes included).
    Linear and without recursion; an invalid text gets some figure and is then refused by the
    parser itself."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _lone_surrogate(v: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, else None."""
    if isinstance(v, str):
        return path if _has_surrogate(v) else None
    if isinstance(v, dict):
        for k, x in v.items():
            sub = f"{path}.{k}" if path else str(k)
            if _has_surrogate(k):
                return path or "the body"
            found = _lone_surrogate(x, sub)
            if found is not None:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _lone_surrogate(x, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_request(kind: str, body: dict[str, Any]) -> ApiRequest:
    """Validate a chat (`kind="chat"`) or completion body; raises ApiError(400)."""
    allowed = set(_COMMON) | set(_NEUTRAL) | set(_IGNORED)
    allowed |= set(_CHAT_ONLY) if kind == "chat" else set(_COMPLETION_ONLY)
    if kind != "chat":
        allowed |= {"best_of", "echo", "suffix"}
    for key in body:
        if key not in allowed:
            raise unsupported(key)
    for key, neutral in _NEUTRAL.items():
        if body.get(key) is not None and not _is_neutral(key, body[key], neutral):
            raise unsupported(key, f" (only {neutral!r} is served)" if neutral is not None
                              else "")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' is required and must be a non-empty string",
                  code="missing_required_parameter" if model is None else "invalid_type")
    default = DEFAULT_MAX_TOKENS_CHAT if kind == "chat" else DEFAULT_MAX_TOKENS_COMPLETION
    max_tokens = _max_tokens(body, default, kind)
    sampling = _sampling(body)
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body.get("stream_options"), stream)
    n = _int(body, "n", 1, 1, MAX_N)
    if n > 1:  # the choices' seeds' base (drawn when sampling without one)
        sampling = sampling.seeded()
    common = dict(model=model, max_tokens=max_tokens, sampling=sampling, n=n,
                  stop=_stop(body.get("stop")), stream=stream,
                  include_usage=include_usage, extra=_extension(body.get("specbus")),
                  logprobs=_logprobs(kind, body))
    if kind == "chat":
        from nodes.gateway import tools as tl

        fmt = tl.response_grammar(body.get("response_format"))
        tools = tl.parse_tools(body.get("tools"), body.get("tool_choice"),
                               body.get("parallel_tool_calls"))
        tl.no_grammar_conflict(fmt, tools)
        messages = _messages(body.get("messages"))
        if tools is not None:
            messages = (tl.tools_message(tools), *messages)
        grammar = fmt or (tl.tool_grammar(tools) if tools else None)
        param = tl.SCHEMA_PARAM if fmt else tl.TOOLS_PARAM if grammar else None
        # (compiled once off the event loop, by the app: `tools.check_grammar`)
        return ApiRequest(kind="chat", messages=messages, **common, grammar=grammar,
                          grammar_param=param, tools=tools)
    text, ids = _prompt(body.get("prompt"))
    return ApiRequest(kind="completion", prompt=text, prompt_ids=ids, **common)


def _is_neutral(key: str, value: Any, neutral: Any) -> bool:
    """True when a field we do not serve holds the value that changes nothing."""
    if key in ("logit_bias", "tools", "functions") and value in ({}, []):
        return True
    if key == "tool_choice" and value == "none":
        return True
    if key == "response_format":
        return value == {"type": "text"}
    if key in ("echo", "parallel_tool_calls"):
        return value is False  # tools clients send these defaults; they change nothing here
    if key == "service_tier":
        return value in ("auto", "default")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value == neutral


def _logprobs(kind: str, body: dict) -> int | None:
    """Chat: `logprobs` true/false and `top_logprobs` 0..20 (only with logprobs true);
    completions: `logprobs` 0..5 (the number of alternatives) or null."""
    if kind != "chat":
        return _int(body, "logprobs", None, 0, MAX_COMPLETION_TOP)
    on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_CHAT_TOP)
    if top and not on:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if on else None


def _sampling(body: dict) -> SamplingParams:
    """temperature, top_p, seed and the logit controls (top_k, min_p, the repetition,
    presence and frequency penalties, logit_bias) as the wire's `SamplingParams`,
    range-checked by it. A control at its neutral value is left off (absent on the wire);
    logit_bias token ids are checked against the vocabulary by the verifier."""

    def opt(key: str, neutral: float) -> float | None:
        v = _number(body, key, neutral)
        return None if v == neutral else v  # an int stays one: a huge one is no float

    try:
        bias = _logit_bias(body.get("logit_bias"))
        top_k = _int(body, "top_k", 0)
        if top_k is not None and top_k < 0:
            top_k = 0 if top_k == -1 else top_k  # -1: off, as vLLM and llama.cpp read it
        sampling = SamplingParams(
            temperature=_as_float(_number(body, "temperature", 1.0, 0.0,
                                          OPENAI_MAX_TEMPERATURE)),
            top_p=_as_float(_number(body, "top_p", 1.0)), top_k=top_k,
            seed=_int(body, "seed", None),
            min_p=opt("min_p", 0.0), repetition_penalty=opt("repetition_penalty", 1.0),
            presence_penalty=opt("presence_penalty", 0.0),
            frequency_penalty=opt("frequency_penalty", 0.0), logit_bias=bias)
        sampling.check()  # the one range check of these settings on their way to the engine
    except BadRequest as exc:
        raise bad(exc.field, f"{exc.field!r} {exc.reason}") from None
    return sampling


def _as_float(v: Any) -> Any:
    """An int temperature or top_p as the float the wire sends; one too large for a float is
    left as it is, for the range check to refuse by name."""
    return float(v) if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53 else v


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's `{"token id": bias}` object as `SamplingParams.logit_bias` (None: empty)."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases",
                  code="invalid_type")
    return logit_bias_pairs(v)


def _int(body: dict, key: str, default: int | None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(key, f"{key!r} must be an integer, got {json.dumps(v)[:40]}",
                  code="invalid_type")
    if lo is not None and hi is not None and not lo <= v <= hi:
        raise bad(key, f"{key!r} must be between {lo} and {hi}, got {str(v)[:40]}")
    return v


def _number(body: dict, key: str, default: float, lo: float | None = None,
            hi: float | None = None) -> float | int:
    """The number under `key` (an int stays an int: a huge one is no float); in [lo, hi]
    when given, else checked by the caller."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise bad(key, f"{key!r} must be a number, got {json.dumps(v)[:40]}",
                  code="invalid_type")
    if lo is not None and hi is not None and (
            not lo <= v <= hi or not math.isfinite(v)):  # compared first: a huge int is no float
        raise bad(key, f"{key!r} must be between {lo:g} and {hi:g}, got {str(v)[:40]}")
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"{key!r} must be a boolean, got {json.dumps(v)[:40]}",
                  code="invalid_type")
    return v


def _max_tokens(body: dict, default: int, kind: str) -> int:
    a = _int(body, "max_tokens", None, 1, MAX_TOKENS_LIMIT)
    b = _int(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT) if kind == "chat" else None
    if a is not None and b is not None and a != b:
        raise bad("max_completion_tokens",
                  "'max_tokens' and 'max_completion_tokens' disagree; send one of them")
    return b if b is not None else a if a is not None else default


def _stream_options(v: Any, stream: bool) -> bool:
    if v is None:
        return False
    if not isinstance(v, dict):
        raise bad("stream_options", "'stream_options' must be an object", code="invalid_type")
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
    for key in v:
        if key not in ("include_usage", "include_obfuscation"):
            raise unsupported(f"stream_options.{key}")
    usage = v.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options.include_usage", "'include_usage' must be a boolean",
                  code="invalid_type")
    return usage


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "'stop' must be a string or a list of strings", code="invalid_type")
    if len(items) > MAX_STOP:
        raise bad("stop", f"'stop' takes at most {MAX_STOP} sequences, got {len(items)}")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise bad("stop", f"stop sequences must be 1-{MAX_STOP_LEN} characters")
    return tuple(dict.fromkeys(items))


def _prompt(v: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "'prompt' must not be empty")
        return v, None
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        if any(t < 0 or t >= 2**31 for t in v):
            raise bad("prompt", "token ids in 'prompt' must be non-negative 32-bit integers")
        return None, tuple(v)
    if isinstance(v, list) and len(v) > 1:
        raise unsupported("prompt", " as a batch of several prompts (send one per request)")
    raise bad("prompt", "'prompt' is required: a string or a list of token ids",
              code="missing_required_parameter" if v is None else "invalid_type")


def _messages(v: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "'messages' is required: a non-empty list of messages",
                  code="missing_required_parameter" if v is None else "invalid_type")
    if len(v) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(v)}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object", code="invalid_type")
        for key in m:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise unsupported(f"{where}.{key}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, "
                      f"got {json.dumps(role)[:40]}")
        if "tool_calls" in m and role != "assistant":  # only the model's turns call tools
            raise bad(f"{where}.tool_calls", f"only an assistant message carries tool_calls, "
                      f"not a {role} message")
        content = m.get("content")
        if content is None and role == "assistant":  # tool-using clients send this: no text
            content = ""
        text = text_content(content, where)
        if role == "assistant" and m.get("tool_calls"):
            text += _rendered_calls(m["tool_calls"], where)
        if role == "tool":  # the tool prompt format (docs/api.md, "Tools"): a user turn
            from nodes.gateway.tools import tool_result

            role, text = "user", tool_result(text, m.get("tool_call_id"), m.get("name"))
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return tuple(out)


def _rendered_calls(calls: Any, where: str) -> str:
    """An assistant turn's `tool_calls` in the tool prompt format."""
    from nodes.gateway.tools import render_call

    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", "tool_calls must be a list", code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", ""), str):
            raise bad(f"{where}.tool_calls[{j}]", "a tool call is {id, type: function, "
                      "function: {name, arguments (a JSON string)}}")
        out.append(render_call(fn["name"], fn.get("arguments", "")))
    return "\n".join(out)


def text_content(v: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or a list of text parts (their `type` among `kinds`:
    chat's `text`; the Responses API's `input_text`/`output_text` too) joined."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for j, p in enumerate(v):
            if not (isinstance(p, dict) and p.get("type") in kinds
                    and isinstance(p.get("text"), str)):
                raise unsupported(f"{where}.content[{j}]", " (only text parts are served)")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where}.content", f"{where}.content must be a string or a list of text parts",
              code="invalid_type")


def _extension(v: Any) -> dict[str, Any]:
    """`specbus: {speculate: bool, proposers: [ids or names]}`: our own request options."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("specbus", "'specbus' must be an object", code="invalid_type")
    out: dict[str, Any] = {}
    for key, val in v.items():
        if key == "speculate":
            if not isinstance(val, bool):
                raise bad("specbus.speculate", "'specbus.speculate' must be a boolean",
                          code="invalid_type")
            out[key] = val
        elif key == "proposers":
            if not isinstance(val, list) or len(val) > 32 or not all(
                    isinstance(s, str) and 0 < len(s) <= 64 for s in val):
                raise bad("specbus.proposers", "'specbus.proposers' must be a list of names",
                          code="invalid_type")
            out[key] = list(val)
        else:
            raise unsupported(f"specbus.{key}")
    return out
