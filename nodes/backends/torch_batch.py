"""One transformers forward over several sequences, each with its own `DynamicCache` and tree,
packed ragged.

Every fed row of every sequence goes through the linear layers as one packed row
(`input_ids` [1, total]): a sequence's 5-node tree beside seven one-token steps is 12 rows, not
8 x 5 padded ones. Attention runs per sequence (`_ragged_attention`, registered with
transformers as the attention implementation `specbus_ragged` and switched on only for this
call): sequence b's queries meet only its own cache, read in place, and its own tree's visible
nodes. So nothing is copied into a throwaway batch cache, no row meets another sequence's past
(masked or not), and a batch costs what its rows and each sequence's own attention cost.

Why not the two layouts this replaced (padded: pasts left-padded and stacked per step, feeds
padded to the longest; packed: pasts concatenated, a block-diagonal mask over all of them):
both copied every sequence's past into the batch cache and again out of it each step, the
padded one multiplied a draft's rows by the batch size, the packed one made every row attend
over every sequence's past. Measured on SmolLM2 (docs/engine.md, "Batching"): a plain step of 8
sequences 15-20 % faster, one with two trees in it ~20 % faster; and with the few-row kernel
each row's logits are bit for bit its solo logits (the attention is the solo call's, per
sequence; the kernel's sum per row does not depend on the other rows).

How the per-sequence K/V reach the attention: the model is called with a stand-in
`past_key_values` (`_Ragged`) whose `update` appends each sequence's new K/V rows to its own
cache (the concatenation `DynamicLayer.update` does alone) and keeps the full K/V per sequence
for that layer's attention, which gets the stand-in through the call's kwargs. RoPE comes from
per-row `position_ids = past_b + depth`. The 4-D placeholder mask makes transformers skip its
own mask building (it returns a 4-D mask as given); each sequence's mask is built here: none
for a one-token step, causal for a chain over an empty cache, else its past plus its tree's
visibility.

A feed with a true `last_only` attribute (the engine's prompt chunks) gets only its last row's
logits computed and returned ([1, vocab]): the LM head is most of a long prompt's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nodes.backends import growing_cache
from nodes.backends.base import tree_layout

#: the attention implementation name a ragged call switches the model's config to
RAGGED = "specbus_ragged"
_registered = False


def forward(backend: Any, caches: Sequence[Any],
            feeds: Sequence[tuple[Sequence[int], Sequence[int]]],
            last_only: Sequence[bool] | None = None) -> list[np.ndarray]:
    """Append `feeds[b] = (token_ids, parents)` to `caches[b]` in one model call; return each
    sequence's logits float32 [n_b, vocab] ([1, vocab] for a `last_only` feed, or where
    `last_only[b]` says so; see the module docstring). On a backend with a lean forward
    (`torch_lean`) that forward runs instead of the model's, with the same layout and values."""
    device = backend.device
    last = (list(last_only) if last_only is not None
            else [bool(getattr(f, "last_only", False)) for f in feeds])
    if any(len(ids) > BOUNDED_CHUNK and _reindexed(c) for (ids, _), c in zip(feeds, caches,
                                                                               strict=True)):
        return _in_chunks(backend, caches, feeds, last)
    for cache in caches:
        growing_cache.trim(cache)  # bounded layers: drop what no query from here on sees
    sizes = [len(ids) for ids, _ in feeds]
    pasts = [backend.cache_length(c) for c in caches]
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    # the rows' ids and positions built in numpy, one tensor each (a tensor from a list of
    # numpy integers costs a conversion per element)
    ids_np = np.empty(int(offs[-1]), dtype=np.int64)
    pos_np = np.empty_like(ids_np)
    seqmasks: list[SeqMask] = []
    for b, ((tokens, parents), n, past) in enumerate(zip(feeds, sizes, pasts, strict=True)):
        depth, visible = tree_layout(parents)
        ids_np[offs[b]:offs[b] + n] = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos_np[offs[b]:offs[b] + n] = past + depth
        seqmasks.append(SeqMask(past, depth, visible, device))
        growing_cache.feed(caches[b], past, depth, visible)  # re-indexed sinks, if bounded
    ids = torch.from_numpy(ids_np).reshape(1, -1)
    pos = torch.from_numpy(pos_np).reshape(1, -1)
    capture = [getattr(c, "specbus_capture", None) for c in caches]
    union = tuple(sorted({i for layers in capture if layers for i in layers})) or None
    wanted = [[offs[b] + n - 1] if only else
              list(range(offs[b] + getattr(feed, "logits_from", 0), offs[b] + n))
              for b, (n, only, feed) in enumerate(zip(sizes, last, feeds, strict=True))]
    keep = [i for rows in wanted for i in rows]
    trimmed = len(keep) < len(pos[0])  # some feeds want only their last row: skip the others' head
    uniform = [_uniform_mask(m, c) for m, c in zip(seqmasks, caches, strict=True)]
    if backend.lean is not None and all(u is not False for u in uniform):
        out_logits, hidden = backend.lean.run(caches, offs, ids, pos, uniform,
                                              keep if trimmed else None, union)
    else:
        out_logits, hidden = _model_call(backend, caches, offs, ids, pos, seqmasks,
                                         keep if trimmed else None, union)
    if union is not None:
        for b, (cache, layers) in enumerate(zip(caches, capture, strict=True)):
            if layers:
                cols = [union.index(i) for i in layers]
                cache.specbus_hidden = hidden[offs[b]:offs[b + 1]][:, cols]
    logits = out_logits[0].float().cpu().numpy()
    got, start = [], 0
    for rows in wanted:
        got.append(logits[start:start + len(rows)])
        start += len(rows)
    return got


class LogitsFrom(tuple):
    """A feed `(tokens, parents)` whose rows before `logits_from` want no logits (a prompt's
    rows ahead of a draft tree: `TorchBackend.forward_tree_after`); the LM head skips them."""

    def __new__(cls, tokens: Sequence[int], parents: Sequence[int],
                logits_from: int) -> LogitsFrom:
        feed = super().__new__(cls, (list(tokens), list(parents)))
        feed.logits_from = logits_from
        return feed


#: under a bound with sinks, the most rows of one sequence a forward feeds at once: each row
#: past the bound brings its own sink copies (re-indexed positions, `growing_cache.sink_plan`),
#: so a feed's attention grows with its square; a longer chain (a prompt) goes in chunks
BOUNDED_CHUNK = 256


def _reindexed(cache: Any) -> bool:
    return any(isinstance(layer, growing_cache.BoundedLayer) and layer.sink
               for layer in getattr(cache, "layers", ()))


def _in_chunks(backend: Any, caches: Sequence[Any],
               feeds: Sequence[tuple[Sequence[int], Sequence[int]]],
               last: list[bool]) -> list[np.ndarray]:
    """`forward` with each bounded sequence's long chain fed `BOUNDED_CHUNK` rows at a time
    first (the same model: it is a function of the tokens), then every feed's rest together;
    each sequence's logits as one call would return them."""
    head: list[list[np.ndarray]] = [[] for _ in feeds]
    hidden: list[list[Any]] = [[] for _ in feeds]  # captured layer inputs (EAGLE-3), per chunk
    rest = []
    for b, ((ids, parents), cache) in enumerate(zip(feeds, caches, strict=True)):
        ids, parents = list(ids), list(parents)
        chain = parents == list(range(-1, len(ids) - 1))
        if len(ids) > BOUNDED_CHUNK and chain and _reindexed(cache):
            cut = len(ids) - BOUNDED_CHUNK
            for start in range(0, cut, BOUNDED_CHUNK):
                part = ids[start:min(start + BOUNDED_CHUNK, cut)]
                got = forward(backend, [cache], [(part, list(range(-1, len(part) - 1)))],
                              last_only=[last[b]])[0]
                if not last[b]:
                    head[b].append(got)
                if getattr(cache, "specbus_capture", None):
                    hidden[b].append(cache.specbus_hidden)
            ids = ids[cut:]
            parents = list(range(-1, len(ids) - 1))
        elif len(ids) > BOUNDED_CHUNK and _reindexed(cache):
            raise ValueError(f"a draft tree of {len(ids)} nodes under a bound: at most "
                             f"{BOUNDED_CHUNK}")
        rest.append((ids, parents))
    tail = forward(backend, caches, rest, last_only=last)
    for cache, parts in zip(caches, hidden, strict=True):
        if parts:
            cache.specbus_hidden = torch.cat([*parts, cache.specbus_hidden])
    return [np.concatenate([*h, t]) if h else t for h, t in zip(head, tail, strict=True)]


def _model_call(backend: Any, caches: Sequence[Any], offs: np.ndarray, ids: torch.Tensor,
                pos: torch.Tensor, masks: list[SeqMask], keep: list[int] | None,
                union: tuple[int, ...] | None) -> tuple[torch.Tensor, Any]:
    """The packed rows through the model itself, attention switched to `specbus_ragged`;
    returns the logits [1, kept rows, vocab] and the captured layer inputs (or None)."""
    _register()
    device = backend.device
    ragged = _Ragged(caches, offs, masks)
    ragged.specbus_capture, ragged.specbus_hidden = union, None
    kwargs: dict[str, Any] = {}
    if keep is not None:
        kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=device)
    config = backend.model.config
    before = config._attn_implementation
    config._attn_implementation = RAGGED
    try:
        out = backend._run_rows(ragged, [(ragged, slice(None))], input_ids=ids.to(device),
                                position_ids=pos.to(device),
                                attention_mask=torch.zeros((1, 1, 1, 1), device=device),
                                specbus_ragged=ragged, **kwargs)
    finally:
        config._attn_implementation = before
    return out.logits, ragged.specbus_hidden  # hidden: [total, len(union), hidden]


def _mask(past: int, visible: np.ndarray, device: Any) -> Any:
    """Sequence b's attention mask over [its past ; its fed rows] (True: may attend): None for
    one row (it sees everything cached), "causal" for a chain over an empty cache (SDPA's own,
    upper-left aligned, is then right), else a boolean [n, past + n]."""
    n = len(visible)
    if n == 1:
        return None
    if past == 0 and bool(np.array_equal(visible, np.tril(np.ones((n, n), dtype=bool)))):
        return "causal"
    mask = torch.ones((n, past + n), dtype=torch.bool)
    mask[:, past:] = torch.from_numpy(np.ascontiguousarray(visible))
    return mask.to(device)


class SeqMask:
    """Sequence b's masks over [its past ; its fed rows], one per layer geometry: full layers
    `_mask`'s; a `growing_cache.WindowLayer` (a sliding window, or sinks + window) the band
    over absolute positions (key p visible to query q when p > q - window or p < sink) and the
    tree's visibility, from the first row that layer's attention reads."""

    def __init__(self, past: int, depth: np.ndarray, visible: np.ndarray, device: Any) -> None:
        self.past, self.depth, self.visible, self.device = past, depth, visible, device
        self.plain = _mask(past, visible, device)
        self._memo: dict[tuple[int, int, int, int], Any] = {}

    def for_layer(self, layer: Any) -> tuple[int, Any]:
        """(first row of the layer's K/V its attention reads, the mask)."""
        if not isinstance(layer, growing_cache.WindowLayer):
            return 0, self.plain
        start, key = layer.band(self.past)
        if key not in self._memo:
            self._memo[key] = _band_mask(self.past, self.depth, self.visible, key, self.device)
        return start, self._memo[key]


def _band_mask(past: int, depth: np.ndarray, visible: np.ndarray,
               key: tuple[int, int, int, int], device: Any) -> Any:
    """The band mask for past key positions [0, a) + [b, past) then the fed rows (see
    `SeqMask`); None or "causal" where those say the same. With sinks and a row past
    sink + window - 1 (`growing_cache.sink_plan`: re-indexed sink positions), the keys go on
    with each row's own sink copies (n * sink of them, `BoundedLayer.update`): a row whose
    sinks are re-indexed sees its copies instead of the originals."""
    sink, window, a, b = key
    n = len(depth)
    q = torch.from_numpy(past + depth)
    kp = torch.cat([torch.arange(a), torch.arange(b, past), q])
    mask = torch.ones((n, len(kp)), dtype=torch.bool)
    mask[:, len(kp) - n:] = torch.from_numpy(np.ascontiguousarray(visible))
    if window:
        mask &= (kp[None, :] > q[:, None] - window) | (kp[None, :] < sink)
    plan = growing_cache.sink_plan(past, depth, visible, sink, window) if window else None
    if plan is not None:
        moved = torch.from_numpy(plan[0] > 0)
        mask[moved] &= ~(kp[None, :] < sink)
        own = torch.zeros((n, n * sink), dtype=torch.bool)
        for r in np.flatnonzero(plan[0]):
            own[r, r * sink:(r + 1) * sink] = True
        return torch.cat([mask, own], dim=1).to(device)
    if bool(mask.all()) and n == 1:
        return None
    if len(kp) == n and torch.equal(mask, torch.tril(torch.ones((n, n), dtype=torch.bool))):
        return "causal"
    return mask.to(device)


def _uniform_mask(seqmask: SeqMask, cache: Any) -> Any:
    """The one mask every layer of `cache` takes (what the lean forward reads), or False
    where layers differ or one reads a view (a sliding window beside full layers)."""
    layers = cache.layers
    if not any(isinstance(layer, growing_cache.WindowLayer) for layer in layers):
        return seqmask.plain
    got = [seqmask.for_layer(layer) for layer in layers]
    first = got[0]
    if first[0] or any(g[0] != first[0] or g[1] is not first[1] for g in got):
        return False
    return first[1]


class _Ragged:
    """The `past_key_values` a ragged call hands the model: each layer's `update` appends every
    sequence's new K/V rows to its own cache and keeps their full K/V for that layer's
    attention (`_ragged_attention`). Also the stand-in cache `_run_rows` sees (the union of
    the capturing caches' layers; `forward` splits the captured states per sequence)."""

    def __init__(self, caches: Sequence[Any], offs: np.ndarray, masks: list[SeqMask]) -> None:
        self.caches, self.offs, self.masks = caches, offs, masks
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.specbus_capture: tuple[int, ...] | None = None
        self.specbus_hidden: Any = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        offs = self.offs
        self.kv = [cache.update(keys[:, :, offs[b]:offs[b + 1]],
                                values[:, :, offs[b]:offs[b + 1]], layer_idx)
                   for b, cache in enumerate(self.caches)]
        return keys, values  # unused: the attention reads `self.kv`


def _ragged_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, specbus_ragged: _Ragged | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Per-sequence scaled dot-product attention of the packed queries [1, heads, total, d]
    over each sequence's own K/V; returns [1, total, heads, d] as transformers' attention
    functions do."""
    if specbus_ragged is None:
        raise RuntimeError(f"the {RAGGED!r} attention runs only inside torch_batch.forward")
    ragged, offs = specbus_ragged, specbus_ragged.offs
    gqa = query.shape[1] != ragged.kv[0][0].shape[1]
    softcap = kwargs.get("softcap")
    layer_idx = getattr(module, "layer_idx", None)
    outs = []
    for b, ((k, v), seqmask) in enumerate(zip(ragged.kv, ragged.masks, strict=True)):
        q = query[:, :, offs[b]:offs[b + 1]]
        if layer_idx is None:
            start, mask = 0, seqmask.plain
        else:
            start, mask = seqmask.for_layer(ragged.caches[b].layers[layer_idx])
        if start:
            k, v = k[..., start:, :], v[..., start:, :]
        if softcap is not None:
            outs.append(_softcapped(q, k, v, mask, scaling, softcap))
            continue
        causal = isinstance(mask, str)
        outs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else mask, is_causal=causal, scale=scaling,
            enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                scaling: float | None, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping (Gemma 2), as transformers' eager attention: scores
    scaled, tanh-capped, masked, softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    n, total = q.shape[-2], k.shape[-2]
    if isinstance(mask, str):
        mask = torch.ones((n, total), dtype=torch.bool, device=q.device).tril(total - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _register() -> None:
    """Make `specbus_ragged` a transformers attention implementation (once per process)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(RAGGED, _ragged_attention)
        _registered = True
