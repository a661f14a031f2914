"""Measure EAGLE heads on open-ended chat prompts no head was trained on.

    python -m nodes.training.evaluate HEAD [HEAD ...] [--max-tokens 96]

For every prompt, in turn (interleaved, so load drifts hit every configuration alike): plain
greedy decoding, then each head with 8-node trees (`fixed_k=8`) and with the adaptive budget.
Reports committed tokens per verifier forward (the prefill's block excluded), checks that
every output equals plain greedy token for token (lossless), and the wall time of each
generation against plain's. One torch thread; pin the process (`taskset -c N`) yourself.
The prompts are written for this check: not from the training prompt set
(nodes/training/prompts.py) nor from the benchmarks' (tools/prompts.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

EVAL_PROMPTS = (
    "What are some good ways to spend a free afternoon in a town I have never visited?",
    "Tell me about the life cycle of a butterfly.",
    "Write a short letter from a sailor at sea to his family back home.",
    "Why do so many people enjoy watching scary movies?",
    "How does a microwave oven heat food?",
    "Give me ideas for a science fair project for a middle school student.",
    "Write a story about a clockmaker who builds a mechanical bird.",
    "What should I know before adopting a parrot?",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="head folders (name=PATH to label one)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=len(EVAL_PROMPTS))
    ap.add_argument("--ks", default="8,a", help="fixed_k values, 'a' for adaptive")
    ap.add_argument("--json", default=None, help="write the per-prompt figures here")
    ap.add_argument("--fp32", action="store_true",
                    help="draft with fp32 weights (default on a CPU: int8, as served)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.eagle.source import EagleDrafter
    from nodes.engine import Engine, GenerationParams

    backend = TorchBackend.load(None, device="cpu")
    heads = []
    for spec in args.heads:
        name, _, path = spec.rpartition("=")
        heads.append((name or Path(path).name, EagleDrafter.load(path, backend,
                                                                       int8=not args.fp32)))
    ks = [None if k == "a" else int(k) for k in args.ks.split(",")]
    configs = [(f"{name} k={'adaptive' if k is None else k}", d, k) for name, d in heads
               for k in ks]
    params = GenerationParams(max_tokens=args.max_tokens)
    rows = []
    for i, prompt in enumerate(EVAL_PROMPTS[: args.prompts]):
        ids = backend.tokenizer.encode(prompt, chat=True)
        plain = Engine(backend, None).generate(ids, params)
        row = {"prompt": prompt, "plain_s": plain.elapsed_s, "tokens": len(plain.token_ids)}
        for label, drafter, k in configs:
            gen = Engine(backend, drafter, fixed_k=k).generate(ids, params)
            forwards = max(1, gen.stats.blocks - 1)  # the prefill's block is not a verify step
            row[label] = {
                "tpf": (len(gen.token_ids) - 1) / forwards,
                "lossless": list(gen.token_ids) == list(plain.token_ids),
                "speedup": plain.elapsed_s / gen.elapsed_s,
                "accept": gen.stats.acceptance,
            }
        rows.append(row)
        print(f"[{i}] {len(plain.token_ids)} tokens, plain {plain.elapsed_s:.1f} s: " + "; ".join(
            f"{label} {row[label]['tpf']:.2f} t/f x{row[label]['speedup']:.2f}"
            f"{'' if row[label]['lossless'] else ' NOT LOSSLESS'}" for label, _, _ in configs),
            flush=True)
    print()
    for label, _, _ in configs:
        tpf = [r[label]["tpf"] for r in rows]
        sp = [r[label]["speedup"] for r in rows]
        ok = all(r[label]["lossless"] for r in rows)
        print(f"{label:28s} tokens/forward " + " ".join(f"{x:.2f}" for x in tpf) +
              f" | median {statistics.median(tpf):.2f} worst {min(tpf):.2f}; speed vs plain "
              f"median x{statistics.median(sp):.2f}; lossless {ok}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
