"""A model drafter that takes the generation's grammar (issue 46, item 4: a proposer whose card
says it can take the grammar): it drafts from its own logits masked by the grammar, so every
path it offers is one the grammar allows from the committed state, and the grammar's state
follows what a proposer does to the session (assumed drafts extended, a commit rolling them
back)."""

from __future__ import annotations

from nodes.drafters.model import ModelDrafter
from nodes.engine.grammar import Constraint, Grammars
from nodes.engine.sampling import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def test_a_model_drafter_under_the_grammar_drafts_only_what_it_allows(tiny_torch, prompt_ids):
    grammars = Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)
    c = Constraint.json_schema(SCHEMA)
    drafter = ModelDrafter(tiny_torch, tree_width=3)
    assert drafter.takes_grammar
    state = drafter.open(prompt_ids, SamplingParams())
    state.constrain(grammars.matcher(c))
    free = drafter.open(prompt_ids, SamplingParams())
    judge = grammars.matcher(c)  # at the committed state, for checking only
    refused_free = 0
    for _ in range(8):
        tree = state.draft_ahead(4, width=3)
        assert len(tree)
        for toks, _ in tree.path_tokens():
            assert judge.valid_prefix(toks.tolist()) == len(toks)
        ids = free.draft(4)[0].tolist()
        refused_free += judge.valid_prefix(ids) < len(ids)
        # as a proposer: the chain is assumed, then the verifier commits only its first token
        # and one of its own (a rollback of the rest)
        chain = tree.chain_tokens.tolist()
        state.extend(chain)
        committed = len(state.tokens) - len(chain)
        state.truncate(committed + 1)
        judge.advance(chain[0])
        if judge.done:
            break
        own = int(judge.allowed().nonzero()[0][-1])  # a token the grammar allows, not drafted
        state.extend([own])
        free.truncate(committed)
        free.extend([chain[0], own])
        judge.advance(own)
        if judge.done:
            break
    assert state.grammar is not None and state.grammar.consumed == judge.consumed
    assert refused_free  # the random tiny model, drafting free, leaves the grammar


def test_a_drafter_without_a_hugging_face_tokenizer_does_not_take_it(tiny_torch):
    class Bare:
        tokenizer = object()
        model_name = "bare"
        fingerprint = "x"

    assert not ModelDrafter(Bare()).takes_grammar


def test_the_engines_own_model_drafter_drafts_under_the_grammar(tiny_torch, prompt_ids):
    """In process the engine hands its own model drafter's source a copy of the grammar:
    the output is constrained plain decoding's, and more drafted tokens are accepted than
    when the same drafter drafts free (the tiny model drafting for itself: its masked argmax
    is the verifier's; its free drafts leave the grammar and are pruned)."""
    from nodes.engine import Engine, GenerationParams, Stats

    c = Constraint.json_schema(SCHEMA)

    class Free(ModelDrafter):
        takes_grammar = False

    params = GenerationParams(max_tokens=40, constraint=c)
    plain = Engine(tiny_torch, None, grammar_drafts=False).generate(prompt_ids, params)
    got = {}
    for name, drafter in (("grammar", ModelDrafter(tiny_torch, tree_width=1)),
                          ("free", Free(tiny_torch, tree_width=1))):
        stats = Stats()
        engine = Engine(tiny_torch, drafter, grammar_drafts=False, fixed_k=4)
        out = [t for b in engine.stream(prompt_ids, params, stats=stats) for t in b.token_ids]
        assert out == list(plain.token_ids)
        got[name] = stats.accepted
    assert got["grammar"] > got["free"]
