"""One path for generation parameters (issue 44, item 3): checked once where they enter, the
limit declared once, the seed drawn in one place, one type from the HTTP edge to the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

import codec.declare as declare
from codec.errors import BadRequest
from codec.sampling import SamplingParams
from codec.structs import GenerateReq


@pytest.fixture()
def range_checks(monkeypatch):
    """How many times SamplingParams' range checks really run."""
    runs = []
    real = declare._run_checks

    def counted(obj, *a, **k):
        if isinstance(obj, SamplingParams):
            runs.append(obj)
        return real(obj, *a, **k)

    monkeypatch.setattr(declare, "_run_checks", counted)
    return runs


def test_http_to_engine_checks_the_settings_once_per_edge(range_checks):
    from nodes.gateway.openai_schema import parse_request
    from nodes.node_common import requests

    api = parse_request("completion", {"model": "m", "prompt": "hi", "max_tokens": 8,
                                       "temperature": 1, "top_k": 5, "presence_penalty": 0.5})
    assert len(range_checks) == 1  # the HTTP edge
    assert type(api.sampling.temperature) is float  # as the wire sends it, no second record
    req = GenerateReq(prompt=api.prompt, chat=False, max_tokens=api.max_tokens,
                      sampling=api.sampling)
    assert req.sampling is api.sampling and len(range_checks) == 1  # built: not again
    got = requests.admit_generate(req.to_message(), 49152, 8192)
    assert len(range_checks) == 2  # the wire edge (another process in a cluster)
    params = requests.generation_params(got).seeded()  # unseeded: a seed drawn here
    assert params.sampling.seed is not None
    params.validate()  # Engine.start's
    assert len(range_checks) == 2
    # one type from the edge to the engine
    assert type(api.sampling) is type(got.sampling) is type(params.sampling) is SamplingParams


def test_a_checked_record_is_not_checked_again_but_a_replaced_one_is(range_checks):
    sp = SamplingParams(temperature=0.5, top_k=3)
    sp.check()
    sp.check()
    assert len(range_checks) == 1
    bad = replace(sp, top_k=-1)
    with pytest.raises(BadRequest) as err:
        bad.check()
    assert err.value.field == "top_k"
    with pytest.raises(BadRequest):  # a failed check is not remembered as passed
        bad.check()


def test_the_seed_is_drawn_in_one_place_and_kept():
    from nodes.engine.state import GenerationParams
    from nodes.gateway.openai_schema import parse_request

    assert SamplingParams().seeded().seed is None  # greedy: none drawn
    seeded = SamplingParams(temperature=1.0, seed=7)
    assert seeded.seeded() is seeded
    drawn = SamplingParams(temperature=1.0).seeded()
    assert 0 <= drawn.seed < 2**63
    params = GenerationParams(sampling=drawn)
    assert params.seeded() is params  # the engine keeps the gateway's (or verifier's) seed
    api = parse_request("chat", {"model": "m", "n": 2, "temperature": 1.0,
                                 "messages": [{"role": "user", "content": "hi"}]})
    assert api.sampling.seed is not None  # the n choices' base seed
    assert api.choice(0).sampling.seed == api.sampling.seed


def test_the_generation_limit_is_declared_once():
    from codec import structs
    from nodes.gateway import openai_schema
    from nodes.node_common import requests
    from nodes.verifier import role

    assert openai_schema.MAX_TOKENS_LIMIT is requests.MAX_TOKENS_LIMIT \
        is role.MAX_TOKENS_LIMIT is structs.MAX_TOKENS_LIMIT == 4096
