"""Writing EAGLE-3 head checkpoints for tests, in the published layout, without our saver.

The tensors are written with `safetensors` directly under the names vLLM/SGLang read, so the
loader is tested against the layout itself, not against its own writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, INTER = 64, 4, 2, 96  # the tiny verifier's hidden size is 64


def head_tensors(vocab: int = 49152, draft_vocab: int = 512, hidden: int = HIDDEN,
                 feature: int = HIDDEN, seed: int = 0, own_embedding: bool = False,
                 scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    hd = hidden // HEADS
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    out = {
        "fc.weight": r(hidden, 3 * feature),
        "midlayer.self_attn.q_proj.weight": r(HEADS * hd, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(KV_HEADS * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(KV_HEADS * hd, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": r(hidden, HEADS * hd),
        "midlayer.mlp.gate_proj.weight": r(INTER, hidden),
        "midlayer.mlp.up_proj.weight": r(INTER, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, INTER),
        "midlayer.input_layernorm.weight": 1 + r(hidden),
        "midlayer.hidden_norm.weight": 1 + r(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden),
        "norm.weight": 1 + r(hidden),
        "lm_head.weight": r(draft_vocab, hidden),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if own_embedding:
        out["embed_tokens.weight"] = r(vocab, hidden)
    return out


def head_config(vocab: int = 49152, draft_vocab: int = 512, hidden: int = HIDDEN,
                layer_ids=(0, 1, 1), target_hidden: int | None = None) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
    }
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    return cfg


def write_head(folder, tensors: dict, config: dict, dtype=torch.float16) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder
