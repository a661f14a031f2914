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
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

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


class WindowLayer(GrowingLayer):
    """A layer attending to a band of absolute positions: the first `sink` (0 for none) and
    the last `window` (query q sees key p when p > q - window or p < sink), the mask a
    function of positions alone, so prefill, decoding, a draft tree and a batch compute the
    same thing (docs: "Cache shapes").

    `trim=False` (a model's own sliding-window layer): every position is kept, the attention
    reads a view of the last `window - 1` plus the fed rows, so a crop, a prefix copy or a
    tree compaction is exact at any length. `trim=True` (`--kv-sink/--kv-window` on a full
    layer): positions no future query can see (below `length - window + 1`, past the sinks)
    are dropped at the start of each forward (`trim`), rows moved down in place once at least
    `SLACK // 2` of them are dead, the buffer held at `sink + window + SLACK` rows (room for
    the dead rows and a draft tree of `SLACK // 2` more; a larger feed grows it for that
    forward, the next trim shrinks it back): memory is constant in the context length.
    Rolling back below the first kept position is refused.

    Rows: [0, held sinks) are positions [0, min(sink, length)); the rest are positions
    [off, length), off = held sinks + `_drop`."""

    def __init__(self, sink: int = 0, window: int | None = None, trim: bool = False,
                 **kwargs: Any) -> None:
        self.sink, self.window, self.trim_rows = int(sink), window, bool(trim)
        self._drop = 0  # positions dropped between the sinks and the kept tail
        super().__init__(**kwargs)

    @property
    def is_sliding(self) -> bool:  # type: ignore[override]
        return not self.trim_rows

    # -- positions ------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return (self._length + self._drop) if self.is_initialized else 0

    def held_sinks(self) -> int:
        return min(self.sink, self.get_seq_length())

    def offset(self) -> int:
        """The first position of the kept tail."""
        return self.held_sinks() + self._drop

    def band(self, past: int) -> tuple[int, tuple[int, int, int, int]]:
        """For a forward appending after `past` positions: the first row its attention reads
        and the key of the positions it reads before the fed ones, (sink, window, a, b):
        positions [0, a) then [b, past), the same before and after the forward's update."""
        if not self.trim_rows:
            start = max(0, past - self.window + 1) if self.window else 0
            return start, (0, self.window or 0, 0, start)
        if not self._drop:
            return 0, (self.sink, self.window or 0, 0, 0)
        return 0, (self.sink, self.window or 0, self.sink, self.sink + self._drop)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not "
                             f"{tokens_to_remove}")
        if not self.is_initialized:
            return
        target = max(self.get_seq_length() - abs(tokens_to_remove), 0)
        if self._drop and target < self.offset():
            raise ValueError(f"cannot roll back to {target} positions: positions below "
                             f"{self.offset()} were dropped (kv window {self.window})")
        self._length = self._values_length = target - self._drop

    def reset(self) -> None:
        super().reset()
        self._drop = 0

    def steady(self) -> int:
        """The rows a trimming layer's buffer keeps once past sink + window."""
        return self.sink + (self.window or 0) + SLACK

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, keep: int) -> None:
        if not self.trim_rows:
            return super()._grow(key_states, value_states, keep)
        total = keep + int(key_states.shape[-2])
        capacity = max(total + max(SLACK, total // 4), self.steady())
        self._realloc(capacity, keep, like=(key_states, value_states))

    def _realloc(self, capacity: int, keep: int, like: tuple[torch.Tensor, torch.Tensor]
                 ) -> None:
        buffers = []
        for old, ref in zip((self._keys, self._values), like, strict=True):
            shape = (*ref.shape[:-2], capacity, ref.shape[-1])
            buf = torch.empty(shape, dtype=ref.dtype, device=ref.device)
            if keep:
                buf[..., :keep, :] = old[..., :keep, :]
            buffers.append(buf)
        self._keys, self._values = buffers
        self._length = self._values_length = keep

    def trim(self, exact: bool = False) -> None:
        """Drop the positions no query from the current length on can see (class
        docstring): when at least `SLACK // 2` are dead, or any with `exact`; then shrink a buffer
        grown past its steady size (a long prompt fed at once)."""
        if not (self.trim_rows and self.is_initialized and self._keys is not None):
            return
        length, sinks = self.get_seq_length(), self.held_sinks()
        dead = max(0, length - self.window + 1 - self.offset())
        if dead and (exact or dead >= SLACK // 2):
            first = sinks + dead  # the row of the first position kept
            n = self._length - first
            for buf in (self._keys, self._values):
                buf[..., sinks:sinks + n, :] = buf[..., first:first + n, :].clone()
            self._drop += dead
            self._length = self._values_length = sinks + n
        if self._keys.shape[-2] > self.steady() and self._length <= self.steady() - SLACK:
            self._realloc(self.steady(), self._length, like=(self._keys, self._values))


def band_layer(layer: Any) -> bool:
    return isinstance(layer, WindowLayer)


def trim(cache: Any, exact: bool = False) -> None:
    """Trim every trimming layer of `cache` (the start of a forward; `exact` when kept)."""
    for layer in cache.layers:
        if isinstance(layer, WindowLayer):
            layer.trim(exact)


def compact(layer: Any, base: int, keep: torch.Tensor) -> None:
    """After a tree forward at length `base`: the fed rows `keep` (feed indices) moved, in
    place, to positions base.., the rest dropped."""
    if layer.keys is None:
        return
    row = base - (layer._drop if isinstance(layer, WindowLayer) else 0)
    for name in ("_keys", "_values"):
        buf = getattr(layer, name)
        buf[..., row:row + len(keep), :] = buf[..., row + keep, :]  # index: a copy first
    layer._length = layer._values_length = row + len(keep)


def kv_bytes(cache: Any) -> int:
    """Bytes of K/V buffers the cache holds (allocated, room ahead included)."""
    total = 0
    for layer in cache.layers:
        for name in ("_keys", "_values"):
            t = getattr(layer, name, None)
            if t is None:
                t = getattr(layer, name.lstrip("_"), None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def windowed(config: Any) -> bool:
    """Whether `config`'s model has sliding-window layers (those need our band masks)."""
    return any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers)


def new_cache(config: Any, bound: tuple[int, int] | None = None) -> DynamicCache:
    """A `DynamicCache` for `config`: full-attention layers grow in place (`GrowingLayer`), or
    keep sinks + window under `bound` = (sink, window) (`WindowLayer(trim=True)`); sliding-
    window layers become `WindowLayer`s keeping everything, their window applied by the mask
    (exact crops and prefix copies at any length), or under a bound trimmed to their window.
    Any other kind of layer (chunked attention, shared K/V) is refused."""
    from nodes.engine.errors import BadRequestError

    cache = DynamicCache(config=config)
    layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layers.append(GrowingLayer() if bound is None
                          else WindowLayer(bound[0], bound[1], trim=True))
        elif type(layer) is DynamicSlidingWindowLayer:
            # bounded (constant memory): its window trimmed too; else every position kept
            layers.append(WindowLayer(0, int(layer.sliding_window), trim=bound is not None))
        else:
            raise BadRequestError(f"model type {getattr(config, 'model_type', '?')!r}: cache "
                                  f"layer {type(layer).__name__} is served by no path here "
                                  "(full and sliding-window attention are)")
    cache.layers = layers
    return cache
