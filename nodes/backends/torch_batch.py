"""One transformers forward over several sequences, each with its own `DynamicCache` and tree.

Each sequence keeps its own cache between steps (crop, compact and hidden-state capture stay
per sequence, as when it runs alone). A batched step builds a throwaway batch cache:

- past K/V left-padded to the longest past (`past_max`) and stacked, per layer;
- the fed tokens right-padded to the longest feed (`n_max`);
- a 4-D additive float mask [B, 1, n_max, past_max + n_max]: row b's real node i sees its own
  past (the last `past_b` columns of the padded past) and its tree's visible nodes; pad
  columns are `finfo.min`, and a pad node sees only itself (a finite row, never NaN);
- per-row `position_ids = past_b + depth` (RoPE is applied to the new keys only, so the left
  padding of the past does not move anyone's positions).

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
    sequence's logits float32 [n_b, vocab] (see the module docstring)."""
    device, dtype = backend.device, backend.model.dtype
    sizes = [len(ids) for ids, _ in feeds]
    pasts = [backend.cache_length(c) for c in caches]
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
    out = backend._run_rows(run_cache, [(c, slice(0, n)) for c, n in zip(caches, sizes,
                                                                          strict=True)],
                            input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=pos.to(device))
    for layer, run_layer in zip(_layers(caches), run_cache.layers, strict=True):
        keys, values = run_layer.keys, run_layer.values
        for b, (own, n) in enumerate(zip(layer, sizes, strict=True)):
            own.update(keys[b:b + 1, :, past_max:past_max + n],
                       values[b:b + 1, :, past_max:past_max + n])
    logits = out.logits.float().cpu().numpy()
    return [logits[b, :n] for b, n in enumerate(sizes)]


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
