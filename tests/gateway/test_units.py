"""Fast units of the gateway: request validation, stop-safe text, verifier choice, metrics."""

from __future__ import annotations

import pytest

from discovery.cards import Card
from discovery.table import Member, State
from nodes.cluster_client.choice import Balancer, NoCapacity, VerifierInfo, verifiers_of
from nodes.cluster_client.text import TextAssembler
from nodes.gateway.metrics import GatewayMetrics
from nodes.gateway.openai_schema import ApiError, parse_json, parse_request


# -- request parsing ----------------------------------------------------------------------------
def test_chat_request_is_typed():
    r = parse_request("chat", {
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "logprobs": False, "user": "u"})
    assert r.kind == "chat" and r.max_tokens == 7 and r.stop == ("x",)
    assert r.messages == ({"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"})
    assert r.stream and r.include_usage and r.sampling.temperature == 0.0


def test_sampling_is_the_wires_own_type_with_its_one_check():
    from codec.sampling import SamplingParams

    r = parse_request("completion", {"model": "m", "prompt": "a", "top_p": 0.5, "seed": 3})
    assert r.sampling == SamplingParams(1.0, 0.5, 0, 3)  # OpenAI's default temperature: 1
    with pytest.raises(ApiError) as exc:
        parse_request("completion", {"model": "m", "prompt": "a", "top_p": 1.5})
    assert exc.value.code == "invalid_value" and "(0, 1]" in exc.value.message


def test_completion_prompt_forms():
    assert parse_request("completion", {"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_request("completion", {"model": "m", "prompt": ["hi"]}).prompt == "hi"
    r = parse_request("completion", {"model": "m", "prompt": [1, 2, 3]})
    assert r.prompt_ids == (1, 2, 3) and r.max_tokens == 16


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ("completion", {"model": "m", "prompt": "a", "echo": True}, "echo"),
    ("completion", {"model": "m", "prompt": "a", "seed": -1}, "seed"),
    ("completion", {"model": "m", "prompt": "a", "top_p": 0}, "top_p"),
    ("completion", {"model": "m", "prompt": "a", "stop": ["a"] * 5}, "stop"),
    ("completion", {"model": "m", "prompt": "a", "stop": [""]}, "stop"),
    ("completion", {"model": "m", "prompt": "a", "max_tokens": True}, "max_tokens"),
    ("completion", {"model": "m", "prompt": "a", "temperature": float("nan")}, "temperature"),
    ("completion", {"model": "m", "prompt": "a", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
              "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a",
                                          "tool_calls": []}]}, "messages[0].tool_calls"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
              "response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
              "specbus": {"turbo": True}}, "specbus.turbo"),
])
def test_refused_with_the_parameter_named(kind, body, param):
    with pytest.raises(ApiError) as exc:
        parse_request(kind, body)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.body()["error"]["param"] == param


def test_bad_json_is_typed():
    for raw in (b"{", b"\xff", b"3", b'"x"'):
        with pytest.raises(ApiError) as exc:
            parse_json(raw)
        assert exc.value.code == "invalid_json"


# -- text assembly -----------------------------------------------------------------------------
def feed(asm: TextAssembler, pieces: list[str]) -> str:
    text, out = "", ""
    for p in pieces:
        text += p
        out += asm.update(text)
    return out


def test_stop_string_across_chunks_is_never_emitted():
    asm = TextAssembler(("\n\n",))
    out = feed(asm, ["Hello", "\n", "\nWorld"])
    assert out == "Hello" and asm.stopped and asm.text == "Hello"


def test_partial_stop_is_released_when_it_does_not_complete():
    asm = TextAssembler(("STOP",))
    assert feed(asm, ["a ST", "ART"]) == "a START" and not asm.stopped
    asm = TextAssembler(("STOP",))
    assert asm.update("a ST") == "a "
    assert asm.update("a START") == "START"
    assert asm.finish() == ""


def test_half_character_waits_for_the_rest():
    asm = TextAssembler()
    assert asm.update("caf\ufffd") == "caf"
    assert asm.update("café") == "é"


def test_finish_uses_the_final_text_and_cuts_at_stop():
    asm = TextAssembler(("END",))
    assert asm.update("abc E") == "abc "
    assert asm.finish("abc ENDxyz") == "" and asm.text == "abc " and asm.stopped
    asm = TextAssembler()
    asm.update("abc")
    assert asm.finish("abcdef") == "def"


# -- balancer ----------------------------------------------------------------------------------
def info(node_id: str, tok_s: float = 10.0) -> VerifierInfo:
    return VerifierInfo(node_id, node_id, f"tcp://127.0.0.1:{1000 + len(node_id)}", "m", "fp",
                        tok_s)


def test_least_loaded_with_room_then_429():
    b = Balancer(max_inflight=2)
    a, c = info("a"), info("c")
    b.report("a", active=1, queued=0)  # another client keeps `a` busy
    assert b.pick([a, c]).node_id == "c"
    b.acquire(c)
    assert b.pick([a, c]).node_id in ("a", "c")
    for v in (a, a, c):
        b.acquire(v)
    with pytest.raises(NoCapacity):
        b.pick([a, c])
    b.release(a)
    assert b.pick([a, c]).node_id == "a"
    with pytest.raises(LookupError):
        b.pick([a, c], exclude={"a", "c"})


def member(node_id, roles, state=State.ALIVE, model="m", observer=False):
    card = Card(node_id=node_id, cluster="c", incarnation=1, version=1, roles=roles,
                endpoints={"gossip": "tcp://127.0.0.1:1", "stream": "tcp://127.0.0.1:2"},
                model=model, observer=observer)
    return Member(card=card, state=state, last_heard=0.0, since=0.0)


def test_only_alive_verifiers_with_a_model_count():
    found = verifiers_of([member("v", ("verifier",)), member("p", ("proposer",)),
                          member("d", ("verifier",), State.DEAD), member("s", ("verifier",),
                                                                       State.SUSPECT),
                          member("g", ("gateway", "verifier")), member("x", ("verifier",),
                                                                       model="")])
    assert [v.node_id for v in found] == ["v", "g"]


def test_a_model_with_no_alive_verifier_is_served_by_its_suspect_ones():
    # heartbeats late (a gossip flood, a loaded box): a suspect is tried, not refused; a
    # model with an alive verifier keeps to it; dead and departed ones never count
    found = verifiers_of([member("a", ("verifier",), State.SUSPECT, model="m1"),
                          member("b", ("verifier",), State.ALIVE, model="m1"),
                          member("c", ("verifier",), State.SUSPECT, model="m2"),
                          member("d", ("verifier",), State.DEAD, model="m3"),
                          member("e", ("verifier",), State.LEFT, model="m3")])
    assert [v.node_id for v in found] == ["b", "c"]


# -- metrics -----------------------------------------------------------------------------------
def test_prometheus_text_has_the_figures():
    from prometheus_client.parser import text_string_to_metric_families

    m = GatewayMetrics()
    m.count_request("/v1/completions", 200)
    m.count_done("v1", 5, 10, {"drafted": 8, "accepted": 6,
                               "proposers": {"p1": {"drafted": 8, "accepted": 6, "name": "ng"}}})
    m.on_stats("v1", {"verifier": {"active": 1, "queued": 2, "generations": 3, "steps": 4,
                                   "stepped": 10, "rows": 25, "committed": 15}})
    m.on_stats("p1", {"proposer": {"draft_tokens": 40, "drafts_served": 9}})
    text = m.render([info("v1")], {"v1": 1}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(metric, **labels):
        return samples[(metric, tuple(sorted(labels.items())))]

    v1 = {"verifier": "v1", "name": "v1", "model": "m"}
    assert value("specbus_gateway_requests_total", endpoint="/v1/completions",
                 status="200") == 1
    assert value("specbus_gateway_tokens_total", kind="completion") == 10
    assert value("specbus_gateway_acceptance") == 0.75
    assert value("specbus_verifier_queued", **v1) == 2
    assert value("specbus_verifier_gateway_inflight", **v1) == 1
    assert value("specbus_verifier_stepped", **v1) == 10  # batching (issue 24)
    assert value("specbus_verifier_rows", **v1) == 25
    assert value("specbus_verifier_committed", **v1) == 15
    assert value("specbus_verifier_batch_mean", **v1) == 2.5
    assert value("specbus_verifier_rows_per_forward", **v1) == 6.25
    assert value("specbus_verifier_tokens_per_forward_per_sequence", **v1) == 1.5
    assert value("specbus_proposer_accepted_total", proposer="p1", name="ng") == 6
    assert value("specbus_proposer_telemetry", proposer="p1", figure="draft_tokens") == 40


def test_prometheus_labels_are_escaped():
    from prometheus_client.parser import text_string_to_metric_families

    m = GatewayMetrics()
    m.count_done("v1", 1, 1, {"proposers": {"p1": {"drafted": 1, "name": 'a"b\nc\\'}}})
    fams = list(text_string_to_metric_families(m.render([], {}).decode()))
    names = {s.labels.get("name") for f in fams for s in f.samples if "proposer" in s.labels}
    assert names == {'a"b\nc\\'}


# -- the role's socket and flags ---------------------------------------------------------------
def test_http_address_parsing():
    from nodes.gateway.role import parse_http

    assert parse_http("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_http("localhost:0") == ("127.0.0.1", 0)
    assert parse_http("[::1]:9000") == ("::1", 9000)
    for bad in ("8000", "127.0.0.1", "127.0.0.1:99999", "example.com:80", ":80"):
        with pytest.raises(ValueError):
            parse_http(bad)


def test_role_binds_loopback_before_joining_and_a_taken_port_fails():
    from nodes.gateway.role import GatewayRole

    role = GatewayRole("127.0.0.1", 0)
    try:
        assert role.url.startswith("http://127.0.0.1:") and role.card_extras == {"http": role.url}
        port = int(role.url.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            GatewayRole("127.0.0.1", port)
    finally:
        role.close()


def test_http_flag_needs_the_gateway_role():
    import argparse

    from nodes.cmd_node import _make_gateway, add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--role", "verifier", "--http", "127.0.0.1:0"])
    with pytest.raises(ValueError, match="gateway role"):
        _make_gateway(args, config_from_args(args))
    args = parser.parse_args(["--role", "gateway", "--http", "127.0.0.1:0",
                              "--gateway-max-inflight", "0"])
    with pytest.raises(ValueError, match="max-inflight"):
        _make_gateway(args, config_from_args(args))


# -- hostile bodies (issue 21): a 400 naming the problem, never a 500 --------------------------
@pytest.mark.parametrize("raw, code", [
    (b'{"model": "m", "stop": ["\\ud800"]}', "invalid_unicode"),  # a lone surrogate
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\udfff"}]}',
     "invalid_unicode"),
    (b'{"\\ud800": 1}', "invalid_unicode"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # 100k deep
    (b'{"a":' * 40 + b"1" + b"}" * 40, "invalid_json"),  # deeper than any OpenAI body
    (b'{"model": "m", "prompt": "\xed\xa0\x80"}', "invalid_json"),  # a surrogate in UTF-8
    (b'{"seed": ' + b"9" * 5000 + b"}", "invalid_json"),  # past Python's digit limit
])
def test_hostile_bodies_are_400_with_a_code(raw, code):
    with pytest.raises(ApiError) as exc:
        parse_json(raw)
    assert exc.value.status == 400 and exc.value.code == code


@pytest.mark.parametrize("field", ["temperature", "top_p", "max_tokens", "seed"])
def test_a_400_digit_integer_is_a_400(field):
    body = parse_json(b'{"model": "m", "prompt": "x", "%s": %s}' % (field.encode(), b"9" * 400))
    with pytest.raises(ApiError) as exc:
        parse_request("completion", body)
    assert exc.value.status == 400 and exc.value.param == field
    assert len(exc.value.message) < 200  # the number is not echoed in full


def test_a_request_the_wire_refuses_takes_no_slot():
    """The lock of issue 21: a request failing while its `generate_req` is built must leave
    the verifier's slot free (8 such requests once locked the gateway into 429 for good)."""
    import asyncio

    from nodes.gateway.generation import Generation, Plan, StreamFailed

    class Node:  # the membership and client the generation reads; no socket is reached
        class membership:  # noqa: N801 - stands in for the membership object
            @staticmethod
            def members(include_self=True):
                return [member("v", ("verifier",))]

    api = parse_request("completion", {"model": "m", "prompt": "x"})
    api = type(api)(**{**api.__dict__, "stop": ("\ud800",)})  # what no wire can carry
    balancer = Balancer(1)
    gen = Generation(Node(), balancer, GatewayMetrics(), Plan(api, None), 15.0, None)

    async def first():
        return await anext(gen.events())

    for _ in range(4):
        with pytest.raises(StreamFailed) as exc:
            asyncio.run(first())
        assert exc.value.error.status == 400
    assert balancer.inflight == {}


def test_tables_keyed_by_peers_are_bounded():
    from nodes.gateway.metrics import MAX_TRACKED

    m = GatewayMetrics()
    for i in range(MAX_TRACKED * 4):
        m.on_stats(f"fake{i}", {"proposer": {"draft_tokens": 1}})
        m.count_done(f"v{i}", 1, 1, {"proposers": {f"p{i}": {"drafted": 1, "name": "x"}}})
    assert len(m.telemetry) == MAX_TRACKED and "fake0" not in m.telemetry
    assert len(m.per_verifier) == MAX_TRACKED and len(m.per_proposer) == MAX_TRACKED
    assert len(m.proposer_names) == MAX_TRACKED
    b = Balancer(8)
    for i in range(MAX_TRACKED * 4):
        b.report(f"fake{i}", 1, 1)
    assert len(b.reported) == MAX_TRACKED


# -- what a new user's tools send (issue 22) -----------------------------------------------------
def test_harmless_defaults_that_tools_send_are_accepted():
    api = parse_request("chat", {
        "model": "m", "parallel_tool_calls": False, "top_logprobs": 0, "service_tier": "auto",
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None},
                     {"role": "user", "content": "again"}]})
    assert [m["content"] for m in api.messages] == ["hi", "", "again"]
    for key, value in (("top_logprobs", 3), ("service_tier", "flex")):
        with pytest.raises(ApiError) as exc:
            parse_request("chat", {"model": "m", key: value,
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert exc.value.param == key
    with pytest.raises(ApiError):  # only an assistant turn may be empty
        parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": None}]})


def test_http_port_out_of_range_says_so():
    from nodes.gateway.role import parse_http

    with pytest.raises(ValueError, match="out of range"):
        parse_http("127.0.0.1:99999")
