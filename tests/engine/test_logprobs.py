"""Log probabilities of committed tokens: the verifier's own, the same with or without drafts."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, SamplingParams
from nodes.engine.errors import BadRequestError
from tests.engine.conftest import ScriptedDrafter, hf_greedy

N = 24
TOP = 5


def run(engine, prompt_ids, params):
    tokens, lp, ids, top = [], [], [], []
    for block in engine.stream(prompt_ids, params):
        tokens += block.token_ids
        assert block.logprobs is not None and len(block.logprobs) == len(block.token_ids)
        lp.append(block.logprobs.logprobs)
        ids.append(block.logprobs.top_ids)
        top.append(block.logprobs.top_logprobs)
    return tokens, np.concatenate(lp), np.concatenate(ids), np.concatenate(top)


def reference(backend, prompt_ids, tokens):
    """log-softmax of one plain HF forward over prompt + output."""
    import torch

    with torch.no_grad():
        logits = backend.model(torch.tensor([prompt_ids + tokens])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return logp.numpy()


@pytest.mark.parametrize("how", ["plain", "ngram", "perfect_drafts"])
def test_logprobs_are_the_verifiers_whatever_was_drafted(tiny_torch, prompt_ids, how):
    eos = tiny_torch.tokenizer.eos_token_ids
    reference_ids = hf_greedy(tiny_torch, prompt_ids, N, min(eos))
    drafter = {"plain": None, "ngram": NgramDrafter(),
               "perfect_drafts": ScriptedDrafter(prompt_ids + reference_ids, "perfect",
                                                 tiny_torch.vocab_size)}[how]
    params = GenerationParams(max_tokens=N, logprobs=TOP, eos_token_ids=frozenset())
    tokens, lp, ids, top = run(Engine(tiny_torch, drafter, fixed_k=4 if drafter else None),
                               prompt_ids, params)
    assert tokens == reference_ids[: len(tokens)] and len(tokens) == N
    ref = reference(tiny_torch, prompt_ids, tokens)
    np.testing.assert_allclose(lp, ref[np.arange(N), tokens], atol=2e-4)
    want = np.argsort(-ref, axis=1, kind="stable")[:, :TOP]
    np.testing.assert_allclose(top, np.take_along_axis(ref, want, 1), atol=2e-4)
    assert (ids[:, 0] == np.asarray(tokens)).all()  # greedy: the token is the most likely
    assert (np.diff(top, axis=1) <= 0).all()  # most likely first


def test_sampled_tokens_get_their_own_logprob(tiny_torch, prompt_ids):
    params = GenerationParams(max_tokens=12, logprobs=0, eos_token_ids=frozenset(),
                              sampling=SamplingParams(temperature=1.5, seed=3))
    tokens, lp, ids, top = run(Engine(tiny_torch, NgramDrafter()), prompt_ids, params)
    ref = reference(tiny_torch, prompt_ids, tokens)
    np.testing.assert_allclose(lp, ref[np.arange(len(tokens)), tokens], atol=2e-4)
    assert ids.shape == (len(tokens), 0) and top.shape == (len(tokens), 0)


def test_no_logprobs_unless_asked_and_bounds_checked(tiny_torch, prompt_ids):
    blocks = list(Engine(tiny_torch).stream(prompt_ids, GenerationParams(max_tokens=3)))
    assert all(b.logprobs is None for b in blocks)
    with pytest.raises(BadRequestError, match="logprobs"):
        list(Engine(tiny_torch).stream(prompt_ids, GenerationParams(max_tokens=3, logprobs=21)))
