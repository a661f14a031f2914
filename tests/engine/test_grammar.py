"""Grammar constraints (nodes/engine/grammar.py): compiled by llguidance for the real SmolLM2
tokenizer, applied to the verifier's own logits at every accepted position, so constrained
speculation (ngram drafts, grammar drafts, trees, batches, sampling) commits exactly what
constrained plain decoding does, and every output matches its constraint."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from nodes.engine.grammar import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    Grammars,
    GrammarSource,
    prune_tree,
)
from nodes.engine.sampling import SamplingParams
from nodes.engine.settle import Settler
from nodes.engine.sources import DraftSource
from nodes.engine.state import Stats
from nodes.engine.tree import DraftTree, TokenTree

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = Constraint.json_schema(SCHEMA)
REGEX = Constraint("regex", r"(yes|no), [0-9]{2,4} items?\.")
LARK = Constraint("lark", 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/')


def check_json(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "kind", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert obj["kind"] in ("cat", "dog", "bird")
    assert len(obj["tags"]) <= 3 and all(t in ("a", "bb") for t in obj["tags"])


def valid(c: Constraint, text: str) -> None:
    if c.kind == "json_schema":
        check_json(text)
    elif c.kind == "regex":
        assert re.fullmatch(c.text, text), text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text


@pytest.fixture(scope="module")
def grammars(tiny_torch):
    return Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)


def params(c: Constraint, *, seed: int | None = None, n: int = 60) -> GenerationParams:
    sp = SamplingParams() if seed is None else SamplingParams(temperature=0.9, top_p=0.95,
                                                              seed=seed)
    return GenerationParams(max_tokens=n, sampling=sp, constraint=c)


def _collect(engine, prompt, p, sources):
    tokens, last = [], None
    for block in engine.stream(prompt, p, sources=sources):
        tokens.extend(block.token_ids)
        last = block
    return tokens, last.finish_reason


# ---- compiling -------------------------------------------------------------------------------
def test_compile_cache_and_bounds(grammars):
    a = grammars.compile(JSON_SCHEMA)
    hits = grammars.hits
    assert grammars.compile(Constraint.json_schema(SCHEMA)) is a
    assert grammars.hits == hits + 1
    small = Grammars(grammars.tokenizer, grammars.vocab_size, cache_size=2)
    small._ll = grammars.ll_tokenizer
    for c in (REGEX, LARK, JSON_SCHEMA):
        small.compile(c)
    assert len(small._cache) == 2 and REGEX not in small._cache


@pytest.mark.parametrize("c, reason", [
    (Constraint("json_schema", '{"type": "objectx"}'), "does not compile: Invalid type"),
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("lark", "start: foo"), "unknown name"),
    (Constraint("regex", "(unclosed"), "does not compile"),
    (Constraint("xml", "<a/>"), "kind must be one of"),
    (Constraint.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(10_000)}}), "more than the"),
])
def test_bad_constraints_are_400s_naming_why(grammars, c, reason):
    with pytest.raises(BadRequestError, match=reason) as err:
        grammars.compile(c)
    assert err.value.field == "grammar"


def test_compile_deadline(grammars):
    slow = Grammars(grammars.tokenizer, grammars.vocab_size, timeout_s=1e-6)
    slow._ll = grammars.ll_tokenizer
    with pytest.raises(BadRequestError, match="took longer than"):
        slow.compile(Constraint.json_schema({"type": "object", "properties": {
            f"q{i}": {"type": "integer"} for i in range(300)}}))


def test_wire_form_round_trips_and_is_bounded():
    assert Constraint.from_wire(JSON_SCHEMA.to_wire()) == JSON_SCHEMA
    with pytest.raises(BadRequestError):
        Constraint.from_wire({"kind": "regex", "text": "x" * (MAX_CONSTRAINT_BYTES + 1)})
    with pytest.raises(BadRequestError):
        Constraint.from_wire({"kind": "regex", "text": "a", "extra": 1})


def test_matcher_prunes_and_forces(grammars, tiny_torch):
    tok = tiny_torch.tokenizer
    m = grammars.matcher(JSON_SCHEMA)
    forced = m.forced(8)
    assert tok.decode(forced) == '{"name'  # the rest may merge with what follows
    good = tok.hf.encode('{"name":"Al","age":3')
    bad = tok.hf.encode('{"nome":"Al"}')
    tree = TokenTree(0)
    tree.merge([(0, DraftTree.of_chain(good)), (1, DraftTree.of_chain(bad))], 64, 64)
    pruned = prune_tree(tree, m)
    shared = next(i for i, (a, b) in enumerate(zip(good, bad, strict=False)) if a != b)
    assert 0 < m.valid_prefix(bad) < len(bad)
    # the good branch whole, of the bad one only its grammatical start ('{"' shared)
    assert pruned.drafted == len(good) + m.valid_prefix(bad) - shared < tree.drafted
    assert m.consumed == 0 and m.valid_prefix(good) == len(good)
    # the grammar drafter: the whole forced run '{"name":"', its tail (which may merge with
    # the free text after it) written each way the vocabulary allows, fewest tokens first
    src = GrammarSource(m)
    paths = [list(t) for t, _ in src.propose([], 8).path_tokens()]
    assert all(p[:len(forced)] == forced for p in paths)
    assert [tok.decode(p) for p in paths] == ['{"name":"'] * len(paths)
    assert len(paths) >= 2 and len(set(map(tuple, paths))) == len(paths)
    assert len(paths[0]) == min(map(len, paths))
    assert all(m.valid_prefix(p) == len(p) for p in paths) and m.consumed == 0


def test_forced_tail_follows_the_models_habit(grammars, tiny_torch):
    """The way the model wrote a forced tail ('":' then '"', or '":"') is drafted first the
    next time, in this sequence and (as the prior) in the verifier's next ones."""
    tok = tiny_torch.tokenizer
    m = grammars.matcher(JSON_SCHEMA)
    first = m.forced_paths(8)
    other = next(p for p in first[1:] if p[len(m.forced(8))] != first[0][len(m.forced(8))])
    for t in other:  # the model wrote the run the second way
        m.advance(t)
    again = grammars.matcher(JSON_SCHEMA).forced_paths(8)
    assert again[0] == other and tok.decode(again[0]) == tok.decode(first[0])


# ---- lossless ----------------------------------------------------------------------------------
class Branchy(DraftSource):
    """Drafts from a known continuation, plus an alternative that takes another grammatical
    token at its second place (from its own matcher), and an ungrammatical one, so the
    verified trees branch, get pruned, and are accepted deep."""

    name = "branchy"

    def __init__(self, prompt_len, reference, vocab, matcher=None, seed=0):
        self.start, self.ref, self.vocab, self.matcher = prompt_len, list(reference), vocab, \
            matcher
        self.rng = np.random.default_rng(seed)

    def propose(self, committed, budget):
        if budget <= 0:
            return DraftTree.of_chain([])
        at = len(committed) - self.start
        truth = self.ref[at: at + budget] or [7]
        out = [truth, [int(self.rng.integers(self.vocab)) for _ in truth]]
        if self.matcher is not None and len(truth) > 2:
            self.matcher.sync(0)
            self.matcher.replay(committed[self.start:] + truth[:1])
            allowed = np.flatnonzero(self.matcher.allowed())
            others = allowed[allowed != truth[1]]
            if len(others):
                out.insert(1, truth[:1] + [int(self.rng.choice(others))] + truth[2:])
        return DraftTree.from_paths([(c, None) for c in out])


@pytest.mark.parametrize("c", [JSON_SCHEMA, REGEX, LARK], ids=["json", "regex", "lark"])
def test_constrained_greedy_speculation_equals_plain(tiny_torch, prompt_ids, c):
    plain = Engine(tiny_torch, grammar_drafts=False)
    ref = plain.generate(prompt_ids, params(c))
    assert ref.finish_reason == "eos"
    valid(c, ref.text)
    grammar_only = Engine(tiny_torch)  # the grammar's forced tokens are the only drafts
    gen = grammar_only.generate(prompt_ids, params(c))
    assert gen.token_ids == ref.token_ids
    if c.kind == "json_schema":
        assert gen.stats.accepted > 0  # keys and punctuation came free
    ngram = Engine(tiny_torch, NgramDrafter(), fixed_k=4)
    assert ngram.generate(prompt_ids, params(c)).token_ids == ref.token_ids
    stats = Stats()
    trees = Engine(tiny_torch, fixed_k=8)  # every proposal verified: branching trees
    tokens = [t for b in trees.stream(prompt_ids, params(c), stats=stats, sources=[
        Branchy(len(prompt_ids), ref.token_ids, tiny_torch.vocab_size,
                trees.grammars.matcher(c))]) for t in b.token_ids]
    assert tokens == ref.token_ids
    assert stats.accepted > 0
    assert stats.tree_blocks > 0 or c is not JSON_SCHEMA  # (the others: short, mostly forced)


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "sampled"])
def test_the_eos_after_the_grammars_end_costs_no_forward(tiny_torch, prompt_ids, monkeypatch,
                                                         seed):
    """Where a block completes the grammar, its EOS (the only token left) comes with it: the
    same tokens as a forward for it would give, one block fewer; not with log probabilities."""
    engine = Engine(tiny_torch, grammar_drafts=False)
    fast = engine.generate(prompt_ids, params(REGEX, seed=seed))
    with_lp = engine.generate(prompt_ids, GenerationParams(
        max_tokens=60, sampling=params(REGEX, seed=seed).sampling, constraint=REGEX,
        logprobs=1))
    monkeypatch.setattr(Settler, "_grammar_end", staticmethod(lambda seq, new: new))
    ref = engine.generate(prompt_ids, params(REGEX, seed=seed))
    assert ref.finish_reason == fast.finish_reason == "eos"
    assert fast.token_ids == ref.token_ids == with_lp.token_ids
    assert fast.stats.blocks == ref.stats.blocks - 1 == with_lp.stats.blocks - 1


def test_constrained_sampling_speculation_equals_plain(tiny_torch, prompt_ids):
    plain = Engine(tiny_torch, grammar_drafts=False)
    for seed in (1, 2):
        ref = plain.generate(prompt_ids, params(JSON_SCHEMA, seed=seed))
        check_json(ref.text)
        spec = Engine(tiny_torch, NgramDrafter())
        assert spec.generate(prompt_ids, params(JSON_SCHEMA, seed=seed)).token_ids == \
            ref.token_ids
        trees = Engine(tiny_torch, fixed_k=8)
        tokens, _ = _collect(trees, prompt_ids, params(JSON_SCHEMA, seed=seed), [
            Branchy(len(prompt_ids), ref.token_ids, tiny_torch.vocab_size,
                    trees.grammars.matcher(JSON_SCHEMA))])
        assert tokens == ref.token_ids


def test_constrained_batch_equals_solo(tiny_torch, prompt_ids):
    plain = Engine(tiny_torch, grammar_drafts=False)
    cases = [params(JSON_SCHEMA), params(REGEX), params(LARK), GenerationParams(max_tokens=20),
             params(JSON_SCHEMA, seed=5)]
    solo = [plain.generate(prompt_ids, p).token_ids for p in cases]
    engine = Engine(tiny_torch, NgramDrafter())
    seqs = [engine.start(prompt_ids, p) for p in cases]
    out = [[] for _ in seqs]
    while any(s.finish_reason is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        for i, block in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
            out[i].extend(block.token_ids)
    assert out == solo


def test_logprobs_come_from_the_masked_distribution(tiny_torch, prompt_ids):
    """Log probabilities of a constrained run are the masked distribution's: a token the
    grammar forces has probability 1, and no alternative outside the grammar is listed."""
    blocks = []
    Engine(tiny_torch).generate(prompt_ids, GenerationParams(
        max_tokens=40, constraint=REGEX, logprobs=2), on_block=blocks.append)
    tokens = [t for b in blocks for t in b.token_ids]
    text = tiny_torch.tokenizer.decode(tokens[:-1])
    valid(REGEX, text)
    lp = np.concatenate([b.logprobs.logprobs for b in blocks])
    comma = tokens.index(tiny_torch.tokenizer.hf.convert_tokens_to_ids(","))
    assert lp[comma] == pytest.approx(0.0, abs=1e-6)  # after yes/no: "," is forced
    assert np.all(lp > -np.inf)


def test_one_token_check_agrees_with_the_mask(grammars, tiny_torch):
    """Greedy reads only a row's argmax, so the verifier checks that one token
    (`GrammarMatcher.allows`) and masks the row only when it is forbidden: the check must say
    what the mask says, for every token of the vocabulary, at states inside and between
    values, at the end (EOS) and after it."""
    tok = tiny_torch.tokenizer
    m = grammars.matcher(JSON_SCHEMA)
    text = tok.hf.encode('{"name":"Al","age":3,"kind":"dog","tags":["a"]}',
                         add_special_tokens=False)
    for at in [0, 2, 4, 6, 9, len(text)]:
        m.sync(0)
        m.replay(text[:at])
        allowed = m.allowed()
        checked = np.array([m.allows(t) for t in range(tiny_torch.vocab_size)])
        assert (checked == allowed).all(), at
        # the favourites forbidden: none, one, three (checked one by one), six (past the
        # tries: the full mask); ties among them
        for n in (0, 1, 3, 6):
            row = np.random.default_rng(at).standard_normal(tiny_torch.vocab_size)
            row[np.flatnonzero(~allowed)[:n]] = [99.0, 98.0, 98.0, 97.0, 96.0, 95.0][:n]
            full = m.mask_logits(row.copy())
            lazy, pick = m.mask_and_pick(row.copy(), argmax_only=True)
            assert int(np.argmax(lazy)) == int(np.argmax(full)), (at, n)
            assert pick is None or pick == int(np.argmax(full)), (at, n)
    # and along random walks through the other kinds (a regex, Lark, any JSON object)
    rng = np.random.default_rng(0)
    for c in (REGEX, LARK, Constraint("json_object")):
        m = grammars.matcher(c)
        for _ in range(4):
            if m.done:
                break
            allowed = m.allowed()
            checked = np.array([m.allows(t) for t in range(tiny_torch.vocab_size)])
            assert (checked == allowed).all(), c
            for _ in range(int(rng.integers(1, 4))):
                if not m.done:
                    m.advance(int(rng.choice(np.flatnonzero(m.allowed()))))


def test_constrained_greedy_with_suffix_and_int8_drafts_and_a_batch_of_8(tiny_torch, prompt_ids):
    """Issue 46's list: the suffix drafter (one index shared by the requests) and the int8
    copy of the verifier as drafters under a grammar, and eight constrained sequences in one
    batch (four constraint kinds, each prompt its own), each token for token its constrained
    plain decoding."""
    from nodes.drafters.registry import make_drafter

    plain = Engine(tiny_torch, grammar_drafts=False)
    kinds = [JSON_SCHEMA, REGEX, LARK, Constraint("json_object")]
    prompts = [list(prompt_ids) + [100 + i] for i in range(8)]
    cases = [(prompts[i], params(kinds[i % 4], n=40)) for i in range(8)]
    solo = [plain.generate(ids, p).token_ids for ids, p in cases]
    for spec in ("suffix", "int8"):
        engine = Engine(tiny_torch, make_drafter(spec, tiny_torch))
        for (ids, p), want in zip(cases[:4], solo[:4], strict=True):
            assert engine.generate(ids, p).token_ids == want, spec
    engine = Engine(tiny_torch, make_drafter("suffix", tiny_torch))
    seqs = [engine.start(ids, p) for ids, p in cases]
    out: list[list[int]] = [[] for _ in seqs]
    while any(s.finish_reason is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        for i, block in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
            out[i].extend(block.token_ids)
    assert out == solo


class Ungrammatical(DraftSource):
    """A remote proposer drafting without the grammar, always wrong where it matters: its
    chain starts with a token the grammar refuses (its own matcher says which)."""

    name = "ungrammatical"

    def __init__(self, prompt_len, matcher):
        self.start, self.matcher, self.asked = prompt_len, matcher, 0

    def propose(self, committed, budget):
        if budget <= 0:
            return DraftTree.of_chain([])
        self.asked += 1
        self.matcher.sync(0)
        self.matcher.replay(committed[self.start:])
        refused = np.flatnonzero(~self.matcher.allowed())
        return DraftTree.of_chain([int(refused[0])] * budget)


def test_drafts_the_grammar_refuses_count_as_misses(tiny_torch, prompt_ids):
    """A source whose drafts the grammar cuts is wrong there: its record counts the miss
    (before, a draft pruned whole was 'unheard' and kept the source's estimate, so a proposer
    drafting unconstrained kept being asked and waited for). Verify costs pinned: the
    decisions depend only on which drafts were right."""
    from tests.engine.test_engine_tree import PinnedCost

    engine = Engine(tiny_torch, grammar_drafts=False)
    engine.cost = PinnedCost(max_k=engine.max_draft)
    source = Ungrammatical(len(prompt_ids), engine.grammars.matcher(JSON_SCHEMA))
    seq = engine.start(prompt_ids, params(JSON_SCHEMA, n=40), sources=[source])
    tokens = []
    while seq.finish_reason is None:
        tokens += engine.step(seq).token_ids
    assert tokens == Engine(tiny_torch, grammar_drafts=False).generate(
        prompt_ids, params(JSON_SCHEMA, n=40)).token_ids
    assert seq.stats.drafted == 0  # nothing of it ever cost a row
    assert seq.cost.acceptance_of("ungrammatical") < 0.2
    assert source.asked < len(tokens) // 2  # asked less and less: it has been wrong


TOOL_LIKE = Constraint.json_schema({"anyOf": [
    {"type": "object", "properties": {
        "tool": {"const": name},
        "arguments": {"type": "object", "properties": {k: {"type": "string", "maxLength": 5}
                                                       for k in keys},
                      "required": list(keys), "additionalProperties": False}},
     "required": ["tool", "arguments"], "additionalProperties": False}
    for name, keys in (("get_weather", ("city", "date")), ("get_time", ("city",)))]})


def test_recalled_forced_tokens_answer_as_the_mask(grammars, tiny_torch):
    """A state's check of a token against forced text uses the fast-forward tokens of an
    earlier state with the same last token and forced bytes (`GrammarMatcher.forced_memo`,
    shared by a grammar's sequences): the answers must stay the mask's, token by token, on
    random walks through grammars whose forced runs recur (keys, tool names), with the memo
    warmed by the walks before; what the recall rests on must hold in every state recalled
    (llguidance's own tokens and the recalled agree where both have them); and the recall
    must be used."""
    rng = np.random.default_rng(7)
    vocab = tiny_torch.vocab_size
    recalled = 0
    for c in (TOOL_LIKE, JSON_SCHEMA, Constraint("json_object")):
        for walk in range(4):
            m = grammars.matcher(c)
            assert m.forced_memo is not None
            for _ in range(40):
                if m.done:
                    break
                allowed = m.allowed()
                text = m._forced_bytes()
                known = m._recalled(text)
                recalled += bool(known)
                if known is not None:  # what the recall rests on: one tokenization, cut
                    real = list(m.ll.compute_ff_tokens())
                    n = min(len(real), len(known))
                    assert real[:n] == known[:n], (c.kind, walk, real, known)
                # every allowed token, the recalled first token, and a sample of the rest
                ids = set(np.flatnonzero(allowed)[:300].tolist())
                ids |= set(rng.integers(0, vocab, 200).tolist())
                if known:
                    ids.add(known[0])
                for t in sorted(ids):
                    assert m.allows(t) == bool(allowed[t]), (c.kind, walk, t)
                m.advance(int(rng.choice(np.flatnonzero(allowed))))
    assert recalled > 0


def test_the_shared_habits_stay_bounded(grammars, monkeypatch):
    """How the model wrote a forced tail is remembered across a verifier's sequences for its
    whole life (`Grammars.habits`): at most `HABITS_KEPT` tails, the least recently learnt
    dropped first."""
    from nodes.engine import grammar as grammar_mod

    monkeypatch.setattr(grammar_mod, "HABITS_KEPT", 2)
    shared: dict[bytes, int] = {}
    m = grammars.matcher(JSON_SCHEMA)
    m.shared_habits = shared
    a = m.pieces.bytes.index(b"a")
    for tail in (b"ax", b"ay", b"az"):
        m._learn(tail, a)
    assert list(shared) == [b"ay", b"az"] and m.habits[b"ax"] == a
