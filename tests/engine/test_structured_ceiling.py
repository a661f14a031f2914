"""The constrained oracle ceiling (tools/structured_ceiling.py) on the real grammar source
(llguidance over the tiny model's tokenizer) and the real ngram drafter, with answers built so
the forwards are known: a wholly forced answer is the perfect drafter's, an answer nothing
proposes costs plain steps, and with two sources the oracle takes the better one each step."""

from __future__ import annotations

import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.engine.grammar import Constraint, Grammars, GrammarSource
from nodes.engine.sampling import SamplingParams
from tools.structured_ceiling import end_to_end, perfect
from tools.trace_ceiling import Ceiling, replay_sources


def rows_cost(n: int) -> float:
    """A verify forward of n rows: one unit, plus a tenth for each extra row."""
    return 1.0 + 0.1 * (n - 1)


@pytest.fixture(scope="module")
def grammars(tiny_torch):
    return Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)


def replay(grammars, constraint, prompt, answer, drafter=None, max_k=8):
    matcher = grammars.matcher(constraint)
    sources = [GrammarSource(matcher)]
    if drafter is not None:
        sources.append(drafter.open_source(prompt, SamplingParams()))
    return replay_sources(sources, matcher.advance, prompt, answer, rows_cost, max_k)


def forced_answer(grammars, constraint) -> list[int]:
    """The whole text the grammar forces, as its own first forced path tokenizes it."""
    return grammars.matcher(constraint).forced_paths(1000)[0]


def test_a_wholly_forced_answer_is_the_perfect_drafters(grammars):
    text = "the quick brown fox jumps over the lazy dog and runs far away again"
    c = Constraint("regex", text.replace(" ", "\\ "))
    answer = forced_answer(grammars, c)
    assert len(answer) > 10  # two steps at least: a whole one and the rest
    got = replay(grammars, c, [1, 2, 3], answer)
    best = perfect(len(answer), rows_cost, 8)
    assert got.committed == best.committed and sum(got.committed) == len(answer) - 1
    assert got.committed[0] == 9  # 8 forced drafts and the model's token
    assert got.drafted_s == pytest.approx(best.drafted_s)
    assert got.plain_s == pytest.approx((len(answer) - 1) * rows_cost(1))


def test_an_answer_nothing_proposes_costs_plain_steps(grammars, tiny_torch):
    c = Constraint("regex", "[a-z ]+")  # forces nothing
    answer = tiny_torch.tokenizer.encode("many small words with spaces here", chat=False)
    got = replay(grammars, c, [1, 2, 3], answer, NgramDrafter())
    assert got.committed == (1,) * (len(answer) - 1)
    assert got.speedup == pytest.approx(1.0)


def test_with_two_sources_the_oracle_takes_the_better_each_step(grammars, tiny_torch):
    """Free text the prompt holds (the ngram drafter copies it) inside a grammar that forces
    a fixed head: the grammar drafts the head, the ngram the rest."""
    tok = tiny_torch.tokenizer
    body = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
    c = Constraint("regex", "Answer:\\ [a-z ]+")
    head = forced_answer(grammars, c)
    answer = head + tok.encode(" " + body, chat=False)
    prompt = tok.encode("Copy: " + body, chat=False)
    alone = replay(grammars, c, prompt, answer)
    copied = replay(grammars, c, prompt, answer, NgramDrafter())
    assert alone.forwards > copied.forwards
    assert sum(copied.committed) == sum(alone.committed) == len(answer) - 1
    assert copied.forwards >= perfect(len(answer), rows_cost, 8).forwards


def test_end_to_end_adds_the_first_token_to_both_sides():
    c = Ceiling(plain_s=9.0, drafted_s=3.0, tokens=10)
    assert c.speedup == pytest.approx(3.0)
    assert end_to_end(c, 3.0) == pytest.approx(2.0)
    assert end_to_end(c, 0.0) == pytest.approx(3.0)
