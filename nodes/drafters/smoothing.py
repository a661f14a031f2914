"""SmoothQuant-style activation smoothing for a Llama-family torch model before int8 quantisation.

Why: dynamic int8 quantises each Linear's *input* per tensor, and a few channels of those inputs
are tens of times larger than the rest, so every other channel loses its precision. Dividing an
input channel by s and multiplying the matching weight column by s leaves the product unchanged
in exact arithmetic (the division folds into the RMSNorm weight or the producing Linear) but moves
the outliers from activations into weights, which are quantised per output channel and cope.
Xiao et al., "SmoothQuant" (2022): s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha).

The channel maxima come from a short built-in calibration text (prose, code, dialogue), never from
the prompts being served.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# Calibration text: varied registers so outlier channels of each kind show up; not a benchmark
# prompt. A few hundred tokens are enough for stable channel maxima.
CALIBRATION_TEXTS: tuple[str, ...] = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]",
    "Q: How many legs does a spider have? A: Eight. Q: What is the capital of Japan? A: Tokyo. "
    "Q: Why do leaves change colour in autumn? A: Chlorophyll breaks down, revealing other "
    "pigments.",
)

DEFAULT_ALPHA = 0.7  # 0.6-0.7 agreed best with fp32 on SmolLM2-135M; 0.5 and 0.85 were worse


# Decoders whose RMSNorm multiplies by `weight` (Gemma's multiplies by 1 + weight: not foldable so)
SMOOTHABLE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def is_llama_like(model: Any) -> bool:
    """Whether the model has the decoder layout smoothing knows how to fold (Llama family)."""
    if getattr(getattr(model, "config", None), "model_type", None) not in SMOOTHABLE_TYPES:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    first = layers[0]
    attn, mlp = getattr(first, "self_attn", None), getattr(first, "mlp", None)
    return (
        all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and hasattr(first, "input_layernorm")
        and hasattr(first, "post_attention_layernorm")
    )


def input_absmax(model: Any, token_batches: Iterable[Sequence[int]]) -> dict[str, Any]:
    """Per-channel max |input| of every layer's q_proj, gate_proj and down_proj over the batches."""
    import torch

    wanted = {}
    for i, layer in enumerate(model.model.layers):
        wanted[layer.self_attn.q_proj] = f"{i}.qkv"
        wanted[layer.mlp.gate_proj] = f"{i}.gate_up"
        wanted[layer.mlp.down_proj] = f"{i}.down"
    stats: dict[str, Any] = {}

    def record(module, inputs, _output):
        x = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
        key = wanted[module]
        stats[key] = torch.maximum(stats[key], x) if key in stats else x

    hooks = [m.register_forward_hook(record) for m in wanted]
    try:
        with torch.no_grad():
            for ids in token_batches:
                model(torch.tensor([list(ids)], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return stats


def _scales(act_max, linears, alpha: float):
    import torch

    w_max = torch.stack([m.weight.detach().abs().amax(dim=0).float() for m in linears]).amax(dim=0)
    s = act_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1.0 - alpha)
    return s.clamp(min=1e-5)


def _fold(s, consumers, producer, rows: bool = False) -> None:
    """Multiply the consumers' input columns by s and divide the producer by it: a norm weight
    (a vector) or, with `rows`, the output rows of the Linear weight that makes the input."""
    for lin in consumers:
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])
    producer.div_(s.to(producer.dtype)[:, None] if rows else s.to(producer.dtype))


def smooth_(model: Any, absmax: dict[str, Any], alpha: float = DEFAULT_ALPHA) -> int:
    """Fold smoothing scales into the model in place; returns how many input groups were smoothed.

    Per layer: q/k/v inputs (folded into input_layernorm), gate/up inputs (into
    post_attention_layernorm) and down_proj's input (into up_proj's output rows, since
    down's input is act(gate) * up). The fp32 model's outputs are unchanged up to rounding.
    """
    import torch

    groups = 0
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            _fold(_scales(absmax[f"{i}.qkv"], qkv, alpha), qkv, layer.input_layernorm.weight)
            gate_up = (mlp.gate_proj, mlp.up_proj)
            _fold(_scales(absmax[f"{i}.gate_up"], gate_up, alpha), gate_up,
                  layer.post_attention_layernorm.weight)
            s = _scales(absmax[f"{i}.down"], (mlp.down_proj,), alpha)
            _fold(s, (mlp.down_proj,), mlp.up_proj.weight, rows=True)
            if mlp.up_proj.bias is not None:
                mlp.up_proj.bias.div_(s.to(mlp.up_proj.bias.dtype))
            groups += 3
    return groups
