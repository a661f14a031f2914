"""The verifier's float32 forward for Llama models on a CPU, without transformers' module stack.

Why: on one CPU core a SmolLM2-135M decode step spent ~20 ms of ~80 ms outside the matrix
products: module calls, decorators, mask and output objects, a key/value `repeat` before every
masked attention (transformers gives masked SDPA no grouped-query support on CPUs, so each
layer copied its whole K/V 3x for a verify), and three separate calls for q/k/v and two for
gate/up. A verify step of 4 tokens paid the most. This runs the same arithmetic over the same
weights and caches as `torch_batch.forward`'s model call, op for op, so every logit is bit for
bit what that call gives (tests/engine/test_torch_lean.py checks it on SmolLM2), with:

* q/k/v and gate/up as one product each, through the few-row kernel, whose sum for each output
  does not depend on the other outputs computed with it (the modules' weights become views of
  the fused ones: no second copy). More rows than the kernel serves go through the modules;
* grouped-query attention asked of SDPA directly (`enable_gqa`, which also takes a mask), the
  same values without the copies;
* the layers' inputs kept for hidden-state capture (EAGLE-3) without hooks.

Taken only where it can be checked (`supported`): a Llama layout (`lean_llama.lean_supported`)
whose projections are plain float32 `nn.Linear`s on the CPU served by the few-row kernel.
Anything else (CUDA, MPS, quantised copies, other architectures) keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nodes.backends import few_rows


def supported(model: Any) -> bool:
    """Whether `LeanForward(model)` reproduces the model's own forward here."""
    from nodes.backends.lean_llama import lean_supported

    if not lean_supported(model) or few_rows.load() is None:
        return False
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        for lin in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj,
                    mlp.up_proj, mlp.down_proj):
            if not (few_rows.installed(lin) and lin.bias is None
                    and lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu"):
                return False
    return few_rows.installed(model.lm_head)


@dataclass
class _Layer:
    module: Any
    qkv: torch.Tensor  # the fused weights [q + k + v rows, hidden]
    gate_up: torch.Tensor
    q_rows: int
    kv_rows: int
    intermediate: int


class LeanForward:
    """The forward (see the module docstring). Built once per backend; fuses the model's
    q/k/v and gate/up weights in place (the modules keep views of them)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.kernel = few_rows.load()
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.layers = [self._fuse(layer) for layer in inner.layers]

    @staticmethod
    def _fuse(layer: Any) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        qkv = _fuse_rows(att.q_proj, att.k_proj, att.v_proj)
        gate_up = _fuse_rows(mlp.gate_proj, mlp.up_proj)
        return _Layer(layer, qkv, gate_up, int(att.q_proj.weight.shape[0]),
                      int(att.k_proj.weight.shape[0]), int(mlp.gate_proj.weight.shape[0]))

    @torch.inference_mode()
    def run(self, caches: Sequence[Any], offs: Sequence[int], ids: torch.Tensor,
            pos: torch.Tensor, masks: Sequence[Any], keep: Sequence[int] | None,
            capture: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append rows offs[b]:offs[b+1] of `ids` [1, total] (positions `pos` [1, total]) to
        `caches[b]`, each sequence attending over its own cache under `masks[b]` (None, the
        string "causal", or a boolean [n_b, past_b + n_b]); returns the logits [1, kept rows,
        vocab] of the rows `keep` (None: all) and, when `capture` names layers, their inputs
        [total, len(capture), hidden]."""
        total = ids.shape[1]
        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)
        taps: dict[int, torch.Tensor] = {}
        wanted = set(capture or ())
        for i, layer in enumerate(self.layers):
            if i in wanted:
                taps[i] = h
            h = self._layer(i, layer, h, cos, sin, caches, offs, masks, total)
        hidden = None
        if capture:
            hidden = torch.stack([taps[i][0] for i in capture], dim=1)
        if keep is not None:
            h = h[:, torch.as_tensor(list(keep), dtype=torch.long), :]
        return self.model.lm_head(self.norm(h)), hidden

    def _layer(self, i: int, layer: _Layer, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, caches: Sequence[Any], offs: Sequence[int],
               masks: Sequence[Any], total: int) -> torch.Tensor:
        module = layer.module
        att, mlp = module.self_attn, module.mlp
        x = module.input_layernorm(h)
        if total <= few_rows.MAX_ROWS:
            qkv = self.kernel.linear(x.reshape(total, x.shape[-1]), layer.qkv, None)[None]
            q = qkv[..., :layer.q_rows]
            k = qkv[..., layer.q_rows:layer.q_rows + layer.kv_rows]
            v = qkv[..., layer.q_rows + layer.kv_rows:]
        else:
            q, k, v = att.q_proj(x), att.k_proj(x), att.v_proj(x)
        shape = (1, total, -1, self.head_dim)
        q, k = apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2),
                                    cos, sin)
        v = v.view(shape).transpose(1, 2)
        gqa = self.heads != self.kv_heads
        outs = []
        for b, (cache, mask) in enumerate(zip(caches, masks, strict=True)):
            rows = slice(offs[b], offs[b + 1])
            keys, values = cache.update(k[:, :, rows], v[:, :, rows], i)
            causal = isinstance(mask, str)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, rows], keys, values, attn_mask=None if causal else mask,
                is_causal=causal, scale=att.scaling, enable_gqa=gqa))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        out = out.transpose(1, 2).contiguous().reshape(1, total, -1).contiguous()
        h = h + att.o_proj(out)
        x = module.post_attention_layernorm(h)
        if total <= few_rows.MAX_ROWS:
            gu = self.kernel.linear(x.reshape(total, x.shape[-1]), layer.gate_up, None)[None]
            gate, up = gu[..., :layer.intermediate], gu[..., layer.intermediate:]
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        return h + mlp.down_proj(mlp.act_fn(gate) * up)


def _fuse_rows(*linears: Any) -> torch.Tensor:
    """One weight holding the linears' rows in order; each linear's weight becomes a view of
    its rows (the same values: the modules compute what they did, with no second copy)."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows
    return fused
