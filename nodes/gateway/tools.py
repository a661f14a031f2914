"""Structured output and tool calls for the OpenAI API: `response_format`, `tools`,
`tool_choice`, assistant `tool_calls` and `tool` messages.

Everything here turns into two things the cluster already has: chat messages of text (the tool
prompt format below, docs/api.md "Tools") and a grammar (`generate_req.grammar`) the verifier
applies to its own logits, so a constrained answer is still the lossless speculative one.

The tool prompt format (the embedded SmolLM2's chat template has no tool format of its own):
the tools are listed in a system message, a call is written as

    <tool_call>
    {"name": "<function>", "arguments": {...}}
    </tool_call>

(one block per call, several for parallel calls), and a tool's result comes back as a user
turn `<tool_response>\n{"tool_call_id": ..., "name": ..., "content": ...}\n</tool_response>`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from nodes.gateway.errors import ApiError, bad

MAX_TOOLS = 128
#: the most calls one answer may hold with parallel_tool_calls (see `max_calls`)
MAX_PARALLEL_CALLS = 8
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: llguidance's JSON options for a call's object: no whitespace between tokens
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Tools:
    """The request's function tools and what it lets the model do with them."""

    functions: tuple[dict[str, Any], ...]  # {name, description, parameters}
    choice: str  # "none" | "auto" | "required" | a function's name
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"


def parse_tools(tools: Any, choice: Any, parallel: Any) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` checked; None without tools."""
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"tools must be a list of at most {MAX_TOOLS} tools")
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not \
                _NAME.match(fn["name"]):
            raise bad("tools", f"tools[{i}] must be {{type: function, function: {{name "
                      "(a-z, A-Z, 0-9, _ and -, at most 64), parameters}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "parameters must be a JSON schema "
                      "object")
        fns.append({"name": fn["name"], "description": str(fn.get("description", "")),
                    "parameters": params})
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise bad("tools", "tool names must be distinct")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if not isinstance(name, str):
            raise bad("tool_choice", "tool_choice must be none, auto, required or "
                      "{type: function, function: {name}}")
        if name not in names:
            raise bad("tool_choice", f"tool_choice names {name!r}, which is not among the "
                      f"tools ({', '.join(names)})", code="tool_not_found")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", "tool_choice must be none, auto, required or "
                  "{type: function, function: {name}}")
    return Tools(tuple(fns), choice, parallel is not False)


def response_grammar(fmt: Any) -> dict[str, str] | None:
    """`response_format` as a `generate_req.grammar`; None for text."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict):
        raise bad("response_format", "response_format must be an object")
    kind = fmt.get("type")
    if kind == "json_object":
        return {"kind": "json_object", "text": ""}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise bad("response_format.json_schema",
                      "json_schema must be {name, schema, strict}")
        return {"kind": "json_schema",
                "text": json.dumps(closed(spec.get("schema", {})), separators=(",", ":"))}
    raise bad("response_format.type", "response_format.type must be text, json_object or "
              "json_schema")


def max_calls(tools: Tools, callable_tools: int) -> int:
    """How many calls one answer may hold: 1 without parallel calls; with them, as many as
    there are tools it may call, at least 2 (the same tool for two arguments) and at most
    MAX_PARALLEL_CALLS. Unbounded, a small greedy model repeats its call until max_tokens and
    the answer is a truncated text, not calls."""
    if not tools.parallel:
        return 1
    return min(MAX_PARALLEL_CALLS, max(2, callable_tools))


def tool_grammar(tools: Tools) -> dict[str, str] | None:
    """The grammar of what the model may answer under `tools` (None: free text)."""
    if not tools.active:
        return None
    fns = [f for f in tools.functions if tools.choice in ("auto", "required", f["name"])]
    # compact JSON (no free whitespace, "," and ":" with nothing around them, as `render_call`
    # writes the history's calls): a small model cannot pad a call with newlines and spaces, and
    # every key and separator is forced, so the grammar drafts it
    call = {"x-guidance": _COMPACT, "oneOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": closed(f["parameters"])},
        "required": ["name", "arguments"], "additionalProperties": False} for f in fns]}
    calls = "call"
    for _ in range(max_calls(tools, len(fns)) - 1):  # call ("\n" call ("\n" call)?)?
        calls = f"call (\"\\n\" {calls})?"
    lark = (f"start: {'calls | TEXT' if tools.choice == 'auto' else 'calls'}\n"
            f"calls: {calls}\n"
            f"call: \"<tool_call>\\n\" body \"\\n</tool_call>\"\n"
            f"body: %json {json.dumps(call, separators=(',', ':'))}\n")
    if tools.choice == "auto":  # free text, but not starting a tool call
        lark += "TEXT: /([^<]|<[^t])(.|\\n)*/ | /[^<]?/\n"
    return {"kind": "lark", "text": lark}


#: keywords that combine a subschema with others: under them an object closed on its own
#: `properties` could contradict its siblings, so a schema holding any is left as it is
_COMBINERS = ('"allOf"', '"unevaluatedProperties"', '"dependentSchemas"', '"if"')


def closed(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing of other keys
    closed (`additionalProperties: false`), as OpenAI's strict mode requires of a schema.

    Non-strict tools (LangChain's `bind_tools`, litellm, most clients) send open objects, and a
    small model under an open object's grammar invents keys ("description": ...) and rambles in
    them until `max_tokens`. Closing only narrows what the grammar allows: every answer still
    validates against the schema as sent. Left open: objects with `additionalProperties`,
    `patternProperties` or a `$ref` of their own, and whole schemas using a combining keyword
    (`_COMBINERS`), where closing one part could make the whole unsatisfiable."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    if any(k in text for k in _COMBINERS):
        return schema
    return _close(schema)


def _close(s: Any) -> Any:
    if isinstance(s, list):
        return [_close(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _close(sub) for name, sub in v.items()}
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties") and \
                isinstance(v, dict | list):
            out[k] = _close(v)
        else:
            out[k] = v
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties", "$ref")):
        out["additionalProperties"] = False
    return out


def tools_message(tools: Tools) -> dict[str, str]:
    """The system turn listing the tools (docs/api.md, "Tools")."""
    listed = "\n".join(json.dumps(f, separators=(",", ":")) for f in tools.functions)
    return {"role": "system", "content": (
        "You can call these functions (JSON schemas of their arguments):\n<tools>\n"
        f"{listed}\n</tools>\nTo call a function, answer with only\n<tool_call>\n"
        '{"name":"<function name>","arguments":{<its arguments>}}\n</tool_call>\n'
        "(one block per call).")}


def render_call(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments
    return CALL_OPEN + json.dumps({"name": name, "arguments": args},
                                  separators=(",", ":")) + CALL_CLOSE


def tool_result(content: str, call_id: str | None, name: str | None) -> str:
    return "<tool_response>\n" + json.dumps(
        {"tool_call_id": call_id, "name": name, "content": content}) + "\n</tool_response>"


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of an answer made only of tool call blocks; else None."""
    if not text.startswith("<tool_call>"):
        return None
    calls, end = [], 0
    for m in _CALL.finditer(text):
        if text[end:m.start()].strip():
            return None
        end = m.end()
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        head = _HEAD.format(name=obj["name"])
        raw = m.group(1)  # the arguments as the model wrote them (compact: the grammar's)
        args = raw[len(head):-1] if raw.startswith(head) and raw.endswith("}") else json.dumps(
            obj.get("arguments", {}), separators=(",", ":"))
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": args}})
    if not calls or text[end:].strip():
        return None
    return calls


#: where a request's grammar came from, for its 400s' `param`
SCHEMA_PARAM, TOOLS_PARAM = "response_format.json_schema.schema", "tools"


def check_grammar(grammar: dict[str, str] | None, param: str) -> None:
    """Refuse, before any verifier sees it, a grammar that is too large or does not compile
    under the verifiers' llguidance limits (nodes.engine.grammar.validate: size, then compile,
    a few ms): a 400 naming the reason and `param`. An unsatisfiable schema llguidance sees at
    compile time (`minLength` over `maxLength`, a `false` schema) is one of these; a grammar
    that accepts nothing only with the model's tokens is found by the verifier, and its 400
    names `param` too (`generation._api_error`)."""
    if grammar is None:
        return
    if grammar["kind"] == "json_schema" and grammar["text"] == "false":
        raise ApiError(400, "the schema is false: it accepts nothing", param=param,
                       code="invalid_schema")
    error = _compile_error(grammar["kind"], grammar["text"])
    if error is not None:
        if param == TOOLS_PARAM:  # the tools' call grammar holds their parameters' schemas
            error = "tools: the grammar of their calls " + error.removeprefix("lark ")
        raise ApiError(400, error, param=param, code="invalid_schema")


@lru_cache(maxsize=128)
def _compile_error(kind: str, text: str) -> str | None:
    """Why (kind, text) does not compile, or None; remembered (clients resend their schemas)."""
    from nodes.engine.errors import BadRequestError
    from nodes.engine.grammar import Constraint, validate

    try:
        validate(Constraint(kind, text))
    except BadRequestError as exc:
        return str(exc)
    return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


#: how a call's JSON starts, its arguments next (the grammar's property order, compact)
_HEAD = '{{"name":"{name}","arguments":'
_HEAD_RE = re.compile(r'<tool_call>\n\{"name":"([a-zA-Z0-9_-]{1,64})","arguments":')


class CallStream:
    """A tool-call answer's text, fed as it is generated (pieces of any length: speculation
    commits several tokens at once), turned into OpenAI `tool_calls` deltas: a call's first
    delta as soon as its name is complete (`index`, `id`, `type`, `function.name`,
    `function.arguments` ""), then `function.arguments` fragments as the arguments grow.
    Concatenated, a call's fragments are exactly its arguments as `parse_calls` reads them
    from the whole answer (the text the model wrote).

    The grammar's calls are compact JSON, so the first raw newline after a call's arguments
    ends them (a JSON string holds its newlines escaped) and the character before it is the
    call object's closing brace: the last character received is held back until the next
    shows it is not that brace. Text that does not have the call format (a grammar that
    ordered the keys otherwise) streams nothing; `fallback` then tells the caller to send the
    calls whole from the answer."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[dict[str, Any]] = []  # {id, name, arguments sent so far}
        self._at = 0  # where the next call starts in `text`
        self._args = -1  # where the current call's arguments start (-1: between calls)
        self.fallback = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        out: list[dict[str, Any]] = []
        while not self.fallback:
            if self._args < 0:  # a call's head: `<tool_call>\n{"name":"...","arguments":`
                rest = self.text[self._at:].lstrip("\n")
                m = _HEAD_RE.match(rest)
                if m is None:
                    probe = '<tool_call>\n{"name":"'
                    if not (probe.startswith(rest) or rest.startswith(probe)) or len(
                            rest) > len(probe) + 64 + len('","arguments":'):
                        self.fallback = bool(rest.strip())
                    break
                start = len(self.text) - len(rest)
                self._args = start + m.end()
                call = {"id": new_call_id(), "name": m.group(1), "arguments": ""}
                self.calls.append(call)
                out.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                            "function": {"name": call["name"], "arguments": ""}})
                continue
            call = self.calls[-1]
            end = self.text.find("\n", self._args)
            upto = end - 1 if end >= 0 else len(self.text) - 1  # hold the maybe-closing brace
            fragment = self.text[self._args + len(call["arguments"]):upto]
            if fragment:
                call["arguments"] += fragment
                out.append({"index": len(self.calls) - 1,
                            "function": {"arguments": fragment}})
            if end < 0:
                break
            close = self.text.find("</tool_call>", end)
            if close < 0:
                break
            self._at, self._args = close + len("</tool_call>"), -1
        return out


def no_grammar_conflict(fmt: dict | None, tools: Tools | None) -> None:
    if fmt is not None and tools is not None and tools.active:
        raise ApiError(400, "response_format and tools (with tool_choice other than none) "
                       "cannot both constrain one answer", param="response_format")
