"""`--kv-sink S --kv-window W` on MLX: `BoundedKVCache`, an mlx-lm cache layer holding only the
band (docs/engine/cache-shapes.md, "The bounded model"; the torch twin is
`growing_cache.BoundedLayer`).

The bounded model is a function of the tokens alone: a query at absolute position q sees key p
when p < S (the sinks) or q - W < p <= q (the window); RoPE rotates every token at its own
absolute position (mlx-lm's attention rotates at `cache.offset`, which stays the absolute
length). Between steps the resident K/V holds exactly the sinks and the last W committed
positions (one more than the next query reads, so a rollback of one position stays exact).
A forward's fed rows go into a transient overlay, [resident ; fed], which `crop` (the
engine's word on what was accepted, after every step) cuts and commits; a forward with no crop
after it is committed at the start of the next. The mask (`make_mask`, which mlx-lm's models
ask of a layer's cache before the layers run) is a boolean mask over [resident ; fed] rows
built from their absolute positions.

A sliding-window layer under a bound is a `BoundedKVCache(0, window)`: the same band with no
sinks, so it keeps its own window and no more.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


class BoundedKVCache(_BaseCache):
    """One layer's bounded K/V (see the module docstring).

    Resident rows: [0, held sinks) are positions [0, min(sink, committed)); the rest are the
    last `window` (at most) committed positions [held sinks + drop, committed). `offset` is the
    absolute length, pending overlay rows included (what mlx-lm rotates the next rows at)."""

    def __init__(self, sink: int, window: int) -> None:
        if window < 1 or sink < 0:
            raise ValueError(f"a bounded cache needs a window (got sink {sink}, window {window})")
        self.sink, self.window = int(sink), int(window)
        self.keys: mx.array | None = None  # resident: [batch, kv heads, rows, head dim]
        self.values: mx.array | None = None
        self.work_k: mx.array | None = None  # the overlay: [resident ; fed rows]
        self.work_v: mx.array | None = None
        self.pend = 0  # overlay rows past the resident ones (positions not yet committed)
        self.drop = 0  # positions dropped between the sinks and the kept tail
        self.offset = 0  # positions held, committed and pending

    # -- what mlx-lm asks of a cache ------------------------------------------------------------
    def rows(self) -> int:
        """Resident rows."""
        return 0 if self.keys is None else int(self.keys.shape[2])

    def committed(self) -> int:
        return self.offset - self.pend

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.commit()  # a second forward without a crop: the last one's rows were all accepted
        if self.keys is None:
            self.work_k, self.work_v = keys, values
        else:
            self.work_k = mx.concatenate([self.keys, keys], axis=2)
            self.work_v = mx.concatenate([self.values, values], axis=2)
        self.pend = int(keys.shape[2])
        self.offset += self.pend
        return self.work_k, self.work_v

    def positions(self) -> mx.array:
        """The absolute position of each resident row."""
        rows = mx.arange(self.rows())
        if not self.drop:
            return rows
        return mx.where(rows < self.sink, rows, rows + self.drop)

    def make_mask(self, N: int, return_array: bool = False,  # noqa: N803 - mlx-lm's name
                  window_size: int | None = None) -> mx.array:
        """The mask of the forward about to feed `N` rows: query rows at positions
        offset..offset+N-1 against keys [resident ; fed], each visible where the band says
        (`window_size`, mlx-lm's sliding window, is this cache's own `window` already)."""
        self.commit()  # the mask is asked before any layer updates: commit as they will
        start = self.offset
        fed = mx.arange(start, start + N)
        keys = mx.concatenate([self.positions(), fed]) if self.rows() else fed
        q, k = fed[:, None], keys[None]
        return (k <= q) & ((k < self.sink) | (k > q - self.window))

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.work_k is not None:
            return self.work_k, self.work_v
        if self.keys is None:
            return ()
        return self.keys, self.values

    @state.setter
    def state(self, v: Any) -> None:  # pragma: no cover - mlx-lm's prompt-cache files
        raise ValueError("a bounded K/V cache is not saved or loaded as a prompt cache")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, int(n))
        self.crop(self.offset - n)
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None and self.work_k is None

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K/V and, while a forward's rows are pending, the overlay."""
        total = 0
        for t in (self.keys, self.values, self.work_k, self.work_v):
            if t is not None:
                total += int(t.nbytes)
        return total

    # -- commits and rollbacks ------------------------------------------------------------------
    def commit(self) -> None:
        """The overlay's rows become resident: the sinks and the last `window` committed
        positions kept, the rest dropped, the overlay freed."""
        work_k, work_v = self.work_k, self.work_v
        if work_k is None or work_v is None:
            return
        total = self.rows() + self.pend  # rows of the overlay that stay
        length = self.offset
        sinks = min(self.sink, length)
        tail = min(self.window, length - sinks, total - sinks)
        parts_k, parts_v = [], []
        if sinks:
            parts_k.append(work_k[..., :sinks, :])
            parts_v.append(work_v[..., :sinks, :])
        if tail:
            parts_k.append(work_k[..., total - tail:total, :])
            parts_v.append(work_v[..., total - tail:total, :])
        if parts_k:
            # copies (a lone slice would be a view keeping the whole overlay alive), evaluated
            # now: the overlay's memory goes back at once
            self.keys, self.values = (mx.array(parts[0]) if len(parts) == 1
                                      else mx.concatenate(parts, axis=2)
                                      for parts in (parts_k, parts_v))
            mx.eval(self.keys, self.values)
        else:
            self.keys = self.values = None
        self.drop = length - sinks - tail
        self.work_k = self.work_v = None
        self.pend = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions and commit (the engine's crop after every step).
        A rollback into committed positions is exact while the next query's band is still held
        (to at least sink + drop + window - 1); deeper ones are refused, never served with
        missing K/V."""
        target = max(int(length), 0)
        committed = self.committed()
        if target >= self.offset:
            self.commit()
            return
        if self.work_k is not None and target >= committed:
            self.pend -= self.offset - target
            self.offset = target
            self.commit()
            return
        self.work_k = self.work_v = None
        self.pend = 0
        self.offset = committed
        if self.drop and target < self.sink + self.drop + self.window - 1:
            raise ValueError(f"cannot roll back to {target} positions: its window needs "
                             f"positions from {max(0, target - self.window + 1)}, and those "
                             f"below {min(self.sink, committed) + self.drop} were dropped "
                             f"(kv window {self.window})")
        rows = target - self.drop
        if self.keys is not None:
            if rows:
                self.keys = mx.array(self.keys[..., :rows, :])  # copies: no view on the old
                self.values = mx.array(self.values[..., :rows, :])
                mx.eval(self.keys, self.values)
            else:
                self.keys = self.values = None
        self.offset = target


def bounded_cache(layers: list[Any], bound: tuple[int, int]) -> list[Any]:
    """mlx-lm's cache for a model (`make_prompt_cache`), bounded: a plain `KVCache` (a
    full-attention layer) becomes `BoundedKVCache(sink, window)`, a sliding-window
    `RotatingKVCache` a `BoundedKVCache(0, its window)`; None for a layer of another kind."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    out = []
    for layer in layers:
        if type(layer) is KVCache:
            out.append(BoundedKVCache(*bound))
        elif type(layer) is RotatingKVCache and not layer.keep:
            out.append(BoundedKVCache(0, int(layer.max_size)))
        else:
            out.append(None)
    return out


def kv_bytes(cache: list[Any]) -> int:
    """Bytes of K/V buffers an MLX cache holds (allocated: a `KVCache`'s room ahead included; a
    bounded layer's overlay too, while a forward's rows are not yet committed)."""
    total = 0
    for layer in cache:
        if isinstance(layer, BoundedKVCache):
            total += layer.nbytes
        elif getattr(layer, "keys", None) is not None:
            total += int(layer.keys.nbytes) + int(layer.values.nbytes)
    return total
