"""mlx/mlx-lm backend: Apple silicon for speed, also runs on Linux via mlx[cpu]."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from nodes import models
from nodes.backends.base import Backend
from nodes.backends.tokenizer import Tokenizer
from nodes.engine.errors import ModelNotFoundError

log = logging.getLogger(__name__)

PREFILL_STEP = 2048  # mlx_lm.generate_step's default prefill_step_size


class MlxBackend(Backend):
    """An mlx-lm model with plain `KVCache` layers (trimmable, unlike `RotatingKVCache`)."""

    name = "mlx"

    def __init__(self, model: Any, tokenizer: Tokenizer, model_name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        probe = model(mx.array([[0]]))
        self.vocab_size = int(probe.shape[-1])

    @classmethod
    def load(cls, model_ref: str | None = None) -> MlxBackend:
        ref = models.resolve(model_ref)
        from mlx_lm import load

        try:
            folder = models.mlx_folder(ref)
            model, _ = load(str(folder))
            tokenizer = Tokenizer(ref.path)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelNotFoundError(
                f"model {ref.name!r}: could not load for MLX from {ref.path}: {exc}".splitlines()[0]
            ) from None
        return cls(model, tokenizer, ref.name)

    def new_cache(self) -> Any:
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if not all(type(layer) is KVCache for layer in cache):
            raise ModelNotFoundError(
                f"model {self.model_name!r}: MLX cache is not plain KVCache layers; "
                "speculative decoding needs a trimmable cache"
            )
        return cache

    def forward(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        logits = self.model(mx.array([list(token_ids)]), cache=cache)
        return np.array(logits[0].astype(mx.float32))

    def forward_last(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        logits = self.model(mx.array([list(token_ids)]), cache=cache)
        return np.array(logits[0, -1].astype(mx.float32))

    def prefill(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        # like mlx_lm.generate_step: all but the last token in chunks, then the last one alone
        ids = list(token_ids)
        for start in range(0, len(ids) - 1, PREFILL_STEP):
            chunk = ids[start : min(start + PREFILL_STEP, len(ids) - 1)]
            self.model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
        return self.forward_last(cache, ids[-1:])

    def cache_length(self, cache: Any) -> int:
        return int(cache[0].offset)

    def crop(self, cache: Any, length: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        extra = self.cache_length(cache) - length
        if extra > 0:
            trim_prompt_cache(cache, extra)
