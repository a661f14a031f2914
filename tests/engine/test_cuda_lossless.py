"""The engine on a CUDA device (skipped without one; the device machine runs it): greedy output
through the torch backend on CUDA, plain and speculative (scripted chains of every quality, the
ngram drafter, a batch in the batch-invariant mode), is token for token Hugging Face
`generate(do_sample=False)` on the same device. The quantized forward is CPU-only; a CUDA
verifier computes in fp32 through transformers (docs/engine/quantized.md)."""

from __future__ import annotations

import pytest
import torch

from nodes.engine import Engine, GenerationParams
from tests.engine.conftest import ScriptedDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the device machine runs it)")

N = 24
PARAMS = GenerationParams(max_tokens=N, eos_token_ids=frozenset())


@pytest.fixture(scope="module")
def cuda_backend(tiny_folder):
    from nodes.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(str(tiny_folder), device="cuda")
    assert backend.device == "cuda" and backend.weights == "fp32"
    return backend


def _hf(backend, ids):
    ids_t = torch.tensor([list(ids)], device="cuda")
    out = backend.model.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                                 max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_plain_is_hf_greedy_on_cuda(cuda_backend, prompt_ids):
    assert Engine(cuda_backend, None).generate(prompt_ids, PARAMS).token_ids == \
        _hf(cuda_backend, prompt_ids)


@pytest.mark.parametrize("mode", ["perfect", "random", "wrong"])
def test_speculation_is_hf_greedy_on_cuda(cuda_backend, prompt_ids, mode):
    ref = _hf(cuda_backend, prompt_ids)
    drafter = ScriptedDrafter(list(prompt_ids) + ref, mode, cuda_backend.vocab_size)
    gen = Engine(cuda_backend, drafter, max_draft=8).generate(prompt_ids, PARAMS)
    assert gen.token_ids == ref
    if mode == "perfect":
        assert gen.stats.accepted > 0


def test_ngram_speculation_is_hf_greedy_on_cuda(cuda_backend, prompt_ids):
    from nodes.drafters.registry import make_drafter

    ids = list(prompt_ids) * 3
    gen = Engine(cuda_backend, make_drafter("ngram", cuda_backend)).generate(ids, PARAMS)
    assert gen.token_ids == _hf(cuda_backend, ids)


def test_a_batch_in_the_invariant_mode_is_each_solo_output_on_cuda(cuda_backend, prompt_ids):
    prompts = [list(prompt_ids), list(prompt_ids[:5]), list(prompt_ids[3:]),
               list((prompt_ids * 3)[:30])]
    solo = [_hf(cuda_backend, p) for p in prompts]
    cuda_backend.batch_invariant = True
    try:
        engine = Engine(cuda_backend, None)
        live = {i: engine.start(p, PARAMS) for i, p in enumerate(prompts)}
        out = {i: [] for i in live}
        while live:
            order = sorted(live)
            for i, block in zip(order, engine.step_batch([live[i] for i in order]),
                                strict=True):
                out[i] += block.token_ids
            for i in order:
                if live[i].finish_reason is not None:
                    live.pop(i).close()
    finally:
        cuda_backend.batch_invariant = False
    assert [out[i] for i in range(len(prompts))] == solo
