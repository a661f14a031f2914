"""The suffix drafter in the engine, on the tiny random Llama: greedy output equals Hugging Face
`generate(do_sample=False)` whatever the global index holds, and an answer written once is
drafted whole the second time it is asked for (counted in verifier forwards, never timed)."""

from __future__ import annotations

import pytest

from nodes.drafters.suffix import SuffixDrafter, SuffixOptions
from nodes.engine import Engine, GenerationParams
from tests.engine.conftest import hf_greedy, stream_checked

N = 32
EOS_NONE = frozenset({49151})
PARAMS = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)


@pytest.fixture(scope="module")
def reference(tiny_torch, prompt_ids):
    return hf_greedy(tiny_torch, prompt_ids, N, eos_id=49151)


def fill(drafter: SuffixDrafter, reference, vocab: int) -> None:
    """Earlier outputs: unrelated ones, and related ones (the answer with wrong turns)."""
    for i in range(6):
        s = drafter.open([1, 2, 3], None)
        s.extend([(i * 977 + j * 131) % vocab for j in range(40)])
        s.close()
    for cut in (5, 12, 20):
        s = drafter.open([1, 2, 3], None)
        s.extend(reference[:cut] + [(t + 1) % vocab for t in reference[cut:]])
        s.close()


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("k", [4, None])
@pytest.mark.parametrize("indexed", ["empty", "filled"])
def test_suffix_chains_and_trees_match_hf(tiny_torch, prompt_ids, reference, width, k, indexed):
    drafter = SuffixDrafter(SuffixOptions(width=width, factor=2.0))
    if indexed == "filled":
        fill(drafter, reference, tiny_torch.vocab_size)
    out, stats = stream_checked(Engine(tiny_torch, drafter, fixed_k=k), prompt_ids, PARAMS)
    assert out == reference
    if indexed == "filled":
        assert stats.accepted > 0


def test_the_second_identical_request_is_drafted_whole(tiny_torch, prompt_ids, reference):
    drafter = SuffixDrafter()
    engine = Engine(tiny_torch, drafter, fixed_k=16)
    first, s1 = stream_checked(engine, prompt_ids, PARAMS)
    assert drafter.index.stats()["documents"] == 1  # the finished output, at close
    second, s2 = stream_checked(engine, prompt_ids, PARAMS)
    assert first == second == reference
    # the prompt's hash files the answer (outputs only): prefill, then 16 drafted + 1, then
    # the last 13 + 1 (suffix matching alone ramped 2, 5, 11: 5 forwards)
    assert s2.accepted == N - 3 and s2.blocks == 3 < s1.blocks, (s1.blocks, s2.blocks)
    shared = SuffixDrafter(SuffixOptions(prompts=True))
    engine = Engine(tiny_torch, shared, fixed_k=16)
    stream_checked(engine, prompt_ids, PARAMS)
    _, s3 = stream_checked(engine, prompt_ids, PARAMS)
    # the prompt indexed too: the answer is matched from its first token on
    assert s3.accepted == N - 3 and s3.blocks == 3, s3  # prefill + 2 blocks of <= 16


def test_a_source_sees_the_last_block_before_close(tiny_torch, prompt_ids, reference):
    drafter = SuffixDrafter()
    stream_checked(Engine(tiny_torch, drafter, fixed_k=4), prompt_ids, PARAMS)
    doc = drafter.index.docs[0]
    stored = list(drafter.index.tokens[doc.start + 1 : doc.end - 1])  # between START and SEP
    assert stored == reference


@pytest.mark.parametrize("name", ["agent_tools", "sql_schema", "file_edits"])
def test_the_traces_load_and_encode(tiny_torch, name):
    from tools.bench_suffix import encode_request, load_trace

    requests = load_trace(name)
    assert len(requests) >= 10
    for req in requests:
        assert len(encode_request(tiny_torch.tokenizer, req)) > 20


def test_the_micro_benchmark_stays_within_its_budget():
    from tools.bench_suffix import micro

    out = micro(20_000, "suffix:budget=0.25")
    assert out["evicted"] > 0 and out["index_bytes"] <= out["budget_bytes"]
    assert out["drafted_per_call"] > 0 and out["draft_us_per_call"] > 0
