"""A lean decode forward for plain Llama models with int8 weights: the int8 drafter's engine.

Why: on one CPU core, HF's module stack spent ~45 % of an int8 SmolLM2-135M token in Python
(module calls, cache objects, mask building, 181 separate quantised Linears), and a remote int8
proposer's speedup is bounded by how fast it drafts (it must draft every committed token). This
runs the int8 arithmetic with q/k/v and gate/up fused into one Linear each and a preallocated
K/V buffer per layer, in one of two weight forms:

* `weights="w8"` (where the few-row kernel is built: nodes/backends/w8.py): every projection,
  the down projections and the LM head included, with weight-only int8 (a float32 scale per
  output channel, float32 activations), from the model as it is (no smoothing: activation
  outliers do not touch weight-only quantisation).
* `weights="dynamic"` (the fallback): the same arithmetic as `quantize_int8`'s HF copy (the
  same smoothed weights, per-channel int8 weights quantised by torch's own dynamic quantiser,
  per-tensor dynamic activations, the down projections in fp32; fused projections keep the same
  rows and scales, one activation quantisation instead of three).

Only the layout it can check is taken (`lean_supported`): Llama with no biases, SiLU, and a
rotary embedding fixed at load; anything else keeps the HF path. A drafter's arithmetic never
decides the output (the verifier checks every token), only how often it agrees.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nodes.backends.base import Backend, tree_layout
from nodes.backends.tokenizer import Tokenizer

#: rotary embeddings whose inverse frequencies do not change with the sequence length
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})
_FIRST_CAPACITY = 256


def lean_supported(model: Any) -> bool:
    """Whether `model` has the exact layout the lean forward implements."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    return (
        cfg is not None and rotary is not None
        and getattr(cfg, "model_type", None) == "llama"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", None) == "silu"
        and getattr(rotary, "rope_type", "default") in _STATIC_ROPE
        and getattr(model, "lm_head", None) is not None
        and getattr(model.lm_head, "bias", None) is None
    )


@dataclass
class _Layer:
    norm_in: torch.Tensor
    qkv: Any  # a projection: called on x [n, in], returns [n, out]
    out: Any
    norm_post: torch.Tensor
    gate_up: Any
    down: Any


class LeanCache:
    """One sequence's K/V: a buffer per layer [kv heads, capacity, head dim], `length` used."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.length = 0
        self.keys = [torch.empty(kv_heads, _FIRST_CAPACITY, head_dim) for _ in range(layers)]
        self.values = [torch.empty(kv_heads, _FIRST_CAPACITY, head_dim) for _ in range(layers)]
        #: the last tree fed after `length` positions, whose K/V stay in the buffers past a crop
        #: back to its base (LeanBackend.forward_tree): (base, tokens, parents, logits)
        self.tree: tuple[int, list[int], list[int], np.ndarray] | None = None

    def reserve(self, total: int) -> None:
        """Room for `total` positions (doubling, so appends stay amortised O(1))."""
        cap = self.keys[0].shape[1]
        if total <= cap:
            return
        while cap < total:
            cap *= 2
        self.tree = None  # only what is below `length` is copied
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.empty(old.shape[0], cap, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                buffers[i] = new


class LeanLlama:
    """The decode forward (see the module docstring)."""

    def __init__(self, model: Any, weights: str = "dynamic") -> None:
        """Quantise the projections of `model` (the fp32 model): `weights="dynamic"` (smoothed
        already, by the caller) keeps the MLP down projections fp32 as the smoothed HF copy
        does; `weights="w8"` quantises every one, weight-only (see the module docstring)."""
        if weights not in ("dynamic", "w8"):
            raise ValueError(f"weights: 'dynamic' or 'w8', not {weights!r}")
        self.weights = weights
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.vocab_size = int(cfg.vocab_size)
        inner = model.model
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.embed = inner.embed_tokens.weight.detach().float().clone()
        self.norm_final = inner.norm.weight.detach().float().clone()
        fused: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(inner.layers):
            att, mlp = layer.self_attn, layer.mlp
            fused[f"{i}_qkv"] = _stack(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight)
            fused[f"{i}_out"] = _stack(att.o_proj.weight)
            fused[f"{i}_gate_up"] = _stack(mlp.gate_proj.weight, mlp.up_proj.weight)
            if weights == "w8":
                fused[f"{i}_down"] = _stack(mlp.down_proj.weight)
        fused["head"] = _stack(model.lm_head.weight)
        proj = _w8(fused) if weights == "w8" else _dynamic(fused)
        self.head = proj["head"]
        self.layers = [
            _Layer(
                norm_in=layer.input_layernorm.weight.detach().float().clone(),
                qkv=proj[f"{i}_qkv"],
                out=proj[f"{i}_out"],
                norm_post=layer.post_attention_layernorm.weight.detach().float().clone(),
                gate_up=proj[f"{i}_gate_up"],
                down=proj[f"{i}_down"] if weights == "w8"
                else _Float(layer.mlp.down_proj.weight.detach().float().clone()),
            )
            for i, layer in enumerate(inner.layers)
        ]
        self.intermediate = int(inner.layers[0].mlp.down_proj.weight.shape[1])

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim)

    @torch.inference_mode()
    def forward(self, cache: LeanCache, token_ids: Sequence[int], *, last_only: bool,
                parents: Sequence[int] | None = None) -> torch.Tensor:
        """Append the tokens (a chain, or a tree by `parents`) and return their logits
        [n or 1, vocab]."""
        n, past = len(token_ids), cache.length
        if parents is None:
            return self._run(cache, token_ids, past + torch.arange(n), _chain_mask(n, past),
                             last_only)
        depth, visible = tree_layout(parents)
        mask = torch.ones(n, past + n, dtype=torch.bool)
        mask[:, past:] = torch.from_numpy(visible)
        return self._run(cache, token_ids, past + torch.from_numpy(depth), mask, last_only)

    @torch.inference_mode()
    def extend_tree(self, cache: LeanCache, base: int, token_ids: Sequence[int],
                    parents: Sequence[int], start: int) -> torch.Tensor:
        """Logits [n - start, vocab] of nodes `start`.. of a tree fed after `base` positions
        whose first `start` nodes are cached already (at base.., `cache.length` base + start)."""
        n = len(token_ids)
        depth, visible = tree_layout(parents)
        mask = torch.ones(n - start, base + n, dtype=torch.bool)
        mask[:, base:] = torch.from_numpy(visible[start:])
        return self._run(cache, token_ids[start:], base + torch.from_numpy(depth[start:]), mask,
                         False)

    def _run(self, cache: LeanCache, token_ids: Sequence[int], positions: torch.Tensor,
             mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        n, past = len(token_ids), cache.length
        cache.reserve(past + n)
        cos, sin = self._rope(positions)
        x = self.embed[torch.tensor(list(token_ids), dtype=torch.long)]
        h_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms(x, layer.norm_in, self.eps))
            q = qkv[:, :h_dim].view(n, self.heads, self.head_dim).transpose(0, 1)
            k = qkv[:, h_dim:h_dim + kv_dim].view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            v = qkv[:, h_dim + kv_dim:].view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            keys, values = cache.keys[i], cache.values[i]
            keys[:, past:past + n] = _rotate(k, cos, sin)
            values[:, past:past + n] = v
            att = F.scaled_dot_product_attention(
                _rotate(q, cos, sin)[None], keys[None, :, : past + n],
                values[None, :, : past + n], attn_mask=mask, enable_gqa=True)
            x = x + layer.out(att[0].transpose(0, 1).reshape(n, h_dim))
            gu = layer.gate_up(_rms(x, layer.norm_post, self.eps))
            x = x + layer.down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:])
        cache.length = past + n
        if last_only:
            x = x[-1:]
        return self.head(_rms(x, self.norm_final, self.eps))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale


class LeanBackend(Backend):
    """`LeanLlama` behind the backend interface the model drafter drives (CPU, one sequence
    per cache, trees included)."""

    name = "torch"
    supports_tree = True

    def __init__(self, lean: LeanLlama, tokenizer: Tokenizer, model_name: str) -> None:
        self.lean = lean
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = "cpu"
        self.vocab_size = lean.vocab_size

    def new_cache(self) -> LeanCache:
        return self.lean.new_cache()

    def forward(self, cache: LeanCache, token_ids: Sequence[int]) -> np.ndarray:
        cache.tree = None
        return self.lean.forward(cache, token_ids, last_only=False).numpy()

    def forward_last(self, cache: LeanCache, token_ids: Sequence[int]) -> np.ndarray:
        cache.tree = None
        return self.lean.forward(cache, token_ids, last_only=True)[0].numpy()

    def forward_tree(self, cache: LeanCache, token_ids: Sequence[int],
                     parents: Sequence[int]) -> np.ndarray:
        """A tree's logits. A model drafter grows its tree a level at a time, feeding the whole
        tree again after a crop back to its base each time; the nodes fed last time are still
        in the buffers, so only the new ones are computed (each node's K/V depends on its
        ancestors alone, which come before it). Weight-only int8 only: its rows are
        independent, while dynamic int8 scales a call's activations together."""
        base, tokens, parents = cache.length, [int(t) for t in token_ids], [int(p) for p in parents]
        memo, start = cache.tree, 0
        if memo is not None and memo[0] == base and self.lean.weights == "w8":
            m = len(memo[1])
            if m <= len(tokens) and memo[1] == tokens[:m] and memo[2] == parents[:m]:
                start = m
        if start == len(tokens):
            logits = memo[3]
            cache.length = base + start
        elif start:
            cache.length = base + start
            new = self.lean.extend_tree(cache, base, tokens, parents, start).numpy()
            logits = np.concatenate([memo[3], new])
        else:
            logits = self.lean.forward(cache, tokens, last_only=False, parents=parents).numpy()
        cache.tree = (base, tokens, parents, logits)
        return logits

    def compact(self, cache: LeanCache, base: int, keep: Sequence[int]) -> None:
        cache.tree = None
        idx = torch.tensor([base + i for i in keep], dtype=torch.long)
        for buffers in (cache.keys, cache.values):
            for layer in buffers:
                layer[:, base:base + len(idx)] = layer[:, idx]
        cache.length = base + len(idx)

    def cache_length(self, cache: LeanCache) -> int:
        return cache.length

    def crop(self, cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, max(length, 0))
        if cache.tree is not None and cache.length < cache.tree[0]:
            cache.tree = None


def _stack(*weights: torch.Tensor) -> torch.Tensor:
    """The given weights' rows stacked: one fused projection's float32 weight."""
    return torch.cat([x.detach().float() for x in weights], dim=0)


class _Float:
    """A float32 projection (the dynamic form's down projections)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Dynamic:
    """Per-channel int8 weights packed by torch's dynamic quantiser; activations quantised per
    call (per tensor)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range=True)


class _W8:
    """Weight-only int8 (nodes/backends/w8.py) called straight into the kernel: x is always
    [n, in] float32 here, so none of `W8Linear.forward`'s checks are needed."""

    __slots__ = ("kernel", "packed", "scale")

    def __init__(self, kernel: Any, packed: torch.Tensor, scale: torch.Tensor) -> None:
        self.kernel, self.packed, self.scale = kernel, packed, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear_w8(x, self.packed, self.scale)


def _dynamic(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per-channel int8 weights packed by torch's dynamic quantiser (as `quantize_int8`)."""
    linears = torch.nn.ModuleDict()
    for name, w in weights.items():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        linears[name] = lin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {name: per_channel_dynamic_qconfig for name in linears}
        q = quantize_dynamic(linears, spec, dtype=torch.qint8)
    return {name: _Dynamic(q[name]._packed_params._packed_params) for name in linears}


def _w8(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    from nodes.backends import few_rows
    from nodes.backends.w8 import pack_w8, quantize_weight

    kernel = few_rows.load()
    if kernel is None:
        raise RuntimeError("weight-only int8 needs the few-row kernel (`make setup`)")
    out = {}
    for name, w in weights.items():
        q, scale = quantize_weight(w)
        out[name] = _W8(kernel, pack_w8(q), scale)
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _chain_mask(n: int, past: int) -> torch.Tensor | None:
    """Causal mask of n new tokens after `past` cached ones (None for one token: it sees all)."""
    if n == 1:
        return None
    return torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
