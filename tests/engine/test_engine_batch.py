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

from nodes.backends.base import Backend
from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, Stats
from nodes.engine.cost import CostModel
from nodes.engine.sources import DraftSource
from nodes.engine.tree import DraftTree
from tests.engine.conftest import (
    hf_greedy,
    needs_kernel,
    primed_caches,
    step_live,
    step_together,
)

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
    return primed_caches(backend, prompts, LAYERS if capture else ())


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
    for got, (ids, _) in zip(batched, feeds, strict=True):
        assert got.shape == (len(ids), b.vocab_size)
    _assert_like_solo(b, batched, solo, caches, solo_caches, solo_hidden, capture)


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


# ---- prefills as rows of the batched forward ---------------------------------------------------
class Counting:
    """The real backend underneath, counting the engine's forwards by kind."""

    def __init__(self, backend):
        self.inner = backend
        self.calls: list[tuple[str, int]] = []  # (kind, sequences or rows)
        self.mixed: list[tuple[int, int]] = []  # per batch: (prompt rows, stepping sequences)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_batch(self, caches, feeds):
        self.calls.append(("batch", len(caches)))
        prompt = [len(f[0]) for f in feeds if getattr(f, "last_only", False)]
        self.mixed.append((sum(prompt), len(feeds) - len(prompt)))
        return self.inner.forward_batch(caches, feeds)

    def prefill(self, cache, ids):
        self.calls.append(("prefill", len(ids)))
        return self.inner.prefill(cache, ids)

    def forward_last(self, cache, ids):
        self.calls.append(("last", len(ids)))
        return self.inner.forward_last(cache, ids)


class OneAtATime(Backend):
    """A backend without a batched forward (what MLX is): the default `forward_batch`."""

    def __init__(self, backend):
        self.inner, self.calls = backend, []
        self.tokenizer, self.vocab_size = backend.tokenizer, backend.vocab_size
        self.model_name, self.supports_tree = backend.model_name, True

    def new_cache(self):
        return self.inner.new_cache()

    def forward(self, cache, ids):
        self.calls.append(("forward", len(ids)))
        return self.inner.forward(cache, ids)

    def forward_tree(self, cache, ids, parents):
        self.calls.append(("tree", len(ids)))
        return self.inner.forward_tree(cache, ids, parents)

    def prefill(self, cache, ids):
        self.calls.append(("prefill", len(ids)))
        return self.inner.prefill(cache, ids)

    def cache_length(self, cache):
        return self.inner.cache_length(cache)

    def crop(self, cache, length):
        self.inner.crop(cache, length)

    def compact(self, cache, base, keep):
        self.inner.compact(cache, base, keep)


TINY_N = 12
TINY_PARAMS = GenerationParams(max_tokens=TINY_N, eos_token_ids=frozenset())


def _tiny_prompts(prompt_ids):
    """Prompts of several lengths (one longer than a chunk of 8)."""
    return [prompt_ids, prompt_ids[:5], prompt_ids[3:], (prompt_ids * 3)[:30], prompt_ids[:2]]


def _tiny_solo(backend, prompts):
    engine = Engine(backend, None)
    return [engine.generate(p, TINY_PARAMS).token_ids for p in prompts]


def _step_all(engine, prompts, *, join_at=0, cancel=None, sources=None):
    """The first prompt starts alone; the others join after `join_at` steps. `cancel = (index,
    step)` closes that sequence then (mid-prefill with chunks). Returns outputs and steps."""
    live, out, steps = {}, {i: [] for i in range(len(prompts))}, 0
    opened = {i: (sources(i) if sources else []) for i in range(len(prompts))}
    live[0] = engine.start(prompts[0], TINY_PARAMS, sources=opened[0])
    while live or steps <= join_at:
        if steps == join_at:
            for i in range(1, len(prompts)):
                live[i] = engine.start(prompts[i], TINY_PARAMS, sources=opened[i])
        if cancel is not None and steps == cancel[1]:
            live.pop(cancel[0]).close()
        step_live(engine, live, out)
        steps += 1
    return out, opened, steps


def test_prefills_join_the_running_batch_in_one_forward(tiny_torch, prompt_ids):
    """New prompts go through the same `forward_batch` as the running sequences' steps: one
    forward per step, no separate prefill; every output is its solo output and HF's."""
    prompts = _tiny_prompts(prompt_ids)
    solo = _tiny_solo(tiny_torch, prompts)
    backend = Counting(tiny_torch)
    out, _, _ = _step_all(Engine(backend, None), prompts, join_at=2)
    assert [out[i] for i in range(len(prompts))] == solo
    eos = tiny_torch.tokenizer.eos_token_ids
    assert solo[1] == hf_greedy(tiny_torch, prompts[1], TINY_N, next(iter(eos)))
    # steps 0-1: the first sequence alone (its solo prefill, then one step); step 2: the four
    # new prompts and the running sequence in ONE forward; then one forward per step
    assert backend.calls[0] == ("prefill", len(prompts[0]))
    assert backend.calls[1:3] == [("batch", 1), ("batch", 5)]
    assert all(kind == "batch" for kind, _ in backend.calls[1:])


def test_unchunked_prompts_join_up_to_a_bound_on_rows(tiny_torch, prompt_ids, monkeypatch):
    """Without chunks, whole prompts join the forward while their rows stay within
    `BATCHED_PROMPT_ROWS`; the rest are prefilled alone (`Backend.prefill`), as before."""
    from nodes.engine import core

    monkeypatch.setattr(core, "BATCHED_PROMPT_ROWS", 16)
    prompts = _tiny_prompts(prompt_ids)  # 12 (running), then 5, 9, 30, 2 rows
    solo = _tiny_solo(tiny_torch, prompts)
    backend = Counting(tiny_torch)
    out, _, _ = _step_all(Engine(backend, None), prompts, join_at=2)
    assert [out[i] for i in range(len(prompts))] == solo
    # step 2: 5 + 9 + 2 rows join the running sequence; the 30-row prompt goes alone
    assert backend.calls[2:4] == [("prefill", 30), ("batch", 4)]
    assert backend.mixed[1] == (16, 1)


def test_unchunked_prompts_arriving_together_start_first_come_first_within_a_step_budget(
        tiny_torch, prompt_ids):
    """Without chunks a step feeds whole prompts while their rows stay within
    `prefill_step_rows` (the first always); the rest wait, in order, for later steps. Each
    output is still its solo output."""
    prompts = _tiny_prompts(prompt_ids)  # 12 (running), then 5, 9, 30, 2 rows
    solo = _tiny_solo(tiny_torch, prompts)
    backend = Counting(tiny_torch)
    engine = Engine(backend, None)
    engine.prefill_step_rows = 10
    out, _, _ = _step_all(engine, prompts, join_at=2)
    assert [out[i] for i in range(len(prompts))] == solo
    # step 2: the 5-row prompt (5 + 9 > 10: the 9 waits, and the 2 behind it); step 3: the
    # 9 (9 + 30 > 10); step 4: the 30, over the budget but first; step 5: the 2
    assert [rows for rows, _ in backend.mixed[1:6]] == [5, 9, 30, 2, 0]
    assert all(kind == "batch" for kind, _ in backend.calls[1:])


def test_prompt_chunks_join_the_running_batch(tiny_torch, prompt_ids):
    """With chunks, a long prompt's chunks are rows of the running batch's forward, each
    step feeding at most one chunk's worth of prompt rows; outputs unchanged."""
    prompts = _tiny_prompts(prompt_ids)
    solo = _tiny_solo(tiny_torch, prompts)
    backend = Counting(tiny_torch)
    engine = Engine(backend, None, prefill_chunk=8)
    out, _, steps = _step_all(engine, prompts, join_at=1)
    assert [out[i] for i in range(len(prompts))] == solo
    # one forward per step, never a forward of its own for a chunk
    assert len(backend.calls) == steps
    assert all(kind == "batch" for kind, _ in backend.calls[2:])
    assert max(rows for rows, _ in backend.mixed) <= 8
    fed = sum(rows for rows, _ in backend.mixed) + sum(n for k, n in backend.calls if k != "batch")
    assert fed == sum(len(p) for p in prompts)
    assert sum(1 for rows, stepping in backend.mixed if rows and stepping) >= 4


def test_a_cancelled_chunked_prefill_leaves_the_others_unchanged(tiny_torch, prompt_ids):
    prompts = _tiny_prompts(prompt_ids)
    solo = _tiny_solo(tiny_torch, prompts)
    out, _, _ = _step_all(Engine(Counting(tiny_torch), None, prefill_chunk=8), prompts,
                       join_at=1, cancel=(3, 3))  # the 30-token prompt, two chunks in
    assert out[3] == []
    assert [out[i] for i in (0, 1, 2, 4)] == [solo[i] for i in (0, 1, 2, 4)]


def test_without_a_batched_forward_prefills_run_alone(tiny_torch, prompt_ids):
    """The default `forward_batch` (one at a time, MLX's): prefills keep their own forward
    (`Backend.prefill`), outputs unchanged; so does torch's `batch_invariant` mode."""
    prompts = _tiny_prompts(prompt_ids)
    solo = _tiny_solo(tiny_torch, prompts)
    backend = OneAtATime(tiny_torch)
    out, _, _ = _step_all(Engine(backend, None), prompts, join_at=2)
    assert [out[i] for i in range(len(prompts))] == solo
    assert sum(1 for kind, _ in backend.calls if kind == "prefill") == len(prompts)
    counting = Counting(tiny_torch)
    tiny_torch.batch_invariant = True
    try:
        out, _, _ = _step_all(Engine(counting, None), prompts, join_at=2)
    finally:
        tiny_torch.batch_invariant = False
    assert [out[i] for i in range(len(prompts))] == solo
    assert sum(1 for kind, _ in counting.calls if kind == "prefill") == len(prompts)


@pytest.mark.parametrize("capture", [False, True])
def test_a_prompt_chunk_in_the_batched_forward_matches_alone(tiny_torch, prompt_ids, capture):
    """Prompt rows (only the last row's logits) beside trees: each row as alone, within float
    tolerance; caches and captured hidden states too."""
    from nodes.engine.core import _PromptRows

    b = tiny_torch
    prompts, feeds = _prompts(prompt_ids)[:3], _feeds(prompt_ids)[1:3]
    chunk = (prompt_ids * 2)[:17]

    def caches():
        out = _primed(b, prompts[:2], capture)
        fresh, half = b.new_cache(), b.new_cache()  # a new prompt; a prompt's second chunk
        for c in (fresh, half):
            if capture:
                b.capture_hidden(c, LAYERS[1:])
        b.forward_last(half, chunk[:8])
        b.take_hidden(half)
        return [*out, fresh, half]

    solo_caches = caches()
    solo = [b.forward_batch([c], [f])[0] for c, f in zip(solo_caches[:2], feeds, strict=True)]
    solo.append(b.forward_last(solo_caches[2], chunk)[None])
    solo.append(b.forward_last(solo_caches[3], chunk[8:])[None])
    solo_hidden = [b.take_hidden(c) for c in solo_caches]
    got_caches = caches()
    got = b.forward_batch(got_caches, [*feeds, _PromptRows(chunk), _PromptRows(chunk[8:])])
    _assert_like_solo(b, got, solo, got_caches, solo_caches, solo_hidden, capture)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "transformers-forward"])
def test_the_batch_feeds_its_rows_packed_ragged(tiny_torch, prompt_ids, monkeypatch, lean):
    """One model row per fed token: a tree and a prompt chunk beside one-token steps are not
    padded to the longest feed (which would multiply the linear layers' work); and attention
    is per sequence, each over its own past and fed rows only (no row meets another
    sequence's past, masked or not). Through the lean forward and transformers' alike."""
    from nodes.backends import torch_batch
    from nodes.engine.core import _PromptRows

    b = tiny_torch
    if lean and b.lean is None:
        pytest.skip("no lean forward here (it needs the few-row kernel: make setup)")
    monkeypatch.setattr(b, "lean", b.lean if lean else None)
    caches = [*_primed(b, _prompts(prompt_ids)[:3]), b.new_cache()]
    feeds = [*_feeds(prompt_ids)[:3], _PromptRows((prompt_ids * 2)[:17])]
    pasts = [b.cache_length(c) for c in caches]
    rows, keys = [], []
    hook = b.model.model.embed_tokens.register_forward_hook(
        lambda _m, _args, out: rows.append(tuple(out.shape[:2])))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        keys.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch_batch.F, "scaled_dot_product_attention", spy)
    try:
        b.forward_batch(caches, feeds)
    finally:
        hook.remove()
    sizes = [len(f[0]) for f in feeds]
    assert rows == [(1, sum(sizes))]
    per_layer = [(n, past + n) for n, past in zip(sizes, pasts, strict=True)]
    assert keys == per_layer * b.model.config.num_hidden_layers
    assert b.model.config._attn_implementation != "specbus_ragged"  # switched back


class Hidden(DraftSource):
    """A source reading hidden states (as an EAGLE head does): keeps what it is handed."""

    name, hidden_layers = "hidden", (1,)

    def __init__(self):
        self.got = []

    def propose(self, committed, budget):
        return DraftTree.of_chain([])

    def feedback(self, fb):
        self.got.append(None if fb.hidden is None else fb.hidden.clone())


def test_a_capturing_prefill_in_the_batch_hands_over_its_hidden_states(tiny_torch, prompt_ids):
    prompts = _tiny_prompts(prompt_ids)
    solo = _tiny_solo(tiny_torch, prompts)
    alone = Hidden()
    list(Engine(tiny_torch, None).stream(prompts[3], TINY_PARAMS, sources=[alone]))
    backend = Counting(tiny_torch)
    out, opened, _ = _step_all(Engine(backend, None, prefill_chunk=8), prompts, join_at=1,
                            sources=lambda i: [Hidden()] if i == 3 else [])
    assert [out[i] for i in range(len(prompts))] == solo
    assert all(kind == "batch" for kind, _ in backend.calls[1:])
    got = opened[3][0].got
    assert got[0].shape == (len(prompts[3]), 1, 64)  # prefilled whole, in the batch
    assert len(got) == len(alone.got)
    for g, ref in zip(got, alone.got, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-4)


# ---- draft sizing given the batch (pinned costs: no timing in the verdicts) ---------------------
class _Pinned(CostModel):
    """Solo verify costs as on SmolLM2 (CPU), a batch's cost per total rows from `ROWS`;
    nothing learnt from timing."""

    ROWS = staticmethod(lambda rows: 0.0)

    def __post_init__(self):
        super().__post_init__()
        for n in range(1, 18):
            self._verify[n] = 0.056 if n == 1 else 0.090 + 0.003 * (n - 2)
        for rows in range(1, 400):
            self._batch[rows] = self.ROWS(rows)

    def record_verify(self, fed, seconds):
        return None

    def record_batch(self, rows, seconds):
        return None

    def record_draft(self, drafted, seconds, name=""):
        return None


class _Idle(_Pinned):
    """Rows nearly free (a GPU far from saturation): 0.1 ms a row."""

    ROWS = staticmethod(lambda rows: 0.056 + 0.0001 * rows)


class _Loaded(_Pinned):
    """Every row costs a full share (a saturated device): 56 ms a row."""

    ROWS = staticmethod(lambda rows: 0.056 * rows)


class Truth(DraftSource):
    """Proposes the reference continuation (always right)."""

    name = "truth"

    def __init__(self, reference):
        self.reference = reference

    def propose(self, committed, budget):
        toks = self.reference[len(committed):len(committed) + budget]
        return DraftTree.of_chain(toks)


def _drafted_runs(backend, prompts, solo, cost, *, together):
    """Per sequence, the draft tokens each of its blocks verified: all stepped together, or
    each alone; plus the outputs."""
    def engine():  # a fresh one: no source's record from earlier generations
        out = Engine(backend, None)
        out.cost = cost(max_k=out.max_draft)
        return out

    src = [[Truth(p + ref)] for p, ref in zip(prompts, solo, strict=True)]
    if not together:
        runs = [list(engine().stream(p, TINY_PARAMS, sources=s)) for p, s in zip(prompts, src,
                                                                                  strict=True)]
        return [[b.drafted for b in r] for r in runs], [[t for b in r for t in b.token_ids]
                                                        for r in runs]
    engine = engine()
    seqs = [engine.start(p, TINY_PARAMS, sources=s) for p, s in zip(prompts, src, strict=True)]
    drafted, out = [[] for _ in seqs], [[] for _ in seqs]
    while any(q.finish_reason is None for q in seqs):
        live = [i for i, q in enumerate(seqs) if q.finish_reason is None]
        for i, b in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
            drafted[i].append(b.drafted)
            out[i] += b.token_ids
    return drafted, out


def test_at_low_load_each_sequence_keeps_its_solo_plan(tiny_torch, prompt_ids):
    prompts = _tiny_prompts(prompt_ids)[:4]
    solo = _tiny_solo(tiny_torch, prompts)
    alone, out_alone = _drafted_runs(tiny_torch, prompts, solo, _Idle, together=False)
    batched, out = _drafted_runs(tiny_torch, prompts, solo, _Idle, together=True)
    assert out == out_alone == solo
    assert batched == alone and sum(map(sum, alone)) > 0


def test_at_high_load_the_batch_narrows_to_plain_decoding(tiny_torch, prompt_ids):
    prompts = _tiny_prompts(prompt_ids)[:4]
    solo = _tiny_solo(tiny_torch, prompts)
    alone, out_alone = _drafted_runs(tiny_torch, prompts, solo, _Loaded, together=False)
    batched, out = _drafted_runs(tiny_torch, prompts, solo, _Loaded, together=True)
    assert out == out_alone == solo  # trimming drafts never changes an output
    assert sum(map(sum, alone)) > 0  # alone, each sequence speculates (solo costs)
    assert sum(map(sum, batched)) == 0  # together, no draft row buys its cost


def test_a_prompt_in_the_step_does_not_make_drafts_ride_free(tiny_torch, prompt_ids):
    """Where every row costs a full share, a step that also feeds a new 30-row prompt is long
    anyway, but a draft row in it would delay that prompt for tokens worth a decode step's
    share: the running sequences draft nothing in it, as in the steps without it (judged on
    the step's own length, every draft rode along). Outputs unchanged."""
    prompts = _tiny_prompts(prompt_ids)
    running, joining = prompts[:2], prompts[3]
    solo = _tiny_solo(tiny_torch, running + [joining])
    engine = Engine(tiny_torch, None)
    engine.cost = _Loaded(max_k=engine.max_draft)
    seqs = [engine.start(p, TINY_PARAMS, sources=[Truth(p + ref)])
            for p, ref in zip(running, solo[:2], strict=True)]
    out = [[], [], []]
    for _ in range(3):  # both prompts, then two decode steps: no draft buys its row
        for i, b in enumerate(engine.step_batch(seqs)):
            out[i] += b.token_ids
            assert b.drafted == 0
    seqs.append(engine.start(joining, TINY_PARAMS, sources=[]))
    blocks = engine.step_batch(seqs)
    assert blocks[2].fed == len(joining) == 30 and len(blocks[2].token_ids) == 1
    assert [b.drafted for b in blocks[:2]] == [0, 0]
    for i, b in enumerate(blocks):
        out[i] += b.token_ids
    for i, rest in enumerate(step_together(engine, seqs)):
        out[i] += rest
    assert out == solo


def test_a_fresh_engine_learns_its_batch_curve_from_throwaway_forwards(tiny_torch, prompt_ids,
                                                                       monkeypatch):
    """Before any user, a few batched forwards (`learn_batch_cost`) give the batch curve its
    first points, so the first burst is not judged on the solo curve; they leave nothing
    behind, and there is nothing to learn alone or where forwards do not batch rows."""
    solo = _tiny_solo(tiny_torch, [prompt_ids])[0]
    engine = Engine(tiny_torch, None)
    assert not engine.cost._batch
    engine.learn_batch_cost(prompt_ids[:3], 4)  # shorter than the 4-row chains: repeated
    assert sorted(engine.cost._batch) == [4, 16]
    assert engine.generate(prompt_ids, TINY_PARAMS).token_ids == solo
    for batch, invariant in ((1, False), (4, True)):
        monkeypatch.setattr(tiny_torch, "batch_invariant", invariant, raising=False)
        fresh = Engine(tiny_torch, None)
        fresh.learn_batch_cost(prompt_ids, batch)
        assert not fresh.cost._batch


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
        step_live(engine, live, out)
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


@pytest.mark.slow
def test_prompts_joining_in_chunks_change_no_output(smol, smol_prompts, solo, mode):
    """Prompt chunks of 16 rows ride in the running batch's forward (batched mode)."""
    out = _run(Engine(smol, None, prefill_chunk=16), smol_prompts, join_at=4)
    for i, ref in enumerate(solo):
        assert out[i] == ref, f"sequence {i}"


def _assert_like_solo(b, got, solo, caches, solo_caches, solo_hidden, capture):
    """Batched logits, caches and captured hidden states equal the same sequences' solo ones
    (float32 rounding aside) with the same argmax. Hidden states get 1e-3: a prompt chunk's
    rows go through the few-row matmul alone (<= 24 rows) and torch's in a bigger batch, and
    the tiny model amplifies that rounding in one channel to ~2.4e-4 (a wrong row would differ
    by orders more; `SPECBUS_MATMUL=torch` passes at 1e-4)."""
    for g, ref in zip(got, solo, strict=True):
        assert g.shape == ref.shape
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=0)
        assert (g.argmax(-1) == ref.argmax(-1)).all()
    for cache, ref_cache, ref_h in zip(caches, solo_caches, solo_hidden, strict=True):
        assert b.cache_length(cache) == b.cache_length(ref_cache)
        for layer, ref in zip(cache.layers, ref_cache.layers, strict=True):
            torch.testing.assert_close(layer.keys, ref.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, ref.values, atol=1e-4, rtol=1e-4)
        got_h = b.take_hidden(cache)
        if capture:
            assert got_h.shape == ref_h.shape
            torch.testing.assert_close(got_h, ref_h, atol=1e-3, rtol=1e-3)
        else:
            assert got_h is None and ref_h is None


@pytest.mark.slow
@needs_kernel
def test_a_ragged_step_within_the_kernels_rows_gives_each_sequence_its_solo_logits(
        smol, smol_prompts):
    """Per-sequence attention plus the few-row kernel (each row's sums independent of the
    others, up to `few_rows.MAX_ROWS` rows): a batched step of 8 sequences (plain steps, a
    chain, a tree; 16 rows) gets, bit for bit, the logits and K/V each sequence gets alone."""
    from nodes.backends import few_rows

    prompts = smol_prompts[:8]
    feeds = [([p[-1]], [-1]) for p in prompts]
    feeds[1] = ([prompts[1][-1], 11, 12, 13], [-1, 0, 1, 2])
    feeds[5] = ([prompts[5][-1], 5, 6, 7, 8], [-1, 0, 0, 1, 2])
    assert sum(len(f[0]) for f in feeds) <= few_rows.MAX_ROWS

    alone_caches, batch_caches = primed_caches(smol, prompts), primed_caches(smol, prompts)
    alone = [smol.forward_batch([c], [f])[0] for c, f in zip(alone_caches, feeds, strict=True)]
    batched = smol.forward_batch(batch_caches, feeds)
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert np.array_equal(a, b), f"sequence {i}"
    for a, b in zip(alone_caches, batch_caches, strict=True):
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(a.layers, b.layers, strict=True))
