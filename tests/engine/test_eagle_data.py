"""Training data for EAGLE heads: the generated chat prompts, cycled temperatures, a time
limit and resuming for responses, labels captured while generating equal to teacher forcing
the same text, and batched teacher forcing equal to one sequence at a time (tiny verifier)."""

from __future__ import annotations

import time

import torch

from nodes.training import data as D
from nodes.training.evaluate import EVAL_PROMPTS
from nodes.training.prompts import all_prompts, chat_prompts
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
                            cycle=True, on_batch=lambda s, start: seen.append(len(s.tokens)))
    assert len(seqs.tokens) == 6 and seen == [2, 4, 6]
    inputs = [tiny_torch.tokenizer.encode(p, chat=tiny_torch.tokenizer.has_chat_template)
              for p in prompts]
    assert all(s[: len(i)] == i for s, i in zip(seqs.tokens, inputs, strict=True))
    greedy = D.make_responses(tiny_torch, prompts[:2], max_new=6, batch=2, temperatures=(0.0,))
    assert greedy.tokens == seqs.tokens[:2]  # batch 0 is greedy
    # resuming after the first batch makes the same rest; a passed deadline makes nothing
    rest = D.make_responses(tiny_torch, prompts, max_new=6, batch=2, temperatures=(0.0, 0.9),
                            cycle=True, done=D.Sequences(seqs.tokens[:2]))
    assert rest.tokens == seqs.tokens
    none = D.make_responses(tiny_torch, prompts, max_new=6, batch=2, temperatures=(0.0,),
                            cycle=True, deadline=time.monotonic() - 1)
    assert none.tokens == []


def test_labels_captured_while_generating_equal_teacher_forcing_the_same_text(tiny_torch):
    """The generating forwards (left-padded batch, one KV cache) see what one teacher-forced
    pass over the finished sequences sees: the same hidden states, argmax and (on the draft
    vocabulary) the same top distribution; the system prompt cut and the last token (whose
    row generation never computes) handled alike."""
    prompts = D.PROMPTS[:4]
    seqs = D.make_responses(tiny_torch, prompts, max_new=12, batch=4, temperatures=(0.8,),
                            layers=LAYERS)
    assert len(seqs.captured) == 4 and len({len(t) for t in seqs.tokens}) > 1  # padding used
    plain = D.make_responses(tiny_torch, prompts, max_new=12, batch=4, temperatures=(0.8,))
    assert plain.tokens == seqs.tokens and plain.captured is None  # capture changes no token
    # the whole vocabulary as draft vocabulary: the random tiny model's distributions are
    # flat, so only there do the captured candidates hold the teacher-forced top entries
    ids = torch.arange(tiny_torch.vocab_size)
    forced = D.teacher_force(tiny_torch, D.Sequences([t[:-1] for t in seqs.tokens]), LAYERS,
                             ids, batch=1, skip=3)
    caught = D.examples_from_captured(seqs, ids, skip=3)
    for a, b in zip(forced, caught, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.top1, b.top1)
        # fp16 rows: a last-bit difference before rounding moves a value of ~70 by 0.06
        assert torch.allclose(a.features.float(), b.features.float(), rtol=2e-3, atol=2e-3)
        # the same likeliest token, and the top entries in the same proportions (captured
        # ones are renormalised over the candidates' mass, teacher-forced ones over the whole
        # vocabulary; the runners-up of a flat random model are near ties, so their order may
        # differ in the last bits)
        assert torch.equal(a.top_ids[:, 0], b.top_ids[:, 0])
        ratio_a = a.top_p.float() / a.top_p.float()[:, :1]
        ratio_b = b.top_p.float() / b.top_p.float()[:, :1]
        assert torch.allclose(ratio_a, ratio_b, atol=1e-2)


def test_captured_labels_are_restricted_to_the_draft_vocabulary():
    """Candidates outside the draft vocabulary drop out, the rest are renormalised, ids are
    draft ids, short rows are padded with zero probability; the system prompt is cut."""
    vocab_ids = torch.tensor([[7, 3, 9, 1]] * 10, dtype=torch.int32)  # best first
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 10, dtype=torch.float16)
    cap = D.Captured(torch.zeros(10, 3, 2, dtype=torch.float16), vocab_ids, probs,
                     torch.full((10,), 7))
    seqs = D.Sequences([list(range(11))], [cap])
    draft_ids = torch.tensor([1, 3, 9])  # 7, the likeliest, is not a draft token
    (ex,) = D.examples_from_captured(seqs, draft_ids, skip=2)
    assert ex.tokens.tolist() == list(range(2, 10)) and len(ex.features) == 8
    assert ex.top_ids[0, :3].tolist() == [1, 2, 0]  # draft ids of 3, 9, 1
    assert torch.allclose(ex.top_p[0, :3].float(), torch.tensor([0.5, 1 / 3, 1 / 6]),
                          atol=2e-3)
    assert ex.top_p.shape[1] == min(D.TOPK, 4) and float(ex.top_p[0, 3]) == 0.0
    assert ex.top1.tolist() == [7] * 8  # the verifier's own argmax, draft token or not


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
