"""Batched steps (`Engine.step_batch`, `Backend.forward_batch`): several sequences, each with
its own cache and tree, in one forward; each sequence's output equals its output alone.

The tiny random model checks the batched forward itself (logits, caches, hidden states per
row) against the solo code paths; the real SmolLM2 checks whole generations, joining and
leaving mid-batch. Batched CPU matmuls are not bit-identical to solo ones (docs/engine.md,
"Batching"), so the exactness tests run the backend's `batch_invariant` mode, and the default
mode is checked to within float tolerance plus identical greedy choices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, Stats

LAYERS = (0, 1)


def _feeds(prompt_ids):
    """Mixed feeds: a plain step, a chain, a branching tree, a longer chain."""
    return [
        ([prompt_ids[-1]], [-1]),
        ([prompt_ids[-1], 11, 12], [-1, 0, 1]),
        ([prompt_ids[-1], 5, 6, 7, 8], [-1, 0, 0, 1, 2]),
        ([prompt_ids[-1], 21, 22, 23, 24, 25], [-1, 0, 1, 2, 3, 4]),
    ]


def _primed(backend, prompts, capture=False):
    caches = []
    for ids in prompts:
        cache = backend.new_cache()
        if capture:
            backend.capture_hidden(cache, LAYERS)
        backend.forward(cache, ids[:-1])
        backend.take_hidden(cache)
        caches.append(cache)
    return caches


def _prompts(prompt_ids):
    """Pasts of different lengths, so the batch is left-padded."""
    return [prompt_ids, prompt_ids[:4], prompt_ids[2:], prompt_ids[:7]]


@pytest.mark.parametrize("capture", [False, True])
def test_batched_forward_matches_each_sequence_alone(tiny_torch, prompt_ids, capture):
    b = tiny_torch
    prompts, feeds = _prompts(prompt_ids), _feeds(prompt_ids)
    solo_caches = _primed(b, prompts, capture)
    solo, solo_hidden = [], []
    for cache, feed in zip(solo_caches, feeds, strict=True):
        solo += b.forward_batch([cache], [feed])
        solo_hidden.append(b.take_hidden(cache))
    caches = _primed(b, prompts, capture)
    batched = b.forward_batch(caches, feeds)
    for got, ref, (ids, _) in zip(batched, solo, feeds, strict=True):
        assert got.shape == (len(ids), b.vocab_size)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    for cache, ref_cache, ref_h in zip(caches, solo_caches, solo_hidden, strict=True):
        assert b.cache_length(cache) == b.cache_length(ref_cache)
        for layer, ref in zip(cache.layers, ref_cache.layers, strict=True):
            torch.testing.assert_close(layer.keys, ref.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, ref.values, atol=1e-4, rtol=1e-4)
        got_h = b.take_hidden(cache)
        if capture:
            assert got_h.shape == ref_h.shape
            torch.testing.assert_close(got_h, ref_h, atol=1e-4, rtol=1e-4)
        else:
            assert got_h is None and ref_h is None


def test_only_capturing_rows_get_hidden_states(tiny_torch, prompt_ids):
    b = tiny_torch
    prompts, feeds = _prompts(prompt_ids)[:2], _feeds(prompt_ids)[:2]
    plain = _primed(b, prompts[:1])[0]
    capturing = _primed(b, prompts[1:], capture=True)[0]
    b.forward_batch([plain, capturing], feeds)
    assert b.take_hidden(plain) is None
    assert b.take_hidden(capturing).shape == (len(feeds[1][0]), len(LAYERS), 64)


def test_batch_invariant_mode_is_bit_exact(tiny_torch, prompt_ids):
    b = tiny_torch
    prompts, feeds = _prompts(prompt_ids), _feeds(prompt_ids)
    solo = [b.forward_batch([c], [f])[0] for c, f in zip(_primed(b, prompts), feeds,
                                                         strict=True)]
    b.batch_invariant = True
    try:
        batched = b.forward_batch(_primed(b, prompts), feeds)
    finally:
        b.batch_invariant = False
    for got, ref in zip(batched, solo, strict=True):
        assert np.array_equal(got, ref)


def test_a_batch_of_one_is_the_solo_step(tiny_torch, prompt_ids):
    """`step` is `step_batch` of one: same blocks as a plain stream."""
    engine = Engine(tiny_torch, None)
    params = GenerationParams(max_tokens=12, eos_token_ids=frozenset())
    ref = [blk.token_ids for blk in engine.stream(prompt_ids, params)]
    seq = engine.start(prompt_ids, params)
    got = []
    while seq.finish_reason is None:
        got.append(engine.step_batch([seq])[0].token_ids)
    assert got == ref


def test_a_batch_refuses_finished_and_repeated_sequences(tiny_torch, prompt_ids):
    engine = Engine(tiny_torch, None)
    seq = engine.start(prompt_ids, GenerationParams(max_tokens=1))
    with pytest.raises(ValueError):
        engine.step_batch([seq, seq])
    engine.step_batch([seq])
    with pytest.raises(RuntimeError):
        engine.step_batch([seq])


# ---- the real SmolLM2: whole generations ---------------------------------------------------------
N = 40
PROMPTS = [
    "Rename the function mean to average and return the code:\n\ndef mean(values):\n"
    "    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "What are three tips for staying focused while studying?",
    "Copy this sentence word for word: The committee agreed to open the tower to visitors "
    "on weekends from 1 June, with tickets at 3 euros for adults.",
    "Hi",
    "Write a short story about a robot who learns to paint.",
    "List the days of the week, then list them again in reverse order.",
    "Add a docstring to this function and return it:\n\ndef adults(users):\n"
    "    return [user for user in users if user['age'] >= 18]\n",
    "Tell me about the moon.",
]


def _drafts(i, prompt):
    """Plain on some sequences, ngram chains on some, ngram trees on others."""
    if i % 3 == 0:
        return []
    branches = 1 if i % 3 == 1 else 3
    return [NgramDrafter(branches=branches).open_source(prompt, GenerationParams().sampling)]


@pytest.fixture(scope="module")
def smol(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(smollm2_folder), device="cpu")


@pytest.fixture(scope="module")
def smol_prompts(smol):
    return [smol.tokenizer.encode(p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def solo(smol, smol_prompts):
    """Each prompt decoded alone, plain greedy (what speculation must reproduce)."""
    engine = Engine(smol, None)
    return [engine.generate(p, GenerationParams(max_tokens=N)).token_ids for p in smol_prompts]


def _run(engine, prompts, *, leave=None, join_at=None, stats=None):
    """Step sequences together until all finish. `leave = (index, step)` closes that sequence
    after that many steps; `join_at = step` starts the second half of the prompts then;
    `stats` (one for all) counts what the steps fed."""
    params = GenerationParams(max_tokens=N)
    first = list(range(len(prompts))) if join_at is None else list(range(len(prompts) // 2))
    live = {i: engine.start(prompts[i], params, stats=stats,
                                    sources=_drafts(i, prompts[i])) for i in first}
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    steps = 0
    while live or (join_at is not None and steps <= join_at):
        if join_at is not None and steps == join_at:
            for i in range(len(prompts) // 2, len(prompts)):
                live[i] = engine.start(prompts[i], params, stats=stats,
                                    sources=_drafts(i, prompts[i]))
        if leave is not None and steps == leave[1] and leave[0] in live:
            live.pop(leave[0]).close()
        order = sorted(live)
        for i, block in zip(order, engine.step_batch([live[i] for i in order]), strict=True):
            out[i] += block.token_ids
        for i in order:
            if live[i].finish_reason is not None:
                live.pop(i).close()
        steps += 1
    return out


@pytest.fixture(params=[True, False], ids=["batch_invariant", "batched"])
def mode(request, smol):
    """Exact by construction (`batch_invariant`), and the batched forward itself (its logits
    differ from solo in the last bits; on these prompts the greedy choices do not)."""
    smol.batch_invariant = request.param
    yield request.param
    smol.batch_invariant = False


@pytest.mark.slow
def test_eight_mixed_sequences_each_equal_their_solo_output(smol, smol_prompts, solo, mode):
    stats = Stats()
    out = _run(Engine(smol, None), smol_prompts, stats=stats)
    for i, ref in enumerate(solo):
        assert out[i] == ref, f"sequence {i} ({'invariant' if mode else 'batched'})"
    assert stats.tree_blocks and stats.spec_blocks > stats.tree_blocks and stats.plain_steps


@pytest.mark.slow
def test_a_sequence_leaving_mid_batch_changes_no_other(smol, smol_prompts, solo, mode):
    out = _run(Engine(smol, None), smol_prompts, leave=(2, 3))
    for i, ref in enumerate(solo):
        if i == 2:
            assert out[i] == ref[: len(out[i])] and len(out[i]) < len(ref)
        else:
            assert out[i] == ref, f"sequence {i}"


@pytest.mark.slow
def test_sequences_joining_mid_batch_change_no_other(smol, smol_prompts, solo, mode):
    out = _run(Engine(smol, None), smol_prompts, join_at=4)
    for i, ref in enumerate(solo):
        assert out[i] == ref, f"sequence {i}"
