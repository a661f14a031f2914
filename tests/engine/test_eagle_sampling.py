"""Sampling with an EAGLE-3 head keeps the verifier's distribution.

The head's chains are sampled from its own distribution (processed like the verifier's:
temperature, top-k), and those rows go to rejection sampling as `q`. The check is the one of
test_engine_sampling.py: a chi-square goodness of fit of 600 seeded 4-token samples against
the exact joint distribution computed from the verifier alone.

The head is random, but its draft vocabulary is the few tokens the exact distribution can
produce, so its samples land in the verifier's support often enough for the test to exercise
acceptance as well as rejection.
"""

from __future__ import annotations

import pytest
import torch

from nodes.drafters.registry import make_drafter
from nodes.engine import Engine
from tests.engine.eagle_heads import head_config, head_tensors, write_head
from tests.engine.test_engine_sampling import (  # noqa: F401 - fixtures used by name
    CHI2_CRIT_DF15_ALPHA1E3,
    SAMPLES,
    chi_square,
    exact,
    prompt_ids,
    sample_counts,
)


@pytest.fixture(scope="module")
def support_head(tmp_path_factory, tiny_torch, exact):  # noqa: F811
    ids = torch.tensor(sorted({t for seq in exact for t in seq}))
    t = head_tensors(draft_vocab=len(ids))
    t["d2t"] = ids - torch.arange(len(ids))
    t["t2d"] = torch.zeros(tiny_torch.vocab_size, dtype=torch.bool)
    t["t2d"][ids] = True
    folder = tmp_path_factory.mktemp("eagle_support")
    return write_head(folder, t, head_config(draft_vocab=len(ids)), dtype=torch.float32)


def test_sampling_with_the_heads_q_matches_exact(tiny_torch, prompt_ids, exact,  # noqa: F811
                                                 support_head):
    drafter = make_drafter(f"eagle:{support_head}", tiny_torch)
    counts, acceptance = sample_counts(Engine(tiny_torch, drafter, fixed_k=3), prompt_ids)
    assert chi_square(counts, exact, SAMPLES) < CHI2_CRIT_DF15_ALPHA1E3
    assert acceptance is not None and acceptance > 0.02  # acceptance exercised, not only rejection
