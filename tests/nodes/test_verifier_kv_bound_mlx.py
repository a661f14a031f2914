"""A real MLX verifier process with `--kv-sink 4 --kv-window 32` (the embedded SmolLM2 on
mlx-lm, its own ngram drafter): its card says the bound, its speculative output equals plain
decoding under the same bound, which equals this process's bounded MLX engine."""

from __future__ import annotations

import pytest

from nodes.cluster_client import GenerateRequest
from tests.nodes.conftest import client_of, one_verifier
from tests.nodes.test_verifier_kv_bound import PROMPT, SINK, WINDOW

#: tokens per generation: the chat prompt alone (62 tokens) passes the 4 + 32 bound, and each
#: MLX token costs ~0.4 s on one slow CPU core (80, the torch test's length, took 110 s here)
MAX = 40

pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def bounded_mlx(tmp_path_factory):
    c = one_verifier(tmp_path_factory, "--backend", "mlx", "--drafter", "ngram",
                     "--kv-sink", str(SINK), "--kv-window", str(WINDOW))
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_a_bounded_mlx_verifier_is_lossless_and_says_its_bound(bounded_mlx):
    from nodes.backends.mlx_backend import MlxBackend
    from nodes.engine import Engine, GenerationParams

    with client_of(bounded_mlx) as client:
        v = client.verifiers(60)[0]
        assert v.card.backend == "mlx" and v.card.extras.get("kv_bound") == [SINK, WINDOW]
        plain = client.generate(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False), v)
        spec = client.generate(GenerateRequest(PROMPT, max_tokens=MAX), v)
    assert spec.stats["token_ids"] == plain.stats["token_ids"]
    assert spec.stats["drafted"] > 0
    b = MlxBackend.load("smollm2-135m")
    b.bound_kv(SINK, WINDOW)
    ids = b.tokenizer.encode(PROMPT, chat=True)
    local = Engine(b, None).generate(ids, GenerationParams(max_tokens=MAX))
    assert plain.stats["token_ids"] == local.token_ids
