"""What re-indexed sink positions cost under `--kv-sink/--kv-window` (docs/engine/cache-shapes.md,
"Absolute or re-indexed positions"): `.venv/bin/python -m tools.bench_reindex`.

1. One bounded decode step (one row) and a 5-row verify of SmolLM2-135M fp32 at ~1,000
   positions, S=4, W=64, one torch thread on one core: absolute sink positions (the re-indexing
   switched off: `sink_plan` answering None) against re-indexed (the product), interleaved, the
   median of 30 each.
2. The attention of one layer alone at SmolLM2's shape (its input built, then one SDPA call):
   absolute, re-indexed by sink copies (the product's form), re-indexed by a widened head
   dimension ([q_back ; q] against [k_sink ; 0] and [0 ; k_window]), the choice's measurement.

Timings on a shared machine: compare rows of one run, and report the load it prints.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

SINK, WINDOW = 4, 64


def _pin() -> None:
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(os.environ.get("CORE", "0"))})
    torch.set_num_threads(1)


def step_times(rounds: int = 6, reps: int = 5) -> dict[str, Any]:
    import numpy as np

    from nodes.backends import growing_cache
    from nodes.backends.torch_backend import TorchBackend

    b = TorchBackend.load(None, device="cpu", weights="fp32")
    b.bound_kv(SINK, WINDOW)
    ids = np.random.default_rng(0).integers(100, 30000, 1400).tolist()
    real = growing_cache.sink_plan

    def run(mode: str) -> tuple[list[float], list[float]]:
        growing_cache.sink_plan = real if mode == "reindexed" else (lambda *a, **k: None)
        try:
            cache = b.new_cache()
            b.forward_last(cache, ids[:1000])
            pos, one, five = 1000, [], []
            for _ in range(reps):
                t = time.perf_counter()
                b.forward(cache, [ids[pos]])
                one.append(time.perf_counter() - t)
                pos += 1
                t = time.perf_counter()
                b.forward(cache, ids[pos:pos + 5])
                five.append(time.perf_counter() - t)
                b.crop(cache, pos + 1)  # one of the five accepted
                pos += 1
            return one, five
        finally:
            growing_cache.sink_plan = real

    got: dict[str, tuple[list[float], list[float]]] = {"absolute": ([], []),
                                                      "reindexed": ([], [])}
    for r in range(rounds):
        for mode in (("absolute", "reindexed") if r % 2 == 0 else ("reindexed", "absolute")):
            one, five = run(mode)
            got[mode][0].extend(one)
            got[mode][1].extend(five)
    return {mode: {"step_ms": round(statistics.median(one) * 1e3, 2),
                   "verify5_ms": round(statistics.median(five) * 1e3, 2), "n": len(one)}
            for mode, (one, five) in got.items()}


def _bench(fn: Any, reps: int) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)


def _attention_at(n: int, reps: int) -> dict[str, float]:
    """Microseconds of one layer's attention for an n-row forward, three ways."""
    import torch
    import torch.nn.functional as F

    heads, kv_heads, d = 9, 3, 64
    res = SINK + WINDOW
    K, V = torch.randn(1, kv_heads, res, d), torch.randn(1, kv_heads, res, d)
    k, v = torch.randn(1, kv_heads, n, d), torch.randn(1, kv_heads, n, d)
    q = torch.randn(1, heads, n, d)
    cos, sin = torch.randn(n * SINK, d), torch.randn(n * SINK, d)
    qcos, qsin = torch.randn(n, d), torch.randn(n, d)
    plain_mask = torch.ones(n, res + n, dtype=torch.bool)
    copies_mask = torch.ones(n, res + n + n * SINK, dtype=torch.bool)
    src = torch.arange(SINK).repeat(n)
    zeros = torch.zeros(1, kv_heads, res + n, d)

    def absolute() -> Any:
        kk, vv = torch.cat([K, k], 2), torch.cat([V, v], 2)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=plain_mask,
                                              scale=d ** -0.5, enable_gqa=True)

    def copies() -> Any:
        kk, vv = torch.cat([K, k], 2), torch.cat([V, v], 2)
        sk = kk[..., :SINK, :] if n == 1 else kk.index_select(-2, src)
        sv = vv[..., :SINK, :] if n == 1 else vv.index_select(-2, src)
        sk = torch.addcmul(sk * cos, sk.roll(d // 2, dims=-1), sin)
        return F.scaled_dot_product_attention(
            q, torch.cat([kk, sk], 2), torch.cat([vv, sv], 2), attn_mask=copies_mask,
            scale=d ** -0.5, enable_gqa=True)

    def widened() -> Any:
        kk, vv = torch.cat([K, k], 2), torch.cat([V, v], 2)
        q_back = torch.addcmul(q * qcos, q.roll(d // 2, dims=-1), qsin)
        kw = torch.cat([torch.cat([kk[..., :SINK, :], zeros[..., :SINK, :]], -1),
                        torch.cat([zeros[..., SINK:, :], kk[..., SINK:, :]], -1)], 2)
        return F.scaled_dot_product_attention(
            torch.cat([q_back, q], -1), kw, torch.cat([vv, torch.zeros_like(vv)], -1),
            attn_mask=plain_mask, scale=d ** -0.5, enable_gqa=True)[..., :d]

    return {"absolute_us": _bench(absolute, reps), "copies_us": _bench(copies, reps),
            "widened_us": _bench(widened, reps)}


def attention_times(reps: int = 400) -> dict[str, Any]:
    return {f"rows_{n}": _attention_at(n, reps) for n in (1, 5)}


def main() -> None:
    _pin()
    print("attention of one layer:", attention_times())
    print("SmolLM2 bounded steps:", step_times())
    print("load average:", [round(x, 2) for x in os.getloadavg()])


if __name__ == "__main__":
    main()
