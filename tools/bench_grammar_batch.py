"""Where the time goes in a constrained batch (issue 46, item 5).

Eight constrained sequences (the extraction and tool-call requests of tools/bench_structured.py,
each its own prompt and grammar) stepped together (`Engine.step_batch`) on the embedded SmolLM2,
one core (`sched_setaffinity {0}`) and one torch thread, as the verifier runs. Greedy and sampled
(temperature 0.8, seeds 1..8), plain (no drafts) and speculative (grammar + ngram drafts).
Each part of the step is timed by wrapping it:

- forward: `Backend.forward_batch`;
- full masks: `GrammarMatcher.allowed` (llguidance's bitmask fill and its unpacking to a bool
  row) and, apart, the batched fill (`GrammarMatcher.fill_batch`) where it is on;
- allows: the greedy rows' favourite checks (`GrammarMatcher.allows`);
- apply: the rest of `GrammarMatcher.mask_logits` (setting forbidden logits to -inf);
- prune: `grammar.prune_tree` (drafts checked before the forward);
- drafting: `GrammarMatcher.forced_paths` (the grammar drafter's forced tokens);
- accept: the rest of `Engine._accept` (choosing, sampling noise, advancing matchers);
- other: the rest of the step (planning, settling, the cache).

Decode steps only (a step feeding prompt rows is left out), per generated token and as a share
of the step, the least disturbed of `--rounds`. `--batch-masks off|on` chooses the path
(`nodes.engine.settle.BATCH_MASKS`; default: the engine's, off), `--compare` runs both,
interleaved; every run's tokens must equal the first's (greedy and sampled apart), else exit 1.

    .venv/bin/python -m tools.bench_grammar_batch [--max-tokens 96] [--rounds 2] [--compare]
    .venv/bin/python -m tools.bench_grammar_batch --cpus 0,1 --gil-probe
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any


class Timer:
    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.phase = "decode"

    def wrap(self, owner: Any, name: str, key: str) -> None:
        orig = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.s[f"{self.phase}:{key}"] += time.perf_counter() - t0
                self.n[f"{self.phase}:{key}"] += 1

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--compare", action="store_true",
                    help="run with batched masks off and on, interleaved")
    ap.add_argument("--batch-masks", choices=["off", "on"], default=None)
    ap.add_argument("--cpus", default="0",
                    help="cores the process may run on (the verifier's: one, core 0)")
    ap.add_argument("--gil-probe", action="store_true",
                    help="only: whether the batched fill releases the GIL, and its latency "
                         "beside a busy Python thread")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    import nodes.engine.core as core_mod
    import nodes.engine.grammar as grammar_mod
    import nodes.engine.planner as planner_mod
    import nodes.engine.settle as settle_mod
    from codec.sampling import SamplingParams
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.ngram import NgramDrafter
    from nodes.engine import Engine, GenerationParams
    from tools.bench_structured import _requests

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(1)
    backend = TorchBackend.load(None, device="cpu", weights=args.weights)
    reqs = [r for r in _requests(backend.tokenizer, False, agent=False)][: args.batch]
    if args.gil_probe:
        return _gil_probe(backend, reqs)
    T = Timer()
    T.wrap(backend, "forward_batch", "forward")
    GM = grammar_mod.GrammarMatcher
    T.wrap(GM, "allowed", "full masks")
    T.wrap(GM, "allows", "allows")
    T.wrap(GM, "mask_logits", "mask_logits")
    T.wrap(GM, "forced_paths", "drafting")
    if hasattr(grammar_mod, "fill_batch"):
        T.wrap(grammar_mod, "fill_batch", "batched fill")
    T.wrap(planner_mod, "prune_tree", "prune")
    T.wrap(core_mod.Engine, "_accept", "accept")
    T.wrap(core_mod.Engine, "step_batch", "step")
    modes = ["off", "on"] if args.compare else [
        args.batch_masks or ("on" if settle_mod.BATCH_MASKS else "off")]
    engines = {"plain": Engine(backend, None, grammar_drafts=False),
               "grammar+ngram": Engine(backend, NgramDrafter())}

    decode_tokens = [0]

    def run(engine: Engine, sampled: bool) -> tuple[list[list[int]], int]:
        seqs = []
        for i, r in enumerate(reqs):
            sp = SamplingParams(temperature=0.8, seed=i + 1) if sampled else SamplingParams()
            seqs.append(engine.start(r["ids"], GenerationParams(
                max_tokens=args.max_tokens, sampling=sp, constraint=r["constraint"])))
        out: list[list[int]] = [[] for _ in seqs]
        steps = 0
        decode_tokens[0] = 0
        while any(s.finish_reason is None for s in seqs):
            live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
            # a step that feeds prompt rows is timed apart: decode steps are the subject
            T.phase = "decode" if all(seqs[i].generated for i in live) else "prefill"
            if T.phase == "decode":
                tokens_before = sum(map(len, out))
            for i, b in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
                out[i].extend(b.token_ids)
            if T.phase == "decode":
                steps += 1
                decode_tokens[0] += sum(map(len, out)) - tokens_before
        for s in seqs:
            engine.release(s, keep=False)
        return out, steps

    for e in engines.values():  # warm
        run(e, False)
    results: dict[str, Any] = {}
    outputs: dict[tuple, list] = {}
    for r in range(args.rounds):
        for mode in modes:
            settle_mod.BATCH_MASKS = mode == "on"
            for sampled in (False, True):
                for name, e in engines.items():
                    T.s.clear()
                    T.n.clear()
                    t0 = time.perf_counter()
                    out, steps = run(e, sampled)
                    wall = time.perf_counter() - t0
                    key = (name, "sampled" if sampled else "greedy")
                    if key[1] in outputs and outputs[key[1]] != out:
                        print(f"MISMATCH {key} mode {mode}", file=sys.stderr)
                        results["mismatch"] = True
                    outputs.setdefault(key[1], out)  # every engine, every mode: the same
                    tokens = decode_tokens[0]
                    s = {k[7:]: v for k, v in T.s.items() if k.startswith("decode:")}
                    n = {k[7:]: v for k, v in T.n.items() if k.startswith("decode:")}
                    parts = {
                        "forward": s.get("forward", 0.0),
                        "full masks": s.get("full masks", 0.0),
                        "batched fill": s.get("batched fill", 0.0),
                        "allows": s.get("allows", 0.0),
                        "apply": s.get("mask_logits", 0.0) - s.get("allows", 0.0)
                        - s.get("full masks", 0.0),
                        "prune": s.get("prune", 0.0),
                        "drafting": s.get("drafting", 0.0),
                    }
                    parts["accept (rest)"] = max(0.0, s.get("accept", 0.0)
                                                 - s.get("mask_logits", 0.0))
                    # (the batched fill runs on the mask thread, beside the forward: not part
                    # of the step thread's time)
                    parts["other"] = s.get("step", 0.0) - sum(parts.values()) \
                        + parts["batched fill"]
                    row = {"tokens": tokens, "steps": steps, "wall_s": wall,
                           "step_s": s.get("step", 0.0),
                           "full_masks": n.get("full masks", 0),
                           "allows_calls": n.get("allows", 0),
                           "ms_per_token": {k: v / tokens * 1e3 for k, v in parts.items()},
                           "share": {k: v / max(s.get("step", 1e-9), 1e-9)
                                     for k, v in parts.items()}}
                    results.setdefault(f"{mode} {name} {key[1]}", []).append(row)
                    print(f"round {r + 1} masks={mode} {name:14s} {key[1]:7s} "
                          f"decode: {tokens} tok {steps} steps {s.get('step', 0.0):.2f} s, "
                          f"all {wall:.2f} s  " + "  ".join(
                              f"{k} {v / tokens * 1e3:.3f}" for k, v in parts.items()),
                          file=sys.stderr)
    results["load"] = os.getloadavg()
    results["cpus"] = args.cpus
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if results.get("mismatch") else 0


def _gil_probe(backend: Any, reqs: list[dict[str, Any]]) -> int:
    """A Python thread counting as fast as it can, alone, then beside one second of repeated
    batched fills (`grammar.fill_batch`) and of per-row fills of the same matchers (their
    start states: llguidance's cached masks after the first): the counter's rate says whether
    the call holds the GIL, the calls a second their latency under that contention."""
    import threading

    import llguidance

    from nodes.engine.grammar import Grammars, fill_batch

    g = Grammars(backend.tokenizer, backend.vocab_size)
    ms = [g.matcher(r["constraint"]) for r in reqs]
    ex = llguidance.LLExecutor(1)
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    def rate(f) -> tuple[int, int]:
        c0, t, n = count[0], time.perf_counter(), 0
        while time.perf_counter() - t < 1.0:
            f()
            n += 1
        return count[0] - c0, n

    def per_row() -> None:
        for m in ms:
            m.ll.unsafe_compute_mask_ptr(m._bits.ctypes.data, m._bits.nbytes)

    alone = [rate(lambda: fill_batch(ms, ex))[1], rate(per_row)[1]]
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    c0 = count[0]
    time.sleep(1.0)
    base = count[0] - c0
    batch = rate(lambda: fill_batch(ms, ex))
    rows = rate(per_row)
    stop[0] = True
    th.join()
    print(f"alone: {1e3 / alone[0]:.3f} ms a batched fill of {len(ms)}, "
          f"{1e3 / alone[1]:.3f} ms for {len(ms)} per-row fills")
    print(f"beside a busy thread: counter {base}/s alone, {batch[0]}/s during batched fills "
          f"({1e3 / batch[1]:.3f} ms each), {rows[0]}/s during per-row fills "
          f"({1e3 / rows[1]:.3f} ms for {len(ms)}); load average {os.getloadavg()}")
    return 0


def _print(results: dict[str, Any]) -> None:
    print(f"load average {results['load'][0]:.2f} {results['load'][1]:.2f} "
          f"{results['load'][2]:.2f}")
    for key, rows in results.items():
        if not isinstance(rows, list):
            continue
        best = min(rows, key=lambda x: x["step_s"])  # the least disturbed round
        parts = best["ms_per_token"]
        print(f"\n{key}: decode steps: {best['tokens']} tokens, {best['steps']} steps, "
              f"{best['step_s'] / best['steps'] * 1e3:.1f} ms a step (best of {len(rows)}), "
              f"{best['full_masks']} full masks, {best['allows_calls']} allows checks")
        print(f"  {'part':14s} {'ms/token':>9s} {'share':>7s}")
        for k, v in parts.items():
            print(f"  {k:14s} {v:9.3f} {best['share'][k] * 100:6.1f}%")


if __name__ == "__main__":
    sys.exit(main())
