"""A `DynamicCache` whose layers append in place: room reserved ahead, a crop moves a length.

Why: transformers' `DynamicLayer.update` concatenates the whole cached K/V with the new rows,
on every layer of every forward. A decode step therefore copies the entire cache twice per
layer (keys and values), so the step's cost grows with the context: for SmolLM2-135M at 200
cached positions that is 60 copies a step, ~3 ms of an ~80 ms step on one CPU core, and 5x
that at 1,000 positions. Speculation makes it worse: every rejected draft is cropped away
(a view) and the next forward copies the cropped view again.

`GrowingLayer` keeps each layer's K/V in a buffer with room ahead (a quarter of the length,
at least `SLACK` positions), writes new rows into it, and hands out views of the used part;
`crop` only moves the length. Whoever sets `layer.keys`/`layer.values` (compaction, prefix
copies, trimming before a cache is kept) hands it a new buffer, exactly full. Values and
their order are what `DynamicLayer` would hold, so a forward reads the same numbers: only
the copies go.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

#: positions of room reserved beyond a growth at least (a draft tree, a few steps)
SLACK = 64


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` with in-place appends (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        self._keys: torch.Tensor | None = None  # [batch, kv heads, capacity, head dim]
        self._values: torch.Tensor | None = None
        #: positions used in each buffer: equal except between the two assignments of a
        #: caller replacing both (`layer.keys = ...; layer.values = ...`)
        self._length = self._values_length = 0
        super().__init__(**kwargs)

    # -- the used part, as DynamicLayer's attributes -------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._keys is None:
            return None
        return self._keys[..., :self._length, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value
        self._length = 0 if value is None or value.dim() < 2 else int(value.shape[-2])

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._values is None:
            return None
        return self._values[..., :self._values_length, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value
        self._values_length = 0 if value is None or value.dim() < 2 else int(value.shape[-2])

    # -- DynamicLayer's operations, without the copies -----------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self._keys is None or self._keys.dim() < 4:
            self.device = key_states.device
            self.is_initialized = True
            self._grow(key_states, value_states, 0)
        n, new = self._length, int(key_states.shape[-2])
        if n + new > self._keys.shape[-2]:
            self._grow(key_states, value_states, n)
        self._keys[..., n:n + new, :] = key_states
        self._values[..., n:n + new, :] = value_states
        self._length = self._values_length = n + new
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, keep: int) -> None:
        """New buffers with room for the rows coming and a quarter more (at least `SLACK`),
        holding the first `keep` positions of the old ones."""
        total = keep + int(key_states.shape[-2])
        capacity = total + max(SLACK, total // 4)
        buffers = []
        for old, like in ((self._keys, key_states), (self._values, value_states)):
            shape = (*like.shape[:-2], capacity, like.shape[-1])
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            if keep:
                buf[..., :keep, :] = old[..., :keep, :]
            buffers.append(buf)
        self._keys, self._values = buffers
        self._length = self._values_length = keep

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not "
                             f"{tokens_to_remove}")
        if self.is_initialized:
            self._length = self._values_length = max(self._length - abs(tokens_to_remove), 0)

    def reset(self) -> None:
        self._keys = self._values = None
        self._length = self._values_length = 0
        self.is_initialized = False


def new_cache(config: Any) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers grow in place; any other kind
    of layer the config asks for (sliding windows) stays transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
