"""A resumed generation (`generate_req.resumed`: a failover) starts its grammar matcher, and
its presence / frequency counts, after the tokens it had already generated: in process, every
cut point of a constrained run resumed on a fresh sequence gives exactly the rest of the
uninterrupted run (greedy, speculative, seeded sampling; penalties counted), where a resume that
forgets them starts a second JSON object. The wire field's bounds, and a replay the grammar
refuses, are 400s naming `resumed`. (Through real processes, with a proposer and a verifier
SIGKILLed: tests/nodes/test_constrained_failover.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from codec.errors import BadRequest
from codec.messages import decode, encode
from codec.sampling import SamplingParams
from codec.structs import GenerateReq
from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from nodes.engine.grammar import Constraint
from nodes.node_common.requests import generation_params

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}
JSON = Constraint.json_schema(SCHEMA)


def check(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "kind"} and obj["kind"] in ("cat", "dog", "bird")
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and len(obj["name"]) <= 6


# ---- the wire field ----------------------------------------------------------------------------
def test_resumed_is_bounded_checked_against_tokens_and_absent_by_default():
    toks = np.array([5, 6, 7, 8], np.int32)
    req = GenerateReq(tokens=toks, resumed=3, grammar=JSON.to_wire())
    back = GenerateReq.from_message(decode(encode(req.to_message(sender="n", seq=1, rid=2))))
    assert back.resumed == 3 and generation_params(back).resumed == 3
    plain = GenerateReq(tokens=toks).to_message()
    assert "resumed" not in plain.fields  # requests that resume nothing are the bytes they were
    assert generation_params(GenerateReq.from_message(plain)).resumed == 0
    assert GenerateReq(tokens=toks, resumed=0).resumed == 0
    for bad in (dict(tokens=toks, resumed=4),  # no prompt left
                dict(tokens=toks, resumed=-1), dict(tokens=toks, resumed=1.5),
                dict(tokens=toks, resumed=True), dict(prompt="hi", resumed=2),
                dict(messages=({"role": "user", "content": "hi"},), resumed=1)):
        with pytest.raises(BadRequest) as err:
            GenerateReq(**bad)
        assert err.value.field == "resumed", bad


# ---- the engine ----------------------------------------------------------------------------------
def _params(n: int, resumed: int = 0, *, c: Constraint | None = JSON,
            sampling: SamplingParams | None = None) -> GenerationParams:
    return GenerationParams(max_tokens=n, sampling=sampling or SamplingParams(),
                            constraint=c, resumed=resumed)


@pytest.fixture(scope="module")
def plain(tiny_torch):
    return Engine(tiny_torch, grammar_drafts=False)


def test_every_cut_of_a_constrained_run_resumes_to_its_rest(tiny_torch, prompt_ids, plain):
    n = 60
    ref = plain.generate(prompt_ids, _params(n))
    assert ref.finish_reason == "eos"
    out = ref.token_ids
    check(tiny_torch.tokenizer.decode(out[:-1]))
    spec = Engine(tiny_torch, NgramDrafter())  # grammar drafts + ngram: speculative resume
    for k in range(1, len(out) - 1):
        prompt = [*prompt_ids, *out[:k]]
        for engine in (plain, spec):
            got = engine.generate(prompt, _params(n - k, k))
            assert got.token_ids == out[k:], (k, engine is spec)
            assert got.finish_reason == "eos"
    # forgetting what was generated (today's resume without the field) starts a new object
    k = len(out) // 2
    forgot = plain.generate([*prompt_ids, *out[:k]], _params(n - k, 0))
    assert forgot.token_ids != out[k:]
    assert tiny_torch.tokenizer.decode(forgot.token_ids).startswith("{")


def test_seeded_constrained_sampling_resumes_to_its_rest(tiny_torch, prompt_ids, plain):
    """The sampling noise is keyed by the seed and the absolute position: a seeded
    constrained draw (penalties on) resumes to the same tokens."""
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3, presence_penalty=1.5,
                        frequency_penalty=0.8)
    n = 60
    ref = plain.generate(prompt_ids, _params(n, sampling=sp)).token_ids
    check(tiny_torch.tokenizer.decode(ref[:-1]))
    for k in (1, len(ref) // 3, len(ref) // 2, len(ref) - 2):
        got = plain.generate([*prompt_ids, *ref[:k]], _params(n - k, k, sampling=sp))
        assert got.token_ids == ref[k:], k


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(smollm2_folder), device="cpu")


def test_penalty_counts_include_the_resumed_tokens(smollm2):
    """Presence / frequency penalties count the generated tokens: a resume counts the ones
    it was given as generated (the real SmolLM2 repeats itself, so the counts decide its
    text; the tiny random model's logits are too peaked for them to matter)."""
    engine = Engine(smollm2, grammar_drafts=False)
    prompt = smollm2.tokenizer.encode("List the days of the week, one per line.", chat=True)
    sp = SamplingParams(presence_penalty=1.5, frequency_penalty=1.0)
    n = 32
    ref = engine.generate(prompt, _params(n, c=None, sampling=sp)).token_ids
    unpenalised = engine.generate(prompt, _params(n, c=None)).token_ids
    assert ref != unpenalised  # the penalties shape this text
    for k in (8, 16, 24):
        got = engine.generate([*prompt, *ref[:k]], _params(n - k, k, c=None, sampling=sp))
        assert got.token_ids == ref[k:], k
    # counted as prompt instead (before `resumed`), the text goes another way
    k = 16
    forgot = engine.generate([*prompt, *ref[:k]], _params(n - k, 0, c=None, sampling=sp))
    assert forgot.token_ids != ref[k:]


def test_a_replay_the_grammar_refuses_is_a_400_naming_resumed(tiny_torch, prompt_ids, plain):
    tok = tiny_torch.tokenizer
    bad = tok.hf.encode('{"nome":')
    with pytest.raises(BadRequestError, match="does not match the grammar") as err:
        plain.start([*prompt_ids, *bad], _params(20, len(bad)))
    assert err.value.field == "resumed"
    with pytest.raises(BadRequestError) as err:
        plain.start(prompt_ids, _params(20, len(prompt_ids)))  # nothing left of the prompt
    assert err.value.field == "resumed"
    good = tok.hf.encode('{"name":"Al')
    seq = plain.start([*prompt_ids, *good], _params(20, len(good)))
    assert seq.grammar.consumed == 0 and seq.grammar.valid_prefix(tok.hf.encode('"')) == 1
