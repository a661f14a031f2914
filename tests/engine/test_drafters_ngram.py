"""Prompt-lookup drafter: longest suffix first, most recent occurrence, 0..k tokens."""

from __future__ import annotations

import numpy as np

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import SamplingParams

SP = SamplingParams()


def draft(tokens, k, min_n=1, **kw):
    ids, probs = NgramDrafter(min_n=min_n, **kw).open(tokens, SP).draft(k)
    assert probs is None and ids.dtype.name == "int32"
    return ids.tolist()


def test_longest_suffix_wins():
    # suffix [1, 2] occurs followed by 9; suffix [2] alone most recently followed by 5
    tokens = [1, 2, 9, 9, 2, 5, 5, 1, 2]
    assert draft(tokens, 3) == [9, 9, 2]
    assert draft(tokens, 3, max_n=1) == [5, 5, 1]


def test_most_recent_occurrence():
    tokens = [3, 7, 1, 3, 8, 2, 3]
    assert draft(tokens, 2, max_n=1) == [8, 2]


def test_no_match_gives_nothing_and_never_pads():
    assert draft([1, 2, 3, 4], 5) == []
    assert draft([4, 1, 4], 5) == [1, 4]  # only what exists, no padding
    assert draft([4, 1, 4], 0) == []


def test_extend_sees_generated_tokens():
    s = NgramDrafter(min_n=2).open([10, 11, 12], SP)
    assert s.draft(4)[0].tolist() == []
    s.extend([13, 10, 11])
    assert s.draft(4)[0].tolist() == [12, 13, 10, 11]
    s.extend([12])
    assert s.draft(2)[0].tolist() == [13, 10]


def test_min_n_respected():
    assert draft([5, 6, 7, 5], 2, min_n=2) == []


def test_default_prefers_long_context():
    # [1, 2, 3] last followed by 8; the shorter suffix [2, 3] most recently by 9
    tokens = [1, 2, 3, 8, 0, 2, 3, 9, 5, 1, 2, 3]
    assert NgramDrafter().open(tokens, SP).draft(1)[0].tolist() == [8]
    assert NgramDrafter(max_n=2).open(tokens, SP).draft(1)[0].tolist() == [9]


def test_truncate_rolls_back_to_a_fresh_sessions_index():
    """Drafting ahead assumes tokens then rolls back: the index must equal a fresh session's."""
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    rolled = NgramDrafter(min_n=1, max_n=3).open(prompt, SP)
    rolled.extend([3, 1, 2, 9, 9])
    rolled.truncate(len(prompt) + 1)
    rolled.extend([7])
    fresh = NgramDrafter(min_n=1, max_n=3).open([*prompt, 3, 7], SP)
    assert rolled.tokens == fresh.tokens
    assert rolled.index == fresh.index
    assert rolled.draft(4)[0].tolist() == fresh.draft(4)[0].tolist()


def test_draft_ahead_sends_the_other_continuations_as_branches():
    from tests.engine.conftest import Ahead, Branch

    # "1 2" was followed by 3 and by 4; "9 1 2" (the longest match) by 4
    prompt = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    s = NgramDrafter().open(prompt, SamplingParams())
    out = Ahead(s.draft_ahead(4, width=3))
    assert out.ids.tolist() == s.draft(4)[0].tolist() == [4, 9, 1, 2]
    assert out.conf is None  # n-grams have no probabilities
    assert out.branches == (Branch(0, (3, 9, 1, 2)),)
    assert Ahead(s.draft_ahead(4, width=1)).branches == ()


def test_match_classes_double_in_width():
    from nodes.engine.sources import match_class

    assert [match_class(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 40)] == [
        None, "m1", "m2", "m3", "m3", "m5", "m5", "m9", "m9"]


def test_the_source_names_the_length_of_the_match_it_would_continue():
    prompt = [1, 2, 3, 4, 5, 6, 7]
    source = NgramDrafter().open_source(prompt, SP)
    assert source.draft_class(prompt) is None  # no earlier occurrence of any suffix
    assert source.draft_class(prompt + [9]) is None
    assert source.draft_class(prompt + [9, 5]) == "m1"  # [5] occurred
    assert source.draft_class(prompt + [9, 5, 6, 7]) == "m3"  # [5, 6, 7]
    # the class is that of the draft it then proposes: the continuation of [5, 6, 7]
    assert source.propose(prompt + [9, 5, 6, 7], 2).chain_tokens.tolist() == [9, 5]


def test_a_generic_session_source_syncs_for_a_class_only_when_its_session_names_classes():
    """`DraftStateSource` (a `DraftState` as an engine source): a session naming classes is
    told the committed tokens to name one; one naming none (a model drafter) is not, so its
    catch-up, a forward, stays in `propose`, where the engine times it as drafting."""
    from nodes.drafters.base import DraftState, DraftStateSource
    from nodes.drafters.ngram import NgramState

    class Silent(DraftState):
        def __init__(self):
            self.told = []

        def extend(self, delta):
            self.told.extend(delta)

        def draft(self, k):
            return np.zeros(0, np.int32), None

    silent = Silent()
    source = DraftStateSource(silent, 0)
    assert source.draft_class([1, 2, 3]) is None and silent.told == []
    source.propose([1, 2, 3], 2)
    assert silent.told == [1, 2, 3]
    ngram = DraftStateSource(NgramState([1, 2, 3, 9], 1, 8), 4)
    assert ngram.draft_class([1, 2, 3, 9, 2, 3]) == "m2"
    assert ngram.propose([1, 2, 3, 9, 2, 3], 2).chain_tokens.tolist() == [9, 2]


def test_a_repeating_tail_is_drafted_on_with_its_period():
    """A match that runs into the tip goes on with the period once the tail has repeated at
    least twice (match length >= its distance from the tip): the model looping on one token
    is drafted k tokens a step, not one (seen: a JSON string of "00" x 115 drafted one token a
    step); a match that does not overlap the tip still stops there."""
    assert draft([5, 7, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert draft([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert draft([4, 1, 4], 5) == [1, 4]  # [4] is 2 from the tip but 1 long: no loop yet
    assert draft([9, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # period 3 > match 2: cut at the tip
