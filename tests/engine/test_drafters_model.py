"""Model drafter: its KV cache follows the committed tokens through rejections."""

from __future__ import annotations

import numpy as np

from nodes.drafters.model import ModelDrafter
from nodes.engine import SamplingParams


def test_rollback_matches_fresh_session(tiny_torch, tiny_draft_folder, prompt_ids):
    from nodes.backends.torch_backend import TorchBackend

    drafter = ModelDrafter(TorchBackend.load(str(tiny_draft_folder), device="cpu"))
    sp = SamplingParams()
    s = drafter.open(prompt_ids, sp)
    committed = list(prompt_ids)
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids, probs = s.draft(5)
        assert probs is None and len(ids) == 5 and ids.dtype == np.int32
        # commit a random-length prefix of the draft plus one "correction" token
        n = int(rng.integers(0, 6))
        delta = ids[:n].tolist() + [int(rng.integers(1000))]
        s.extend(delta)
        committed += delta
        fresh = drafter.open(committed, sp).draft(3)[0].tolist()
        assert s.draft(3)[0].tolist() == fresh
        # the cache holds exactly the ids the session believes it holds
        assert drafter.backend.cache_length(s.cache) == len(s.cached)


def test_sampling_returns_probabilities(tiny_torch, prompt_ids):
    s = ModelDrafter(tiny_torch).open(prompt_ids, SamplingParams(1.0, 1.0, 5, seed=3))
    ids, probs = s.draft(4)
    assert probs.shape == (4, tiny_torch.vocab_size) and probs.dtype == np.float32
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-4)
    assert all(probs[i, t] > 0 for i, t in enumerate(ids))
    assert ((probs > 0).sum(axis=1) == 5).all()  # top-k applied


def test_drafting_ahead_then_truncate_matches_fresh_session(tiny_torch, tiny_draft_folder,
                                                            prompt_ids):
    """The proposer's draft-ahead loop: assume own drafts (extend), then a commit disagrees
    (truncate + the correction); the next drafts equal a fresh session's."""
    from nodes.backends.torch_backend import TorchBackend

    drafter = ModelDrafter(TorchBackend.load(str(tiny_draft_folder), device="cpu"))
    sp = SamplingParams()
    s = drafter.open(prompt_ids, sp)
    ahead = []
    for _ in range(3):
        ids = s.draft(4)[0].tolist()
        s.extend(ids)
        ahead += ids
    keep = len(prompt_ids) + 5  # the verifier accepted 5 of the 12 assumed tokens
    correction = (ahead[5] + 1) % 1000
    s.truncate(keep)
    s.extend([correction])
    committed = [*prompt_ids, *ahead[:5], correction]
    assert s.tokens == committed
    assert s.draft(4)[0].tolist() == drafter.open(committed, sp).draft(4)[0].tolist()
    assert drafter.backend.cache_length(s.cache) == len(s.cached)
