"""Greedy speculative decoding is token-for-token identical to HF generate(do_sample=False)."""

from __future__ import annotations

import pytest

from nodes.drafters.base import Drafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.core import Stats
from tests.engine.conftest import hf_greedy, stream_checked

N = 24




@pytest.fixture(scope="module")
def reference(tiny_torch, prompt_ids):
    """HF greedy continuation with an EOS id nobody produces (so it runs the full length)."""
    return hf_greedy(tiny_torch, prompt_ids, N + 12, eos_id=49151)


def test_reference_is_not_degenerate(reference):
    # a constant output would make drafts trivially right; the test model must vary
    assert len(set(reference)) > 5


@pytest.mark.parametrize("mode", ["perfect", "wrong", "random", "empty", "long"])
@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_greedy_matches_hf(tiny_torch, prompt_ids, reference, scripted, mode, k):
    drafter = scripted(prompt_ids + reference, mode, tiny_torch.vocab_size, seed=k or 0)
    engine = Engine(tiny_torch, drafter, fixed_k=k)
    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({49151}))
    assert stream_checked(engine, prompt_ids, params)[0] == reference[:N]


def test_perfect_drafts_are_all_accepted(tiny_torch, prompt_ids, reference, scripted):
    engine = Engine(tiny_torch, scripted(prompt_ids + reference, "perfect", 49152), fixed_k=7)
    stats = Stats()
    blocks = list(
        engine.stream(
            prompt_ids,
            GenerationParams(max_tokens=N, eos_token_ids=frozenset({49151})),
            stats=stats,
        )
    )
    assert stats.acceptance == 1.0
    # prefill block + ceil((N-1)/8) blocks of 8 committed tokens
    assert len(blocks) == 1 + -(-(N - 1) // 8)


def test_wrong_drafts_are_all_rejected(tiny_torch, prompt_ids, reference, scripted):
    engine = Engine(tiny_torch, scripted(prompt_ids + reference, "wrong", 49152), fixed_k=4)
    stats = Stats()
    list(
        engine.stream(
            prompt_ids,
            GenerationParams(max_tokens=N, eos_token_ids=frozenset({49151})),
            stats=stats,
        )
    )
    assert stats.accepted == 0 and stats.drafted > 0


@pytest.mark.parametrize("k", [2, 8])
def test_eos_inside_draft(tiny_torch, prompt_ids, reference, scripted, k):
    # make the 6th generated token the EOS: its first occurrence ends generation there
    eos = reference[5]
    cut = reference.index(eos) + 1
    expected = hf_greedy(tiny_torch, prompt_ids, N, eos_id=eos)
    assert expected == reference[:cut]
    engine = Engine(tiny_torch, scripted(prompt_ids + reference, "perfect", 49152), fixed_k=k)
    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({eos}))
    out, _ = stream_checked(engine, prompt_ids, params)  # also checks the cache after EOS
    assert out == expected
    assert engine.generate(prompt_ids, params).finish_reason == "eos"


def test_max_tokens_respected_with_long_drafts(tiny_torch, prompt_ids, reference, scripted):
    for n in (1, 2, 5, 9):
        engine = Engine(tiny_torch, scripted(prompt_ids + reference, "long", 49152), fixed_k=8)
        gen = engine.generate(
            prompt_ids, GenerationParams(max_tokens=n, eos_token_ids=frozenset({49151}))
        )
        assert gen.token_ids == reference[:n]
        assert gen.finish_reason == "length"


def test_ngram_and_model_drafters_match_hf(tiny_torch, tiny_draft_folder, prompt_ids, reference):
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.model import ModelDrafter
    from nodes.drafters.ngram import NgramDrafter

    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({49151}))
    # the verifier itself as a chain drafter: every draft must be accepted (trees: test_tree)
    same_model = ModelDrafter(tiny_torch, tree_width=1)
    other = ModelDrafter(TorchBackend.load(str(tiny_draft_folder), device="cpu"))
    for drafter in (NgramDrafter(), same_model, other):
        for k in (4, None):
            out, stats = stream_checked(Engine(tiny_torch, drafter, fixed_k=k), prompt_ids, params)
            assert out == reference[:N], drafter.name
            if drafter is same_model and k:
                assert stats.acceptance == 1.0


def test_stop_string(tiny_torch, prompt_ids, reference):
    full = tiny_torch.tokenizer.decode(reference[:N])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    gen = Engine(tiny_torch).generate(
        prompt_ids, GenerationParams(max_tokens=N, stop=(stop,), eos_token_ids=frozenset())
    )
    assert gen.finish_reason == "stop"
    assert gen.text == full[: full.find(stop)]
    assert stop in tiny_torch.tokenizer.decode(gen.token_ids)
    assert gen.token_ids == reference[: len(gen.token_ids)]


class _ExplodingDrafter(Drafter):
    """Drafts correctly a few times, then raises: generation must go on alone, unchanged."""

    name = "exploding"
    fingerprint = None

    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def open(self, prompt_ids, params):
        session = self.inner.open(prompt_ids, params)
        calls = [0]
        real_draft = session.draft

        def draft(k):
            calls[0] += 1
            if calls[0] > self.after:
                raise ConnectionError("proposer vanished")
            return real_draft(k)

        session.draft = draft
        return session


def test_failing_drafter_degrades_to_plain(tiny_torch, prompt_ids, reference, scripted):
    drafter = _ExplodingDrafter(scripted(prompt_ids + reference, "perfect", 49152), after=2)
    stats = Stats()
    engine = Engine(tiny_torch, drafter, fixed_k=3)
    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({49151}))
    out = [t for b in engine.stream(prompt_ids, params, stats=stats) for t in b.token_ids]
    assert out == reference[:N]
    assert stats.drafter_errors == 1 and stats.accepted == 6
