"""`--kv-sink S --kv-window W`: the bound's validation, light enough for a CLI to call before
it loads a model, and its re-indexed sink positions (`sink_plan`, shared by both backends).
The bound itself: on torch `growing_cache.BoundedLayer`, masks in `torch_batch`; on MLX
`mlx_bound.BoundedKVCache`, which makes its own mask."""

from __future__ import annotations

from typing import Any

import numpy as np

from nodes.engine.errors import BadRequestError

#: the largest sink or window `--kv-sink/--kv-window` takes (positions)
MAX_KV_BOUND = 1 << 20
#: how a bound places its sinks, as the card (`extras.kv_positions`), `generate --json` and
#: the monitor say it: re-indexed within the cache (`sink_plan`), the one mode computed
#: (absolute sink positions were measured and left: docs/engine/cache-shapes.md)
POSITIONS = "reindexed"


def check_kv_bound(sink: int | None, window: int | None,
                   config: Any = None) -> tuple[int, int] | None:
    """(sink, window) validated, or None when neither is given; a BadRequestError naming the
    flag otherwise: both or neither, integers, sink >= 1, window >= 2, each at most
    `MAX_KV_BOUND` and within the model's trained context where it says one."""
    if sink is None and window is None:
        return None
    if sink is None or window is None:
        raise BadRequestError("--kv-sink and --kv-window go together: give both (e.g. "
                              "--kv-sink 4 --kv-window 64) or neither")
    for flag, value, least in (("--kv-sink", sink, 1), ("--kv-window", window, 2)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequestError(f"{flag} {value!r}: a whole number of positions")
        if value < least:
            raise BadRequestError(f"{flag} {value}: must be at least {least} (positions)")
        if value > MAX_KV_BOUND:
            raise BadRequestError(f"{flag} {value}: absurd; at most {MAX_KV_BOUND} positions")
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    if isinstance(limit, int) and sink + window > limit:
        raise BadRequestError(f"--kv-sink {sink} + --kv-window {window} exceed the model's "
                              f"{limit}-position context: the bound would never apply")
    return int(sink), int(window)


def sink_plan(past: int, depth: np.ndarray, visible: np.ndarray, sink: int,
              window: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Re-indexed sink positions (StreamingLLM's, docs/engine/cache-shapes.md): a query at
    position q meets sink s at distance min(q, sink + window - 1) - s. For a forward of rows at
    positions past + depth (tree visibility `visible`) after `past` committed positions: None
    when no row is past sink + window - 1 (every distance is already the true one), else
    (shift [n], src [n, sink]): row r's sink keys are the work buffer's rows src[r] (resident
    [held sinks ; ...] then the fed rows) rotated forward by shift[r] (0: the row takes the
    sinks as they are). `BoundedLayer.update` appends those n * sink keys after the fed rows;
    `torch_batch._band_mask` lets row r see its own (and not the originals) where its shift
    is positive. A function of the positions and the tree alone."""
    n = len(depth)
    if not sink or n == 0:
        return None
    q = past + np.asarray(depth, dtype=np.int64)
    shift = np.maximum(q - (sink + window - 1), 0)
    if not shift.any():
        return None
    held = min(sink, past)
    src = np.zeros((n, sink), dtype=np.int64)
    src[:, :held] = np.arange(held)
    for s in range(held, sink):  # sinks fed in this forward (a prompt from the start)
        match = np.asarray(visible, dtype=bool) & (q == s)[None, :]
        src[:, s] = past + match.argmax(axis=1)
    src[shift == 0] = 0  # masked out: any row will do
    return shift, src
