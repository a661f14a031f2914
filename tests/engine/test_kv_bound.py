"""Bounded K/V (`--kv-sink S --kv-window W`): every full-attention layer attends to the first S
positions and the last W (a band over absolute positions, a function of the tokens alone) and
keeps only those K/V. Plain decoding equals a from-scratch forward under the same band mask at
every step; speculative decoding (chains, trees, a batch of 4) equals plain decoding under the
same bound; the K/V bytes are the same at 1,000 and 4,000 positions; bad bounds are refused."""

from __future__ import annotations

import pytest
import torch

from nodes.backends.torch_backend import TorchBackend, check_kv_bound
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from tests.engine.conftest import (
    DecoyTree,
    check_overlay_commits,
    kv_bytes_after,
    step_together,
    stream_checked,
)
from tests.engine.test_hybrid_cache import EOS_NONE, build_family

SINK, WINDOW = 4, 16
N = 48


@pytest.fixture(scope="module", params=["lean", "transformers", "gemma3"])
def bounded(request, tiny_folder, tmp_path_factory, smollm2_folder):
    """The tiny Llama through the lean forward and through transformers' own, and a tiny
    Gemma 3 (sliding layers keep their own window; the full layer takes the bound)."""
    if request.param == "gemma3":
        folder = tmp_path_factory.mktemp("gemma3_bound")
        build_family(folder, smollm2_folder, "gemma3")
    else:
        folder = tiny_folder
    b = TorchBackend.load(str(folder), device="cpu")
    if request.param == "transformers":
        b.lean = None
    b.bound_kv(SINK, WINDOW)
    return request.param, b


@pytest.fixture(scope="module")
def prompts(bounded):
    _, b = bounded
    text = ("The quick brown fox jumps over the lazy dog, and then the dog chases the fox "
            "around the old barn twice before")
    return [b.tokenizer.encode(text), b.tokenizer.encode("Once upon a time"),
            b.tokenizer.encode("1, 2, 3, 4, 5, 6"), b.tokenizer.encode("def f(x):\n")]


def _band_reference(b, prompt, n):
    """Greedy decoding by a from-scratch forward of the whole sequence each step, full layers
    under the sink + window band mask (sliding layers under their own window)."""
    ids = list(prompt)
    model = b.model
    kinds = getattr(model.config, "layer_types", None)
    for _ in range(n):
        L = len(ids)
        q = torch.arange(L)[:, None]
        k = torch.arange(L)[None, :]
        band = (k <= q) & ((k > q - WINDOW) | (k < SINK))
        masks = {"full_attention": band}
        if kinds and "sliding_attention" in kinds:
            masks["sliding_attention"] = (k <= q) & (k > q - model.config.sliding_window)
        as_float = {name: torch.zeros(1, 1, L, L).masked_fill(~m, torch.finfo(torch.float32).min)
                    for name, m in masks.items()}
        mask = as_float if len(as_float) > 1 else as_float["full_attention"]
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), attention_mask=mask).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def plain(bounded, prompts):
    _, b = bounded
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    return [stream_checked(Engine(b, None), p, params)[0] for p in prompts]


def test_plain_bounded_decoding_is_the_band_model(bounded, prompts, plain):
    _, b = bounded
    assert len(prompts[0]) > SINK + WINDOW  # a prompt longer than the bound
    assert plain[0] == _band_reference(b, prompts[0], N)


def test_the_bound_changes_the_output(bounded, prompts, plain):
    from tests.engine.conftest import hf_greedy

    _, b = bounded
    assert plain[0] != hf_greedy(b, prompts[0], N, eos_id=49151)


@pytest.mark.parametrize("mode,k", [("random", 3), ("wrong", 4), ("perfect", 8),
                                    ("random", 12)])
def test_chain_equals_plain_under_the_bound(bounded, prompts, plain, scripted, mode, k):
    _, b = bounded
    drafter = scripted(prompts[0] + plain[0], mode, b.vocab_size, seed=k)
    out, stats = stream_checked(Engine(b, drafter, fixed_k=k), prompts[0],
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert out == plain[0] and stats.drafted > 0


@pytest.mark.parametrize("k", [4, 12])
def test_tree_equals_plain_under_the_bound(bounded, prompts, plain, k):
    _, b = bounded
    source = DecoyTree(prompts[0] + plain[0], b.vocab_size, seed=k)
    out, stats = stream_checked(Engine(b, fixed_k=k), prompts[0],
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE),
                                sources=[source])
    assert out == plain[0] and stats.tree_blocks > 0


def test_batch_of_four_equals_plain_under_the_bound(bounded, prompts, plain, scripted):
    _, b = bounded
    engine = Engine(b, None, fixed_k=4)
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    seqs = []
    for i, (p, ref) in enumerate(zip(prompts, plain, strict=True)):
        sources = ([scripted(p + ref, "random", b.vocab_size, seed=i).open_source(
            p, params.sampling)] if i % 2 == 0 else [DecoyTree(p + ref, b.vocab_size, seed=i)])
        seqs.append(engine.start(p, params, sources=sources))
    out = step_together(engine, seqs)
    for q in seqs:
        q.close()
    assert out == plain


def test_resume_from_committed_tokens_equals_plain(bounded, prompts, plain):
    """A failover resume re-prefills prompt + what was committed: the band model is a function
    of the tokens, so it goes on as the uninterrupted run did."""
    _, b = bounded
    cut = N // 2
    resumed, _ = stream_checked(Engine(b, None), prompts[0] + plain[0][:cut],
                                GenerationParams(max_tokens=N - cut, eos_token_ids=EOS_NONE))
    assert resumed == plain[0][cut:]


def test_kv_bytes_are_constant_past_the_bound(bounded):
    name, b = bounded
    at_1k, at_4k = kv_bytes_after(b, 1000)[0], kv_bytes_after(b, 4000)[0]
    assert at_1k == at_4k
    if name == "gemma3":  # two sliding layers (window 8) trimmed too, one full layer bounded
        per_layer = 2 * 2 * 16 * 4
        assert at_1k == per_layer * (8 * 2 + SINK + WINDOW)
        return
    per_row = 2 * b.model.config.num_hidden_layers * b.model.config.num_key_value_heads * (
        b.model.config.hidden_size // b.model.config.num_attention_heads) * 4
    assert at_1k == per_row * (SINK + WINDOW)  # resident: the band alone


@pytest.mark.parametrize("sink,window,why", [
    (0, 64, "--kv-sink 0"), (-1, 64, "--kv-sink -1"), (4, 0, "--kv-window 0"),
    (4, -5, "--kv-window -5"), (4, 10**9, "absurd"), (4, None, "go together"),
    (None, 64, "go together"), (4, 1021, "context"), (2.5, 64, "whole number")])
def test_bad_bounds_are_refused(sink, window, why):
    class Cfg:
        max_position_embeddings = 1024

    with pytest.raises(BadRequestError, match=why):
        check_kv_bound(sink, window, Cfg())


def test_no_bound_is_none():
    assert check_kv_bound(None, None) is None


def test_the_overlay_holds_only_a_forwards_rows_and_commits_what_stays(bounded):
    """Resident K/V: sinks + window rows; a verify's fed rows live in a transient overlay that
    the crop commits (accepted rows) and frees; a rollback past the held band is refused."""
    name, b = bounded
    if name == "gemma3":
        return  # the layer mix is covered by the bytes test above
    check_overlay_commits(b, lambda cache: cache.layers[0]._work_k is None
                          and cache.layers[0].get_seq_length() == 202)


def test_kv_bytes_are_the_same_at_16k(bounded):
    name, b = bounded
    if name != "lean":
        return
    assert kv_bytes_after(b, 16000)[0] == kv_bytes_after(b, 1000)[0]


def test_a_next_turn_starts_from_the_last_ones_bounded_kv(bounded, prompts, plain):
    """Prefix reuse under the bound (issue 45): turn 2 (turn 1's prompt and answer, then
    more) takes the whole of turn 1's K/V from the prefix cache, its band as it was; a prompt
    sharing only a short prefix with it, whose window the kept cache no longer holds, is
    prefilled whole. Both decode as an engine without the cache does."""
    from nodes.engine.prefix_cache import PrefixCache

    _, b = bounded
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    engine = Engine(b, None, prefix_cache=PrefixCache(b, 64 << 20))
    first, _ = stream_checked(engine, prompts[0], params)  # kept when it ends
    assert first == plain[0]
    held = len(prompts[0]) + N - 1  # its cache: the prompt and all but the last token
    turn2 = prompts[0] + plain[0] + prompts[1]
    got, stats = stream_checked(engine, turn2, params)
    assert stats.reused == held
    assert got == stream_checked(Engine(b, None), turn2, params)[0]
    short = prompts[0][:SINK + WINDOW + 4] + prompts[2]
    got, stats = stream_checked(engine, short, params)
    assert stats.reused == 0  # its window was dropped from the kept cache
    assert got == stream_checked(Engine(b, None), short, params)[0]
