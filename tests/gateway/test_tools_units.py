"""response_format and tools as the gateway parses them (no cluster): the grammar sent, the
tool prompt format, the 400s, and tool-call answers parsed back."""

from __future__ import annotations

import json

import pytest

from nodes.gateway.openai_schema import ApiError, parse_request
from nodes.gateway.tools import parse_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw):
    return parse_request("chat", {"model": "m", "messages": MSGS, **kw})


def test_response_format_becomes_the_grammar():
    assert chat(response_format={"type": "json_object"}).grammar == {"kind": "json_object",
                                                                     "text": ""}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}).grammar
    # objects closed (nodes.gateway.tools.closed): the grammar narrows, never widens
    assert g["kind"] == "json_schema" and json.loads(g["text"]) == {
        **schema, "additionalProperties": False}
    assert chat(response_format={"type": "text"}).grammar is None


@pytest.mark.parametrize("choice, lark_has", [
    ("auto", "calls | TEXT"), ("required", "start: calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")])
def test_tools_prompt_and_grammar(choice, lark_has):
    req = chat(tools=[WEATHER], tool_choice=choice)
    assert req.messages[0]["role"] == "system" and "get_weather" in req.messages[0]["content"]
    assert req.grammar["kind"] == "lark" and lark_has in req.grammar["text"]
    assert chat(tools=[WEATHER], tool_choice="none").grammar is None


def test_multi_turn_tool_calls_and_results_render_as_text():
    req = parse_request("chat", {"model": "m", "tools": [WEATHER], "messages": [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]})
    assistant, tool = req.messages[2], req.messages[3]
    assert assistant["content"] == \
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert tool["role"] == "user" and tool["content"].startswith("<tool_response>\n")
    assert json.loads(tool["content"].split("\n")[1])["content"] == "18 C, sunny"


@pytest.mark.parametrize("kw, param, code", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "tool_not_found"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (dict(tools=[{"type": "function"}]), "tools", "invalid_value"),
    (dict(tools=[WEATHER] * 200), "tools", "invalid_value"),
    (dict(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (dict(response_format={"type": "json_object"}, tools=[WEATHER]), "response_format", None),
])
def test_bad_tools_and_formats_are_specific_400s(kw, param, code):
    with pytest.raises(ApiError) as err:
        chat(**kw)
    assert err.value.status == 400 and err.value.param == param
    if code:
        assert err.value.code == code


def test_answers_parse_back_into_tool_calls():
    text = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>')
    calls = parse_calls(text)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_calls("It is sunny.") is None
    assert parse_calls("<tool_call>\n{bad\n</tool_call>") is None


def test_closed_narrows_open_objects_only():
    from nodes.gateway.tools import closed

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "free": {"type": "object", "additionalProperties": True},
        "xs": {"type": "array", "items": {"properties": {"c": {}}}}},
        "$defs": {"D": {"properties": {"d": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True  # said: left as is
    assert out["properties"]["xs"]["items"]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is not changed
    mixed = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(mixed) == mixed  # closing each part would make the whole unsatisfiable
    assert closed(True) is True


@pytest.mark.parametrize("tools, parallel, most", [(1, None, 2), (1, False, 1), (3, True, 3),
                                                    (50, True, 8)])
def test_parallel_calls_are_bounded(tools, parallel, most):
    fns = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(tools)]
    lark = chat(tools=fns, tool_choice="required", parallel_tool_calls=parallel).grammar["text"]
    calls = next(line for line in lark.splitlines() if line.startswith("calls:"))
    assert calls.count("call") - 1 == most


def test_streamed_call_fragments_reassemble_to_the_answers_calls():
    """CallStream over every way of cutting an answer into pieces (speculation commits
    several tokens at once): name first, then argument fragments that concatenate to exactly
    the arguments the whole answer parses to."""
    import random

    from nodes.gateway.tools import CallStream

    text = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Pa}ris\\n","x":{"a":[1,'
            '2]}}}\n</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{"city":"Tokyo '
            'é"}}\n</tool_call>')
    want = [c["function"] for c in parse_calls(text)]
    assert want[0]["arguments"] == '{"city":"Pa}ris\\n","x":{"a":[1,2]}}'  # as written
    for seed in range(200):
        rng, stream, deltas, at = random.Random(seed), CallStream(), [], 0
        while at < len(text):
            n = rng.randint(1, 12)
            deltas += stream.feed(text[at:at + n])
            at += n
        got: dict[int, dict] = {}
        for d in deltas:
            if "id" in d:  # a call's first delta: id, type, name, no arguments yet
                assert d["index"] not in got and d["type"] == "function"
                got[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d["function"]) == {"arguments"} and d["function"]["arguments"]
                got[d["index"]]["arguments"] += d["function"]["arguments"]
        assert [got[i] for i in sorted(got)] == want and not stream.fallback
    other = CallStream()  # not the call format: nothing streamed, the caller sends it whole
    assert other.feed('<tool_call>\n{"arguments":{},"name":"x"}') == [] and other.fallback


@pytest.mark.parametrize("kw, param, says", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}),
     "response_format.json_schema.schema", "minLength (5) is greater than maxLength (2)"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}}}),
     "response_format.json_schema.schema", "more than the 65536 accepted"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a"], "properties": {"a": {"not": {}}}}}}],
        tool_choice="required"), "tools", "tools: the grammar of their calls"),
])
def test_check_grammar_names_the_reason_and_param(kw, param, says):
    from nodes.gateway.tools import check_grammar

    req = chat(**kw)
    with pytest.raises(ApiError) as err:
        check_grammar(req.grammar, req.grammar_param)
    assert err.value.status == 400 and err.value.param == param and says in err.value.message
    assert err.value.code == "invalid_schema"
    ok = chat(tools=[WEATHER], tool_choice="required")
    check_grammar(ok.grammar, ok.grammar_param)  # a good one passes
