"""MLX backend: speculative greedy output equals mlx_lm's own greedy generation."""

from __future__ import annotations

import mlx.core as mx
import pytest

from nodes.engine import Engine, GenerationParams
from tests.engine.conftest import stream_checked

N = 24
NO_EOS = frozenset({49151})


def mlx_greedy(backend, prompt_ids, max_new, eos_id=None):
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt_ids), backend.model, max_tokens=max_new):
        out.append(int(tok))
        if tok == eos_id:
            break
    return out


@pytest.fixture(scope="module")
def mlx_reference(tiny_mlx, prompt_ids):
    return mlx_greedy(tiny_mlx, prompt_ids, N + 12)


def test_mlx_reference_is_not_degenerate(mlx_reference):
    assert len(set(mlx_reference)) > 5


@pytest.mark.parametrize("mode", ["perfect", "wrong", "random", "empty", "long"])
@pytest.mark.parametrize("k", [3, 8])
def test_mlx_greedy_matches_mlx_lm(tiny_mlx, prompt_ids, mlx_reference, scripted, mode, k):
    engine = Engine(tiny_mlx, scripted(prompt_ids + mlx_reference, mode, 49152), fixed_k=k)
    params = GenerationParams(max_tokens=N, eos_token_ids=NO_EOS)
    out, _ = stream_checked(engine, prompt_ids, params)
    assert out == mlx_reference[:N]


def test_mlx_eos_inside_draft(tiny_mlx, prompt_ids, mlx_reference, scripted):
    eos = mlx_reference[5]
    expected = mlx_greedy(tiny_mlx, prompt_ids, N, eos_id=eos)
    engine = Engine(tiny_mlx, scripted(prompt_ids + mlx_reference, "perfect", 49152), fixed_k=8)
    gen = engine.generate(
        prompt_ids, GenerationParams(max_tokens=N, eos_token_ids=frozenset({eos}))
    )
    assert gen.token_ids == expected and gen.finish_reason == "eos"


def test_mlx_ngram_and_model_drafter(tiny_mlx, prompt_ids, mlx_reference):
    from nodes.drafters.model import ModelDrafter
    from nodes.drafters.ngram import NgramDrafter

    for drafter in (NgramDrafter(), ModelDrafter(tiny_mlx)):
        gen = Engine(tiny_mlx, drafter).generate(
            prompt_ids, GenerationParams(max_tokens=N, eos_token_ids=NO_EOS)
        )
        assert gen.token_ids == mlx_reference[:N], drafter.name


def test_mlx_and_torch_share_tokenizer_fingerprint(tiny_mlx, tiny_torch):
    assert tiny_mlx.fingerprint == tiny_torch.fingerprint
