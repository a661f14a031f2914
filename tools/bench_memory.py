"""`specbus bench memory`: the verifier's resident K/V bytes, process RSS and decode tok/s at
1k, 4k and 16k tokens of context, with full attention and bounded (`--kv-sink/--kv-window`).

Each (mode, context) runs in a process of its own (so its RSS is its own), pinned to core 0
with one torch thread, on the embedded SmolLM2-135M in fp32 (the bound's forward). The
context is a long text that ships with Python itself (`pydoc_data.topics`, the language
reference's prose), repeated where it is shorter. Then `--steps` plain greedy decode steps,
each a one-row forward and the engine's crop (which commits a bounded layer's overlay): tok/s
is one over the median step. Reported: K/V bytes the cache holds after the steps (allocated:
a full cache's room ahead included), VmRSS and VmHWM of the process.

`--fill real` prefills every context token (512 at a time); full attention at 16k then takes
minutes on one core. `--fill tiled` (`--quick`'s) prefills the first 1,024 tokens and extends
the cache to the context length with copies of their K/V rows (full: the rows tiled; bounded:
the dropped positions counted), so shapes, bytes and each step's cost are those of the real
context while its values are not: the figures are about memory and speed, not output. Note
SmolLM2's trained context is 8,192 positions: full attention at 16k is past it.

A speculation section runs greedy generation at a ~1k-token input-grounded prompt (the text,
then its own beginning to continue), full and bounded: plain, the ngram drafter, and an
oracle drafting the mode's own plain output 8 deep. The oracle's speedup (every draft
accepted in both modes) is the speculative machinery's under the bound, to keep within 10 %
of full attention's; ngram's shows what the bound does to a drafter's acceptance on a task
grounded farther back than the window (the bounded model cannot copy what it cannot see).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONTEXTS = (1024, 4096, 16384)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="context lengths in tokens, comma-separated (default 1024,4096,16384)")
    parser.add_argument("--kv-sink", type=int, default=4)
    parser.add_argument("--kv-window", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per row (median)")
    parser.add_argument("--fill", choices=("real", "tiled"), default="real",
                        help="prefill every context token, or 1,024 and tile their K/V")
    parser.add_argument("--spec-tokens", type=int, default=128,
                        help="tokens generated per speculation run (0: skip that section)")
    parser.add_argument("--quick", action="store_true",
                        help="--fill tiled, 24 steps, 64 speculated tokens")
    parser.add_argument("--json", metavar="PATH", default=None, help="write results as JSON")


def long_text() -> str:
    """The shipped long text: Python's own language-reference prose (stdlib pydoc_data)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _tiled(backend: Any, cache: Any, length: int) -> None:
    """Extend `cache` to `length` positions with copies of its rows (see the docstring)."""
    import torch

    from nodes.backends import growing_cache

    for layer in cache.layers:
        if isinstance(layer, growing_cache.BoundedLayer):
            layer._drop += length - layer.get_seq_length()
            continue
        have = layer.get_seq_length()
        reps = -(-length // have)
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, torch.cat([t] * reps, dim=-2)[..., :length, :].contiguous())


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One (mode, context) in this process: fill, decode, measure."""
    import numpy as np
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    from nodes.backends.torch_backend import TorchBackend

    b = TorchBackend.load(None, device="cpu", weights="fp32")
    if spec["bound"]:
        b.bound_kv(*spec["bound"])
    ids = b.tokenizer.encode(long_text())
    out: dict[str, Any] = {"mode": "bounded" if spec["bound"] else "full"}
    if spec.get("spec_tokens"):
        return {**out, **_speculate(b, ids, spec["spec_tokens"])}
    length = spec["context"]
    ids = (ids * (length // len(ids) + 1))[:length]
    cache = b.new_cache()
    fill = length if spec["fill"] == "real" else min(length, 1024)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, fill, 512):
            b.forward_last(cache, ids[s:min(s + 512, fill)])
        b.crop(cache, fill)
        if fill < length:
            _tiled(b, cache, length)
    fill_s = time.perf_counter() - t0
    tok = int(np.argmax(b.forward_last(cache, [ids[-1]])))
    b.crop(cache, length + 1)
    times = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        logits = b.forward(cache, [tok])
        b.crop(cache, b.cache_length(cache))
        times.append(time.perf_counter() - t)
        tok = int(np.argmax(logits[-1]))
    return {**out, "context": length, "fill": spec["fill"], "fill_s": round(fill_s, 2),
            "kv_bytes": b.kv_bytes(cache), "step_ms": round(statistics.median(times) * 1e3, 2),
            "tok_s": round(1 / statistics.median(times), 2), **_rss()}


def _speculate(b: Any, ids: list[int], tokens: int) -> dict[str, Any]:
    """Greedy plain, ngram-speculative and oracle-speculative generation after a ~1k-token
    input-grounded prompt (the text, then its own beginning to continue). The oracle drafts
    the mode's own plain output, 8 deep: every draft accepted in both modes, so its speedup
    is the speculative machinery's (verify rows against steps, the overlay's commits), apart
    from what the bound does to a drafter's acceptance; ngram's is the workload's."""
    import numpy as np

    from nodes.drafters.registry import make_drafter
    from nodes.engine import Engine, GenerationParams
    from nodes.engine.core import Stats
    from nodes.engine.sources import DraftSource
    from nodes.engine.tree import Candidate

    prompt = ids[:960] + ids[:64]

    class Oracle(DraftSource):
        name = "oracle"

        def __init__(self, truth: list[int]) -> None:
            self.truth = truth

        def propose(self, committed, budget):
            at = len(committed) - len(prompt)
            got = self.truth[at:at + min(budget, 8)]
            return [Candidate(np.asarray(got))] if got and budget else []

    got: dict[str, Any] = {}
    for name in ("plain", "ngram", "oracle"):
        drafter = make_drafter("ngram", b) if name == "ngram" else None
        sources = [Oracle(got["plain"]["tokens"])] if name == "oracle" else None
        engine = Engine(b, drafter)
        params = GenerationParams(max_tokens=tokens, eos_token_ids=())
        out, stats, first, n0 = [], Stats(), None, 0
        kw = {"sources": sources} if sources else {}
        for block in engine.stream(prompt, params, stats=stats, **kw):
            if first is None:
                first, n0 = time.perf_counter(), len(block.token_ids)
            out.extend(block.token_ids)
        got[name] = {"tokens": out, "tok_s": (len(out) - n0) / (time.perf_counter() - first)}
    plain = got["plain"]["tok_s"]
    return {"plain_tok_s": round(plain, 2),
            "ngram_tok_s": round(got["ngram"]["tok_s"], 2),
            "ngram_speedup": round(got["ngram"]["tok_s"] / plain, 3),
            "oracle_tok_s": round(got["oracle"]["tok_s"], 2),
            "oracle_speedup": round(got["oracle"]["tok_s"] / plain, 3),
            "identical": got["plain"]["tokens"] == got["ngram"]["tokens"]
            == got["oracle"]["tokens"]}


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    code = ("import json, sys; from tools.bench_memory import _child; "
            "print('RESULT ' + json.dumps(_child(json.loads(sys.argv[1]))))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=root,
                          capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"bench child {spec} failed:\n{proc.stderr[-2000:]}")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.fill, args.steps = "tiled", min(args.steps, 24)
        args.spec_tokens = min(args.spec_tokens, 64)
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    bound = [args.kv_sink, args.kv_window]
    from nodes.backends.kv_bound import check_kv_bound

    check_kv_bound(*bound)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    for context in contexts:
        for b in (None, bound):
            row = _spawn({"bound": b, "context": context, "fill": args.fill,
                          "steps": args.steps})
            print(f"{row['mode']:<8} {context:>6}: {row['kv_bytes'] / 1e6:8.2f} MB K/V, "
                  f"{row['tok_s']:6.2f} tok/s", file=sys.stderr)
            rows.append(row)
    spec = []
    if args.spec_tokens:
        for b in (None, bound):
            spec.append(_spawn({"bound": b, "spec_tokens": args.spec_tokens}))
    report = {"model": "smollm2-135m (fp32)", "bound": bound, "fill": args.fill,
              "steps": args.steps, "load_1min_at_start": load, "rows": rows,
              "speculation": spec, "summary": _summary(rows, spec, contexts)}
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _summary(rows: list[dict], spec: list[dict], contexts: list[int]) -> dict[str, Any]:
    by = {(r["mode"], r["context"]): r for r in rows}
    lo, hi = min(contexts), max(contexts)
    out: dict[str, Any] = {}
    for mode in ("full", "bounded"):
        if (mode, lo) in by and (mode, hi) in by:
            out[f"{mode}_tok_s_{hi}_over_{lo}"] = round(by[mode, hi]["tok_s"]
                                                      / by[mode, lo]["tok_s"], 3)
    kv = [by["bounded", c]["kv_bytes"] for c in contexts if ("bounded", c) in by]
    if kv:
        out["bounded_kv_spread"] = round((max(kv) - min(kv)) / min(kv), 4)
    for c in contexts:
        if ("full", c) in by and ("bounded", c) in by:
            out[f"kv_ratio_{c}"] = round(by["full", c]["kv_bytes"]
                                         / by["bounded", c]["kv_bytes"], 2)
    if len(spec) == 2:
        for k in ("oracle", "ngram"):
            out[f"{k}_speedup_bounded_over_full"] = round(spec[1][f"{k}_speedup"]
                                                          / spec[0][f"{k}_speedup"], 3)
    return out


def _print(rep: dict[str, Any]) -> None:
    s, w = rep["bound"]
    print(f"\nspecbus bench memory: {rep['model']}, one core, one torch thread, bound S={s} "
          f"W={w}, fill {rep['fill']}, {rep['steps']} steps (load {rep['load_1min_at_start']})")
    head = f"{'mode':<8} {'context':>7} {'K/V MB':>8} {'RSS MB':>8} {'peak MB':>8} {'tok/s':>7}"
    print(head)
    print("-" * len(head))
    for r in rep["rows"]:
        print(f"{r['mode']:<8} {r['context']:>7} {r['kv_bytes'] / 1e6:8.2f} "
              f"{r['VmRSS'] / 1e6:8.0f} {r['VmHWM'] / 1e6:8.0f} {r['tok_s']:7.2f}")
    for r in rep["speculation"]:
        print(f"speculation ({r['mode']}): plain {r['plain_tok_s']} tok/s; ngram "
              f"{r['ngram_tok_s']} tok/s, {r['ngram_speedup']}x; oracle 8 deep "
              f"{r['oracle_tok_s']} tok/s, {r['oracle_speedup']}x; identical {r['identical']}")
    print("summary: " + ", ".join(f"{k} {v}" for k, v in rep["summary"].items()))
