"""Chunked prefill (`Engine(prefill_chunk=N)`): a prompt longer than N goes in one chunk per
step (blocks with no tokens until the last), chunk boundaries depend on the prompt alone, and
one step feeds at most N prompt rows across the sequences it prefills."""

from __future__ import annotations

import pytest

from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError

PARAMS = GenerationParams(max_tokens=10, eos_token_ids=frozenset())


@pytest.fixture(scope="module")
def long_prompt(tiny_torch, prompt_ids):
    return (prompt_ids * 3)[:30]


def _blocks(engine, prompt):
    return list(engine.stream(prompt, PARAMS, sources=[]))


def test_a_long_prompt_goes_in_chunks_then_decodes_as_whole(tiny_torch, long_prompt):
    blocks = _blocks(Engine(tiny_torch, None, prefill_chunk=8), long_prompt)
    assert [b.fed for b in blocks[:4]] == [8, 8, 8, 6]
    assert all(not b.token_ids and b.finish_reason is None for b in blocks[:3])
    assert [b.cache_len for b in blocks[:3]] == [8, 16, 24]
    chunked = [t for b in blocks for t in b.token_ids]
    whole = [t for b in _blocks(Engine(tiny_torch, None), long_prompt) for t in b.token_ids]
    assert len(chunked) == PARAMS.max_tokens
    assert chunked == whole  # the tiny model's K/V agree to far below its logit gaps


def test_a_prompt_within_the_chunk_is_prefilled_whole(tiny_torch, prompt_ids):
    blocks = _blocks(Engine(tiny_torch, None, prefill_chunk=len(prompt_ids)), prompt_ids)
    assert blocks[0].token_ids and blocks[0].fed == len(prompt_ids)


def test_one_step_feeds_at_most_one_chunk_of_prompt_rows(tiny_torch, long_prompt, prompt_ids):
    engine = Engine(tiny_torch, None, prefill_chunk=8)
    solo = [t for b in _blocks(engine, long_prompt) for t in b.token_ids]
    tiny_torch.batch_invariant = True
    try:
        seqs = [engine.start(long_prompt, PARAMS, sources=[]) for _ in range(2)]
        first = engine.step_batch(seqs)
        assert [b.fed for b in first] == [8, 0]  # the second waits for the next step
        out = [[], []]
        while any(s.finish_reason is None for s in seqs):
            live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
            for i, b in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
                out[i] += b.token_ids
                assert not b.token_ids or seqs[i].prefilled in (0, len(long_prompt))
    finally:
        tiny_torch.batch_invariant = False
    assert out == [solo, solo]


def test_a_chunk_must_be_positive(tiny_torch):
    with pytest.raises(BadRequestError):
        Engine(tiny_torch, None, prefill_chunk=0)


def test_the_budget_holds_when_chunks_share_the_forward(tiny_torch, long_prompt, prompt_ids):
    """Batched (chunks as rows of one forward): still one chunk's worth of prompt rows per
    step, the same chunk boundaries, and the same outputs as alone."""
    engine = Engine(tiny_torch, None, prefill_chunk=8)
    solo = [[t for b in _blocks(engine, p) for t in b.token_ids]
            for p in (long_prompt, prompt_ids[:6])]
    seqs = [engine.start(p, PARAMS, sources=[]) for p in (long_prompt, long_prompt[:20],
                                                          prompt_ids[:6])]
    fed = [b.fed for b in engine.step_batch(seqs)]
    assert fed == [8, 0, 0]
    fed = [b.fed for b in engine.step_batch(seqs)]
    assert fed == [8, 0, 0]
    seqs[1].close()  # cancelled between chunks, before its first: the others go on
    seqs = [seqs[0], seqs[2]]
    out = [[], []]
    while any(s.finish_reason is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        new = {i for i in live if not seqs[i].started}
        blocks = engine.step_batch([seqs[i] for i in live])
        assert sum(b.fed for i, b in zip(live, blocks, strict=True) if i in new) <= 8
        for i, b in zip(live, blocks, strict=True):
            out[i] += b.token_ids
    assert out == solo
