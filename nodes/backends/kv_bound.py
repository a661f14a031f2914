"""`--kv-sink S --kv-window W`: the bound's validation, light enough for a CLI to call before
it loads a model (the bound itself: on torch `growing_cache.BoundedLayer`, masks in
`torch_batch`; on MLX `mlx_bound.BoundedKVCache`, which makes its own mask)."""

from __future__ import annotations

from typing import Any

from nodes.engine.errors import BadRequestError

#: the largest sink or window `--kv-sink/--kv-window` takes (positions)
MAX_KV_BOUND = 1 << 20


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
