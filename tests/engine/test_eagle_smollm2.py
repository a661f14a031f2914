"""An EAGLE-3 head on the real SmolLM2-135M (slow): a random head of the real shape (hidden
576, 9 heads / 3 KV heads, layers 2/15/27, an 8192-token draft vocabulary) round-trips
through the published layout and keeps greedy output identical to HF, with trees."""

from __future__ import annotations

import pytest
import torch

from nodes.drafters.eagle.checkpoint import save_head
from nodes.drafters.registry import make_drafter
from nodes.engine import Engine, GenerationParams
from nodes.training.train import new_head
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(smollm2_folder), device="cpu")


def test_a_random_head_of_the_real_shape_is_lossless_on_smollm2(smollm2, tmp_path):
    ids = torch.sort(torch.randperm(smollm2.vocab_size,
                                    generator=torch.Generator().manual_seed(0))[:8192]).values
    head = new_head(smollm2, ids, (2, 15, 27))
    save_head(tmp_path, head, {"tokenizer_fingerprint": smollm2.fingerprint})
    assert (tmp_path / "model.safetensors").stat().st_size < 25e6
    drafter = make_drafter(f"eagle:{tmp_path}", smollm2)
    assert drafter.layers == (2, 15, 27)
    prompt = smollm2.tokenizer.encode("Write a short poem about the sea.", chat=True)
    eos = min(smollm2.tokenizer.eos_token_ids)
    params = GenerationParams(max_tokens=24)
    gen = Engine(smollm2, drafter, fixed_k=6).generate(prompt, params)
    assert gen.token_ids == hf_greedy(smollm2, prompt, 24, eos)
    assert gen.stats.tree_blocks > 0 and gen.stats.drafter_errors == 0


def test_the_shipped_head_loads_offline_and_stays_lossless(smollm2):
    """`--drafter eagle` with no path: the head in the package, for this very verifier."""
    import configparser
    import json

    from nodes.drafters.eagle.source import SHIPPED_HEAD

    if not (SHIPPED_HEAD / "config.json").exists():
        pytest.skip("no head shipped")
    assert (SHIPPED_HEAD / "model.safetensors").stat().st_size <= 25e6
    meta = json.loads((SHIPPED_HEAD / "specbus_head.json").read_text())
    assert meta["tokenizer_fingerprint"] == smollm2.fingerprint
    cfg = configparser.ConfigParser()
    cfg.read(SHIPPED_HEAD.parents[3] / "setup.cfg")
    declared = cfg["options.package_data"]["nodes.drafters.eagle"].split()
    assert sorted(declared) == sorted(f"smollm2_head/{p.name}" for p in SHIPPED_HEAD.iterdir()
                                      if not p.name.startswith("."))
    drafter = make_drafter("eagle", smollm2)
    prompt = smollm2.tokenizer.encode("Tell me about the tallest mountains on Earth.",
                                      chat=True)
    eos = min(smollm2.tokenizer.eos_token_ids)
    gen = Engine(smollm2, drafter, fixed_k=8).generate(prompt, GenerationParams(max_tokens=32))
    assert gen.token_ids == hf_greedy(smollm2, prompt, 32, eos)
    assert gen.stats.accepted > 0 and gen.stats.drafter_errors == 0


def test_on_a_cpu_the_shipped_head_drafts_int8_and_agrees_with_its_fp32_self(smollm2):
    """int8 weights must keep the head's predictions: on the verifier's real features of a
    chat answer the int8 head's top token equals the fp32 head's at most positions and hits
    the verifier's next token as often, give or take a little. Weight-only int8 (the few-row
    kernel) quantizes every linear, `fc` included; the dynamic-int8 fallback all but `fc`
    (which reads the verifier's outlier-heavy hidden states)."""
    from nodes.backends import w8
    from nodes.drafters.eagle.cache import HeadCache
    from nodes.drafters.eagle.source import SHIPPED_HEAD, EagleDrafter

    if not (SHIPPED_HEAD / "config.json").exists():
        pytest.skip("no head shipped")
    int8 = EagleDrafter.load(None, smollm2)  # the default on a CPU
    fp32 = EagleDrafter.load(None, smollm2, int8=False)
    if w8.available() is None:
        assert isinstance(int8.head.fc, w8.W8Linear)
        assert isinstance(int8.head.lm_head, w8.W8Linear)
        floor = 0.95
    else:
        assert isinstance(int8.head.fc, torch.nn.Linear)
        assert not isinstance(int8.head.lm_head, torch.nn.Linear)  # a quantized module
        floor = 0.8
    assert isinstance(fp32.head.lm_head, torch.nn.Linear)
    prompt = smollm2.tokenizer.encode("How do tides work, and why are there two a day?",
                                      chat=True)
    answer = Engine(smollm2, None).generate(prompt, GenerationParams(max_tokens=96)).token_ids
    seq = prompt + answer
    cache = smollm2.new_cache()
    smollm2.capture_hidden(cache, int8.layers)
    smollm2.forward(cache, seq[:-1])
    feats = smollm2.take_hidden(cache)
    top = {}
    for name, d in (("int8", int8), ("fp32", fp32)):
        head = d.head
        own = HeadCache(head.cfg.num_key_value_heads, head.cfg.dim_head, torch.float32, "cpu")
        with torch.inference_mode():
            out = head.step(own, torch.tensor(seq[1:]), feats, torch.arange(len(seq) - 1))
            top[name] = head.target_ids()[head.logits(out).argmax(-1)][: len(seq) - 2]
    truth = torch.tensor(seq[2:])
    agree = (top["int8"] == top["fp32"]).float().mean().item()
    hit8 = (top["int8"] == truth).float().mean().item()
    hit32 = (top["fp32"] == truth).float().mean().item()
    print(f"int8/fp32 argmax agreement {agree:.3f}; top-1 {hit8:.3f} vs {hit32:.3f}")
    assert agree >= floor, agree
    assert hit8 >= hit32 - 0.05, (hit8, hit32)


def test_the_verifier_writes_varied_prompts_of_its_own(smollm2):
    """`train-drafter --self-prompts`: user turns sampled after the chat template's user
    header; kept only when the model ended them, each text once, the same for the same seed."""
    from nodes.training.data import model_written_prompts, user_turn_prefix

    prefix = smollm2.tokenizer.decode(user_turn_prefix(smollm2.tokenizer))
    assert prefix.rstrip().endswith("user")
    first = model_written_prompts(smollm2, 4, seed=3, batch=6)
    assert len(first) == 4 and len(set(first)) == 4 and all(p.strip() == p and p for p in first)
    assert model_written_prompts(smollm2, 4, seed=3, batch=6) == first
