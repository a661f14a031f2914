"""The grammar's forced run continued by a lookup drafter (nodes/engine/forced_lookup.py): a
lookup's peek past assumed tokens leaves its state exactly as it was, the source drafts the
forced run and then what the lookup knows follows it, and what it drafts is accepted only where
constrained plain decoding writes the same (real tiny Llama, real llguidance grammar)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.drafters.ngram import NgramDrafter
from nodes.drafters.suffix import SuffixDrafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.forced_lookup import ForcedLookupSource, continued_by_lookups
from nodes.engine.grammar import Constraint, Grammars, GrammarSource
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource
from nodes.engine.state import Stats
from nodes.engine.tree import EMPTY_TREE, DraftTree

#: integers: the tiny model's text after a forced `"b":` starts a token of its own (after a
#: string's `":"` it merges the quote into its next token, which the forced run's split misses)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                           "c": {"type": "integer"}},
          "required": ["a", "b", "c"], "additionalProperties": False}

tokens = st.lists(st.integers(0, 5), min_size=1, max_size=40)


def _seen(tree: DraftTree) -> list[tuple[list[int], list[float] | None]]:
    return [([int(t) for t in toks], None if conf is None else [float(c) for c in conf])
            for toks, conf in tree.path_tokens()]


def _suffix_with_history(history: list[int]) -> SuffixDrafter:
    drafter = SuffixDrafter()
    if history:  # an earlier generation filed in the global index
        done = drafter.open(history[:1], SamplingParams())
        done.extend(history[1:])
        done.close()
    return drafter


@settings(max_examples=60, deadline=None)
@given(prompt=tokens, told=tokens, assumed=tokens, history=st.lists(st.integers(0, 5),
                                                                    max_size=40),
       k=st.integers(1, 8), kind=st.sampled_from(["ngram", "suffix"]))
def test_a_peek_is_what_the_extended_state_drafts_and_leaves_the_state_as_it_was(
        prompt, told, assumed, history, k, kind):
    def opened():
        drafter = NgramDrafter() if kind == "ngram" else _suffix_with_history(history)
        return drafter, drafter.open_source(prompt, SamplingParams())

    _, source = opened()
    committed = prompt + told
    before = (source.draft_class(committed), _seen(source.propose(committed, k)))
    label, tree = source.propose_after(committed, assumed, k)
    # the state after the peek answers as before it
    assert (source.draft_class(committed), _seen(source.propose(committed, k))) == before
    # the peek answers as a state told the assumed tokens does (a fresh one: no memo)
    _, other = opened()
    ahead = committed + assumed
    assert label == other.draft_class(ahead)
    assert _seen(tree) == _seen(other.propose(ahead, k))


class _Lookup(DraftSource):
    """A lookup that knows one text: past the committed tokens and any assumed ones it drafts
    that text's continuation where they are a prefix of it, and nothing at the tip itself (so
    only the forced run's continuation can draft what the grammar leaves free)."""

    name = "known"
    peeks = True

    def __init__(self, text: Sequence[int]) -> None:
        self.text = [int(t) for t in text]

    def _after(self, context: list[int], budget: int) -> DraftTree:
        n = len(context)
        if budget <= 0 or self.text[:n] != context:
            return EMPTY_TREE
        return DraftTree.of_chain(self.text[n:n + budget])

    def propose(self, committed, budget):
        return EMPTY_TREE

    def propose_after(self, committed, assumed, budget):
        return "known", self._after([*committed, *assumed], budget)


def test_the_forced_run_is_continued_by_what_the_lookup_knows_follows_it(tiny_torch,
                                                                        prompt_ids):
    constraint = Constraint.json_schema(SCHEMA)
    plain = Engine(tiny_torch, grammar_drafts=False)
    ref = plain.generate(prompt_ids, GenerationParams(max_tokens=60, constraint=constraint))
    assert ref.finish_reason == "eos"
    answer = list(ref.token_ids)
    known = _Lookup([*prompt_ids, *answer])
    grammars = Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)
    # walk the answer: wherever the grammar forces a run that the answer takes and the
    # answer goes on past it, the source drafts the run, then the answer's continuation
    matcher = grammars.matcher(constraint)
    source = continued_by_lookups(matcher, [known])[0]
    assert isinstance(source, ForcedLookupSource) and source.name == "forced+known"
    spliced = 0
    for i, token in enumerate(answer):
        committed = [*prompt_ids, *answer[:i]]
        run = source.forced_run(committed)
        draft = source.propose(committed, 16)
        if run and answer[i:i + len(run)] == run and i + len(run) < len(answer) - 1:
            chain = [int(t) for t in draft.tokens[:draft.chain]]
            assert chain[:len(run)] == run
            assert chain[len(run):] == answer[i + len(run):i + 16]
            assert source.draft_class(committed) == "known"
            spliced += 1
        elif not run:
            assert not len(draft) and source.draft_class(committed) is None
        matcher.advance(token)
    assert spliced > 0  # each key after the first is forced after a value

    # in the engine: the same tokens as constrained plain, and fewer forwards than with the
    # grammar's forced runs alone (the spliced drafts were verified and accepted)
    def run_with(sources):
        engine, stats = Engine(tiny_torch, fixed_k=16), Stats()
        got = [t for block in engine.stream(prompt_ids, GenerationParams(
            max_tokens=60, constraint=constraint), stats=stats, sources=sources)
            for t in block.token_ids]
        return got, stats

    alone, alone_stats = run_with([])
    spliced_run, spliced_stats = run_with([known])
    assert alone == spliced_run == list(ref.token_ids)
    assert spliced_stats.blocks < alone_stats.blocks


def test_sources_that_cannot_peek_are_not_continued(tiny_torch):
    """A remote proposer's source (or any that does not answer `propose_after`) gets no
    forced-run continuation; the engine's in-process lookups do."""

    class Remote(DraftSource):
        name = "remote"
        streams = True

        def propose(self, committed, budget):
            return EMPTY_TREE

    grammars = Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    lookups = [NgramDrafter().open_source([1, 2, 3], SamplingParams()),
               SuffixDrafter().open_source([1, 2, 3], SamplingParams()), Remote(),
               GrammarSource(matcher)]
    assert [s.name for s in continued_by_lookups(matcher, lookups)] == ["forced+ngram",
                                                                       "forced+suffix"]
    assert Remote().propose_after([1], [2], 4) is None
