"""A proposer's EAGLE-3 session drafts what the in-process source drafts from the same hidden
states: the features arrive in rows with the commits, the proposer's assumed tokens and
rollbacks are its own bookkeeping, the head's context is the same."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.drafters.eagle.source import EagleDrafter, EagleSource
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import Feedback
from tests.engine.conftest import Ahead
from tests.engine.test_eagle import LAYERS, foreign_head  # noqa: F401 - fixture


def test_the_session_drafts_what_the_source_drafts(tiny_torch, prompt_ids, foreign_head):  # noqa: F811
    drafter = EagleDrafter.load(foreign_head, tiny_torch)
    cache = tiny_torch.new_cache()
    tiny_torch.capture_hidden(cache, LAYERS)
    tiny_torch.prefill(cache, prompt_ids)
    hidden = tiny_torch.take_hidden(cache).half().float()  # as the wire carries them
    committed = list(prompt_ids) + [17]
    rows = hidden.reshape(len(hidden), -1).half().numpy()

    source = EagleSource(drafter.head, drafter.layers, prompt_ids, SamplingParams(), 1, "in")
    source.feedback(Feedback((17,), len(committed), 0, 0, hidden=hidden))
    want = source.propose(committed, 6).chain_tokens.tolist()

    session = drafter.open(prompt_ids, SamplingParams())
    session.extend([17])
    session.features(rows)
    first = Ahead(session.draft_ahead(3))
    assert first.ids.tolist() == want[:3]
    session.extend(first.ids.tolist())  # assumed, as a proposer drafting ahead does
    assert Ahead(session.draft_ahead(3)).ids.tolist() == want[3:6]
    session.truncate(len(committed))  # the commit disagreed: rolled back to it
    assert Ahead(session.draft_ahead(6)).ids.tolist() == want
    session.close()


def test_no_features_no_drafts(tiny_torch, prompt_ids, foreign_head):  # noqa: F811
    session = EagleDrafter.load(foreign_head, tiny_torch).open(prompt_ids, SamplingParams())
    session.extend([17])
    assert not len(session.draft_ahead(4))
    with pytest.raises(BadRequestError, match="do not fit"):
        session.features(np.zeros((2, 5), dtype=np.float16))


def test_a_wider_session_adds_the_heads_runners_up_as_one_token_branches(
        tiny_torch, prompt_ids, foreign_head):  # noqa: F811
    """With a tree width (a proposer's `--tree-width`) the chain is unchanged and each drafted
    position offers the head's next likeliest tokens there, by their draft probability,
    where they are worth MIN_ALT_CONF; past tokens already assumed, positions count from the
    new part."""
    import torch

    from nodes.drafters.model import MIN_ALT_CONF

    drafter = EagleDrafter.load(foreign_head, tiny_torch)
    cache = tiny_torch.new_cache()
    tiny_torch.capture_hidden(cache, LAYERS)
    tiny_torch.prefill(cache, prompt_ids)
    rows = tiny_torch.take_hidden(cache).reshape(len(prompt_ids), -1).half().numpy()
    narrow, wide = (drafter.open(prompt_ids, SamplingParams()) for _ in range(2))
    for s in (narrow, wide):
        s.extend([17])
        s.features(rows)
    chain = Ahead(narrow.draft_ahead(4))
    tree = Ahead(wide.draft_ahead(4, width=3))
    assert tree.ids.tolist() == chain.ids.tolist()
    assert tree.branches  # a random head is unsure: it has runners-up
    src = wide.source
    head = src.head
    h = src.last
    for at in range(4):  # the head's own distribution at each chain position
        with torch.inference_mode():
            q = torch.softmax(head.logits(h[None])[0].float(), -1)
        top = torch.topk(q, 3)
        want = [(int(head.target_ids()[int(i)]), float(p))
                for p, i in zip(top.values[1:], top.indices[1:], strict=True)
                if p >= MIN_ALT_CONF]
        got = [(b.tokens[0], b.conf[0]) for b in tree.branches if b.at == at]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert np.allclose([p for _, p in got], [p for _, p in want], atol=1e-5)
        if at < 3:  # the head's context grows by the chain token, as while drafting
            with torch.inference_mode():
                h = head.step(src.cache, torch.tensor([int(chain.ids[at])]), h[None],
                              torch.tensor([src.fed + at]))[0]
    src.cache.crop(src.fed)
    wide.extend(tree.ids[:2].tolist())  # assumed: the next offer's branches count from there
    later = Ahead(wide.draft_ahead(2, width=3))
    assert later.ids.tolist() == chain.ids[2:4].tolist()
    assert {(b.at, b.tokens) for b in later.branches} == {
        (b.at - 2, b.tokens) for b in tree.branches if b.at >= 2}
