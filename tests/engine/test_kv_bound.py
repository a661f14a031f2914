"""Bounded K/V (`--kv-sink S --kv-window W`): every full-attention layer attends to the first S
positions and the last W (a band, a function of the tokens alone) and keeps only those K/V; the
sinks' positions are re-indexed as StreamingLLM's (a query at q meets sink s at distance
min(q, S + W - 1) - s). Plain decoding equals a from-scratch eager forward under the same band
and sink distances at every step; speculative decoding (chains, trees, a batch of 4) equals
plain decoding under the same bound; the K/V bytes are the same at 1,000 and 4,000 positions;
bad bounds are refused."""

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
    node_path,
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


def _reference_logits(b, ids, reindex=True):
    """Logits [len(ids), vocab] of a from-scratch forward of `ids`, written independently of
    the product: the model's own modules, an eager attention (`_ReferenceAttention`) over all
    positions under the band mask (full layers: sinks + window; sliding layers: their own
    window), the sinks scored, for a query at q >= S + W, with the query rotated back by
    q - (S + W - 1) by the model's own rotary embedding (`reindex`; else absolute)."""
    from transformers import AttentionInterface

    model = b.model
    kinds = getattr(model.config, "layer_types", None)
    L = len(ids)
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    masks = {"full_attention": (k <= q) & ((k > q - WINDOW) | (k < SINK))}
    if kinds and "sliding_attention" in kinds:
        masks["sliding_attention"] = (k <= q) & (k > q - model.config.sliding_window)
    back = torch.clamp(torch.arange(L) - (SINK + WINDOW - 1), min=0)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, dtype=torch.float32)
    extra = {"layer_type": "full_attention"} if kinds else {}
    cos, sin = rotary(x, back[None], **extra)
    scale = getattr(rotary, "attention_scaling", None)
    if scale is None:
        scale = getattr(rotary, "full_attention_attention_scaling", 1.0)
    cos, sin = cos / scale, sin / scale
    ref = _ReferenceAttention(masks, kinds, cos, sin if reindex else None)
    AttentionInterface.register("bound_reference", ref)
    before = model.config._attn_implementation
    model.config._attn_implementation = "bound_reference"
    float_masks = {name: torch.zeros(1, 1, L, L) for name in masks}  # applied by ref itself
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), attention_mask=float_masks if kinds
                        else float_masks["full_attention"]).logits[0]
    finally:
        model.config._attn_implementation = before
    return out


class _ReferenceAttention:
    """Eager attention: scores q.k * scaling, the sinks' scores (full layers, rows past
    S + W - 1) from the query rotated back, the band mask, softmax, then the values."""

    def __init__(self, masks, kinds, cos, sin):
        self.masks, self.kinds, self.cos, self.sin = masks, kinds, cos, sin

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        from transformers.models.llama.modeling_llama import rotate_half

        kind = self.kinds[module.layer_idx] if self.kinds else "full_attention"
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if kind == "full_attention" and self.sin is not None:
            # rotate by -back: cos(-a) = cos(a), sin(-a) = -sin(a)
            q_back = query * self.cos[:, None] + rotate_half(query) * -self.sin[:, None]
            sink_scores = torch.matmul(q_back, key[..., :SINK, :].transpose(2, 3)) * scaling
            scores[..., :SINK] = sink_scores
        scores = scores.masked_fill(~self.masks[kind], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _band_reference(b, prompt, n):
    """Greedy decoding by `_reference_logits` of the whole sequence each step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_reference_logits(b, ids)[-1].argmax()))
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


def test_sink_positions_are_reindexed_past_the_bound(bounded, prompts, plain):
    """The product's logits of a whole sequence (a prefill) are the re-indexed reference's at
    every position; the absolute reference's below S + W - 1 (where the two models agree), and
    not past it (the re-indexing really applies)."""
    _, b = bounded
    ids = prompts[0] + plain[0]
    got = torch.from_numpy(b.forward(b.new_cache(), ids))
    reindexed, absolute = _reference_logits(b, ids), _reference_logits(b, ids, reindex=False)
    edge = SINK + WINDOW - 1
    torch.testing.assert_close(got, reindexed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:edge + 1], absolute[:edge + 1], rtol=1e-4, atol=1e-4)
    assert (got[edge + 8:] - absolute[edge + 8:]).abs().amax(-1).min() > 1e-3


def test_a_tree_holding_its_own_sinks_is_the_reference_model(bounded, prompts):
    """A draft tree fed after 2 positions, two branches from its root, both deeper than
    S + W: the sinks at positions 2 and 3 are the tree's own nodes (each branch its own
    position 3), found through the tree's visibility; every node's logits are the reference
    model's for its path."""
    _, b = bounded
    prefix, pool = prompts[0][:2], prompts[0][2:] + prompts[1] + prompts[3]
    parents = [-1] + list(range(0, 22)) + [0] + list(range(23, 44))  # 23 + 22 nodes
    tokens = [pool[i % len(pool)] for i in range(len(parents))]
    cache = b.new_cache()
    b.forward(cache, prefix)
    got = torch.from_numpy(b.forward_tree(cache, tokens, parents))
    for node in range(len(parents)):
        want = _reference_logits(b, prefix + node_path(tokens, parents, node))[-1]
        torch.testing.assert_close(got[node], want, rtol=1e-3, atol=5e-4)


def test_a_long_chain_goes_in_chunks_as_the_same_model(bounded, prompts, plain, monkeypatch):
    """A chain longer than `BOUNDED_CHUNK` (a prompt) is fed in chunks, each row's sink
    copies staying few: its logits are still the re-indexed reference's."""
    from nodes.backends import torch_batch

    _, b = bounded
    monkeypatch.setattr(torch_batch, "BOUNDED_CHUNK", 13)
    ids = prompts[0] + plain[0]
    got = torch.from_numpy(b.forward(b.new_cache(), ids))
    assert got.shape[0] == len(ids)
    # (chunks of 13 rows take the few-row kernel: float noise, not a model difference)
    torch.testing.assert_close(got, _reference_logits(b, ids), rtol=1e-3, atol=1e-3)


def test_rope_frequencies_from_the_config_are_the_models(bounded):
    """`rope_inv_freq` (from the config) rotates as the model's own rotary embedding does;
    Gemma 3's global layers and its sliding ones have different bases."""
    from nodes.backends.growing_cache import rope_inv_freq, rotate_forward

    _, b = bounded
    config, rotary = b.model.config, b.model.model.rotary_emb
    kinds = sorted(set(getattr(config, "layer_types", None) or [None]), key=str)
    pos = torch.tensor([[0, 1, 7, 300, 5000]])
    x = torch.randn(1, 2, 5, b.lean.head_dim if b.lean else config.head_dim
                    if getattr(config, "head_dim", None) else
                    config.hidden_size // config.num_attention_heads)
    freqs = {}
    for kind in kinds:
        extra = {"layer_type": kind} if kind else {}
        cos, sin = rotary(x, pos, **extra)
        inv = rope_inv_freq(config, kind)
        freqs[kind] = inv
        angle = pos[0, :, None].float() * inv[None]
        torch.testing.assert_close(torch.cat([angle, angle], -1).cos(), cos[0], rtol=0,
                                   atol=1e-6)
        # a key rotated at 3 then forward by p is the key rotated at 3 + p
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        c3, s3 = rotary(x, torch.full_like(pos, 3), **extra)
        at3, _ = apply_rotary_pos_emb(x, x, c3, s3)
        c, s = rotary(x, pos + 3, **extra)
        want, _ = apply_rotary_pos_emb(x, x, c, s)
        torch.testing.assert_close(rotate_forward(at3, pos[0], inv), want, rtol=1e-4,
                                   atol=1e-4)
    if len(freqs) > 1:
        assert not torch.equal(freqs["full_attention"], freqs["sliding_attention"])


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


def test_a_length_dependent_rope_is_refused_under_a_bound():
    """Dynamic NTK RoPE changes its frequencies with the length: a stored sink key's rotation
    could not be continued exactly, so such a model takes no bound (a clear error)."""
    from transformers import LlamaConfig

    from nodes.backends import growing_cache

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, intermediate_size=64,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                       "factor": 2.0})
    with pytest.raises(ValueError, match="change with the length"):
        growing_cache.new_cache(cfg, (SINK, WINDOW))
    assert growing_cache.new_cache(cfg) is not None  # unbounded: served as before


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 2048},
], ids=lambda r: r["rope_type"])
def test_rope_frequencies_of_each_scaling_type(rope):
    """`rope_inv_freq` against transformers' own Llama rotary embedding for the static RoPE
    types (yarn's attention scaling multiplies cos and sin there, once; a re-indexed sink's
    further rotation is a pure one)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from nodes.backends.growing_cache import rope_inv_freq

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=1, intermediate_size=64, rope_parameters=dict(rope),
                      max_position_embeddings=16384)
    rotary = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 9, 2047, 9000]])
    cos, _ = rotary(torch.zeros(1), pos)
    angle = pos[0, :, None].float() * rope_inv_freq(cfg)[None]
    torch.testing.assert_close(torch.cat([angle, angle], -1).cos(),
                               cos[0] / rotary.attention_scaling, rtol=0, atol=2e-6)
