"""Grammar masks filled for the whole batch while the forward runs (issue 46, item 5:
`Grammars.fill_ahead`, `settle.BATCH_MASKS`): the root rows of the step's sampled and
log-probability sequences get their masks from one batched llguidance call, and the committed
text and its log probabilities are exactly the per-row path's (each row its own fill after the
forward): a batch of 8 constrained sequences, greedy, sampled with seeds and with log
probabilities, with ngram drafts, against constrained plain decoding alone on the per-row path."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, settle
from nodes.engine.grammar import Constraint, fill_batch
from nodes.engine.sampling import SamplingParams

from .test_grammar import JSON_SCHEMA, LARK, REGEX


def _cases(prompt_ids):
    kinds = [JSON_SCHEMA, REGEX, LARK, Constraint("json_object")]
    out = []
    for i in range(8):
        c = kinds[i % 4]
        if i < 3:  # greedy (one with log probabilities: its rows need the full mask)
            p = GenerationParams(max_tokens=40, constraint=c, logprobs=2 if i == 2 else None)
        else:  # sampled, seeded (one with log probabilities too)
            p = GenerationParams(max_tokens=40, constraint=c, logprobs=1 if i == 7 else None,
                                 sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=i))
        out.append((list(prompt_ids) + [100 + i], p))
    return out


def _run_batch(engine, cases):
    seqs = [engine.start(ids, p) for ids, p in cases]
    tokens: list[list[int]] = [[] for _ in seqs]
    lps: list[list] = [[] for _ in seqs]
    while any(s.finish_reason is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        for i, b in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
            tokens[i].extend(b.token_ids)
            if b.logprobs is not None:
                lps[i].append(np.asarray(b.logprobs.logprobs))
    return tokens, [np.concatenate(x) if x else None for x in lps]


def _run_solo(engine, cases):
    tokens, lps = [], []
    for ids, p in cases:
        blocks = []
        engine.generate(ids, p, on_block=blocks.append)
        tokens.append([t for b in blocks for t in b.token_ids])
        lp = [np.asarray(b.logprobs.logprobs) for b in blocks if b.logprobs is not None]
        lps.append(np.concatenate(lp) if lp else None)
    return tokens, lps


def test_batched_masks_equal_the_per_row_path(tiny_torch, prompt_ids, monkeypatch):
    cases = _cases(prompt_ids)
    monkeypatch.setattr(settle, "BATCH_MASKS", False)  # today's path: each row its own fill
    ref_tokens, _ = _run_solo(Engine(tiny_torch, grammar_drafts=False), cases)
    per_row_tokens, per_row_lps = _run_batch(Engine(tiny_torch, NgramDrafter()), cases)
    assert per_row_tokens == ref_tokens
    monkeypatch.setattr(settle, "BATCH_MASKS", True)
    engine = Engine(tiny_torch, NgramDrafter())
    filled = []
    orig = engine.grammars.fill_ahead

    def spy(matchers):
        filled.append(len(matchers))
        return orig(matchers)

    engine.grammars.fill_ahead = spy
    tokens, lps = _run_batch(engine, cases)
    assert tokens == ref_tokens
    # the same batch's log probabilities, bit for bit: the masked rows are the per-row path's
    # (against solo runs they differ in the last bits: batched logits, not masks)
    for got, want in zip(lps, per_row_lps, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert np.array_equal(got, want)
    # the five sampled and the logprobs greedy, together: all but one (a sampled json_object
    # answers `{}` in its first block, the grammar's end, and its EOS comes with it)
    assert filled and max(filled) >= 5
    # the constrained plain batch on the batched path: the same text again
    plain = Engine(tiny_torch, grammar_drafts=False)
    assert _run_batch(plain, cases)[0] == ref_tokens


def test_fill_batch_gives_each_matchers_own_mask(tiny_torch):
    """The batched fill's rows are the bits each matcher's own fill gives (`allowed`), in
    order, states apart."""
    import llguidance

    from nodes.engine.grammar import Grammars

    g = Grammars(tiny_torch.tokenizer, tiny_torch.vocab_size)
    rng = np.random.default_rng(0)
    ms = [g.matcher(c) for c in (JSON_SCHEMA, REGEX, LARK, JSON_SCHEMA)]
    for k, m in enumerate(ms):
        for _ in range(k * 2):
            m.advance(int(rng.choice(np.flatnonzero(m.allowed()))))
    bits = fill_batch(ms, llguidance.LLExecutor(1))
    for row, m in zip(bits, ms, strict=True):
        assert np.array_equal(m.allowed(row), m.allowed())
    assert fill_batch([], None).shape[0] == 0


@pytest.mark.parametrize("on", [True, False])
def test_a_forward_that_fails_hands_the_matchers_back(tiny_torch, prompt_ids, monkeypatch, on):
    """The step waits for the masks it started even when the forward raises: the next step
    finds the matchers its own (and the generation goes on as before)."""
    monkeypatch.setattr(settle, "BATCH_MASKS", on)
    engine = Engine(tiny_torch, grammar_drafts=False)
    p = GenerationParams(max_tokens=12, constraint=JSON_SCHEMA,
                         sampling=SamplingParams(temperature=0.9, seed=3))
    ref = engine.generate(prompt_ids, p).token_ids
    seq = engine.start(prompt_ids, p)
    out = list(engine.step(seq).token_ids)  # the prefill
    orig = tiny_torch.forward_batch
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("forward failed")

    monkeypatch.setattr(tiny_torch, "forward_batch", boom)
    with pytest.raises(RuntimeError):
        engine.step(seq)
    monkeypatch.setattr(tiny_torch, "forward_batch", orig)
    assert calls
    while seq.finish_reason is None:
        out.extend(engine.step(seq).token_ids)
    assert out == ref



def test_the_per_row_path_is_the_default():
    """Off by default: it did not pay on the CPU verifier (docs/engine/constraints.md)."""
    assert settle.BATCH_MASKS is False
