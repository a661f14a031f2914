"""Sampling with speculation is distributed exactly as the verifier sampling alone.

We compute the exact joint distribution of the first 4 sampled tokens (temperature 3, top-k 2:
16 sequences) from the verifier's own probabilities and check the empirical distribution of
engine outputs against it with a chi-square goodness-of-fit test at alpha = 1e-3 (df = 15,
critical value 37.70). Seeds are fixed, so each run is deterministic; a wrong acceptance rule
(e.g. always accepting drafts, or not removing q on rejection) shifts the distribution by far
more than this test tolerates (see test_chi_square_detects_bias).
"""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import Engine, GenerationParams, SamplingParams
from nodes.engine.sampling import probs_from_logits

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


class TemperedSelfDrafter:
    """Stochastic drafter with q != p: the verifier's model sampled at another temperature and
    top-k (its support even includes tokens the verifier can never pick)."""

    name = "tempered-self"
    fingerprint = None

    def __init__(self, backend):
        from nodes.drafters.model import ModelDrafter

        self.inner = ModelDrafter(backend)

    def check_compatible(self, fingerprint):
        return None

    def open(self, prompt_ids, params):
        return self.inner.open(prompt_ids, SamplingParams(1.5, 1.0, 3, params.seed))


class GreedyModelDrafter:
    """Deterministic drafter (point mass q): the verifier's own argmax, ignoring temperature."""

    name = "greedy-self"
    fingerprint = None

    def __init__(self, backend):
        from nodes.drafters.model import ModelDrafter

        self.inner = ModelDrafter(backend)

    def check_compatible(self, fingerprint):
        return None

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
