"""Suffix drafter benchmarks: index cost, single requests against ngram, repeated traces.

    python -m tools.bench_suffix --micro [--tokens 200000]          # us per token, bytes per token
    python -m tools.bench_suffix --compare [--max-tokens 96]        # in process, SmolLM2
    python -m tools.bench_suffix --trace agent_tools [--max-tokens 96]
    ... [--json PATH]                                                # the table as JSON too

`--micro` needs no model: it indexes synthetic documents drawn from a small vocabulary with
repeated phrases (so chains are long, as in a repetitive workload), times lookups and drafts per
token, and measures the global index's memory with tracemalloc against its own `nbytes`.
`--compare` decodes a few prompts written for this benchmark (not the decode benchmark's) plain,
with the ngram drafter and with a fresh suffix drafter (nothing indexed), all in this process
on the embedded model, and checks every output equals plain greedy. `--trace NAME` replays
tools/traces/NAME.json request by request: plain, per-request ngram, and one suffix drafter whose
global index keeps what the trace has written so far. Pin it yourself (`taskset -c 0`); torch
gets one thread. Ratios are only meaningful within one run on a shared machine.

The issue's full benchmark (the shared rows over real node processes, HF prompt lookup, a
verifier started later, single requests against HF) is `specbus bench decode --trace`
(tools/bench_trace.py); this module keeps the model-free `--micro` and the quick in-process
replays.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

log = logging.getLogger(__name__)

TRACES = Path(__file__).resolve().parent / "traces"

_ROSTER = """Amara Diallo, Lisbon
Jonas Weber, Graz
Priya Raman, Pune
Tomasz Nowak, Gdansk
Lucia Ferreira, Porto
Kenji Sato, Sendai"""

_FUNC = """def invoice_total(lines, tax_rate):
    total = 0
    for line in lines:
        total += line["qty"] * line["price"]
    if total > 1000:
        total -= total * 0.05
    return round(total * (1 + tax_rate), 2)
"""

_PARA = ("The river curls past the mill before it reaches the town. In spring the river floods "
         "the lower meadow, and the children race paper boats along the river bank until dusk.")

_EMAIL = ("Hi Sam, the vendor call moved to 12 May at 10:00. Please send the draft budget by "
          "9 May so Ana can review it. The board meets on 20 May and expects the final numbers. "
          "Thanks, Lee")

#: (class, prompt): new prompts, written for this benchmark, not tools/prompts.py's
COMPARE_PROMPTS = [
    ("input-grounded", "Turn this list into a JSON array of objects with keys \"name\" and "
                       "\"city\":\n\n" + _ROSTER),
    ("input-grounded", "Rename the variable `total` to `subtotal` in this function and return "
                       "the whole function:\n\n" + _FUNC),
    ("input-grounded", "Repeat this paragraph exactly, replacing every \"river\" with "
                       "\"canal\":\n\n" + _PARA),
    ("input-grounded", "Quote every sentence of this email that contains a date, one per "
                       "line:\n\n" + _EMAIL),
    ("open-ended", "Write a short poem about a lighthouse keeper who collects seashells."),
    ("open-ended", "Explain to a ten-year-old why the sky turns orange at sunset."),
    ("open-ended", "Give three tips for keeping a sourdough starter alive."),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--micro", action="store_true", help="index cost and memory, no model")
    what.add_argument("--compare", action="store_true",
                      help="single requests: plain vs ngram vs suffix, in process")
    what.add_argument("--trace", metavar="NAME", help="replay tools/traces/NAME.json")
    parser.add_argument("--tokens", type=int, default=200_000, help="--micro: tokens indexed")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=1, help="--compare: runs per config")
    parser.add_argument("--limit", type=int, default=0, help="--trace: first N requests only")
    parser.add_argument("--spec", default="suffix", help="the suffix drafter spec to measure")
    parser.add_argument("--json", default=None, metavar="PATH")


# -- micro -----------------------------------------------------------------------------------

def micro(n_tokens: int, spec: str) -> dict:
    """Index ~n_tokens of synthetic repetitive documents; time lookups and drafts."""
    from nodes.drafters.suffix import SuffixDrafter
    from nodes.engine.sampling import SamplingParams

    rng = random.Random(0)
    phrases = [[rng.randrange(2000) for _ in range(rng.randrange(4, 24))] for _ in range(400)]

    def doc(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += phrases[rng.randrange(len(phrases))] if rng.random() < 0.7 else [
                rng.randrange(30000)]
        return out[:n]

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    drafter = SuffixDrafter.from_spec(spec)
    t0 = time.perf_counter()
    indexed = 0
    while indexed < n_tokens:
        d = doc(rng.randrange(100, 600))
        drafter.index.add([1, 2, 3] + d, 3)
        indexed += len(d)
    insert_s = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stats = drafter.index.stats()

    sp = SamplingParams()
    session = drafter.open([5, 6, 7] + doc(200), sp)
    text = doc(2000)
    t_extend = t_class = t_draft = 0.0
    drafted = 0
    for t in text:
        t1 = time.perf_counter()
        session.extend([t])
        t2 = time.perf_counter()
        session.draft_class()  # the engine asks this first; the draft reuses its matches
        t3 = time.perf_counter()
        tree = session.draft_ahead(16, drafter.tree_width)
        t_draft += time.perf_counter() - t3
        t_class += t3 - t2
        t_extend += t2 - t1
        drafted += len(tree)  # tree nodes: the chain, then each alternative past where it leaves it
    per_m = 1e6 / max(stats["tokens"], 1)
    return {
        "indexed_tokens": stats["tokens"], "documents": stats["documents"],
        "evicted": stats["evicted"], "budget_bytes": stats["budget"],
        "index_bytes": stats["bytes"], "tracemalloc_bytes": traced,
        "bytes_per_million_tokens": round(traced * per_m),
        "insert_us_per_token": round(insert_s / max(indexed, 1) * 1e6, 3),
        "extend_us_per_token": round(t_extend / len(text) * 1e6, 2),
        "class_us_per_call": round(t_class / len(text) * 1e6, 2),
        "draft_us_per_call": round(t_draft / len(text) * 1e6, 2),
        "draft_us_per_drafted_token": round(t_draft / max(drafted, 1) * 1e6, 2),
        "drafted_per_call": round(drafted / len(text), 2),
    }


# -- decoding ----------------------------------------------------------------------------------

def _backend():
    import torch

    from nodes.backends.registry import load_backend

    torch.set_num_threads(1)
    return load_backend("torch", None)


def _decode(engine, ids: list[int], max_tokens: int) -> dict:
    from nodes.engine.core import GenerationParams, Stats

    stats = Stats()
    out: list[int] = []
    t0 = time.perf_counter()
    for block in engine.stream(ids, GenerationParams(max_tokens=max_tokens), stats=stats):
        out.extend(block.token_ids)
    dt = time.perf_counter() - t0
    return {"tokens": out, "s": dt, "forwards": stats.blocks,
            "tok_per_forward": len(out) / max(stats.blocks, 1), "tok_s": len(out) / dt,
            "accepted": stats.accepted, "drafted": stats.drafted}


def _engines(backend, spec: str):
    from nodes.drafters.registry import make_drafter
    from nodes.engine.core import Engine

    engines = {"plain": Engine(backend, None), "ngram": Engine(backend, make_drafter("ngram")),
               "suffix": Engine(backend, make_drafter(spec))}
    engines["suffix"].drafter_spec = spec
    return engines


def _warm(backend, engines) -> None:
    """First forwards are cold (allocation, kernel selection): not any config's cost. The
    suffix drafter is replaced afterwards, so the warm-up text is never in its index."""
    from nodes.drafters.registry import make_drafter

    warm = backend.tokenizer.encode("Count from one to ten.", chat=True)
    for e in engines.values():
        _decode(e, warm, 8)
    engines["suffix"].drafter = make_drafter(engines["suffix"].drafter_spec)


def compare(max_tokens: int, repeat: int, spec: str) -> dict:
    """Each prompt plain / ngram / suffix (fresh drafter: nothing indexed), interleaved;
    the fastest of `repeat` runs per config."""
    from nodes.drafters.registry import make_drafter

    backend = _backend()
    engines = _engines(backend, spec)
    _warm(backend, engines)
    rows = []
    for cls, prompt in COMPARE_PROMPTS:
        ids = backend.tokenizer.encode(prompt, chat=True)
        best: dict[str, dict] = {}
        for _ in range(repeat):
            for name, engine in engines.items():
                if name == "suffix":
                    engine.drafter = make_drafter(spec)  # single request: nothing indexed
                r = _decode(engine, ids, max_tokens)
                if name not in best or r["s"] < best[name]["s"]:
                    best[name] = r
        same = all(best[n]["tokens"] == best["plain"]["tokens"] for n in best)
        rows.append({
            "class": cls, "prompt": prompt[:48], "identical": same,
            "tokens": len(best["plain"]["tokens"]),
            **{f"{n}_tok_per_fwd": round(r["tok_per_forward"], 3) for n, r in best.items()},
            **{f"{n}_tok_s": round(r["tok_s"], 3) for n, r in best.items()},
            "suffix_vs_ngram_speed": round(best["suffix"]["tok_s"] / best["ngram"]["tok_s"], 3),
            "suffix_vs_ngram_tpf": round(best["suffix"]["tok_per_forward"]
                                         / best["ngram"]["tok_per_forward"], 3),
            "suffix_vs_plain_speed": round(best["suffix"]["tok_s"] / best["plain"]["tok_s"], 3),
            "ngram_vs_plain_speed": round(best["ngram"]["tok_s"] / best["plain"]["tok_s"], 3),
        })
    return {"rows": rows, "summary": _summary(rows)}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for cls in sorted({r["class"] for r in rows}):
        sel = [r for r in rows if r["class"] == cls]
        for key in ("suffix_vs_ngram_speed", "suffix_vs_ngram_tpf", "suffix_vs_plain_speed",
                    "ngram_vs_plain_speed"):
            vals = [r[key] for r in sel]
            out[f"{cls} {key}"] = {"median": statistics.median(vals), "worst": min(vals)}
    out["all identical"] = all(r["identical"] for r in rows)
    return out


def load_trace(name: str) -> list[dict]:
    path = TRACES / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"no trace {name!r}; have: "
                         + ", ".join(sorted(p.stem for p in TRACES.glob("*.json"))))
    requests = json.loads(path.read_text())
    if not isinstance(requests, list) or not requests:
        raise SystemExit(f"{path}: not a JSON list of requests")
    return requests


def encode_request(tokenizer, req: dict) -> list[int]:
    """A trace entry: {"messages": [...]} (chat) or {"prompt": "..."} (chat template too)."""
    if "messages" in req:
        return tokenizer.encode_messages(req["messages"])
    return tokenizer.encode(req["prompt"], chat=True)


def trace(name: str, max_tokens: int, limit: int, spec: str) -> dict:
    """Replay a trace: each request plain, with per-request ngram and with the suffix drafter
    that has indexed the trace's earlier outputs (interleaved per request)."""
    backend = _backend()
    engines = _engines(backend, spec)
    _warm(backend, engines)
    requests = load_trace(name)[: limit or None]
    rows = []
    for i, req in enumerate(requests):
        ids = encode_request(backend.tokenizer, req)
        res = {n: _decode(e, ids, req.get("max_tokens", max_tokens)) for n, e in engines.items()}
        rows.append({
            "request": i, "tokens": len(res["plain"]["tokens"]),
            "identical": all(r["tokens"] == res["plain"]["tokens"] for r in res.values()),
            **{f"{n}_s": round(r["s"], 3) for n, r in res.items()},
            **{f"{n}_tok_per_fwd": round(r["tok_per_forward"], 3) for n, r in res.items()},
            # draft tokens fed to the verifier: on CPU a forward's cost grows with them
            **{f"{n}_fed": r["drafted"] for n, r in res.items() if n != "plain"},
        })
        log.info("request %d: %s", i, rows[-1])
    warm = rows[3:] or rows  # after the first few requests, as the targets say

    def total(rs, n):
        return sum(r[f"{n}_s"] for r in rs)

    summary = {
        "requests": len(rows), "all identical": all(r["identical"] for r in rows),
        "suffix_index": engines["suffix"].drafter.index.stats(),
    }
    for label, rs in (("all", rows), ("after 3", warm)):
        summary[label] = {
            "suffix_vs_plain": round(total(rs, "plain") / total(rs, "suffix"), 3),
            "suffix_vs_ngram": round(total(rs, "ngram") / total(rs, "suffix"), 3),
            "ngram_vs_plain": round(total(rs, "plain") / total(rs, "ngram"), 3),
            **{f"{n}_tok_per_fwd": round(sum(r["tokens"] for r in rs) / sum(
                r["tokens"] / r[f"{n}_tok_per_fwd"] for r in rs), 3)
               for n in ("plain", "ngram", "suffix")},
        }
    return {"trace": name, "rows": rows, "summary": summary}


def _print(result: dict) -> None:
    rows = result.get("rows")
    if rows:
        keys = list(rows[0])
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(str(r[k]) for k in keys))
    for k, v in result.get("summary", result).items():
        if k != "rows":
            print(f"{k}: {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_suffix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SPECBUS_LOG", "WARNING"))
    if args.micro:
        result = micro(args.tokens, args.spec)
    elif args.compare:
        result = compare(args.max_tokens, args.repeat, args.spec)
    else:
        result = trace(args.trace, args.max_tokens, args.limit, args.spec)
    result["loadavg"] = open("/proc/loadavg").read().split()[:3] if os.path.exists(
        "/proc/loadavg") else None
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
