"""One transformers forward over several sequences, each with its own `DynamicCache` and tree.

Each sequence keeps its own cache between steps (crop, compact and hidden-state capture stay
per sequence, as when it runs alone). A batched step builds a throwaway batch cache in one of
two layouts:

- **padded** (one sequence per batch row; plain batched decoding, feeds of similar sizes):
  past K/V left-padded to the longest past (`past_max`) and stacked per layer; the fed tokens
  right-padded to the longest feed (`n_max`); a 4-D additive float mask
  [B, 1, n_max, past_max + n_max]: row b's real node i sees its own past (the last `past_b`
  columns of the padded past) and its tree's visible nodes; pad columns are `finfo.min`, and a
  pad node sees only itself (a finite row, never NaN);
- **packed** (every sequence in one batch row): the pasts concatenated, the fed tokens
  concatenated, a block-diagonal mask [1, 1, N, P + N] (each sequence's rows see its own past
  and its own visible nodes). Used when feeds differ in size (a prompt chunk beside one-token
  steps, one sequence's 16-node tree beside plain steps), where padding every row to the
  longest feed would multiply the linear layers' work: `_packed_pays` compares both layouts'
  estimated work (rows through the linear layers, plus query-key pairs through attention,
  which packing raises: every row meets every sequence's past, masked). With it, a batch's
  cost follows the total rows fed, what the engine's cost model learns it by.

In both, per-row `position_ids = past_b + depth` (RoPE is applied to the new keys only, so
where the past sits in the batch cache does not move anyone's positions).

A feed with a true `last_only` attribute (the engine's prompt chunks) gets only its last row's
logits computed and returned ([1, vocab]): the LM head is most of a long prompt's cost.

After the model call, each sequence's real new K/V rows are appended to its own cache (the same
concatenation `DynamicLayer.update` does alone) and its logits rows are returned. The stacking
copies every sequence's past once per step: docs/engine.md, "Batching", has its cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nodes.backends.base import tree_layout


def forward(backend: Any, caches: Sequence[Any],
            feeds: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
    """Append `feeds[b] = (token_ids, parents)` to `caches[b]` in one model call; return each
    sequence's logits float32 [n_b, vocab] ([1, vocab] for a `last_only` feed; see the module
    docstring)."""
    sizes = [len(ids) for ids, _ in feeds]
    pasts = [backend.cache_length(c) for c in caches]
    last = [bool(getattr(f, "last_only", False)) for f in feeds]
    if _packed_pays(backend, sizes, pasts):
        return _packed(backend, caches, feeds, sizes, pasts, last)
    return _padded(backend, caches, feeds, sizes, pasts, last)


def _packed_pays(backend: Any, sizes: list[int], pasts: list[int]) -> bool:
    """Whether one packed row costs less work than padded rows: rows through the linear
    layers, plus query-key pairs through attention weighted by their share of a row's
    multiply-adds (4 * hidden per pair per layer against 2 * the layer's weights per row)."""
    cfg = backend.model.config
    hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads) * (hidden // heads)
    pair = 4 * hidden / (2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter))
    batch, n_max, past_max = len(sizes), max(sizes), max(pasts)
    total, past_total = sum(sizes), sum(pasts)
    padded = batch * n_max * (1 + pair * (past_max + n_max))
    packed = total * (1 + pair * (past_total + total))
    return packed < padded


def _padded(backend: Any, caches: Sequence[Any], feeds: Sequence[Any], sizes: list[int],
            pasts: list[int], last: list[bool]) -> list[np.ndarray]:
    device, dtype = backend.device, backend.model.dtype
    batch, n_max, past_max = len(caches), max(sizes), max(pasts)
    ids = torch.zeros((batch, n_max), dtype=torch.long)
    pos = torch.zeros((batch, n_max), dtype=torch.long)
    allowed = torch.zeros((batch, 1, n_max, past_max + n_max), dtype=torch.bool)
    for b, ((tokens, parents), n, past) in enumerate(zip(feeds, sizes, pasts, strict=True)):
        depth, visible = tree_layout(parents)
        ids[b, :n] = torch.tensor(list(tokens), dtype=torch.long)
        pos[b, :n] = torch.from_numpy(past + depth)
        pos[b, n:] = past
        allowed[b, 0, :n, past_max - past:past_max] = True
        allowed[b, 0, :n, past_max:past_max + n] = torch.from_numpy(visible)
        pad = torch.arange(n, n_max)
        allowed[b, 0, pad, past_max + pad] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    run_cache = _stacked_cache(backend, caches, pasts, past_max)
    kwargs: dict[str, Any] = {}
    wanted = [[n - 1] if only else list(range(n)) for n, only in zip(sizes, last, strict=True)]
    keep = sorted({i for rows in wanted for i in rows})
    if len(keep) < n_max:  # some feeds want only their last row: skip the others' LM head
        kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=device)
    out = backend._run_rows(run_cache, [(c, slice(0, n)) for c, n in zip(caches, sizes,
                                                                          strict=True)],
                            input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=pos.to(device), **kwargs)
    for layer, run_layer in zip(_layers(caches), run_cache.layers, strict=True):
        keys, values = run_layer.keys, run_layer.values
        for b, (own, n) in enumerate(zip(layer, sizes, strict=True)):
            own.update(keys[b:b + 1, :, past_max:past_max + n],
                       values[b:b + 1, :, past_max:past_max + n])
    logits = out.logits.float().cpu().numpy()
    if "logits_to_keep" not in kwargs:
        return [logits[b, :n] for b, n in enumerate(sizes)]
    where = {i: j for j, i in enumerate(keep)}
    return [logits[b, [where[i] for i in rows]] for b, rows in enumerate(wanted)]


class _Packed:
    """The stand-in cache `_run_rows` sees for the packed row: it asks for the union of the
    capturing caches' layers, and the captured states are then split per sequence."""

    def __init__(self, layers: tuple[int, ...] | None) -> None:
        self.specbus_capture = layers
        self.specbus_hidden = None


def _packed(backend: Any, caches: Sequence[Any], feeds: Sequence[Any], sizes: list[int],
            pasts: list[int], last: list[bool]) -> list[np.ndarray]:
    device, dtype = backend.device, backend.model.dtype
    total, past_total = sum(sizes), sum(pasts)
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    poffs = np.concatenate([[0], np.cumsum(pasts)]).astype(int)
    ids = torch.zeros((1, total), dtype=torch.long)
    pos = torch.zeros((1, total), dtype=torch.long)
    allowed = torch.zeros((1, 1, total, past_total + total), dtype=torch.bool)
    for b, ((tokens, parents), n, past) in enumerate(zip(feeds, sizes, pasts, strict=True)):
        depth, visible = tree_layout(parents)
        at, pat = offs[b], poffs[b]
        ids[0, at:at + n] = torch.tensor(list(tokens), dtype=torch.long)
        pos[0, at:at + n] = torch.from_numpy(past + depth)
        allowed[0, 0, at:at + n, pat:pat + past] = True
        allowed[0, 0, at:at + n, past_total + at:past_total + at + n] = torch.from_numpy(visible)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    run_cache = backend.new_cache()
    for layer, run_layer in zip(_layers(caches), run_cache.layers, strict=True):
        own = [c for c, past in zip(layer, pasts, strict=True) if past]
        if own:
            keys = torch.cat([c.keys for c in own], dim=-2)
            values = torch.cat([c.values for c in own], dim=-2)
            run_layer.lazy_initialization(keys, values)
            run_layer.keys, run_layer.values = keys, values
    wanted = [[offs[b] + n - 1] if only else list(range(offs[b], offs[b] + n))
              for b, (n, only) in enumerate(zip(sizes, last, strict=True))]
    keep = [i for rows in wanted for i in rows]
    capture = [getattr(c, "specbus_capture", None) for c in caches]
    union = tuple(sorted({i for layers in capture if layers for i in layers})) or None
    stand_in = _Packed(union)
    out = backend._run_rows(run_cache, [(stand_in, slice(0, total))],
                            input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=pos.to(device),
                            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device))
    for layer, run_layer in zip(_layers(caches), run_cache.layers, strict=True):
        keys, values = run_layer.keys, run_layer.values
        for b, own in enumerate(layer):
            at = past_total + offs[b]
            own.update(keys[:, :, at:at + sizes[b]], values[:, :, at:at + sizes[b]])
    if union is not None:
        hidden = stand_in.specbus_hidden  # [total, len(union), hidden]
        for b, (cache, layers) in enumerate(zip(caches, capture, strict=True)):
            if layers:
                cols = [union.index(i) for i in layers]
                cache.specbus_hidden = hidden[offs[b]:offs[b + 1]][:, cols]
    logits = out.logits[0].float().cpu().numpy()
    got, start = [], 0
    for rows in wanted:
        got.append(logits[start:start + len(rows)])
        start += len(rows)
    return got


def _layers(caches: Sequence[Any]) -> list[list[Any]]:
    """Per decoder layer, that layer of every sequence's cache."""
    return [list(group) for group in zip(*(c.layers for c in caches), strict=True)]


def _stacked_cache(backend: Any, caches: Sequence[Any], pasts: list[int], past_max: int) -> Any:
    """A batch `DynamicCache` holding every sequence's past K/V, left-padded with zeros."""
    run = backend.new_cache()
    for layer, run_layer in zip(_layers(caches), run.layers, strict=True):
        keys = values = None
        for b, (own, past) in enumerate(zip(layer, pasts, strict=True)):
            if not past:
                continue
            if keys is None:
                keys = own.keys.new_zeros((len(caches), own.keys.shape[1], past_max,
                                           own.keys.shape[-1]))
                values = own.values.new_zeros((len(caches), own.values.shape[1], past_max,
                                               own.values.shape[-1]))
            keys[b, :, past_max - past:] = own.keys[0]
            values[b, :, past_max - past:] = own.values[0]
        if keys is not None:
            run_layer.lazy_initialization(keys, values)
            run_layer.keys, run_layer.values = keys, values
    return run
