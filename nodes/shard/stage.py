"""One stage's slice of a causal LM, loaded tensor by tensor from a safetensors folder.

The model skeleton is built on the `meta` device (no memory), the decoder layers outside the
slice are dropped, and only this stage's tensors are read from disk and assigned. The forward
mirrors transformers' `LlamaModel.forward` over the slice, so the sharded pipeline computes the
same floats as the whole model (greedy output stays byte-identical).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from nodes.backends.base import tree_layout
from nodes.shard.layout import ShardConfigError, StageSlice

log = logging.getLogger(__name__)

#: architectures whose decoder stack has the Llama layout (embed, rotary, layers, norm)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class StageModel:
    """Decoder layers [start, end) plus, on the ends, the embeddings and the LM head."""

    def __init__(self, folder: Path, part: StageSlice, device: str = "cpu") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if config.model_type not in SUPPORTED:
            raise ShardConfigError(
                f"sharding supports {', '.join(SUPPORTED)} models, not {config.model_type!r}")
        self.full_config = config
        self.part = part
        self.device = device
        local = copy.deepcopy(config)
        local.num_hidden_layers = part.end - part.start
        if getattr(local, "layer_types", None):
            local.layer_types = list(config.layer_types[part.start:part.end])
        local.dtype = torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(local, dtype=torch.float32)
        inner = model.model
        if not part.first:
            inner.embed_tokens = None
        if not part.last:
            inner.norm = None
            model.lm_head = None
        # rotary buffers are computed at init, not loaded: rebuild them on a real device
        with torch.device(device):
            inner.rotary_emb = type(inner.rotary_emb)(config=local)
        self._load(folder, model, config)
        self.model = model.eval()
        #: bytes of the weights this stage holds (tied tensors counted once)
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.config = local
        self.dtype = torch.float32

    def _load(self, folder: Path, model: Any, config: Any) -> None:
        from safetensors import safe_open

        part = self.part
        wanted: dict[str, str] = {}  # file key -> our key
        for i in range(part.start, part.end):
            wanted[f"model.layers.{i}."] = f"model.layers.{i - part.start}."
        if part.first:
            wanted["model.embed_tokens."] = "model.embed_tokens."
        if part.last:
            wanted["model.norm."] = "model.norm."
            if config.tie_word_embeddings:
                wanted["model.embed_tokens.weight"] = "lm_head.weight"
            else:
                wanted["lm_head."] = "lm_head."
        state: dict[str, torch.Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ShardConfigError(f"sharding needs safetensors weights; {folder} has none")
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    for prefix, ours in wanted.items():
                        if key.startswith(prefix):
                            state[ours + key[len(prefix):]] = f.get_tensor(key).float()
        if part.last and config.tie_word_embeddings and part.first:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing = [n for n, p in model.named_parameters() if p.is_meta and n not in state]
        if missing:
            raise ShardConfigError(f"{folder}: weights missing for {missing[:3]}")
        model.load_state_dict(state, strict=False, assign=True)
        if part.first and part.last and config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.to(self.device)
        log.info("stage %d/%d: layers %d..%d, %d tensors", part.rank, part.world, part.start,
                 part.end - 1, len(state))

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @staticmethod
    def cache_length(cache: Any) -> int:
        return int(cache.get_seq_length())

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        return self.model.model.embed_tokens(ids)

    @torch.inference_mode()
    def layers(self, hidden: torch.Tensor, cache: Any, position_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's decoder layers, as `LlamaModel.forward` does over its slice."""
        from transformers.masking_utils import create_causal_mask

        inner = self.model.model
        if position_ids is None:
            past = cache.get_seq_length()
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, past_key_values=cache,
                                  position_ids=position_ids)
        pos_emb = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=pos_emb,
                           position_ids=position_ids, past_key_values=cache, use_cache=True)
        return hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor, last_only: bool) -> torch.Tensor:
        """Final norm and LM head: float32 logits [rows, vocab]."""
        hidden = self.model.model.norm(hidden)
        if last_only:
            hidden = hidden[:, -1:, :]
        return self.model.lm_head(hidden)[0].float()


def tree_inputs(past: int, parents: list[int], dtype: torch.dtype,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-D mask and position ids of a token-tree forward (as TorchBackend.forward_tree)."""
    n = len(parents)
    depth, visible = tree_layout(parents)
    mask = torch.zeros((1, 1, n, past + n), dtype=dtype, device=device)
    mask[0, 0, :, past:].masked_fill_(torch.from_numpy(~visible).to(device),
                                      torch.finfo(dtype).min)
    pos = torch.from_numpy(past + depth)[None].to(device)
    return mask, pos
