"""Integration: the real embedded SmolLM2-135M, speculative output == the model alone."""

from __future__ import annotations

import pytest

from nodes.engine import Engine, GenerationParams
from tests.engine.conftest import hf_greedy, stream_checked

pytestmark = pytest.mark.slow

N = 40
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n"
)
PROMPT = "Rename the function mean to average and return the code:\n\n" + CODE


@pytest.fixture(scope="module")
def smol_torch(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(smollm2_folder), device="cpu")


@pytest.fixture(scope="module")
def smol_prompt(smol_torch):
    ids = smol_torch.tokenizer.encode(PROMPT, chat=True)
    assert ids[:3] != smol_torch.tokenizer.encode(PROMPT, chat=False)[:3]  # template applied
    return ids


@pytest.fixture(scope="module")
def hf_reference(smol_torch, smol_prompt):
    return hf_greedy(smol_torch, smol_prompt, N, eos_id=smol_torch.tokenizer.hf.eos_token_id)


@pytest.mark.parametrize("drafter_name", ["ngram", "int8"])
def test_smollm2_torch_matches_hf(smol_torch, smol_prompt, hf_reference, drafter_name):
    from nodes.drafters.registry import make_drafter

    engine = Engine(smol_torch, make_drafter(drafter_name, smol_torch))
    out, stats = stream_checked(engine, smol_prompt, GenerationParams(max_tokens=N))
    assert out == hf_reference
    assert stats.drafted > 0 and stats.accepted > 0  # speculation happened and helped


def test_smollm2_mlx_matches_mlx_lm(smollm2_folder):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.drafters.ngram import NgramDrafter

    backend = MlxBackend.load(str(smollm2_folder))
    ids = backend.tokenizer.encode(PROMPT, chat=True)
    eos = backend.tokenizer.hf.eos_token_id
    expected = []
    for tok, _ in generate_step(mx.array(ids), backend.model, max_tokens=32):
        expected.append(int(tok))
        if tok == eos:
            break
    gen = Engine(backend, NgramDrafter()).generate(ids, GenerationParams(max_tokens=32))
    assert gen.token_ids == expected
    assert gen.stats.accepted > 0


@pytest.mark.parametrize("drafter_name", ["ngram", "int8"])
def test_smollm2_trees_match_hf(smol_torch, smol_prompt, hf_reference, drafter_name):
    """Pinned node budget, so branching trees are really verified (not left to the cost model)."""
    from nodes.drafters.ngram import NgramDrafter
    from nodes.drafters.registry import make_drafter

    if drafter_name == "ngram":
        drafter = NgramDrafter(branches=4)
    else:  # trees asked for: the weight-only int8 drafter's own default is chains
        from nodes.drafters.int8 import Int8Drafter
        from nodes.drafters.model import TREE_WIDTH

        drafter = Int8Drafter(make_drafter("int8", smol_torch).backend, name="int8",
                              tree_width=TREE_WIDTH)
    engine = Engine(smol_torch, drafter, fixed_k=8)
    out, stats = stream_checked(engine, smol_prompt, GenerationParams(max_tokens=N))
    assert out == hf_reference
    assert stats.tree_blocks > 0 and stats.accepted > 0


def test_smollm2_tree_logits_equal_chain(smol_torch, smol_prompt):
    """A 16-node tree in one forward: along every path, the chain forward's logits."""
    import numpy as np

    from tests.engine.test_engine_tree import path_to, random_tree

    b = smol_torch
    tree = random_tree(np.random.default_rng(0), smol_prompt[-1], 15, 2000)
    cache = b.new_cache()
    b.forward(cache, smol_prompt[:-1])
    got = b.forward_tree(cache, tree.tokens, tree.parents)
    worst = 0.0
    for leaf in range(len(tree)):
        nodes = [0, *path_to(tree, leaf)]
        ref = b.new_cache()
        b.forward(ref, smol_prompt[:-1])
        chain = b.forward(ref, [tree.tokens[i] for i in nodes])
        worst = max(worst, float(np.abs(got[nodes] - chain).max()))
        assert (got[nodes].argmax(-1) == chain.argmax(-1)).all()
    assert worst < 1e-3, worst
