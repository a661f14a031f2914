"""Model drafter: its KV cache follows the committed tokens through rejections."""

from __future__ import annotations

import numpy as np

from nodes.drafters.model import ModelDrafter
from nodes.engine import SamplingParams
from tests.engine.conftest import Ahead


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


def test_draft_ahead_is_the_chain_plus_runners_up_with_their_probabilities(
        tiny_torch, prompt_ids, monkeypatch):
    """What a remote proposer streams: the greedy chain `draft` gives, each token's draft
    probability, and at each position the next likeliest tokens as one-token branches."""
    from nodes.drafters import model as model_mod

    monkeypatch.setattr(model_mod, "MIN_ALT_CONF", 0.0)  # a random tiny model is never sure
    drafter = ModelDrafter(tiny_torch)
    chain = drafter.open(prompt_ids, SamplingParams()).draft(5)[0]
    s = drafter.open(prompt_ids, SamplingParams())
    out = Ahead(s.draft_ahead(5, width=3))
    assert out.ids.tolist() == chain.tolist()
    assert [b.at for b in out.branches] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert all(len(b.tokens) == 1 and b.tokens[0] != chain[b.at] for b in out.branches)
    # each position's runners-up in order, below the chain token's probability, and each
    # probability the softmax of the draft model's logits after the chain's prefix
    for at in range(5):
        prefix = [*prompt_ids, *chain[:at].tolist()]
        row = np.asarray(tiny_torch.forward_last(tiny_torch.new_cache(), prefix), np.float64)
        q = np.exp(row - row.max())
        q /= q.sum()
        alts = [b for b in out.branches if b.at == at]
        assert np.isclose(out.conf[at], q[chain[at]], rtol=1e-3)
        assert [b.tokens[0] for b in alts] == np.argsort(-q, kind="stable")[1:3].tolist()
        assert all(np.isclose(b.conf[0], q[b.tokens[0]], rtol=1e-3) for b in alts)
    # width 1: a chain only; the default threshold drops runners-up a drafter gives < 5 %
    assert Ahead(s.draft_ahead(3, width=1)).branches == ()
    monkeypatch.undo()
    assert all(c >= model_mod.MIN_ALT_CONF for b in Ahead(drafter.open(
        prompt_ids, SamplingParams()).draft_ahead(4, 3)).branches for c in b.conf)


def test_draft_ahead_when_sampling_offers_runners_up_of_the_sampling_distribution(
        tiny_torch, prompt_ids):
    s = ModelDrafter(tiny_torch).open(prompt_ids, SamplingParams(1.0, 1.0, 5, seed=3))
    out = Ahead(s.draft_ahead(4, width=3))
    assert len(out.ids) == 4
    # the chain is the mode of q, whatever the seed (a point mass is accepted with p(x): the
    # likeliest token is the best guess), and each runner-up is less likely than its token
    other = ModelDrafter(tiny_torch).open(prompt_ids, SamplingParams(1.0, 1.0, 5, seed=4))
    assert Ahead(other.draft_ahead(4, width=3)).ids.tolist() == out.ids.tolist()
    assert out.ids.tolist() == ModelDrafter(tiny_torch).open(
        prompt_ids, SamplingParams()).draft(4)[0].tolist()
    assert all(b.conf[0] <= out.conf[b.at] for b in out.branches)
    # top-k 5 of a near-uniform model: every position has two runners-up of ~0.2 each
    assert [b.at for b in out.branches] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(0.05 <= b.conf[0] <= 1 and b.tokens[0] != out.ids[b.at] for b in out.branches)
    assert np.all((out.conf > 0) & (out.conf <= 1))
