"""Hybrid caches: sliding-window layers beside full ones (Gemma 2/3, Qwen 2/3, Mistral, Phi 3),
random-weight tiny models built from configs (no download), windows of 8 so every test
crosses them many times. Greedy speculative output equals Hugging Face
`generate(do_sample=False)` (whose caches are transformers' own sliding layers) for chains,
trees, rollback after rejected drafts, a batch of 4, prefix reuse and hidden-state capture."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import Engine, GenerationParams
from nodes.engine.prefix_cache import PrefixCache
from tests.engine.conftest import (
    DecoyTree,
    _tokenizer_files,
    hf_greedy,
    step_together,
    stream_checked,
)

N = 40
WINDOW = 8
EOS_NONE = frozenset({49151})
FAMILIES = ("gemma2", "gemma3", "qwen2", "qwen3", "mistral", "phi3")


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=False)  # tied Gemmas repeat their last token
    if family == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0)
    if family == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **common, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16)
    if family in ("qwen2", "qwen3"):
        cls, cfg = ((tf.Qwen2ForCausalLM, tf.Qwen2Config) if family == "qwen2"
                    else (tf.Qwen3ForCausalLM, tf.Qwen3Config))
        return cls, cfg(**common, num_hidden_layers=3, use_sliding_window=True,
                        sliding_window=WINDOW, max_window_layers=1,
                        layer_types=["full_attention", "sliding_attention",
                                     "sliding_attention"])
    if family == "mistral":
        return tf.MistralForCausalLM, tf.MistralConfig(**common, num_hidden_layers=2,
                                                       sliding_window=WINDOW)
    if family == "phi3":
        return tf.Phi3ForCausalLM, tf.Phi3Config(**common, num_hidden_layers=2,
                                                 sliding_window=WINDOW)
    raise ValueError(family)


def build_family(folder, tokenizer_src, family: str, seed: int = 0) -> None:
    import torch

    torch.manual_seed(seed)
    cls, cfg = _config(family)
    cls(cfg).save_pretrained(folder)
    _tokenizer_files(tokenizer_src, folder)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    folder = tmp_path_factory.mktemp(request.param)
    build_family(folder, smollm2_folder, request.param)
    backend = TorchBackend.load(str(folder), device="cpu")
    assert backend.windowed, f"{request.param}: no sliding-window layer in the tiny config"
    return request.param, backend


PROMPTS = ("The quick brown fox jumps over the lazy dog. The quick",
           "Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13",
           "def main():\n    return")


@pytest.fixture(scope="module")
def refs(family):
    _, b = family
    prompts = [b.tokenizer.encode(p) for p in PROMPTS]
    return [(p, hf_greedy(b, p, N + 8, eos_id=49151)) for p in prompts]


def test_reference_varies(refs):
    assert all(len(set(ref)) > 5 for _, ref in refs)


@pytest.mark.parametrize("mode,k", [("random", 3), ("wrong", 4), ("perfect", 8), ("random", 12)])
def test_chain_matches_hf(family, refs, scripted, mode, k):
    _, b = family
    prompt, ref = refs[0]
    drafter = scripted(prompt + ref, mode, b.vocab_size, seed=k)
    out, stats = stream_checked(Engine(b, drafter, fixed_k=k), prompt,
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert out == ref[:N]
    assert stats.drafted > 0


@pytest.mark.parametrize("k", [4, 12])
def test_tree_matches_hf(family, refs, k):
    _, b = family
    prompt, ref = refs[0]
    source = DecoyTree(prompt + ref, b.vocab_size, seed=k)
    out, stats = stream_checked(Engine(b, fixed_k=k), prompt,
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE),
                                sources=[source])
    assert out == ref[:N]
    assert stats.tree_blocks > 0 and stats.accepted > 0


def test_tree_logits_equal_chain_logits_past_the_window(family, refs):
    """A tree over a past longer than the window: each path's rows equal a chain's."""
    _, b = family
    prompt, ref = refs[0]
    prefix = (prompt + ref)[:2 * WINDOW + 3]
    tokens = [prefix[-1], 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    parents = [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # two branches, each deeper than the window
    cache = b.new_cache()
    b.forward(cache, prefix[:-1])
    tree = b.forward_tree(cache, tokens, parents)
    for leaf in (9, 10):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        path = path[::-1]
        chain_cache = b.new_cache()
        b.forward(chain_cache, prefix[:-1])
        chain = b.forward(chain_cache, [tokens[i] for i in path])
        np.testing.assert_allclose(tree[path], chain, atol=1e-4, rtol=0)


def test_batch_of_four_matches_hf(family, refs, scripted):
    _, b = family
    engine = Engine(b, None, fixed_k=4)
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    seqs = []
    for i, (p, ref) in enumerate(refs):
        drafter = scripted(p + ref, "random", b.vocab_size, seed=i)
        sources = [drafter.open_source(p, params.sampling)] if i % 2 == 0 else [
            DecoyTree(p + ref, b.vocab_size, seed=i)]
        seqs.append(engine.start(p, params, sources=sources))
    out = step_together(engine, seqs)
    for q in seqs:
        q.close()
    assert out == [ref[:N] for _, ref in refs]


def test_prefix_reuse_past_the_window(family, refs, scripted):
    """A second prompt sharing a prefix longer than the window starts from the first one's
    cache and still decodes as HF does."""
    _, b = family
    prompt, ref = refs[0]
    engine = Engine(b, None, prefix_cache=PrefixCache(b, 1 << 26))
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    first, _ = stream_checked(engine, prompt, params)
    assert first == ref[:N]
    longer = prompt + ref[:3 * WINDOW]
    expected = hf_greedy(b, longer, 16, eos_id=49151)
    out, stats = stream_checked(engine, longer,
                                GenerationParams(max_tokens=16, eos_token_ids=EOS_NONE))
    assert stats.reused >= 2 * WINDOW
    assert out == expected


def test_hidden_states_captured_past_the_window(family, refs):
    """Captured layer inputs on a windowed model equal the model's own hidden states."""
    import torch

    _, b = family
    prompt, ref = refs[0]
    ids = (prompt + ref)[:3 * WINDOW]
    cache = b.new_cache()
    b.capture_hidden(cache, (0, 1))
    b.forward(cache, ids[:2 * WINDOW])
    b.take_hidden(cache)
    b.forward(cache, ids[2 * WINDOW:])
    got = b.take_hidden(cache)
    with torch.inference_mode():
        full = b.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.stack([full[0][0, 2 * WINDOW:], full[1][0, 2 * WINDOW:]], dim=1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
