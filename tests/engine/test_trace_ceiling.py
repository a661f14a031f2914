"""The oracle ceiling (tools/trace_ceiling.py) on the real drafters, with answers built so the
right number of forwards is known: it must count exactly what a verifier feeding only the
accepted path would, and carry the suffix index from one request to the next."""

from __future__ import annotations

import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.drafters.suffix import SuffixDrafter, SuffixOptions
from tools.trace_ceiling import CostCurve, measure_costs, oracle_replay


def rows_cost(n: int) -> float:
    """A verify forward of n rows: one unit, plus a tenth for each extra row."""
    return 1.0 + 0.1 * (n - 1)


def test_ngram_copying_its_prompt_needs_two_forwards():
    prompt = list(range(100, 130))
    answer = list(prompt)  # the first token comes with the prefill; 29 are left
    c = oracle_replay(NgramDrafter(), prompt, answer, rows_cost, max_k=16)
    # step 1: 16 drafts right + the model's token (17); step 2: the 11 left + 1 (12)
    assert c.forwards == 2 and c.tokens == 30 and c.committed == (17, 12)
    assert c.drafted_s == pytest.approx(rows_cost(17) + rows_cost(12))
    assert c.plain_s == pytest.approx(29 * rows_cost(1))
    assert c.speedup == pytest.approx(29 / (2.6 + 2.1))


def test_an_answer_the_drafter_never_proposes_costs_plain_steps():
    prompt = list(range(100, 110))
    answer = list(range(500, 540))  # nothing of it in the prompt, no token repeats
    c = oracle_replay(NgramDrafter(), prompt, answer, rows_cost, max_k=16)
    assert c.forwards == 39
    assert c.speedup == pytest.approx(1.0)


def test_the_suffix_index_carries_an_answer_to_the_next_request():
    drafter = SuffixDrafter()
    prompt = list(range(100, 110))
    answer = list(range(500, 540))
    first = oracle_replay(drafter, prompt, answer, rows_cost, max_k=16)
    assert first.forwards == 39  # nothing indexed yet
    # the same request again: its earlier answer is drafted whole (16 + 1, 16 + 1, 5)
    again = oracle_replay(drafter, prompt, answer, rows_cost, max_k=16)
    assert again.forwards == 3
    # another prompt whose answer continues the same text: found in the index from the
    # first token's match on, its drafts sized by the match (SuffixDecoding's factor)
    other = oracle_replay(drafter, list(range(200, 210)), answer, rows_cost, max_k=16)
    assert other.forwards < 39


def test_the_oracle_takes_an_alternative_the_chain_missed():
    """Two earlier answers go one way after the shared tokens and one the other; the request
    goes the lighter way, which the suffix drafter offers only as an alternative."""
    shared = [7, 8, 9, 10, 11, 12]
    heavy, light = [*shared, *range(300, 320)], [*shared, *range(400, 420)]
    steps = {}
    for width in (1, 4):
        drafter = SuffixDrafter(SuffixOptions(width=width))
        for k, ans in enumerate((heavy, heavy, light)):
            oracle_replay(drafter, [10 + k], ans, rows_cost, max_k=16)
        steps[width] = oracle_replay(drafter, [20], light, rows_cost, max_k=16).committed
    # after 7 (the prefill's token), 8 9 drafted and 10 the model's; then 5 drafted after
    # the 5-token match: the chain 11 12 300.. follows the heavy answer, the alternative
    # 11 12 400.. is the request's: with it the oracle takes all 5 and the model's token
    assert steps[1][:2] == (3, 3) and steps[4][:2] == (3, 6), steps
    assert sum(steps[1]) == sum(steps[4]) == len(light) - 1


def test_the_cost_curve_interpolates_between_measured_sizes():
    curve = CostCurve(0.5, {1: 1.0, 4: 1.3, 17: 2.6})
    assert curve.verify(1) == 1.0 and curve.verify(17) == 2.6
    assert curve.verify(2) == pytest.approx(1.1) and curve.verify(10) == pytest.approx(1.9)


def test_costs_are_measured_on_the_backend(tiny_torch):
    curve = measure_costs(tiny_torch, list(range(5, 40)), max_rows=17, repeat=2)
    assert curve.prefill_s > 0
    assert sorted(curve.rows_s) == [1, 2, 4, 8, 16, 17]
    assert all(s > 0 for s in curve.rows_s.values())
