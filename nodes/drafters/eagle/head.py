"""The EAGLE-3 head for Llama-family verifiers, in the published parameter layout.

Per entry i the head reads the verifier's three hidden states at position i (fused by `fc`,
3 x target hidden -> hidden) and the embedding of token i+1, and predicts token i+2. One
decoder layer whose attention takes [input_layernorm(embedding) ; hidden_norm(feature)]
(2 x hidden wide), the fused feature being the residual; then `norm` and an `lm_head` over a
draft vocabulary mapped to the verifier's ids by `d2t` (target = draft + d2t[draft]). While
drafting past the verifier, the layer's own pre-norm output stands in for the feature (it is
hidden-wide, so `fc` is skipped), as in EAGLE.

Parameter names are those of the checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`, optional `embed_tokens`), so `load_state_dict` reads a published head as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nodes.drafters.eagle.cache import HeadCache
from nodes.drafters.eagle.config import EagleConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        hd, width = cfg.dim_head, 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: EagleConfig, own_embedding: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.feature_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size)
                             if own_embedding else None)
        self.shared_embedding: torch.Tensor | None = None  # the verifier's, when not own
        self._inv_freq, self._rope_scale = _rope(cfg)

    # ---- pieces shared by inference and training ----------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens)
        return F.embedding(tokens, self.shared_embedding)

    def fuse(self, feature: torch.Tensor) -> torch.Tensor:
        """Verifier features [n, 3, T] through fc; the head's own outputs [n, hidden] (while
        drafting) pass as they are. The rank decides, never the sizes, which can collide."""
        if feature.dim() == 3:
            return self.fc(feature.flatten(-2))
        return feature

    def project(self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor):
        """q [..., heads, n, d], k and v [..., kv_heads, n, d] (rotated) and the residual
        [..., n, hidden] for entries (token, fused feature) at `positions` ([n], shared by
        any leading batch dimensions)."""
        cfg, layer = self.cfg, self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed(tokens)), layer.hidden_norm(feature)],
                      dim=-1)
        lead, hd = x.shape[:-1], cfg.dim_head
        attn = layer.self_attn
        q = attn.q_proj(x).view(*lead, cfg.num_attention_heads, hd).transpose(-3, -2)
        k = attn.k_proj(x).view(*lead, cfg.num_key_value_heads, hd).transpose(-3, -2)
        v = attn.v_proj(x).view(*lead, cfg.num_key_value_heads, hd).transpose(-3, -2)
        cos, sin = self.rope(positions, x.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v, feature

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq.to(positions.device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return ((emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype))

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [..., heads, n, d] -> the layer's pre-norm output [..., n, hidden]."""
        layer = self.midlayer
        flat = attended.transpose(-3, -2).flatten(-2)
        h = residual + layer.self_attn.o_proj(flat)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, draft_vocab]."""
        return self.lm_head(self.norm(prenorm))

    def target_ids(self) -> torch.Tensor:
        """Verifier id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- inference over the head's own cache --------------------------------------------------
    def step(self, cache: HeadCache, tokens: torch.Tensor, feature: torch.Tensor,
             positions: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Append entries to `cache` and return their pre-norm outputs [n, hidden].

        `visible` (bool [n, cache + n]) says which held entries each new one attends to;
        None: all earlier entries and causal among the new ones."""
        q, k, v, residual = self.project(tokens, self.fuse(feature), positions)
        keys, values = cache.append(k, v)
        n, total = q.shape[1], keys.shape[1]
        if visible is None:
            visible = torch.ones((n, total), dtype=torch.bool, device=q.device)
            visible[:, total - n :] = torch.tril(visible[:, total - n :])
        # grouped KV heads read in place (no per-step copy of the cache per query head)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None],
                                             enable_gqa=True)
        return self.finish(out, residual)


def _rope(cfg: EagleConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (and attention scale) as transformers computes them for a Llama of
    this config, so rope_scaling variants (llama3, ...) match the verifier family's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                        head_dim=cfg.dim_head, rope_theta=cfg.rope_theta,
                        rope_scaling=cfg.rope_scaling,
                        max_position_embeddings=cfg.max_position_embeddings)
    rotary = LlamaRotaryEmbedding(llama)
    return rotary.inv_freq.detach().clone().float(), float(rotary.attention_scaling)
