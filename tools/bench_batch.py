"""Batched verifier forward on the real model: per-step time against the batch size, with
and without drafts, the batched (ragged) forward against one sequence at a time
(`batch_invariant`), and whether its logits equal each sequence's solo logits bit for bit.

    taskset -c 0 .venv/bin/python tools/bench_batch.py [--reps 7] [--past 200]

One torch thread. Prints a markdown table (docs/engine.md, "Batching").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nodes.backends.torch_backend import TorchBackend  # noqa: E402
from tools.prompts import PROMPTS  # noqa: E402


def _caches(backend, prompts, past):
    """One cache per sequence, each holding `past` positions of its prompt (repeated)."""
    caches = []
    for ids in prompts:
        ids = (ids * (past // len(ids) + 1))[:past]
        cache = backend.new_cache()
        backend.forward(cache, ids)
        caches.append(cache)
    return caches


def _time(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(backend, caches, rows: int, past: int, reps: int) -> tuple[float, float, bool]:
    """Median seconds of one batched step of `rows` chained tokens per sequence and of the
    same one sequence at a time; whether the two gave the same logits bit for bit."""
    feeds = [([7 + j for j in range(rows)], list(range(-1, rows - 1)))] * len(caches)
    got: dict[bool, list] = {}

    def step(invariant: bool) -> None:
        backend.batch_invariant = invariant
        got[invariant] = backend.forward_batch(caches, feeds)
        for c in caches:
            backend.crop(c, past)

    step(False)  # warm-up
    batched = _time(lambda: step(False), reps)
    alone = _time(lambda: step(True), reps)
    backend.batch_invariant = False
    exact = all((a == b).all() for a, b in zip(got[False], got[True], strict=True))
    return batched, alone, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--past", type=int, default=200, help="cached positions per sequence")
    ap.add_argument("--batches", default="1,2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = TorchBackend.load(None)
    prompts = [backend.tokenizer.encode(t, chat=True) for _, t in PROMPTS]
    print("| B | rows/seq | batched ms | one-at-a-time ms | speed-up | logits as alone |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        caches = _caches(backend, [prompts[i % len(prompts)] for i in range(batch)], args.past)
        for rows in (1, 4):
            batched, alone, exact = _measure(backend, caches, rows, args.past, args.reps)
            print(f"| {batch} | {rows} | {batched * 1e3:.1f} | {alone * 1e3:.1f} | "
                  f"{alone / batched:.2f}x | {'bit for bit' if exact else 'differ'} |",
                  flush=True)
    cfg = backend.model.config
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * 4
    print(f"\nK/V per cached position: {per_token} bytes (fp32); per sequence of "
          f"{args.past} positions: {per_token * args.past / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
