"""Hidden-state rows a proposer refuses (the wrong width for its head) are not counted against
the session (issue 47): once they were counted before the drafter's width check, so a refused
commit shrank what the session could still receive."""

from __future__ import annotations

import numpy as np
import pytest

from codec.structs import SessionExtend
from nodes.drafters.ngram import NgramDrafter
from nodes.engine.errors import BadRequestError
from nodes.proposer.role import ProposerRole, _Session


class _HeadSession:
    """An n-gram session that reads hidden states of width 4 as an EAGLE-3 head would."""

    def __init__(self, inner):
        self.inner, self.rows = inner, 0

    def features(self, rows):
        if rows.shape[1] != 4:
            raise BadRequestError(f"hidden states of width {rows.shape[1]} do not fit", "hidden")
        self.rows += len(rows)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _extend(tokens, committed, width, rows):
    return SessionExtend(session="s", tokens=np.asarray(tokens, np.int32), committed=committed,
                         hidden_width=width,
                         hidden=np.ones(width * rows, np.float16))


def test_refused_rows_are_not_counted():
    drafter = NgramDrafter()
    role = ProposerRole(drafter, vocab_size=100)
    prompt = [1, 2, 3, 4]
    s = _Session(sid="s", owner="v", draft=_HeadSession(drafter.open(prompt, None)), params=None,
                 tokens=list(prompt), lease_s=30, expires=0, stream=None, horizon=4)
    with pytest.raises(BadRequestError):
        role._commit(s, _extend([5], 5, 3, 4))  # 4 rows of the wrong width
    assert s.hidden_rows == 0 and s.committed == 4
    role._commit(s, _extend([5], 5, 4, 4))  # the 4 right ones still fit the 4 cached
    assert s.hidden_rows == 4 == s.draft.rows and s.committed == 5
