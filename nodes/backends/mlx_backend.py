"""mlx/mlx-lm backend: Apple silicon for speed, also runs on Linux via mlx[cpu]."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from nodes import models
from nodes.backends.base import Backend
from nodes.backends.kv_bound import check_kv_bound
from nodes.backends.tokenizer import Tokenizer
from nodes.engine.errors import BadRequestError, ModelNotFoundError

log = logging.getLogger(__name__)

PREFILL_STEP = 2048  # mlx_lm.generate_step's default prefill_step_size
#: under a bound, the prompt's chunks: each row past the bound brings its own sink copies
#: (re-indexed sink positions, `mlx_bound`), so a chunk's attention grows with its square
BOUNDED_PREFILL_STEP = 256


def _window_cache(window: int) -> Any:
    """A `KVCache` for a sliding-window layer: it keeps every position (trimmable, exact) and
    its mask lets query q see key p when q - window < p <= q, over absolute positions: what
    mlx-lm's `RotatingKVCache` computes for one-token steps, also for a multi-token verify and
    after a trim, wrapped or not."""
    from mlx_lm.models.base import create_causal_mask
    from mlx_lm.models.cache import KVCache

    class WindowKVCache(KVCache):
        def make_mask(self, N: int, return_array: bool = False,  # noqa: N803 - mlx-lm's
                      window_size: int | None = None) -> Any:
            return create_causal_mask(N, self.offset, window_size=window)

    cache = WindowKVCache()
    cache.window = window
    return cache


class MlxBackend(Backend):
    """An mlx-lm model with trimmable caches: plain `KVCache` layers, and a `WindowKVCache`
    where the model has a sliding-window `RotatingKVCache` (`_window_cache`); under
    `--kv-sink/--kv-window` (`bound_kv`) every layer a `mlx_bound.BoundedKVCache`."""

    name = "mlx"

    def __init__(self, model: Any, tokenizer: Tokenizer, model_name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        probe = model(mx.array([[0]]))
        self.vocab_size = int(probe.shape[-1])
        #: (sink, window) of bounded K/V on full-attention layers (`bound_kv`), or None
        self.kv_bound: tuple[int, int] | None = None
        #: the K/V bytes of the cache cropped last (each step's end): `generate --json`'s
        #: `kv_bytes`
        self.last_kv_bytes: int | None = None

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
        """The model's own cache, each `RotatingKVCache` (a sliding-window layer's ring, which
        cannot be trimmed exactly once it wraps, and grows past its size in a multi-token
        verify) replaced by a `WindowKVCache`: every position kept, the window applied by
        its mask, so a crop after a rejected draft is exact at any length."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if self.kv_bound is not None:
            from nodes.backends.mlx_bound import bounded_cache

            bounded = bounded_cache(cache, self.kv_bound, self.model)
            for layer, b in zip(cache, bounded, strict=True):
                if b is None:
                    raise ModelNotFoundError(
                        f"model {self.model_name!r}: MLX cache layer {type(layer).__name__} "
                        "takes no bounded K/V here (plain and sliding-window KV caches do)")
            return bounded
        out = []
        for layer in cache:
            if type(layer) is KVCache:
                out.append(layer)
            elif type(layer) is RotatingKVCache and not layer.keep:
                out.append(_window_cache(layer.max_size))
            else:
                raise ModelNotFoundError(
                    f"model {self.model_name!r}: MLX cache layer {type(layer).__name__} is "
                    "served by no path here (plain and sliding-window KV caches are); "
                    "speculative decoding needs a trimmable cache")
        return out

    def bound_kv(self, sink: int | None, window: int | None) -> None:
        """Bound every full-attention layer's K/V to the first `sink` positions and the last
        `window` (`--kv-sink/--kv-window`; both or neither), as the torch backend does: a band
        with re-indexed sink positions, the rest dropped (`mlx_bound.BoundedKVCache`);
        sliding-window layers keep their own window and no more."""
        args = getattr(self.model, "args", None)
        self.kv_bound = check_kv_bound(sink, window, args)
        if self.kv_bound is not None:
            try:  # each bounded layer takes its rotary embedding: one it cannot is refused
                self.new_cache()
            except ValueError as exc:
                self.kv_bound = None
                raise BadRequestError(f"--kv-sink/--kv-window: {exc}") from None
            log.info("kv: bounded to %d sink + %d window positions per full-attention layer "
                     "(re-indexed sink positions)", *self.kv_bound)

    def kv_bytes(self, cache: Any) -> int:
        """Bytes of the K/V buffers `cache` holds (room ahead included)."""
        from nodes.backends.mlx_bound import kv_bytes

        return kv_bytes(cache)

    def forward(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        logits = self.model(mx.array([list(token_ids)]), cache=cache)
        return np.array(logits[0].astype(mx.float32))

    def forward_last(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        logits = self.model(mx.array([list(token_ids)]), cache=cache)
        return np.array(logits[0, -1].astype(mx.float32))

    def prefill(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        # like mlx_lm.generate_step: all but the last token in chunks, then the last one alone
        ids = list(token_ids)
        step = PREFILL_STEP if self.kv_bound is None else min(PREFILL_STEP, BOUNDED_PREFILL_STEP)
        for start in range(0, len(ids) - 1, step):
            chunk = ids[start : min(start + step, len(ids) - 1)]
            self.model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
        return self.forward_last(cache, ids[-1:])

    def cache_length(self, cache: Any) -> int:
        return int(cache[0].offset)

    def crop(self, cache: Any, length: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        from nodes.backends.mlx_bound import BoundedKVCache, kv_bytes

        if cache and isinstance(cache[0], BoundedKVCache):
            for layer in cache:  # bounded: what stays is committed, the overlay freed
                layer.crop(length)
        else:
            extra = self.cache_length(cache) - length
            if extra > 0:
                trim_prompt_cache(cache, extra)
        self.last_kv_bytes = kv_bytes(cache)
