"""A real verifier process with `--kv-sink 4 --kv-window 32` (the embedded SmolLM2 in fp32, its
own ngram drafter): its card says the bound, its speculative output (drafts accepted) equals
plain decoding under the same bound, which equals this process's bounded engine."""

from __future__ import annotations

import pytest

from nodes.cluster_client import GenerateRequest
from tests.nodes.conftest import client_of, one_verifier

PROMPT = ("Copy this list exactly, twice: apple, banana, cherry, date, elderberry, fig, "
          "grape, honeydew, kiwi, lemon, mango.")
MAX = 80
SINK, WINDOW = 4, 32


@pytest.fixture(scope="module")
def bounded_cluster(tmp_path_factory):
    c = one_verifier(tmp_path_factory, "--weights", "fp32", "--drafter", "ngram",
                     "--kv-sink", str(SINK), "--kv-window", str(WINDOW))
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_a_bounded_verifier_is_lossless_and_says_its_bound(bounded_cluster):
    from nodes.backends.torch_backend import TorchBackend
    from nodes.engine import Engine, GenerationParams

    with client_of(bounded_cluster) as client:
        v = client.verifiers(60)[0]
        assert v.card.extras.get("kv_bound") == [SINK, WINDOW]
        assert v.card.extras.get("kv_positions") == "reindexed"
        plain = client.generate(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False), v)
        spec = client.generate(GenerateRequest(PROMPT, max_tokens=MAX), v)
    assert spec.stats["token_ids"] == plain.stats["token_ids"]
    assert spec.stats["accepted"] > 0
    b = TorchBackend.load("smollm2-135m", device="cpu", weights="fp32")
    b.bound_kv(SINK, WINDOW)
    ids = b.tokenizer.encode(PROMPT, chat=True)
    local = Engine(b, None).generate(ids, GenerationParams(max_tokens=MAX))
    assert plain.stats["token_ids"] == local.token_ids
