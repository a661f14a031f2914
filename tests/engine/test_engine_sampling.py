"""Sampling with speculation is distributed exactly as the verifier sampling alone.

We compute the exact joint distribution of the first 4 sampled tokens (temperature 3, top-k 2:
16 sequences) from the verifier's own probabilities and check the empirical distribution of
engine outputs against it with a chi-square goodness-of-fit test at alpha = 1e-3 (df = 15,
critical value 37.70). Seeds are fixed, so each run is deterministic; a wrong acceptance rule
(e.g. always accepting drafts, or not removing q on rejection) shifts the distribution by far
more than this test tolerates (see test_chi_square_detects_bias).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nodes.drafters.base import Drafter
from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, SamplingParams
from nodes.engine.sampling import probs_from_logits
from nodes.engine.sources import SourceOpener

SP = SamplingParams(temperature=3.0, top_k=2)
LENGTH = 4
SAMPLES = 600


@pytest.fixture(scope="module")
def prompt_ids(tiny_torch):
    """Short prompt: these tests run hundreds of generations."""
    return tiny_torch.tokenizer.encode("The quick brown fox")


CHI2_CRIT_DF15_ALPHA1E3 = 37.697


@pytest.fixture(scope="module")
def exact(tiny_torch, prompt_ids):
    """{token tuple: probability} for the first LENGTH tokens, from the verifier alone."""

    def dist(prefix):
        row = tiny_torch.forward(tiny_torch.new_cache(), prefix)[-1]
        p = probs_from_logits(row, SP)[0]
        return {int(t): float(p[t]) for t in np.nonzero(p)[0]}

    out = {(): 1.0}
    for _ in range(LENGTH):
        out = {
            seq + (t,): pr * pt
            for seq, pr in out.items()
            for t, pt in dist(prompt_ids + list(seq)).items()
        }
    assert len(out) == 2**LENGTH and abs(sum(out.values()) - 1) < 1e-9
    return out


def chi_square(counts: dict, exact: dict, n: int) -> float:
    assert set(counts) <= set(exact), "sampled a sequence outside top-k support"
    return sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())


def sample_counts(engine, prompt_ids, n=SAMPLES):
    counts: dict = {}
    accepted = drafted = 0
    for seed in range(n):
        params = GenerationParams(
            max_tokens=LENGTH,
            sampling=SamplingParams(SP.temperature, SP.top_p, SP.top_k, seed),
            eos_token_ids=frozenset(),
        )
        gen = engine.generate(prompt_ids, params)
        counts[tuple(gen.token_ids)] = counts.get(tuple(gen.token_ids), 0) + 1
        accepted += gen.stats.accepted
        drafted += gen.stats.drafted
    return counts, (accepted / drafted if drafted else None)


def test_exact_distribution_is_spread(exact):
    assert min(exact.values()) * SAMPLES >= 5  # chi-square needs expected counts >= 5


def test_plain_sampling_matches_exact(tiny_torch, prompt_ids, exact):
    counts, _ = sample_counts(Engine(tiny_torch), prompt_ids)
    assert chi_square(counts, exact, SAMPLES) < CHI2_CRIT_DF15_ALPHA1E3


class TemperedSelfDrafter(Drafter):
    """Stochastic drafter with q != p: the verifier's model sampled at another temperature and
    top-k (its support even includes tokens the verifier can never pick)."""

    name = "tempered-self"
    fingerprint = None

    def __init__(self, backend):
        from nodes.drafters.model import ModelDrafter

        self.inner = ModelDrafter(backend)

    def open(self, prompt_ids, params):
        return self.inner.open(prompt_ids, SamplingParams(1.5, 1.0, 3, params.seed))


class GreedyModelDrafter(Drafter):
    """Deterministic drafter (point mass q): the verifier's own argmax, ignoring temperature."""

    name = "greedy-self"
    fingerprint = None

    def __init__(self, backend):
        from nodes.drafters.model import ModelDrafter

        self.inner = ModelDrafter(backend)

    def open(self, prompt_ids, params):
        return self.inner.open(prompt_ids, SamplingParams())  # greedy: returns probs None


@pytest.mark.parametrize("which", ["stochastic", "point_mass"])
def test_speculative_sampling_matches_exact(tiny_torch, prompt_ids, exact, which):
    if which == "stochastic":  # drafter samples from its own q != p
        drafter = TemperedSelfDrafter(tiny_torch)
    else:  # deterministic drafter: point mass q
        drafter = GreedyModelDrafter(tiny_torch)
    counts, acceptance = sample_counts(Engine(tiny_torch, drafter, fixed_k=2), prompt_ids)
    assert acceptance is not None and 0.2 < acceptance  # speculation really happened
    assert chi_square(counts, exact, SAMPLES) < CHI2_CRIT_DF15_ALPHA1E3


def test_chi_square_detects_bias(exact):
    """The test has power: a distribution tilted 20% towards the likeliest sequence fails."""
    top = max(exact, key=exact.get)
    tilted = {s: p * (0.8 if s != top else 1) for s, p in exact.items()}
    tilted[top] += 1 - sum(tilted.values())
    counts = {s: round(p * SAMPLES) for s, p in tilted.items()}
    assert chi_square(counts, exact, SAMPLES) > CHI2_CRIT_DF15_ALPHA1E3


def test_same_seed_same_output(tiny_torch, tiny_draft_folder, prompt_ids):
    from nodes.drafters.ngram import NgramDrafter

    params = GenerationParams(max_tokens=12, sampling=SamplingParams(1.0, 0.9, 0, seed=123))
    a = Engine(tiny_torch, NgramDrafter()).generate(prompt_ids, params).token_ids
    b = Engine(tiny_torch, NgramDrafter()).generate(prompt_ids, params).token_ids
    assert a == b


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9)]
)
def test_logits_processing_matches_hf(temperature, top_k, top_p):
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 500)) * 3
    x = torch.tensor(logits, dtype=torch.float64)
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    expected = torch.softmax(x, dim=-1).numpy()
    got = probs_from_logits(logits, SamplingParams(temperature, top_p, top_k))
    np.testing.assert_allclose(got, expected, atol=1e-9)


# ---- token trees: multi-candidate rejection sampling ---------------------------------------------
class IidChainsDrafter(SourceOpener):
    """SpecInfer-style: three chains drawn independently from the same q != p per step; equal
    prefixes merge in the tree, so duplicate proposals of one token are exercised."""

    name = "iid-chains"
    fingerprint = None

    def __init__(self, backend, chains=3):
        from nodes.drafters.model import ModelDrafter

        self.inner, self.chains = ModelDrafter(backend), chains

    def open_source(self, prompt_ids, params):
        from nodes.engine.sources import DraftSource
        from nodes.engine.tree import DraftTree

        session = self.inner.open(prompt_ids, SamplingParams(1.5, 1.0, 3, params.seed))
        chains, told = self.chains, [len(prompt_ids)]

        class Source(DraftSource):
            def propose(self, committed, budget):
                session.extend(committed[told[0] :])
                told[0] = len(committed)
                k = max(1, budget // chains)
                return DraftTree.from_paths([(session.draft(k)[0], None) for _ in range(chains)]
                                            if budget > 0 else [])

        return Source()


class TopKTreeDrafter(SourceOpener):
    """The real model tree source (EAGLE-2-style top-k, point masses), on the verifier's model."""

    name = "topk-tree"
    fingerprint = None

    def __init__(self, backend, width=2):
        from nodes.drafters.model import ModelDrafter

        self.inner = ModelDrafter(backend, tree_width=width)

    def open_source(self, prompt_ids, params):
        return self.inner.open_source(prompt_ids, params)


def wrong_tree_rule(logits, tree, params, noise_at):
    """Deliberately wrong: a proposed child is accepted whenever the verifier gives its token
    any probability (the sample is never compared with it); only the fix is drawn right."""
    from nodes.engine.sampling import keyed_sample

    rows = probs_from_logits(logits, params)
    node, path = 0, []
    while True:
        for token, child in tree.children[node].items():
            if rows[node][token] > 0:
                path.append(child)
                node = child
                break
        else:
            return path, keyed_sample(rows[node], noise_at(tree.depths[node]))


@pytest.mark.parametrize("which", ["iid_chains", "topk_tree"])
def test_tree_sampling_matches_exact(tiny_torch, prompt_ids, exact, which):
    drafter = IidChainsDrafter(tiny_torch) if which == "iid_chains" else TopKTreeDrafter(tiny_torch)
    engine = Engine(tiny_torch, drafter, fixed_k=6 if which == "iid_chains" else 3)
    counts, acceptance = sample_counts(engine, prompt_ids)
    assert acceptance is not None and 0.2 < acceptance
    assert chi_square(counts, exact, SAMPLES) < CHI2_CRIT_DF15_ALPHA1E3


def test_tree_sampling_catches_a_wrong_rule(tiny_torch, prompt_ids, exact, monkeypatch):
    import nodes.engine.core as core

    monkeypatch.setattr(core, "accept_tree_keyed", wrong_tree_rule)
    engine = Engine(tiny_torch, TopKTreeDrafter(tiny_torch), fixed_k=3)
    counts, _ = sample_counts(engine, prompt_ids)
    assert chi_square(counts, exact, SAMPLES) > CHI2_CRIT_DF15_ALPHA1E3


def test_tree_blocks_really_branch(tiny_torch, prompt_ids):
    """The trees above are trees: several candidates per step, verified in one forward."""
    from nodes.engine.core import Stats

    for drafter in (IidChainsDrafter(tiny_torch), TopKTreeDrafter(tiny_torch)):
        stats = Stats()
        params = GenerationParams(max_tokens=8, sampling=SamplingParams(3.0, 1.0, 2, seed=1),
                                  eos_token_ids=frozenset())
        list(Engine(tiny_torch, drafter, fixed_k=6).stream(prompt_ids, params, stats=stats))
        assert stats.tree_blocks > 0, drafter.name


def test_a_seed_gives_one_text_whatever_drafts_it(tiny_torch, prompt_ids):
    """The sampled token at each position is a function of the seed, the position and the
    verifier's distribution alone: no drafter, tree or draft length changes the text."""
    params = GenerationParams(max_tokens=24, eos_token_ids=frozenset(),
                              sampling=SamplingParams(1.0, 0.95, 0, seed=11))
    engines = [Engine(tiny_torch), Engine(tiny_torch, NgramDrafter()),
               Engine(tiny_torch, TopKTreeDrafter(tiny_torch), fixed_k=4),
               Engine(tiny_torch, IidChainsDrafter(tiny_torch), fixed_k=6),
               Engine(tiny_torch, TemperedSelfDrafter(tiny_torch), fixed_k=3)]
    texts = [e.generate(prompt_ids, params).token_ids for e in engines]
    assert all(t == texts[0] for t in texts), texts
    other = replace(params, sampling=SamplingParams(1.0, 0.95, 0, seed=12))
    assert Engine(tiny_torch).generate(prompt_ids, other).token_ids != texts[0]
