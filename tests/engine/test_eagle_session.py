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
    want = source.propose(committed, 6)[0].tokens.tolist()

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
    assert session.draft_ahead(4) == []
    with pytest.raises(BadRequestError, match="do not fit"):
        session.features(np.zeros((2, 5), dtype=np.float16))
