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

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from nodes.backends.kv_bound import sink_plan

#: positions of room reserved beyond a growth at least (a draft tree, a few steps)
SLACK = 64


#: RoPE types whose frequencies change with the sequence length (transformers'
#: `dynamic_rope_update`): a stored key's rotation could not be continued exactly
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def rope_inv_freq(config: Any, layer_type: str | None = None) -> torch.Tensor:
    """The inverse frequencies [rotated dims / 2] float32 of the RoPE that `config`'s model
    applies on layers of `layer_type` (Gemma 3: "full_attention" and "sliding_attention" have
    different bases), from the config alone: `rope_parameters` (rope_theta, rope_type and its
    scaling, partial_rotary_factor), as transformers' own rotary embeddings compute them. The
    bound's re-indexed sinks are rotated forward with these (pure rotations: a type's
    `attention_scaling` multiplies cos and sin at the rotary embedding, once, already in the
    stored keys). Checked against the models' own rotary embeddings in
    tests/engine/test_kv_bound.py."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    p = params[layer_type] if nested else params
    rope_type = p.get("rope_type", p.get("type", "default")) or "default"
    if rope_type == "default":
        base = p.get("rope_theta", getattr(config, "rope_theta", None))
        if base is None:
            raise ValueError(f"model type {getattr(config, 'model_type', '?')!r}: no RoPE base "
                             "in its config; re-indexed sink positions need one")
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        factor = p.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * (factor or 1.0))
        return 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"re-indexed sink positions need a RoPE whose frequencies do not "
                         f"change with the length; this model's is {rope_type!r}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = (init(config, None, layer_type=layer_type) if nested else init(config, None))
    return inv_freq.float()


def rotation(shift: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [rows, rotated dims] of a rotation by shift [rows] positions, in
    the rotate-half layout (`rotate_forward`: x * cos + roll(x, half) * signed sin)."""
    angle = shift.to(torch.float32)[:, None] * inv_freq[None, :].to(torch.float32)
    sin = angle.sin()
    return torch.cat((angle, angle), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def rotate_forward(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor,
                   turn: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Keys x [..., rows, head dim] stored rotated at their positions, rotated further by
    shift [rows] positions (RoPE composes: a key at p rotated by d is the key at p + d), in
    the rotate-half layout; dims past 2 * len(inv_freq) (partial rotary) stay. `turn`: the
    `rotation(shift, inv_freq)` already made."""
    rot = 2 * int(inv_freq.shape[0])
    cos, sin = turn if turn is not None else rotation(shift, inv_freq)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)
    head = x[..., :rot]
    out = torch.addcmul(head * cos, head.roll(rot // 2, dims=-1), sin)
    return torch.cat((out, x[..., rot:]), dim=-1)


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
    same thing (docs/engine/cache-shapes.md).

    This class (a model's own sliding-window layer): every position is kept, the attention
    reads a view of the last `window - 1` plus the fed rows, so a crop, a prefix copy or a
    tree compaction is exact at any length. `BoundedLayer` keeps only the band."""

    #: whether positions no future query sees are dropped (`BoundedLayer`)
    trim_rows = False

    def __init__(self, sink: int = 0, window: int | None = None, **kwargs: Any) -> None:
        self.sink, self.window = int(sink), window
        self._drop = 0  # positions dropped between the sinks and the kept tail
        super().__init__(**kwargs)

    @property
    def is_sliding(self) -> bool:  # type: ignore[override]
        return not self.trim_rows

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
        start = max(0, past - self.window + 1) if self.window else 0
        return start, (0, self.window or 0, 0, start)

    def trim(self, exact: bool = False) -> None:
        """Nothing to drop: every position is kept (`BoundedLayer` commits here)."""

    def reset(self) -> None:
        super().reset()
        self._drop = 0


class BoundedLayer(WindowLayer):
    """`--kv-sink/--kv-window` on a full layer (or, under a bound, a sliding layer with
    sink 0): the resident K/V holds only the band, `sink + window` committed positions, and a
    forward's fed rows live in a transient overlay that commits only what was accepted
    (mlx-swift-lm #516's shape). Memory between steps is constant in the context length.

    Resident rows: [0, held sinks) are positions [0, min(sink, length)); the rest are the
    last `window` committed positions [off, committed), off = held sinks + `_drop` (one more
    than the next query reads, so a rollback of one position stays exact).

    `update` (once per layer per forward) builds the attention's input, the work buffer
    [resident rows ; fed rows], and keeps it as the overlay: `_pend` of its rows past the
    resident ones are positions not yet committed. `crop` (the engine's word on what stays)
    cuts the overlay and commits it; so does `trim`, at the start of the next forward (a step
    whose drafts were all accepted is never cropped). Committing copies the sinks and the last
    `window` rows of the work buffer into the resident buffer and frees the overlay. A
    rollback into committed positions is exact only while the next query's band is still held
    (to at least off + window - 1); deeper ones are refused, never served with missing K/V.

    With sinks, their positions are re-indexed (`sink_plan`): `update` returns, after the
    overlay, each fed row's own sink keys rotated forward (`feed` says how, before the
    forward), which the band mask lets that row see instead of the originals."""

    trim_rows = True

    def __init__(self, sink: int = 0, window: int | None = None, **kwargs: Any) -> None:
        if not window:
            raise ValueError("a bounded layer needs a window")
        self._work_k: torch.Tensor | None = None  # the overlay: [resident ; fed rows]
        self._work_v: torch.Tensor | None = None
        self._pend = 0  # rows of the overlay past the resident ones (uncommitted positions)
        #: the RoPE inverse frequencies of this layer (`rope_inv_freq`): with sinks, the
        #: re-indexed sink keys are rotated with them
        self.inv_freq: torch.Tensor | None = None
        #: the next forward's re-indexed sinks (`feed`): shift and src of `sink_plan` per copy,
        #: and their rotation's (cos, sin); or None
        self._plan: tuple[torch.Tensor, torch.Tensor, Any] | None = None
        self._plan_at = -1  # the committed length the plan was made for
        super().__init__(sink, window, **kwargs)

    # -- the rows a forward reads: the overlay while there is one ------------------------------
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._work_k is not None:
            return self._work_k[..., :self._length + self._pend, :]
        return None if self._keys is None else self._keys[..., :self._length, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._work_k = self._work_v = None
        self._pend = 0
        GrowingLayer.keys.fset(self, value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._work_v is not None:
            return self._work_v[..., :self._length + self._pend, :]
        return None if self._values is None else self._values[..., :self._values_length, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._work_k = self._work_v = None
        self._pend = 0
        GrowingLayer.values.fset(self, value)

    def get_seq_length(self) -> int:
        return (self._length + self._drop + self._pend) if self.is_initialized else 0

    def committed(self) -> int:
        return (self._length + self._drop) if self.is_initialized else 0

    def held_sinks(self) -> int:
        return min(self.sink, self.committed())

    def band(self, past: int) -> tuple[int, tuple[int, int, int, int]]:
        if not self._drop:
            return 0, (self.sink, self.window or 0, 0, 0)
        return 0, (self.sink, self.window or 0, self.sink, self.sink + self._drop)

    def steady(self) -> int:
        """The rows of the resident buffer: the sinks and the window."""
        return self.sink + int(self.window or 0)

    # -- a forward -------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self._keys is None or self._keys.dim() < 4:
            self.device = key_states.device
            self.is_initialized = True
            self._alloc(key_states, value_states, keep=0)
        if self._work_k is not None:  # a second forward without a crop: all accepted
            self.commit()
        plan, self._plan = self._plan, None
        if plan is not None and self._plan_at != self.committed():
            raise RuntimeError(f"a bounded layer's sink plan was made at {self._plan_at} "
                               f"positions, the forward runs at {self.committed()}")
        self._work_k = torch.cat([self._keys[..., :self._length, :], key_states], dim=-2)
        self._work_v = torch.cat([self._values[..., :self._length, :], value_states], dim=-2)
        self._pend = int(key_states.shape[-2])
        if plan is None:
            return self.keys, self.values
        # re-indexed sinks: row r's own copies of the sink keys, rotated forward for it,
        # after the fed rows (the overlay itself stays [resident ; fed])
        shift, src, turn = plan
        if src.shape[0] == self.sink and self._length >= self.sink:  # one row: a view
            sink_k, sink_v = self._work_k[..., :self.sink, :], self._work_v[..., :self.sink, :]
        else:
            sink_k = self._work_k.index_select(-2, src)
            sink_v = self._work_v.index_select(-2, src)
        sink_k = rotate_forward(sink_k, shift, self.inv_freq, turn)
        return (torch.cat([self.keys, sink_k], dim=-2), torch.cat([self.values, sink_v], dim=-2))

    def feed(self, plan: tuple[np.ndarray, np.ndarray] | None,
             memo: dict[Any, Any] | None = None) -> None:
        """The next forward's `sink_plan` (None: no row needs re-indexing); `memo` shares the
        tensors between the layers of one cache."""
        if plan is None or not self.sink:
            self._plan = None
            return
        if self.inv_freq is None:
            raise RuntimeError("a bounded layer with sinks needs its RoPE frequencies "
                               "(growing_cache.new_cache sets them)")
        key = (id(plan), id(self.inv_freq))
        if memo is not None and key in memo:
            self._plan = memo[key]
        else:
            shift, src = plan
            shift_t = torch.from_numpy(np.repeat(shift, self.sink))
            self._plan = (shift_t, torch.from_numpy(np.ascontiguousarray(src).reshape(-1)),
                          rotation(shift_t, self.inv_freq))
            if memo is not None:
                memo[key] = self._plan
        self._plan_at = self.committed()

    def _alloc(self, like_k: torch.Tensor, like_v: torch.Tensor, keep: int) -> None:
        buffers = []
        for old, ref in ((self._keys, like_k), (self._values, like_v)):
            buf = torch.empty((*ref.shape[:-2], self.steady(), ref.shape[-1]), dtype=ref.dtype,
                              device=ref.device)
            if keep:
                buf[..., :keep, :] = old[..., :keep, :]
            buffers.append(buf)
        self._keys, self._values = buffers
        self._length = self._values_length = keep

    def commit(self) -> None:
        """The overlay's rows become resident: the sinks and the last `window` committed
        positions kept, the rest dropped, the overlay freed."""
        work_k, work_v = self._work_k, self._work_v
        if work_k is None or work_v is None:
            return
        total = self._length + self._pend  # rows of the work buffer that stay
        length = total + self._drop
        sinks = min(self.sink, length)
        tail = min(int(self.window or 0), length - sinks)
        if self._keys is None or self._keys.shape[-2] < self.steady():
            with torch.inference_mode():
                self._alloc(work_k, work_v, keep=0)
        with torch.inference_mode():  # the buffers are inference tensors; crop runs outside
            for buf, work in ((self._keys, work_k), (self._values, work_v)):
                buf[..., :sinks, :] = work[..., :sinks, :]
                buf[..., sinks:sinks + tail, :] = work[..., total - tail:total, :]
        self._drop = length - sinks - tail
        self._length = self._values_length = sinks + tail
        self._work_k = self._work_v = None
        self._pend = 0

    def trim(self, exact: bool = False) -> None:
        """The start of a forward (or a cache kept): what the overlay still holds is accepted."""
        self.commit()

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """After a tree forward at length `base`: the overlay's fed rows `keep` (feed indices)
        moved to positions base.., the rest dropped."""
        if self._work_k is None or base != self.committed():
            raise ValueError(f"compact at {base}: the overlay holds positions from "
                             f"{self.committed()} ({self._pend} of them)")
        row = self._length
        with torch.inference_mode():
            for work in (self._work_k, self._work_v):
                work[..., row:row + len(keep), :] = work[..., row + keep, :]  # a copy first
        self._pend = len(keep)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not "
                             f"{tokens_to_remove}")
        if not self.is_initialized:
            return
        target = max(self.get_seq_length() - abs(tokens_to_remove), 0)
        committed = self.committed()
        if self._work_k is not None and target >= committed:
            self._pend = target - committed
            self.commit()
            return
        self._work_k = self._work_v = None
        self._pend = 0
        if self._drop and target < self.sink + self._drop + int(self.window or 0) - 1:
            raise ValueError(f"cannot roll back to {target} positions: its window needs "
                             f"positions from {max(0, target - int(self.window or 0) + 1)}, "
                             f"and those below {self.offset()} were dropped (kv window "
                             f"{self.window})")
        self._length = self._values_length = target - self._drop

    def prefix_floor(self) -> int:
        """The fewest positions a copy of this layer's prefix can hold: every prefix while
        nothing was dropped, else as deep as a rollback may go (`crop`): a shorter prefix's
        window needs positions no longer held."""
        if not self._drop:
            return 0
        return self.sink + self._drop + int(self.window or 0) - 1

    def copy_prefix_to(self, dst: BoundedLayer, length: int) -> None:
        """Make the empty bounded layer `dst` hold this layer's first `length` committed
        positions as if it had been fed them (the same band, the same dropped count): a
        chat's next turn starting from the last one's K/V. `length` at least `prefix_floor`."""
        if self._work_k is not None:
            raise ValueError("cannot copy a bounded layer with a forward's rows pending")
        if not self.prefix_floor() <= length <= self.committed():
            raise ValueError(f"cannot copy {length} positions of a bounded layer holding "
                             f"{self.committed()} (its window needs positions from "
                             f"{self.prefix_floor()} on)")
        if dst.is_initialized and dst.committed():
            raise ValueError("copying a prefix into a layer that holds positions")
        if self._keys is None:
            return
        dst.device, dst.is_initialized = self.device, True
        with torch.inference_mode():
            dst._alloc(self._keys, self._values, keep=0)
            rows = length - self._drop
            dst._keys[..., :rows, :] = self._keys[..., :rows, :]
            dst._values[..., :rows, :] = self._values[..., :rows, :]
        dst._drop = self._drop
        dst._length = dst._values_length = rows

    def reset(self) -> None:
        super().reset()
        self._work_k = self._work_v = None
        self._pend = 0
        self._plan = None


def band_layer(layer: Any) -> bool:
    return isinstance(layer, WindowLayer)


def feed(cache: Any, past: int, depth: np.ndarray, visible: np.ndarray) -> None:
    """Before a forward of rows at past + depth (tree `visible`): every bounded layer with
    sinks told its re-indexed sink keys (`sink_plan`), one plan per (sink, window)."""
    plans: dict[tuple[int, int], Any] = {}
    memo: dict[Any, Any] = {}
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, BoundedLayer) and layer.sink:
            geometry = (layer.sink, int(layer.window or 0))
            if geometry not in plans:
                plans[geometry] = sink_plan(past, depth, visible, *geometry)
            layer.feed(plans[geometry], memo)


def trim(cache: Any, exact: bool = False) -> None:
    """Commit every bounded layer's overlay (the start of a forward; a cache kept)."""
    for layer in cache.layers:
        if isinstance(layer, BoundedLayer):
            layer.trim(exact)


def commit(cache: Any) -> None:
    """The engine's crop said what stays: every bounded layer's overlay committed."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, BoundedLayer):
            layer.commit()


def compact(layer: Any, base: int, keep: torch.Tensor) -> None:
    """After a tree forward at length `base`: the fed rows `keep` (feed indices) moved, in
    place, to positions base.., the rest dropped."""
    if isinstance(layer, BoundedLayer):
        layer.compact(base, keep)
        return
    if layer.keys is None:
        return
    row = base - (layer._drop if isinstance(layer, WindowLayer) else 0)
    for name in ("_keys", "_values"):
        buf = getattr(layer, name)
        buf[..., row:row + len(keep), :] = buf[..., row + keep, :]  # index: a copy first
    layer._length = layer._values_length = row + len(keep)


def kv_bytes(cache: Any) -> int:
    """Bytes of K/V buffers the cache holds (allocated, room ahead included; a bounded
    layer's overlay too, while a forward's rows are not yet committed)."""
    total = 0
    for layer in cache.layers:
        for name in ("_keys", "_values", "_work_k", "_work_v"):
            t = getattr(layer, name, None)
            if t is None and name in ("_keys", "_values"):
                t = getattr(layer, name.lstrip("_"), None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def windowed(config: Any) -> bool:
    """Whether `config`'s model has sliding-window layers (those need our band masks)."""
    return any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers)


def new_cache(config: Any, bound: tuple[int, int] | None = None) -> DynamicCache:
    """A `DynamicCache` for `config`: full-attention layers grow in place (`GrowingLayer`), or
    keep sinks + window under `bound` = (sink, window) (`BoundedLayer`); sliding-
    window layers become `WindowLayer`s keeping everything, their window applied by the mask
    (exact crops and prefix copies at any length), or under a bound trimmed to their window.
    Any other kind of layer (chunked attention, shared K/V) is refused."""
    from nodes.engine.errors import BadRequestError

    cache = DynamicCache(config=config)
    layers = []
    kinds = getattr(config, "layer_types", None)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            if bound is None:
                layers.append(GrowingLayer())
                continue
            bounded = BoundedLayer(bound[0], bound[1])
            kind = kinds[i] if kinds and i < len(kinds) else None
            bounded.inv_freq = _inv_freq(config, kind)
            layers.append(bounded)
        elif type(layer) is DynamicSlidingWindowLayer:
            # bounded (constant memory): its window trimmed too; else every position kept
            window = int(layer.sliding_window)
            layers.append(WindowLayer(0, window) if bound is None else BoundedLayer(0, window))
        else:
            raise BadRequestError(f"model type {getattr(config, 'model_type', '?')!r}: cache "
                                  f"layer {type(layer).__name__} is served by no path here "
                                  "(full and sliding-window attention are)")
    cache.layers = layers
    return cache


_FREQS: dict[tuple[int, str | None], tuple[Any, torch.Tensor]] = {}


def _inv_freq(config: Any, kind: str | None) -> torch.Tensor:
    """`rope_inv_freq`, once per config and layer type (a cache per sequence is made often)."""
    key = (id(config), kind)
    got = _FREQS.get(key)
    if got is None or got[0] is not config:
        got = (config, rope_inv_freq(config, kind))
        _FREQS[key] = got
    return got[1]
