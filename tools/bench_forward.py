"""`specbus bench forward`: what a verify forward costs by the number of tokens fed.

Every speculative speed-up on a CPU is bounded by this curve: k drafted tokens pay only when
the tokens they commit beat the cost of feeding k + 1 rows instead of one. The benchmark feeds
1..N tokens after a real prompt to the embedded model (or --model) in one process, with torch's
matmul and with the few-row kernel (nodes/backends/few_rows.py) in turn, interleaved per
repetition so that load drifts hit both alike, and reports the fastest of the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import time

MAX_FED = 512  # tokens per forward: far past any verify or prefill chunk measured here
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "It was a dark night and the sea was rough, and the keeper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--fed", default="1,2,3,4,5,6,8,12,16,17,24",
                        help="comma-separated token counts fed per forward")
    parser.add_argument("--context", type=int, default=200,
                        help="positions cached before the fed tokens (default 200)")
    parser.add_argument("--repeat", type=int, default=7, help="repetitions (the fastest counts)")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specbus bench forward", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, parser.error)


def run(args: argparse.Namespace, error=None) -> int:
    def fail(message: str):
        if error is not None:
            error(message)
        raise SystemExit(f"specbus bench forward: {message}")

    try:
        fed = sorted({int(n) for n in args.fed.split(",")})
    except ValueError:
        fail(f"--fed: comma-separated integers expected, got {args.fed!r}")
    if not fed or fed[0] < 1 or args.repeat < 1 or args.threads < 1 or args.context < 1:
        fail("--fed counts, --context, --repeat and --threads must be >= 1")
    if fed[-1] > MAX_FED:
        fail(f"--fed counts must be <= {MAX_FED} (a verify forward's size), got {fed[-1]}")

    import torch
    from transformers import DynamicCache

    from nodes.backends import few_rows
    from nodes.backends.torch_backend import TorchBackend

    torch.set_num_threads(args.threads)
    backend = TorchBackend.load(args.model, "cpu")
    lean = backend.lean
    kernel = few_rows.uninstall(backend.model) > 0
    modes = ["torch", "few-rows"] if kernel else ["torch"]
    if not kernel:
        print(f"few-row kernel not in use here ({few_rows.unavailable() or 'not installed'}); "
              "torch only")
    if lean is not None:
        modes.append("lean")
    prompt = backend.tokenizer.encode(PROMPT)
    while len(prompt) < max(fed[-1], args.context):
        prompt = prompt + prompt
    caches = {}
    for mode in modes:
        backend.lean = lean if mode == "lean" else None
        caches[mode] = (backend.new_cache() if mode == "lean"
                        else DynamicCache(config=backend.model.config))
        backend.forward_last(caches[mode], prompt[:args.context])
    base = args.context
    best: dict[str, dict[int, float]] = {m: {} for m in modes}
    for _ in range(args.repeat):
        for mode in modes:
            (few_rows.install if mode != "torch" else few_rows.uninstall)(backend.model)
            backend.lean = lean if mode == "lean" else None
            cache = caches[mode]
            for n in fed:
                start = time.perf_counter()
                backend.forward(cache, prompt[:n])
                seconds = time.perf_counter() - start
                backend.crop(cache, base)
                best[mode][n] = min(best[mode].get(n, seconds), seconds)
    load = os.getloadavg()
    print(f"forward cost by tokens fed after {args.context} cached: {backend.model_name}, "
          f"{args.threads} torch thread(s), fastest of {args.repeat}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'fed':>4} " + " ".join(f"{m + ' ms':>12} {'x 1 token':>9}" for m in modes))
    for n in fed:
        print(f"{n:>4} " + " ".join(
            f"{best[m][n] * 1e3:>12.1f} {best[m][n] / best[m][fed[0]]:>9.2f}" for m in modes))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": backend.model_name, "threads": args.threads,
                       "context": args.context,
                       "repeat": args.repeat, "loadavg": list(load),
                       "seconds": {m: {str(n): s for n, s in v.items()} for m, v in best.items()}},
                      fh, indent=1)
    return 0
