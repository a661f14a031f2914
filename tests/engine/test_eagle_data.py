"""Training data for EAGLE heads: the generated chat prompts, cycled temperatures, a time
limit and resuming for responses, and batched teacher forcing equal to one sequence at a
time (tiny verifier)."""

from __future__ import annotations

import time

import torch

from nodes.drafters.eagle import data as D
from nodes.drafters.eagle.evaluate import EVAL_PROMPTS
from nodes.drafters.eagle.prompts import all_prompts, chat_prompts
from tools.prompts import PROMPTS as BENCH_PROMPTS

LAYERS = (0, 1, 1)


def test_chat_prompts_are_many_distinct_fixed_and_unseen_elsewhere():
    everything = chat_prompts()
    assert len(everything) >= 2000 and len(set(everything)) == len(everything)
    assert chat_prompts(50) == everything[:50] == chat_prompts(50)
    assert chat_prompts(50, seed=1) != chat_prompts(50)
    assert set(everything) == set(all_prompts())
    assert all(p[0].isupper() and "{" not in p for p in everything)
    bench = {p for _, p in BENCH_PROMPTS} | set(EVAL_PROMPTS) | set(D.PROMPTS)
    assert not bench & set(everything)


def test_cycled_temperatures_a_deadline_and_resuming(tiny_torch):
    prompts = D.PROMPTS[:6]
    seen = []
    seqs = D.make_responses(tiny_torch, prompts, max_new=6, batch=2, temperatures=(0.0, 0.9),
                            cycle=True, on_batch=lambda s: seen.append(len(s)))
    assert len(seqs.tokens) == 6 and seen == [2, 4, 6]
    inputs = [tiny_torch.tokenizer.encode(p, chat=tiny_torch.tokenizer.has_chat_template)
              for p in prompts]
    assert all(s[: len(i)] == i for s, i in zip(seqs.tokens, inputs, strict=True))
    greedy = D.make_responses(tiny_torch, prompts[:2], max_new=6, batch=2, temperatures=(0.0,))
    assert greedy.tokens == seqs.tokens[:2]  # batch 0 is greedy
    # resuming after the first batch makes the same rest; a passed deadline makes nothing
    rest = D.make_responses(tiny_torch, prompts, max_new=6, batch=2, temperatures=(0.0, 0.9),
                            cycle=True, done=seqs.tokens[:2])
    assert rest.tokens == seqs.tokens
    none = D.make_responses(tiny_torch, prompts, max_new=6, batch=2, temperatures=(0.0,),
                            cycle=True, deadline=time.monotonic() - 1)
    assert none.tokens == []


def test_batched_teacher_forcing_equals_one_sequence_at_a_time(tiny_torch):
    seqs = D.make_responses(tiny_torch, D.PROMPTS[:5], max_new=10, batch=5,
                            temperatures=(0.8,))
    seqs.tokens[1] = seqs.tokens[1][:-4]  # lengths differ: padding in the batch
    ids = D.draft_vocab(seqs, 256, tiny_torch.vocab_size)
    one = D.teacher_force(tiny_torch, seqs, LAYERS, ids, batch=1)
    many = D.teacher_force(tiny_torch, seqs, LAYERS, ids, batch=4)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.top1, b.top1)
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-3)
        assert torch.allclose(a.top_p.float(), b.top_p.float(), atol=2e-3)
    skipped = D.teacher_force(tiny_torch, seqs, LAYERS, ids, batch=4, skip=3)
    for a, b in zip(one, skipped, strict=True):
        assert torch.equal(a.tokens[3:], b.tokens) and torch.equal(a.top1[3:], b.top1)
        assert torch.allclose(a.features[3:].float(), b.features.float(), atol=2e-3)
