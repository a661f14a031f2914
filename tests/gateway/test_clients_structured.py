"""Third-party clients against the real gateway and SmolLM2 verifiers (conftest's cluster):
LangChain (`bind_tools`, `with_structured_output` by function calling, JSON mode and JSON
schema), instructor (TOOLS and JSON modes), litellm (tools), and the official openai client's
`chat.completions.parse`, `tool_choice` auto / none and parallel calls.

Every answer must parse and validate against its schema or pydantic model: the grammar makes
even the 135M model's answers valid. (JSON mode, OpenAI's `json_object`, promises any JSON
object, not the schema: where a client's JSON mode asks for a schema the model is told it in
the prompt, and the test gives it a model whose fields are all optional-free strings.)

Each client skips cleanly where its package is missing (`make test` installs them: setup.cfg's
dev extra). No network beyond 127.0.0.1: litellm reads its bundled cost map, no telemetry.
"""

from __future__ import annotations

import json
import os

import pytest

from .conftest import MODEL

pytestmark = pytest.mark.slow
# litellm reads these when it is imported: its bundled cost map (no fetch), no telemetry
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

pydantic = pytest.importorskip("pydantic")
BaseModel, Field = pydantic.BaseModel, pydantic.Field


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=30, description="the city")


class GetTime(BaseModel):
    """Current local time in a city."""

    city: str = Field(max_length=30, description="the city")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


def _tool(model: type[BaseModel], name: str) -> dict:
    schema = model.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    schema["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": model.__doc__,
                                             "parameters": schema}}


WEATHER, TIME = _tool(GetWeather, "get_weather"), _tool(GetTime, "get_time")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ALICE = "Alice is 31 years old. Extract the person."
_VALIDATORS = {"get_weather": GetWeather, "get_time": GetTime, "GetWeather": GetWeather,
               "Person": Person}


def _valid_call(name: str, arguments: str | dict) -> BaseModel:
    """A tool call's arguments validated against its tool's pydantic model."""
    model = _VALIDATORS[name]
    if isinstance(arguments, str):
        return model.model_validate_json(arguments)
    return model.model_validate(arguments)


# -- the openai client ---------------------------------------------------------------------------
def test_openai_parse_pydantic(oai):
    r = oai.chat.completions.parse(model=MODEL, temperature=0, max_tokens=60,
                                   messages=[{"role": "user", "content": ALICE}],
                                   response_format=Person)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Person), msg
    assert Person.model_validate_json(msg.content) == msg.parsed


def test_openai_tool_choice_auto_and_none(oai):
    auto = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, messages=ASK,
                                       tools=[WEATHER, TIME], tool_choice="auto")
    choice = auto.choices[0]
    if choice.message.tool_calls:  # auto: calls (each valid) or text, the model's choice
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for c in choice.message.tool_calls:
            _valid_call(c.function.name, c.function.arguments)
    else:
        assert choice.message.content and not choice.message.content.startswith("<tool_call>")
    none = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, messages=ASK,
                                       tools=[WEATHER, TIME], tool_choice="none")
    assert not none.choices[0].message.tool_calls
    assert none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")


def test_openai_parallel_tool_calls(oai):
    r = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=True, messages=[{
            "role": "user", "content": "What is the weather in Paris, and what time is it in "
                                       "Tokyo? Call both tools."}])
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        _valid_call(c.function.name, c.function.arguments)
    print("parallel calls:", [(c.function.name, c.function.arguments) for c in calls])


# -- LangChain -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(gateway_url):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model=MODEL, base_url=gateway_url + "/v1", api_key="unused",
                         temperature=0, max_tokens=60, max_retries=0, timeout=180)


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools([GetWeather], tool_choice="any").invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls, msg
    for call in msg.tool_calls:
        assert call["name"] == "GetWeather" and call["id"]
        _valid_call(call["name"], call["args"])


def test_langchain_streamed_tool_calls(chat_model):
    """LangChain merges the streamed `tool_calls` deltas (name, then argument fragments) into
    the same calls as the plain answer."""
    bound = chat_model.bind_tools([GetWeather], tool_choice="any")
    ask = "What is the weather in Paris?"
    whole = bound.invoke(ask)
    merged = None
    for part in bound.stream(ask):
        merged = part if merged is None else merged + part
    assert merged.tool_calls and [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls]
    for call in merged.tool_calls:
        _valid_call(call["name"], call["args"])


def test_langchain_tool_result_round_trip(chat_model):
    """The history LangChain sends after a call (the AIMessage with its tool_calls, then a
    ToolMessage) is served; the next answer is text or valid calls."""
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat_model.bind_tools([GetWeather])
    ask = HumanMessage("What is the weather in Paris?")
    first = chat_model.bind_tools([GetWeather], tool_choice="any").invoke([ask])
    history = [ask, first, *(ToolMessage("18 C, sunny", tool_call_id=c["id"])
                             for c in first.tool_calls)]
    again = bound.invoke(history)
    for call in again.tool_calls:
        _valid_call(call["name"], call["args"])
    assert again.tool_calls or again.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat_model, method):
    out = chat_model.with_structured_output(Person, method=method).invoke(ALICE)
    assert isinstance(out, Person), out


def test_langchain_structured_output_json_mode(chat_model):
    """JSON mode constrains to a JSON object (OpenAI's json_object), not to the schema: the
    answer is parsed as JSON and must be an object."""
    out = chat_model.with_structured_output(method="json_mode").invoke(
        "Reply in JSON with the keys name and age: " + ALICE)
    assert isinstance(out, dict), out


# -- instructor ----------------------------------------------------------------------------------
def _instructor(gateway_url, mode: str):
    instructor = pytest.importorskip("instructor")
    import openai

    return instructor.from_openai(
        openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0,
                      timeout=180), mode=getattr(instructor.Mode, mode))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(gateway_url, mode):
    """TOOLS (instructor's default: a named tool) and JSON_SCHEMA (`response_format`
    json_schema): the grammar holds the model to the schema."""
    out = _instructor(gateway_url, mode).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": ALICE}])
    assert isinstance(out, Person), out


def test_instructor_json_mode(gateway_url):
    """JSON mode is OpenAI's `json_object`, the schema only in instructor's prompt: the answer
    is always one whole JSON object; whether it is the schema's is up to the model (the 135M
    model tends to write the schema back, which instructor then refuses)."""
    client = _instructor(gateway_url, "JSON")
    from instructor.core import InstructorRetryException

    try:
        out, completion = client.chat.completions.create_with_completion(
            model=MODEL, temperature=0, max_tokens=120, response_model=Person, max_retries=0,
            messages=[{"role": "user", "content": ALICE}])
    except InstructorRetryException as exc:
        completion = exc.last_completion
        print("instructor JSON mode refused the model's object:", exc)
    else:
        assert isinstance(out, Person)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


# -- litellm -------------------------------------------------------------------------------------
def test_litellm_tools(gateway_url, monkeypatch):
    import socket

    elsewhere: list = []  # any name or address litellm tries beyond loopback: refused, kept
    real = socket.getaddrinfo

    def loopback_only(host, *args, **kw):
        if host not in ("127.0.0.1", "localhost", "::1", None):
            elsewhere.append(host)
            raise socket.gaierror(f"test: no network beyond 127.0.0.1 ({host})")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    r = litellm.completion(model="openai/" + MODEL, api_base=gateway_url + "/v1",
                           api_key="unused", messages=ASK, tools=[WEATHER],
                           tool_choice="required", temperature=0, max_tokens=60, num_retries=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for c in choice.message.tool_calls:
        assert c.function.name == "get_weather"
        _valid_call(c.function.name, c.function.arguments)
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]
    assert not elsewhere, f"litellm reached for {elsewhere}"
