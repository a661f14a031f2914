"""The prefix cache (`nodes/engine/prefix_cache.py`): a prompt starts from the K/V of an earlier
sequence sharing its longest prefix, and prefills only the rest.

The tiny random model checks the bookkeeping (longest match, all but the last position, the
budget, entries superseded) and that reusing changes no output, alone and in a batch; SmolLM2
(`slow`) checks a conversation's second turn against HF greedy.
"""

from __future__ import annotations

import pytest

from nodes.engine import Engine, GenerationParams
from nodes.engine.prefix_cache import PrefixCache
from tests.engine.conftest import hf_greedy, step_together
from tests.engine.test_engine_batch import Hidden  # a source reading hidden states

PARAMS = GenerationParams(max_tokens=8, eos_token_ids=frozenset())
BIG = 1 << 30


def _cache_of(backend, tokens):
    cache = backend.new_cache()
    backend.forward(cache, tokens)
    return cache


def _out(engine, prompt, params=PARAMS):
    return engine.generate(prompt, params).token_ids


@pytest.fixture()
def long_prompt(prompt_ids):
    return (prompt_ids * 3)[:30]


def test_lookup_takes_the_longest_common_prefix_but_never_the_last_position(tiny_torch,
                                                                            long_prompt):
    b = tiny_torch
    pc = PrefixCache(b, BIG, min_reuse=4)
    pc.store(long_prompt[:12], _cache_of(b, long_prompt[:12]))
    pc.store(long_prompt[:5] + [7, 7, 7, 7, 7, 7], _cache_of(b, long_prompt[:5] + [7] * 6))
    assert len(pc) == 2
    cache, n = pc.lookup(long_prompt)
    assert n == 12 and b.cache_length(cache) == 12
    # the whole prompt kept: all but its last position (whose logits give the first token)
    assert pc.lookup(long_prompt[:12])[1] == 11
    assert pc.lookup(long_prompt[:5] + [7, 7, 1])[1] == 7
    assert pc.lookup([9, 9, 9, 9, 9, 9]) is None  # nothing in common
    assert pc.lookup(long_prompt[:3] + [1]) is None  # 3 in common, fewer than min_reuse...
    assert pc.lookup(long_prompt[:4] + [1])[1] == 4  # ...4 are enough
    assert pc.stats.hits == 4 and pc.stats.reused == 12 + 11 + 7 + 4


def test_a_kept_sequence_that_a_newer_one_extends_is_replaced_by_it(tiny_torch, long_prompt):
    b = tiny_torch
    pc = PrefixCache(b, BIG, min_reuse=1)
    pc.store(long_prompt[:10], _cache_of(b, long_prompt[:10]))
    pc.store(long_prompt[:20], _cache_of(b, long_prompt[:20]))  # the next turn
    assert len(pc) == 1
    pc.store(long_prompt[:15], _cache_of(b, long_prompt[:15]))  # covered by the kept one
    assert len(pc) == 1 and pc.lookup(long_prompt)[1] == 20


def test_the_budget_evicts_the_least_recently_used_whole(tiny_torch, long_prompt):
    b = tiny_torch
    one = b.settle_cache(_cache_of(b, long_prompt[:10]), 10)
    pc = PrefixCache(b, 2 * one, min_reuse=1)
    a, c, d = ([t, *long_prompt[1:10]] for t in (101, 102, 103))
    pc.store(a, _cache_of(b, a))
    pc.store(c, _cache_of(b, c))
    assert pc.lookup(a + [1])[1] == 10  # `a` is now the most recently used
    pc.store(d, _cache_of(b, d))
    assert len(pc) == 2 and pc.nbytes <= pc.budget and pc.stats.evicted == 1
    assert pc.lookup(c + [1]) is None  # `c` went
    assert pc.lookup(a + [1])[1] == 10 and pc.lookup(d + [1])[1] == 10
    pc.store(long_prompt, _cache_of(b, long_prompt))  # larger than the whole budget: not kept
    assert len(pc) == 2 and pc.lookup(long_prompt[:25]) is None


def test_a_kept_cache_holds_no_more_memory_than_its_positions(tiny_torch, long_prompt):
    b = tiny_torch
    cache = _cache_of(b, long_prompt)
    full = b.settle_cache(_cache_of(b, long_prompt), len(long_prompt))
    assert b.settle_cache(cache, 10) == full * 10 // len(long_prompt)
    for layer in cache.layers:
        assert layer.keys.untyped_storage().nbytes() == layer.keys.nbytes


def test_a_prompt_sharing_a_prefix_prefills_only_the_rest_and_outputs_the_same(tiny_torch,
                                                                               long_prompt):
    b = tiny_torch
    plain = Engine(b, None)
    engine = Engine(b, None, prefix_cache=PrefixCache(b, BIG, min_reuse=4))
    first = long_prompt[:20]
    assert _out(engine, first) == _out(plain, first)
    blocks = list(engine.stream(long_prompt, PARAMS, sources=[]))
    assert blocks[0].fed == len(long_prompt) - 20 and blocks[0].token_ids
    assert [t for blk in blocks for t in blk.token_ids] == _out(plain, long_prompt)
    # the first answer's tokens are kept too: the same request again reuses all but one
    again = engine.generate(first, PARAMS)
    assert again.stats.reused == len(first) - 1
    assert again.token_ids == _out(plain, first)


def test_a_reusing_prompt_joins_a_batch_without_changing_any_output(tiny_torch, long_prompt,
                                                                    prompt_ids):
    b = tiny_torch
    pc = PrefixCache(b, BIG, min_reuse=4)
    engine, plain = Engine(b, None, prefix_cache=pc), Engine(b, None)
    engine.generate(long_prompt[:16], PARAMS)
    runner = engine.start(prompt_ids, PARAMS, sources=[])
    engine.step(runner)
    joiner = engine.start(long_prompt, PARAMS, sources=[])
    outs = step_together(engine, [runner, joiner])
    assert joiner.reused == 16  # looked up at its first step (the runner holds only 12)
    assert outs[1] == _out(plain, long_prompt)
    assert list(runner.generated) == _out(plain, prompt_ids)


def test_a_prompt_starts_from_a_running_sequences_positions(tiny_torch, long_prompt):
    b = tiny_torch
    pc = PrefixCache(b, BIG, min_reuse=4)
    engine = Engine(b, None, prefix_cache=pc)
    runner = engine.start(long_prompt[:20], PARAMS, sources=[])
    for _ in range(3):
        engine.step(runner)  # prefilled, 3 tokens committed, nothing kept yet
    joiner = engine.start(long_prompt[:20] + [5, 6, 7], PARAMS, sources=[])
    outs = step_together(engine, [runner, joiner])
    assert joiner.reused == 20 and pc.stats.live == 1
    assert outs[1] == _out(Engine(b, None), long_prompt[:20] + [5, 6, 7])


@pytest.mark.parametrize("defer_rows, waits", [(8, True), (64, False)])
def test_prompts_arriving_together_compute_a_shared_prefix_once(tiny_torch, long_prompt,
                                                                defer_rows, waits):
    """The second of two prompts sharing 24 positions waits one step for the first's and
    copies them, when 24 is worth a step (`prefix_defer_rows`); outputs unchanged."""
    b = tiny_torch
    engine = Engine(b, None, prefix_cache=PrefixCache(b, BIG, min_reuse=4))
    engine.prefix_defer_rows = defer_rows
    first, second = long_prompt, long_prompt[:24] + [5, 6, 7]
    seqs = [engine.start(p, PARAMS, sources=[]) for p in (first, second)]
    blocks = engine.step_batch(seqs)
    assert blocks[0].fed == len(first) and blocks[0].token_ids
    if waits:
        assert blocks[1].fed == 0 and not blocks[1].token_ids  # its turn to wait
        blocks = engine.step_batch(seqs)
        assert seqs[1].reused == 24 and blocks[1].fed == 3 and blocks[1].token_ids
    else:
        assert blocks[1].fed == len(second) and seqs[1].reused == 0
    step_together(engine, seqs)
    plain = Engine(b, None)
    assert list(seqs[0].generated) == _out(plain, first)
    assert list(seqs[1].generated) == _out(plain, second)


def test_n_identical_prompts_share_one_prefill(tiny_torch, long_prompt):
    """The n choices of one request (issue 47, `n` > 1): three copies of a prompt shorter than
    `prefix_defer_rows` arriving together: the first is prefilled, the other two wait one
    step and copy all but its last position, so the prompt's positions are computed once
    (30 + 1 + 1 rows fed, not 3 x 30); outputs unchanged."""
    b = tiny_torch
    engine = Engine(b, None, prefix_cache=PrefixCache(b, BIG, min_reuse=4))
    assert len(long_prompt) < engine.prefix_defer_rows
    seqs = [engine.start(long_prompt, PARAMS, sources=[]) for _ in range(3)]
    prompt_rows = 0
    blocks = engine.step_batch(seqs)
    assert [blk.fed for blk in blocks] == [len(long_prompt), 0, 0]
    prompt_rows += blocks[0].fed
    blocks = engine.step_batch(seqs)
    assert [s.reused for s in seqs] == [0, len(long_prompt) - 1, len(long_prompt) - 1]
    assert [blk.fed for blk in blocks[1:]] == [1, 1]  # each its last prompt position
    prompt_rows += sum(blk.fed for blk in blocks[1:])
    assert prompt_rows == len(long_prompt) + 2
    step_together(engine, seqs)
    want = _out(Engine(b, None), long_prompt)
    assert [list(s.generated) for s in seqs] == [want] * 3


def test_chunked_prefill_goes_on_from_the_reused_prefix(tiny_torch, long_prompt):
    b = tiny_torch
    engine = Engine(b, None, prefill_chunk=8, prefix_cache=PrefixCache(b, BIG, min_reuse=4))
    engine.generate(long_prompt[:10], PARAMS)
    blocks = list(engine.stream(long_prompt, PARAMS, sources=[]))
    assert [blk.fed for blk in blocks[:3]] == [8, 8, 4]  # 30 - 10 reused, in chunks of 8
    assert [t for blk in blocks for t in blk.token_ids] == _out(Engine(b, None), long_prompt)


def test_batch_invariant_mode_and_capturing_sequences_never_reuse(tiny_torch, long_prompt):
    b = tiny_torch
    engine = Engine(b, None, prefix_cache=PrefixCache(b, BIG, min_reuse=4))
    engine.generate(long_prompt[:20], PARAMS)
    b.batch_invariant = True
    try:
        seq = engine.start(long_prompt, PARAMS, sources=[])
        engine.step(seq)
        assert seq.reused == 0 and seq.started
    finally:
        b.batch_invariant = False
    source = Hidden()
    list(engine.stream(long_prompt, PARAMS, sources=[source]))
    assert source.got[0].shape[0] == len(long_prompt)  # prefilled whole: every prompt row's states
    # (control: its own finished sequence is kept and reused by a plain one)
    seq = engine.start(long_prompt, PARAMS, sources=[])
    engine.step(seq)
    assert seq.reused == len(long_prompt) - 1


def test_a_failed_or_unfinished_sequence_is_kept_only_when_its_cache_is_whole(tiny_torch,
                                                                            long_prompt):
    b = tiny_torch
    pc = PrefixCache(b, BIG, min_reuse=4)
    engine = Engine(b, None, prefix_cache=pc)
    seq = engine.start(long_prompt, PARAMS, sources=[])
    engine.step(seq)  # prefilled, one token committed
    engine.release(seq, keep=False)  # as after a step that raised
    assert len(pc) == 0 and seq.cache is not None
    seq = engine.start(long_prompt, PARAMS, sources=[])
    engine.step(seq)
    engine.step(seq)
    engine.release(seq)  # cancelled between steps: whole
    assert len(pc) == 1 and seq.cache is None
    assert pc.lookup(long_prompt + seq.generated)[1] == len(long_prompt) + 1


@pytest.mark.slow
def test_a_conversations_second_turn_equals_hf_greedy(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    b = TorchBackend.load(str(smollm2_folder), device="cpu")
    tok = b.tokenizer
    pc = PrefixCache(b, BIG)
    engine = Engine(b, None, prefix_cache=pc)
    params = GenerationParams(max_tokens=40)
    msgs = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    first = engine.generate(tok.encode_messages(msgs), params)
    msgs += [{"role": "assistant", "content": first.text},
             {"role": "user", "content": "Which of them is the longest?"}]
    ids = tok.encode_messages(msgs)
    second = engine.generate(ids, params)
    assert second.stats.reused >= len(tok.encode_messages(msgs[:1])) + len(first.token_ids) - 2
    eos = sorted(tok.eos_token_ids)[0]
    assert second.token_ids == hf_greedy(b, ids, 40, eos)[:len(second.token_ids)]
    assert len(second.token_ids) == len(hf_greedy(b, ids, 40, eos))
