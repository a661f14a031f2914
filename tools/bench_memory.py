"""`specbus bench memory`: the verifier's resident K/V bytes, process RSS and decode tok/s at
1k, 4k and 16k tokens of context, with full attention and bounded (`--kv-sink/--kv-window`).

Each (mode, context) runs in a process of its own (so its RSS is its own), pinned to core 0
with one torch thread, on the embedded SmolLM2-135M in fp32 (the bound's forward). The
context is a long text that ships with Python itself (`pydoc_data.topics`, the language
reference's prose), repeated where it is shorter. Then plain greedy decode steps, each a
one-row forward and the engine's crop (which commits a bounded layer's overlay). Reported:
K/V bytes the cache holds after the steps (allocated: a full cache's room ahead included),
VmRSS and VmHWM of that process, and tok/s, one over the median step, taken in one more
process that holds every row's cache and steps them in turn (`--steps` rounds), so load on a
shared machine falls on all rows alike ("solo": the row's own process, fewer steps).

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
    parser.add_argument("--rounds", type=int, default=3,
                        help="speculation rounds, modes and drafters in turn (median)")
    parser.add_argument("--quick", action="store_true",
                        help="--fill tiled, 32 steps, 64 speculated tokens, 2 rounds")
    parser.add_argument("--quality", type=int, metavar="TOKENS", default=0,
                        help="instead: perplexity and greedy agreement over TOKENS of the text, "
                             "full vs bounded with absolute and re-indexed positions (eager), "
                             "and the bounded product's own forward")
    parser.add_argument("--no-full", action="store_true",
                        help="with --quality: skip full attention (long texts)")
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


def _fill(b, cache, ids: list[int], length: int, how: str) -> None:
    """Put `length` positions of `ids` in `cache`, 512 a forward: every one (`how` "real") or
    the first 1,024 with their K/V tiled to `length` ("tiled": `--fill`)."""
    import torch

    fill = length if how == "real" else min(length, 1024)
    with torch.inference_mode():
        for s in range(0, fill, 512):
            b.forward_last(cache, ids[s:min(s + 512, fill)])
        b.crop(cache, fill)
        if fill < length:
            _tiled(b, cache, length)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One (mode, context) in this process: fill, decode, measure (or, as `spec` says, the
    interleaved timing or the speculation section)."""
    if spec.get("interleaved"):
        return _interleaved(spec)
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
        return _speculate(b, ids, spec["spec_tokens"], spec["rounds"], spec["bound"])
    length = spec["context"]
    ids = (ids * (length // len(ids) + 1))[:length]
    cache = b.new_cache()
    t0 = time.perf_counter()
    _fill(b, cache, ids, length, spec["fill"])
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


def _interleaved(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode tok/s of every (mode, context) from steps taken in turn in one process (one
    backend, a cache per row): load that comes and goes on a shared machine falls on all rows
    alike, so their ratios hold where separate runs' do not."""
    import numpy as np
    import torch

    from nodes.backends import growing_cache
    from nodes.backends.torch_backend import TorchBackend

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    b = TorchBackend.load(None, device="cpu", weights="fp32")
    b.bound_kv(*spec["bound"])  # forwards through the banded path; full caches stay full
    text = b.tokenizer.encode(long_text())
    rows = []
    for context in spec["contexts"]:
        for bound in (None, tuple(spec["bound"])):
            ids = (text * (context // len(text) + 1))[:context]
            cache = growing_cache.new_cache(b.model.config, bound)
            _fill(b, cache, ids, context, spec["fill"])
            rows.append({"mode": "bounded" if bound else "full", "context": context,
                         "cache": cache, "tok": int(ids[-1]), "times": []})
    for _ in range(spec["steps"]):
        for row in rows:
            cache = row["cache"]
            t = time.perf_counter()
            logits = b.forward(cache, [row["tok"]])
            b.crop(cache, b.cache_length(cache))
            row["times"].append(time.perf_counter() - t)
            row["tok"] = int(np.argmax(logits[-1]))
    return {"rows": [{"mode": r["mode"], "context": r["context"],
                      "tok_s": round(1 / statistics.median(r["times"]), 2)} for r in rows]}


def _speculate(b: Any, ids: list[int], tokens: int, rounds: int,
               bound: list[int]) -> dict[str, Any]:
    """Greedy plain, ngram-speculative and oracle-speculative generation after a ~1k-token
    input-grounded prompt (the text, then its own beginning to continue). The oracle drafts
    the mode's own plain output, 8 deep: every draft accepted in both modes, so its speedup
    is the speculative machinery's (verify rows against steps, the overlay's commits), apart
    from what the bound does to a drafter's acceptance; ngram's is the workload's."""

    from nodes.drafters.registry import make_drafter
    from nodes.engine import Engine, GenerationParams
    from nodes.engine.core import Stats
    from nodes.engine.sources import DraftSource
    from nodes.engine.tree import DraftTree

    prompt = ids[:960] + ids[:64]

    class Oracle(DraftSource):
        name = "oracle"

        def __init__(self, truth: list[int]) -> None:
            self.truth = truth

        def propose(self, committed, budget):
            at = len(committed) - len(prompt)
            got = self.truth[at:at + min(budget, 8)]
            return DraftTree.of_chain(got if budget else [])

    def generate(name: str, truth: list[int] | None) -> tuple[list[int], float, Stats]:
        drafter = make_drafter("ngram", b) if name == "ngram" else None
        kw = {"sources": [Oracle(truth)]} if name == "oracle" else {}
        params = GenerationParams(max_tokens=tokens, eos_token_ids=())
        out, first, n0, stats = [], None, 0, Stats()
        for block in Engine(b, drafter).stream(prompt, params, stats=stats, **kw):
            if first is None:
                first, n0 = time.perf_counter(), len(block.token_ids)
            out.extend(block.token_ids)
        return out, (len(out) - n0) / (time.perf_counter() - first), stats

    modes = {"full": None, "bounded": tuple(bound)}
    speeds: dict[tuple[str, str], list[float]] = {}
    outs: dict[tuple[str, str], list[int]] = {}
    drafted: dict[str, tuple[int, int, int]] = {}  # mode -> ngram's (drafted, accepted, blocks)
    for _ in range(rounds):  # modes and drafters in turn: load falls on all alike
        for mode, kv in modes.items():
            b.kv_bound = kv
            for name in ("plain", "ngram", "oracle"):
                out, tok_s, st = generate(name, outs.get((mode, "plain")))
                speeds.setdefault((mode, name), []).append(tok_s)
                outs.setdefault((mode, name), out)
                if name == "ngram":  # (the same every round: greedy, the same text)
                    drafted[mode] = (st.drafted, st.accepted, st.blocks)
    result = []
    for mode in modes:  # speedups: the median of each round's ratio (runs taken together)
        med = {n: statistics.median(speeds[mode, n]) for n in ("plain", "ngram", "oracle")}
        ratio = {n: statistics.median(a / p for a, p in zip(speeds[mode, n],
                                                             speeds[mode, "plain"], strict=True))
                 for n in ("ngram", "oracle")}
        result.append({"mode": mode, "plain_tok_s": round(med["plain"], 2),
                       "ngram_tok_s": round(med["ngram"], 2),
                       "ngram_speedup": round(ratio["ngram"], 3),
                       "oracle_tok_s": round(med["oracle"], 2),
                       "oracle_speedup": round(ratio["oracle"], 3),
                       # what the bound does to the drafter: how much of its drafts the
                       # mode's own text takes (the oracle's is 1 in both modes)
                       "ngram_acceptance": round(drafted[mode][1] / max(1, drafted[mode][0]),
                                                 3),
                       "ngram_tokens_per_block": round(len(outs[mode, "ngram"])
                                                       / max(1, drafted[mode][2]), 2),
                       "identical": outs[mode, "plain"] == outs[mode, "ngram"]
                       == outs[mode, "oracle"]})
    return {"speculation": result}


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
    if args.quality:
        got = quality(args.quality, args.kv_sink, args.kv_window, full=not args.no_full)
        print(json.dumps(got))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(got, f, indent=1)
        return 0
    if args.quick:
        args.fill, args.steps = "tiled", min(args.steps, 32)
        args.spec_tokens, args.rounds = min(args.spec_tokens, 64), min(args.rounds, 2)
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    bound = [args.kv_sink, args.kv_window]
    from nodes.backends.kv_bound import check_kv_bound

    check_kv_bound(*bound)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    for context in contexts:
        for b in (None, bound):
            row = _spawn({"bound": b, "context": context, "fill": args.fill,
                          "steps": max(4, args.steps // 4)})
            print(f"{row['mode']:<8} {context:>6}: {row['kv_bytes'] / 1e6:8.2f} MB K/V, "
                  f"RSS {row['VmRSS'] / 1e6:.0f} MB", file=sys.stderr)
            rows.append(row)
    timed = _spawn({"interleaved": True, "bound": bound, "contexts": contexts,
                    "fill": args.fill, "steps": args.steps})["rows"] if contexts else []
    for row, t in zip(rows, timed, strict=True):
        row["solo_tok_s"], row["tok_s"] = row["tok_s"], t["tok_s"]
    spec = []
    if args.spec_tokens:
        spec = _spawn({"bound": bound, "spec_tokens": args.spec_tokens,
                       "rounds": args.rounds})["speculation"]
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
    lo, hi = (min(contexts), max(contexts)) if contexts else (0, 0)
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
    head = (f"{'mode':<8} {'context':>7} {'K/V MB':>8} {'RSS MB':>8} {'peak MB':>8} "
            f"{'tok/s':>7} {'solo':>7}")
    print(head)
    print("-" * len(head))
    for r in rep["rows"]:
        print(f"{r['mode']:<8} {r['context']:>7} {r['kv_bytes'] / 1e6:8.2f} "
              f"{r['VmRSS'] / 1e6:8.0f} {r['VmHWM'] / 1e6:8.0f} {r['tok_s']:7.2f} "
              f"{r['solo_tok_s']:7.2f}")
    for r in rep["speculation"]:
        print(f"speculation ({r['mode']}): plain {r['plain_tok_s']} tok/s; ngram "
              f"{r['ngram_tok_s']} tok/s, {r['ngram_speedup']}x (acceptance "
              f"{r['ngram_acceptance']}, {r['ngram_tokens_per_block']} tokens a block); "
              f"oracle 8 deep "
              f"{r['oracle_tok_s']} tok/s, {r['oracle_speedup']}x; identical {r['identical']}")
    print("summary: " + ", ".join(f"{k} {v}" for k, v in rep["summary"].items()))


# -- the bound's quality: perplexity and agreement, absolute vs re-indexed positions -------------
def _band_attention(state: dict[str, Any]):
    """An eager attention for a teacher-forced pass under the sink + window band (key p seen by
    query q when p <= q and (p < sink or p > q - window)), in query chunks so its cost and
    memory are linear in the length. `state["reindex"]`: the sinks are scored as StreamingLLM
    re-indexes them (at cache positions 0..S-1, the query at most at S + W - 1: each query
    rotated back by max(0, q - S - W + 1) against them; RoPE is relative, so the window's
    keys score the same both ways)."""
    import torch
    from transformers.models.llama.modeling_llama import rotate_half

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        s, w, chunk = state["sink"], state["window"], 512
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        n = query.shape[2]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        outs = []
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            q = query[:, :, a:b]
            qpos = torch.arange(a, b)
            lo = max(min(s, n), a - w + 1)
            kpos = torch.cat([torch.arange(min(s, n)), torch.arange(lo, b)])
            k = torch.cat([key[:, :, :min(s, n)], key[:, :, lo:b]], dim=2)
            v = torch.cat([value[:, :, :min(s, n)], value[:, :, lo:b]], dim=2)
            scores = torch.matmul(q, k.transpose(2, 3)) * scale
            if state["reindex"]:
                cos, sin = state["cos"][a:b], state["sin"][a:b]  # rotation by -shift(q)
                q_back = q * cos + rotate_half(q) * sin
                sink_scores = torch.matmul(q_back, key[:, :, :min(s, n)].transpose(2, 3)) * scale
                scores[..., :min(s, n)] = sink_scores
            visible = (kpos[None, :] <= qpos[:, None]) & (
                (kpos[None, :] < s) | (kpos[None, :] > qpos[:, None] - w))
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
            outs.append(torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), v))
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None

    return attention


def quality(tokens: int, sink: int, window: int, full: bool = True) -> dict[str, Any]:
    """Teacher-forced over the first `tokens` of the long text: perplexity with full attention
    (when `full`), bounded with absolute positions and bounded re-indexed (eager forms here),
    and the bounded product's own forward (`product`: re-indexed, chunks of 256 through the
    backend); the share of positions where each bounded mode's greedy choice equals full
    attention's."""
    import torch
    from transformers import AttentionInterface

    from nodes.backends.torch_backend import TorchBackend

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    b = TorchBackend.load(None, device="cpu", weights="fp32")
    model = b.model
    ids = torch.tensor([b.tokenizer.encode(long_text())[:tokens]])
    n = ids.shape[1]
    state: dict[str, Any] = {"sink": sink, "window": window, "reindex": False}
    shift = torch.clamp(torch.arange(n) - (sink + window - 1), min=0)
    cos, sin = model.model.rotary_emb(torch.zeros(1, n, 1), (-shift)[None])
    state["cos"], state["sin"] = cos[0], sin[0]
    AttentionInterface.register("specbus_band_quality", _band_attention(state))

    def run(impl: str | None) -> tuple[float, torch.Tensor]:
        before = model.config._attn_implementation
        if impl:
            model.config._attn_implementation = impl
        try:
            with torch.inference_mode():
                h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
                losses, picks = [], []
                for a in range(0, n - 1, 1024):
                    logits = model.lm_head(h[a:min(a + 1024, n - 1)]).float()
                    target = ids[0, a + 1:a + 1 + logits.shape[0]]
                    losses.append(torch.nn.functional.cross_entropy(logits, target,
                                                                    reduction="none"))
                    picks.append(logits.argmax(-1))
        finally:
            model.config._attn_implementation = before
        loss = torch.cat(losses)
        if n - 1 > trained:  # past the trained context alone too
            tails[impl or "full"] = float(np.exp(float(loss[trained:].mean())))
        return float(np.exp(float(loss.mean()))), torch.cat(picks)

    import numpy as np

    trained = int(getattr(model.config, "max_position_embeddings", 0) or 0) or n
    tails: dict[str, float] = {}
    out: dict[str, Any] = {"tokens": n, "sink": sink, "window": window}
    full_picks = None
    if full:
        t = time.perf_counter()
        out["ppl_full"], full_picks = run(None)
        out["full_s"] = round(time.perf_counter() - t, 1)
    for name, reindex in (("absolute", False), ("reindexed", True)):
        state["reindex"] = reindex
        ppl, picks = run("specbus_band_quality")
        out[f"ppl_{name}"] = round(ppl, 3)
        if "specbus_band_quality" in tails:
            out[f"ppl_{name}_past_{trained}"] = round(tails.pop("specbus_band_quality"), 3)
        if full_picks is not None:
            out[f"agree_{name}"] = round(float((picks == full_picks).float().mean()), 4)
    # the product itself: the bounded backend's own forward (re-indexed sink positions),
    # teacher-forced a chunk at a time (its overlay committed by the next forward)
    b.bound_kv(sink, window)
    t = time.perf_counter()
    cache, losses, picks = b.new_cache(), [], []
    with torch.inference_mode():
        for a in range(0, n - 1, 256):
            logits = torch.from_numpy(b.forward(cache, ids[0, a:min(a + 256, n - 1)].tolist()))
            target = ids[0, a + 1:a + 1 + logits.shape[0]]
            losses.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
            picks.append(logits.argmax(-1))
    b.bound_kv(None, None)
    loss = torch.cat(losses)
    out["ppl_product"] = round(float(np.exp(float(loss.mean()))), 3)
    out["product_s"] = round(time.perf_counter() - t, 1)
    if n - 1 > trained:
        out[f"ppl_product_past_{trained}"] = round(float(np.exp(float(loss[trained:].mean()))), 3)
    if full_picks is not None:
        out["agree_product"] = round(float((torch.cat(picks) == full_picks).float().mean()), 4)
    if full:
        out["ppl_full"] = round(out["ppl_full"], 3)
        if "full" in tails:
            out[f"ppl_full_past_{trained}"] = round(tails["full"], 3)
    return out
