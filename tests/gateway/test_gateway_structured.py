"""response_format and tools end to end: the official openai client against the gateway and
real SmolLM2 verifiers (conftest's cluster). Every answer parses and matches its schema."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description":
           "Current weather in a city", "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30}}, "required": ["city"],
               "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_strict(oai):
    r = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Alice is 31. Give her as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and 0 <= obj["age"] <= 150


def test_json_object(oai):
    r = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=300, messages=[
        {"role": "user", "content": "Reply with a JSON object about a cat."}],
        response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason != "length":  # (the 135M model may ramble inside a string)
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {
    "name": "get_weather"}}])
def test_tool_calls_and_their_stream(oai, choice):
    kw = dict(model=MODEL, temperature=0, max_tokens=120, messages=ASK, tools=[WEATHER],
              parallel_tool_calls=False,
              tool_choice=choice)
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    args = [json.loads(c.function.arguments) for c in calls]
    assert all(set(a) == {"city"} for a in args)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert _reassembled(chunks) == [(c.function.name, c.function.arguments) for c in calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the next turn: the call and its result go back through the tool prompt format
    again = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [c.model_dump()
                                                                     for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls)],
        tools=[WEATHER], tool_choice="none")
    assert again.choices[0].message.content


def _reassembled(chunks) -> list[tuple[str, str]]:
    """The (name, arguments) of each streamed call, checking the deltas' shape: a call's
    first delta has its id, type and name, later ones only argument fragments."""
    calls: dict[int, list] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or [] if c.choices else []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.function.name is None and d.function.arguments
                calls[d.index][1] += d.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


TIME = {"type": "function", "function": {"name": "get_time", "description":
        "Local time in a city", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_call_fragments_match_the_answer_under_speculation(oai, choice):
    """Streamed `tool_calls` deltas (name first, then argument fragments as the verifier
    commits them, several tokens a step while it speculates) reassemble to exactly the
    non-streamed calls' arguments; under auto a text answer streams as content."""
    kw = dict(model=MODEL, temperature=0, max_tokens=120, tools=[WEATHER, TIME],
              tool_choice=choice, messages=[{"role": "user", "content": (
                  "What is the weather in Paris, and what time is it in Tokyo?")}])
    whole = oai.chat.completions.create(**kw).choices[0]
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.finish_reason
    if whole.message.tool_calls:
        assert whole.finish_reason == "tool_calls"
        assert _reassembled(chunks) == [(c.function.name, c.function.arguments)
                                        for c in whole.message.tool_calls]
        assert all(json.loads(c.function.arguments)["city"] for c in whole.message.tool_calls)
        fragments = sum(1 for c in chunks for d in (c.choices[0].delta.tool_calls or [] if
                                                     c.choices else []) if d.id is None)
        print(f"{choice}: {len(whole.message.tool_calls)} calls, {fragments} argument "
              f"fragments; speculation: {chunks[-1].model_extra.get('specbus')}")
    else:
        assert choice == "auto" and not _reassembled(chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            whole.message.content


def test_bad_schema_and_missing_tool_are_400s(oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="Invalid type") as err:
        oai.chat.completions.create(model=MODEL, max_tokens=5, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert err.value.code == "invalid_schema"
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="not among the tools") as err:
        oai.chat.completions.create(model=MODEL, max_tokens=5, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "function",
                                                 "function": {"name": "nope"}})
    assert err.value.code == "tool_not_found"


def _with_props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def _fn(name: str, params: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **(
        {"parameters": params} if params else {})}}


def _schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": schema}}}


@pytest.mark.parametrize("kw, param, says", [
    (_schema({"type": "string", "minLength": 5, "maxLength": 2}),  # accepts nothing
     "response_format.json_schema.schema", "minLength (5) is greater than maxLength (2)"),
    (_schema({"not": {}}), "response_format.json_schema.schema", 'Unimplemented keys: ["not"]'),
    (_schema(False), "response_format.json_schema.schema", "accepts nothing"),
    (_schema({"$ref": "#/$defs/nope"}), "response_format.json_schema.schema", "does not exist"),
    (_schema(_with_props(10_000)), "response_format.json_schema.schema",
     "more than the 65536 accepted"),
    (dict(tools=[_fn(f"f{i}") for i in range(1000)]), "tools", "at most 128 tools"),
    (dict(tools=[_fn("f", _with_props(10_000))]), "tools", "more than the 65536 accepted"),
    (dict(tools=[_fn("f", {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "string", "minLength": 5, "maxLength": 2}}})], tool_choice="required"),
     "tools", "unsatisfiable"),
])
def test_bad_grammars_are_specific_400s(raw, kw, param, says):
    """Refused by the gateway before a verifier is asked (nodes.gateway.tools.check_grammar)."""
    status, _, body = raw.json("POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 5, "messages": ASK, **kw})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["code"] in ("invalid_schema", "invalid_value")


TREE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
    "required": ["name", "children"], "additionalProperties": False}


def _is_tree(obj) -> bool:
    return isinstance(obj, dict) and set(obj) == {"name", "children"} and isinstance(
        obj["name"], str) and len(obj["children"]) <= 2 and all(map(_is_tree, obj["children"]))


def test_recursive_schema_compiles_and_holds(oai):
    """A schema that refers to itself (`$ref: "#"`) is served: llguidance compiles recursion
    (docs/api.md); the answer is a tree of the schema, however deep the model goes."""
    r = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, messages=[{
            "role": "user", "content": "A family tree: Ann, whose children are Bob and Cy."}],
        response_format={"type": "json_schema", "json_schema": {"name": "tree",
                                                                 "schema": TREE}})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert _is_tree(json.loads(text)), text
    else:  # cut by max_tokens inside a deep tree: a prefix of one
        assert text.startswith('{"name":"'), text
