"""The quantized verifier: a Llama forward over GGUF-style quantized weights, row-independent.

Why: a decode step streams every weight once, so bytes per weight set its floor. On one core
of the reference machine llama.cpp decodes the embedded SmolLM2 at ~166-177 tok/s from its
Q4_1 / Q8_0 files while our float32 step took ~22 ms (45 tok/s). This forward keeps weights as
llama.cpp's blocks of 32 (`Q8_0`: an int8 per weight and a scale per block; `Q4_1`: a nibble
per weight, a scale and a minimum per block), quantizes each activation row per block as
llama.cpp does, and computes whole layers in C++ (`quant_rows.cpp`), one call a forward.

Lossless: every row's numbers are computed by the same instructions in the same order whatever
else shares the forward (quant_rows.cpp says how), so a token's logits in a k-row verify, a
tree or a batch are bit for bit those of a one-row step. Speculative output is then identical
to this verifier's own plain decoding. It is not the float32 model: `--weights fp32` keeps the
mode identical to Hugging Face `generate`.

Weights come from a GGUF file as they are (Q8_0, Q4_0 (as Q4_1, exactly), Q4_1, F32/F16/BF16),
other block types (K-quants and the rest) dequantized by gguf's reader and re-quantized once to
Q8_0 (said in the log), or from a float32 model quantized at load (`weights="q8"|"q4"`, by
gguf's reference quantizer: the same blocks llama.cpp's quantizer writes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nodes.backends import few_rows
from nodes.backends.weights import AUTO, WEIGHTS  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

KIND_Q8_0, KIND_Q4_1, KIND_F32 = 0, 1, 2
_QK = 32


class QuantError(ValueError):
    """A model or file the quantized forward cannot serve (the message says why)."""


@dataclass
class Matrix:
    """One weight matrix [n, k] in kernel form (see quant_rows.cpp's `QMat`)."""

    kind: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    n: int
    k: int
    source: str  # the block type it came as ("Q4_1", "Q6_K -> Q8_0", ...)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights these blocks stand for [n, k] (tests compare with gguf's)."""
        if self.kind == KIND_F32:
            return self.qs.view(self.n, self.k).clone()
        d = self.d.view(self.n, -1, 1)
        if self.kind == KIND_Q8_0:
            return (self.qs.view(self.n, -1, _QK).float() * d).view(self.n, self.k)
        raw = self.qs.view(self.n, -1, _QK // 2)
        q = torch.cat([raw & 0x0F, raw >> 4], dim=-1).float()
        return (q * d + self.m.view(self.n, -1, 1)).view(self.n, self.k)


def _empty() -> torch.Tensor:
    return torch.empty(0)


def from_blocks(type_name: str, raw: np.ndarray, n: int, k: int) -> Matrix:
    """A matrix from GGUF block bytes `raw` ([n, row bytes] uint8, or float rows) of type
    `type_name`; block types the kernels do not take are re-quantized to Q8_0."""
    raw = np.ascontiguousarray(raw)
    if type_name in ("F32", "F16", "BF16"):
        w = _dequantize(type_name, raw, n, k)
        return Matrix(KIND_F32, torch.from_numpy(w.reshape(n, k)), _empty(), _empty(), n, k,
                      type_name)
    if k % _QK:
        raise QuantError(f"a {type_name} matrix of width {k} (not a multiple of 32)")
    nb = k // _QK
    blocks = raw.reshape(n, -1).view(np.uint8)
    if type_name == "Q8_0":
        b = blocks.reshape(n, nb, 34)
        d = b[..., :2].copy().view(np.float16).astype(np.float32).reshape(n, nb)
        qs = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return Matrix(KIND_Q8_0, torch.from_numpy(qs), torch.from_numpy(d), _empty(), n, k,
                      type_name)
    if type_name in ("Q4_1", "Q4_0"):
        size = 20 if type_name == "Q4_1" else 18
        b = blocks.reshape(n, nb, size)
        d = b[..., :2].copy().view(np.float16).astype(np.float32).reshape(n, nb)
        if type_name == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16).astype(np.float32).reshape(n, nb)
            qs = b[..., 4:].copy().reshape(n, k // 2)
        else:  # d (q - 8) = d q + (-8 d): exact in float32 (d is a float16)
            m = (-8.0 * d).astype(np.float32)
            qs = b[..., 2:].copy().reshape(n, k // 2)
        return Matrix(KIND_Q4_1, torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m),
                      n, k, type_name)
    w = _dequantize(type_name, raw, n, k)
    mat = quantize(w, "Q8_0")
    mat.source = f"{type_name} -> Q8_0"
    return mat


def _dequantize(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return raw.view(np.float32).reshape(n, k).astype(np.float32)
    if type_name == "F16":
        return raw.view(np.float16).reshape(n, k).astype(np.float32)
    try:
        return gguf.quants.dequantize(raw.reshape(n, -1).view(np.uint8), kind).reshape(n, k)
    except NotImplementedError as exc:
        raise QuantError(f"block type {type_name}: gguf's reader cannot dequantize it ({exc})") \
            from None


def quantize(weight: np.ndarray | torch.Tensor, type_name: str) -> Matrix:
    """Float weights [n, k] quantized by gguf's reference quantizer (llama.cpp's blocks)."""
    import gguf

    w = weight.detach().float().numpy() if isinstance(weight, torch.Tensor) else weight
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if k % _QK:
        return from_blocks("F32", w, n, k)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return from_blocks(type_name, raw, n, k)


def stack(mats: Sequence[Matrix]) -> Matrix:
    """Matrices of one kind and width, their rows one after another (a fused projection: each
    row's result does not depend on the rows beside it)."""
    kinds, widths = {m.kind for m in mats}, {m.k for m in mats}
    if len(kinds) != 1 or len(widths) != 1:
        # mixed kinds (a GGUF may keep one projection in another type): all to Q8_0
        return stack([m if m.kind == KIND_Q8_0 else quantize(m.dequantized(), "Q8_0")
                      for m in mats])
    first = mats[0]

    def cat(name: str) -> torch.Tensor:
        parts = [getattr(m, name) for m in mats]
        if parts[0].numel() == 0:
            return parts[0]
        return torch.cat([p.reshape(m.n, -1) for p, m in zip(parts, mats, strict=True)])

    return Matrix(first.kind, cat("qs"), cat("d"), cat("m"), sum(m.n for m in mats), first.k,
                  "+".join(sorted({m.source for m in mats})))


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q: Matrix
    k: Matrix
    v: Matrix
    o: Matrix
    gate: Matrix
    up: Matrix
    down: Matrix


@dataclass
class Weights:
    """A Llama-layout model in kernel form, with what the forward needs of its config."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    eps: float
    inv_freq: torch.Tensor
    rope_scale: float
    embed: Matrix
    head: Matrix
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    form: str  # what the log and the card say: "q4 (GGUF Q4_1 + Q8_0)", ...

    def block_types(self) -> list[str]:
        seen = {self.embed.source, self.head.source}
        for ly in self.layers:
            seen |= {m.source for m in (ly.q, ly.k, ly.v, ly.o, ly.gate, ly.up, ly.down)}
        return sorted(seen)


def _config_numbers(config: Any, rotary: Any) -> dict[str, Any]:
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    return dict(heads=heads, kv_heads=int(config.num_key_value_heads),
                head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
                hidden=hidden, eps=float(config.rms_norm_eps),
                inv_freq=rotary.inv_freq.detach().float().clone(),
                rope_scale=float(getattr(rotary, "attention_scaling", 1.0)))


def from_model(model: Any, weights: str) -> Weights:
    """Quantize a float Llama model at load: `q8` every matrix Q8_0; `q4` the layers Q4_1 and
    the embedding/LM head Q8_0 (the shape of the embedded model's shipped file)."""
    if weights not in ("q8", "q4"):
        raise QuantError(f"weights {weights!r}: q8 or q4")
    layer_type = "Q8_0" if weights == "q8" else "Q4_1"
    inner = model.model
    layers = []
    for layer in inner.layers:
        att, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            layer.input_layernorm.weight.detach().float().clone(),
            layer.post_attention_layernorm.weight.detach().float().clone(),
            *(quantize(lin.weight, layer_type) for lin in (
                att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj,
                mlp.down_proj))))
    embed = quantize(inner.embed_tokens.weight, "Q8_0")
    tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
    head = embed if tied else quantize(model.lm_head.weight, "Q8_0")
    form = "q8 (Q8_0, quantized at load)" if weights == "q8" else \
        "q4 (Q4_1 layers, Q8_0 embedding and head, quantized at load)"
    return Weights(**_config_numbers(model.config, inner.rotary_emb), embed=embed, head=head,
                   final_norm=inner.norm.weight.detach().float().clone(), layers=layers,
                   form=form)


def _unpermute_rows(n: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's convert-time permutation of q/k rows (which
    serves its interleaved rotary): HF row i is GGUF row order[i]."""
    dim = n // heads // 2
    idx = np.arange(n).reshape(heads, dim, 2)
    return idx.swapaxes(1, 2).reshape(n)


def from_gguf(path: Path, model: Any) -> Weights:
    """A Llama GGUF's blocks as they are, with `model` (its float export) for the config and
    rotary. The q/k rows are put back in Hugging Face's order (a row permutation: blocks run
    along rows, so it is exact)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises many types on a bad file
        raise QuantError(f"{path}: not a readable GGUF file ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise QuantError(f"{path}: architecture {arch!r}; the quantized forward serves llama")
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)

    def mat(name: str, rows_for: int | None = None) -> Matrix:
        t = tensors.get(name)
        if t is None:
            raise QuantError(f"{path}: tensor {name} missing")
        k, n = int(t.shape[0]), int(np.prod(t.shape[1:]))
        raw = np.asarray(t.data)
        if rows_for:
            raw = raw.reshape(n, -1)[_unpermute_rows(n, rows_for)]
        try:
            return from_blocks(t.tensor_type.name, raw, n, k)
        except KeyError:
            raise QuantError(f"{path}: tensor {name} has an unknown block type "
                             f"{t.tensor_type.name}") from None

    def vec(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise QuantError(f"{path}: tensor {name} missing")
        return torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(-1).copy())

    layers = []
    for i in range(int(cfg.num_hidden_layers)):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            vec(p + "attn_norm.weight"), vec(p + "ffn_norm.weight"),
            mat(p + "attn_q.weight", heads), mat(p + "attn_k.weight", kv_heads),
            mat(p + "attn_v.weight"), mat(p + "attn_output.weight"),
            mat(p + "ffn_gate.weight"), mat(p + "ffn_up.weight"), mat(p + "ffn_down.weight")))
    embed = mat("token_embd.weight")
    head = mat("output.weight") if "output.weight" in tensors else embed
    w = Weights(**_config_numbers(cfg, model.model.rotary_emb), embed=embed, head=head,
                final_norm=vec("output_norm.weight"), layers=layers, form="")
    w.form = f"file ({path.name} as it is: {', '.join(w.block_types())})"
    return w


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode() if part.dtype == np.uint8 else part.tolist()


class QuantForward:
    """The forward `torch_batch.forward` runs in place of the model's (the same `run`
    interface as `torch_lean.LeanForward`), over `Weights` in kernel form."""

    def __init__(self, weights: Weights) -> None:
        kernel = few_rows.load()
        if kernel is None or not hasattr(kernel, "QModel"):
            raise QuantError("the quantized forward needs the kernels `make setup` builds "
                             f"({few_rows.unavailable() or 'an older build without them'})")
        self.weights = weights
        self.form = weights.form
        w = weights
        self.model = kernel.QModel(w.heads, w.kv_heads, w.head_dim, w.hidden, w.eps,
                                   w.head_dim ** -0.5, w.rope_scale, w.inv_freq)

        def q(m: Matrix) -> Any:
            return kernel.QMat(m.kind, m.qs, m.d, m.m, m.n, m.k)

        try:  # the kernels check every shape against the config: a file that disagrees
            for ly in w.layers:
                self.model.add_layer(ly.attn_norm, ly.ffn_norm, q(stack([ly.q, ly.k, ly.v])),
                                     q(ly.o), q(stack([ly.gate, ly.up])), q(ly.down))
            embed = q(w.embed)
            self.model.set_ends(embed, embed if w.head is w.embed else q(w.head),
                                w.final_norm)
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or ["?"])[0][:200]
            raise QuantError(f"weights that do not fit the model's config ({first})") from None
        self.layers = len(w.layers)
        self.kv_heads, self.head_dim = w.kv_heads, w.head_dim

    def nbytes(self) -> int:
        """Bytes of weights the forward holds (blocks, scales)."""
        return int(self.model.nbytes())

    @torch.inference_mode()
    def run(self, caches: Sequence[Any], offs: Sequence[int], ids: torch.Tensor,
            pos: torch.Tensor, masks: Sequence[Any], keep: Sequence[int] | None,
            capture: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `LeanForward.run`: append rows offs[b]:offs[b+1] of `ids` to `caches[b]`;
        the logits [1, kept rows, vocab] and the captured layer inputs (or None)."""
        offs = [int(o) for o in offs]
        keys, values, pasts = [], [], []
        for b, cache in enumerate(caches):
            fed = offs[b + 1] - offs[b]
            past = int(cache.get_seq_length())
            pasts.append(past)
            for layer in cache.layers:
                _reserve(layer, past, fed, self.kv_heads, self.head_dim)
                keys.append(layer._keys)
                values.append(layer._values)
        mats = [m if isinstance(m, torch.Tensor) else None for m in masks]
        out = self.model.forward(ids.reshape(-1), pos.reshape(-1), offs, pasts, keys, values,
                                 mats, list(keep) if keep is not None else [],
                                 list(capture or ()))
        for b, cache in enumerate(caches):
            length = pasts[b] + offs[b + 1] - offs[b]
            for layer in cache.layers:
                layer._length = layer._values_length = length
        return out[0][None], (out[1] if len(out) > 1 else None)


def _reserve(layer: Any, past: int, fed: int, kv_heads: int, head_dim: int) -> None:
    """Room for `fed` more positions in a growing layer's buffers (contiguous, float32)."""
    keys = layer._keys
    ok = (layer.is_initialized and keys is not None and keys.dim() == 4
          and keys.is_contiguous() and layer._values.is_contiguous()
          and keys.shape[-2] >= past + fed and keys.dtype == torch.float32)
    if ok:
        return
    like = torch.empty(1, kv_heads, fed, head_dim)
    if not layer.is_initialized or keys is None or keys.dim() < 4:
        layer.device = like.device
        layer.is_initialized = True
        layer._grow(like, like, 0)
    else:
        layer._grow(like, like, past)


def build(model: Any, weights: str, gguf_path: Path | None = None) -> QuantForward:
    """The quantized forward for `model` in the form `weights` names: the GGUF's own blocks
    when `gguf_path` is given (`file`, and the embedded model's q4), else q8 / q4 quantized
    at load. Raises QuantError where it cannot serve."""
    from nodes.backends.lean_llama import lean_supported

    if not lean_supported(model):
        raise QuantError("the quantized forward serves Llama-layout models (this is "
                         f"{getattr(model.config, 'model_type', '?')!r})")
    if weights == "file" and gguf_path is None:
        raise QuantError("--weights file serves a GGUF model's own blocks; this model is a "
                         "folder (--model FILE.gguf, or --weights q8 / q4)")
    if gguf_path is not None:
        w = from_gguf(gguf_path, model)
    else:
        w = from_model(model, weights)
    return QuantForward(w)
