"""The gateway's parse of the sampling controls (issue 47, item 1): each accepted on chat and
completions as the wire's `SamplingParams`, neutral values left off the wire, bad values a 400
naming the field; and the `generate_req` they become keeps old requests' bytes."""

from __future__ import annotations

import pytest

from codec.messages import encode
from codec.sampling import SamplingParams
from codec.structs import GenerateReq
from nodes.gateway.openai_schema import ApiError, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("base", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_each_control_is_accepted(base):
    kind = "chat" if "messages" in base else "completion"
    cases = {
        "top_k": (5, dict(top_k=5)),
        "min_p": (0.1, dict(min_p=0.1)),
        "repetition_penalty": (1.3, dict(repetition_penalty=1.3)),
        "presence_penalty": (-0.5, dict(presence_penalty=-0.5)),
        "frequency_penalty": (1.5, dict(frequency_penalty=1.5)),
        "logit_bias": ({"50": -100, "7": 2.5}, dict(logit_bias=((7, 2.5), (50, -100.0)))),
    }
    for key, (value, want) in cases.items():
        sp = parse_request(kind, {**base, key: value}).sampling
        for field, v in want.items():
            assert getattr(sp, field) == v, key


def test_neutral_values_stay_off_the_wire():
    body = {**COMPLETION, "top_k": 0, "min_p": 0, "repetition_penalty": 1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    sp = parse_request("completion", body).sampling
    assert sp == parse_request("completion", COMPLETION).sampling
    assert not sp.adjusts_logits
    plain = GenerateReq(prompt="hi", sampling=SamplingParams(1.0))
    same = GenerateReq(prompt="hi", sampling=sp)
    assert encode(same.to_message(rid=1)) == encode(plain.to_message(rid=1))


def test_top_k_minus_one_is_off():
    assert parse_request("completion", {**COMPLETION, "top_k": -1}).sampling.top_k == 0


def test_controls_travel_and_come_back():
    body = {**CHAT, "top_k": 3, "min_p": 0.2, "repetition_penalty": 1.1,
            "presence_penalty": 0.3, "frequency_penalty": 0.4, "logit_bias": {"9": 1}}
    sp = parse_request("chat", body).sampling
    req = GenerateReq(prompt="x", sampling=sp)
    from codec.messages import decode

    back = GenerateReq.from_message(decode(encode(req.to_message(rid=1))))
    assert back.sampling == sp


@pytest.mark.parametrize("key, value, code", [
    ("top_k", 1 << 30, "invalid_value"),
    ("top_k", "5", "invalid_type"),
    ("min_p", 1.5, "invalid_value"),
    ("repetition_penalty", 0, "invalid_value"),
    ("repetition_penalty", 11, "invalid_value"),
    ("presence_penalty", 2.5, "invalid_value"),
    ("frequency_penalty", -3, "invalid_value"),
    ("frequency_penalty", 10**400, "invalid_value"),
    ("logit_bias", {"abc": 1}, "invalid_value"),
    ("logit_bias", {"5": 101}, "invalid_value"),
    ("logit_bias", {"5": "x"}, "invalid_value"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "invalid_value"),
    ("logit_bias", [1, 2], "invalid_type"),
])
def test_bad_controls_are_a_400_naming_them(key, value, code):
    with pytest.raises(ApiError) as info:
        parse_request("chat", {**CHAT, key: value})
    assert info.value.status == 400 and info.value.param == key
    assert info.value.code == code, info.value.message


def test_the_verifier_refuses_bias_outside_its_vocabulary():
    from nodes.engine.errors import BadRequestError
    from nodes.node_common.requests import admit_generate

    sp = SamplingParams(logit_bias=((100, 1.0),))
    msg = GenerateReq(prompt="x", sampling=sp).to_message(rid=1)
    admit_generate(msg, 101, 0)
    with pytest.raises(BadRequestError) as info:
        admit_generate(msg, 100, 0)
    assert info.value.field == "logit_bias" and "vocabulary" in str(info.value)


# ---- n (issue 47, item 2) ---------------------------------------------------------------------
def test_n_up_to_the_maximum_and_seeds_per_choice():
    from nodes.gateway.openai_schema import MAX_N, choice_seed

    api = parse_request("chat", {**CHAT, "n": 3, "temperature": 0.8, "seed": 7})
    assert api.n == 3
    seeds = [api.choice(i).sampling.seed for i in range(3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and seeds == [choice_seed(7, i)
                                                               for i in range(3)]
    assert all(api.choice(i).n == 1 for i in range(3))
    greedy = parse_request("completion", {**COMPLETION, "n": 3, "temperature": 0})
    assert {greedy.choice(i).sampling for i in range(3)} == {greedy.sampling}
    unseeded = parse_request("completion", {**COMPLETION, "n": 2})
    assert unseeded.sampling.seed is not None  # one base seed for the choices
    for bad_n, code in [(0, "invalid_value"), (MAX_N + 1, "invalid_value"),
                        ("2", "invalid_type")]:
        with pytest.raises(ApiError) as info:
            parse_request("chat", {**CHAT, "n": bad_n})
        assert info.value.param == "n" and info.value.code == code
