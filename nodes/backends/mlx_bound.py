"""`--kv-sink S --kv-window W` on MLX: `BoundedKVCache`, an mlx-lm cache layer holding only the
band (docs/engine/cache-shapes.md, "The bounded model"; the torch twin is
`growing_cache.BoundedLayer`).

The bounded model is a function of the tokens alone: a query at absolute position q sees key p
when p < S (the sinks) or q - W < p <= q (the window); RoPE rotates every token at its own
absolute position (mlx-lm's attention rotates at `cache.offset`, which stays the absolute
length), and the sinks' positions are re-indexed as on torch (a query at q meets sink s at
distance min(q, S + W - 1) - s): each fed row past S + W - 1 gets its own copies of the sink
keys, rotated forward by the layer's own rope, after the fed rows, and the mask lets it see
those instead of the originals (queries never reach an MLX cache: the cache and the mask are
where this can live). Between steps the resident K/V holds exactly the sinks and the last W
committed positions (one more than the next query reads, so a rollback of one position stays exact).
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
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import _BaseCache

from nodes.backends.kv_bound import sink_plan


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
        #: the layer's own rotary embedding (mlx-lm's `self_attn.rope`, `reindex`): with
        #: sinks, re-indexed sink keys are rotated forward with it
        self.rope: Any = None

    # -- what mlx-lm asks of a cache ------------------------------------------------------------
    def rows(self) -> int:
        """Resident rows."""
        return 0 if self.keys is None else int(self.keys.shape[2])

    def committed(self) -> int:
        return self.offset - self.pend

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.commit()  # a second forward without a crop: the last one's rows were all accepted
        past = self.offset
        if self.keys is None:
            self.work_k, self.work_v = keys, values
        else:
            self.work_k = mx.concatenate([self.keys, keys], axis=2)
            self.work_v = mx.concatenate([self.values, values], axis=2)
        self.pend = int(keys.shape[2])
        self.offset += self.pend
        if self._plan(past, self.pend) is None:
            return self.work_k, self.work_v
        # re-indexed sinks: row r's own copies of the sink keys, after the fed rows, rotated
        # forward by past + r - (sink + window - 1) (rows not past the edge: masked out).
        # A chain: positions 0..sink-1 are the work rows 0..sink-1.
        n, sink = self.pend, self.sink
        b, heads, _, dim = self.work_k.shape
        sink_k, sink_v = self.work_k[:, :, :sink], self.work_v[:, :, :sink]
        spread = mx.broadcast_to(sink_k[:, :, :, None], (b, heads, sink, n, dim))
        turned = self.rope(spread.reshape(b, heads * sink, n, dim),
                           offset=past - (sink + self.window - 1))
        copies_k = turned.reshape(b, heads, sink, n, dim).transpose(0, 1, 3, 2, 4)
        copies_v = mx.broadcast_to(sink_v[:, :, None], (b, heads, n, sink, dim))
        return (mx.concatenate([self.work_k, copies_k.reshape(b, heads, n * sink, dim)], axis=2),
                mx.concatenate([self.work_v, copies_v.reshape(b, heads, n * sink, dim)], axis=2))

    def _plan(self, past: int, n: int) -> Any:
        """`kv_bound.sink_plan` of a chain of `n` rows after `past` positions (None: no row
        past sink + window - 1, or no sinks)."""
        if not self.sink or past + n - 1 <= self.sink + self.window - 1:
            return None
        if self.rope is None:
            raise RuntimeError("a bounded MLX cache with sinks needs its layer's rotary "
                               "embedding (`reindex`)")
        depth = np.arange(n)
        return sink_plan(past, depth, np.tri(n, dtype=bool), self.sink, self.window)

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
        mask = (k <= q) & ((k < self.sink) | (k > q - self.window))
        plan = self._plan(start, N)
        if plan is None:
            return mask
        # re-indexed rows see their own sink copies (`update_and_fetch`), not the originals
        moved = mx.array(plan[0] > 0)[:, None]
        mask = mask & ~(moved & (k < self.sink))
        own = np.zeros((N, N * self.sink), dtype=bool)
        for r in np.flatnonzero(plan[0]):
            own[r, r * self.sink:(r + 1) * self.sink] = True
        return mx.concatenate([mask, mx.array(own)], axis=1)

    def reindex(self, rope: Any) -> None:
        """Re-indexed sink positions (StreamingLLM's; `kv_bound.sink_plan`): a query at q
        meets sink s at distance min(q, sink + window - 1) - s, its sink keys rotated forward
        with `rope`, the layer's own rotary embedding (a pure rotation: mlx-lm's `nn.RoPE`
        or `Llama3RoPE`; anything that also scales or depends on the length is refused)."""
        from mlx_lm.models.rope_utils import Llama3RoPE

        if type(rope) not in (nn.RoPE, Llama3RoPE):
            raise ValueError(f"re-indexed sink positions need a pure rotary embedding; this "
                             f"layer's is {type(rope).__name__}")
        self.rope = rope

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


def bounded_cache(layers: list[Any], bound: tuple[int, int],
                  model: Any = None) -> list[Any]:
    """mlx-lm's cache for a model (`make_prompt_cache`), bounded: a plain `KVCache` (a
    full-attention layer) becomes `BoundedKVCache(sink, window)` with re-indexed sink
    positions (its rotary embedding taken from `model`'s layer), a sliding-window
    `RotatingKVCache` a `BoundedKVCache(0, its window)`; None for a layer of another kind."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    out = []
    for i, layer in enumerate(layers):
        if type(layer) is KVCache:
            bounded = BoundedKVCache(*bound)
            if model is not None:
                bounded.reindex(model.layers[i].self_attn.rope)
            out.append(bounded)
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
