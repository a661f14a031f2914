"""`specbus bench decode` (without `--local`): decoding over the bus (protocol 2), one run.

A local cluster of real processes, this 2-core box played as two machines: verifiers pinned to
core 0 with one torch thread, proposers pinned to core 1. One verifier (`v-ngram`, with an
in-process ngram drafter used only for the `inproc-ngram` row) serves every bus row; an `ngram`
and an `int8` proposer that draft ahead and stream chunks, at +0 ms and then through a
userspace delay proxy adding 5, 20 and 50 ms of round trip (this kernel has no netem: see
`tools/delay_proxy.py`; each such proposer advertises the proxy's address with `--advertise`).
One delay at a time (a phase): its proposers are started, every row of that delay runs with its
own plain baseline, and they are stopped; idle nodes crowding core 1 slowed its drafter. Rows:
plain (run first and again last for each prompt: the baseline is the mean of the two, and
`bus-plain-again` against it shows how much the machine drifted); ngram; int8 (its chain plus
its runners-up, a token tree per chunk); ngram + int8 together (merged into one token tree per
forward) at each delay; the int8 proposer sending chains only (`--tree-width 1`) at +0 and +50
ms; the shipped EAGLE-3 head (`--drafter eagle`, int8 weights on its CPU), fed the verifier's
hidden states with every commit (the F3 data plane), at each delay; HF greedy and HF prompt
lookup on the same prompts and token counts, run in this process (its thread pinned to core 0,
one torch thread) right after each prompt's bus rows; the proxies' threads are pinned to core 1
with the proposers. Every bus configuration runs on the same prompts through the same verifier
process, interleaved prompt by prompt (in an order rotated per prompt); speedups are over that
verifier's own plain decoding of the same prompt on its core (hf-* rows: over hf-plain).

Protocol 1's request/reply drafting is gone from the nodes, so it has no row here (its figures
are in the older tables of docs/benchmarks.md). The JSON gives each row's speedup per prompt
(`per_prompt`, prompt indices in the prompt set's order), so the worst prompt can be named.
`--repeat N`: N passes over each prompt, each configuration's median run counts (`median_run`);
a bus row's speedup on a prompt is its median run's tok/s over the plain baseline of the same
pass (the mean of its first and last plain runs), so the VM's drift between passes cancels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

DELAYS_MS = (0, 5, 20, 50)  # every one by default; `--delays` picks some (in this order)
#: delays at which the int8 proposer also runs with chains only (`--tree-width 1`)
CHAIN_DELAYS_MS = (0, 50)
VERIFIER_CORE = ("--cpus", "0", "--threads", "1")
PROPOSER_CORE = ("--cpus", "1")
#: the delay proxies' threads run there too: the network must not cost the verifier's core
PROPOSER_CPUS = {1}


def run_bus(args, prompts: list[tuple[str, str]]) -> int:
    from tools.local_cluster import LocalCluster

    n = 48 if args.quick else args.max_tokens
    if args.quick:
        prompts = [prompts[0], prompts[2], prompts[-2]]
    log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-decode-"))
    rows: list[dict] = []
    with LocalCluster(log_dir=log_dir, mdns=False) as c:
        print(f"starting cluster (logs: {log_dir}); verifier on core 0 (1 torch thread), "
              "each delay's proposers on core 1, one delay at a time", file=sys.stderr)
        # no prefix cache: every row runs the same prompts on this verifier, and a later
        # row would get its prompt's prefill for free
        verifier = c.start_node("v-ngram", "--role", "verifier", "--drafter", "ngram",
                                "--prefix-cache-mb", "0", *VERIFIER_CORE)
        delays = getattr(args, "delays", None) or DELAYS_MS
        hf = _HfRows(args) if 0 in delays else None
        for d in delays:
            results = _run_phase(args, c, verifier, d, prompts, n, hf if d == 0 else None)
            phase_rows = _rows(results)
            if d != delays[0]:  # each phase has its own plain baseline: the first one's shown
                phase_rows = [r for r in phase_rows if not r["name"].startswith("bus-plain")]
            rows += phase_rows
    _print(rows, n)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "max_tokens": n}, indent=2) + "\n")
    return 0


def _start_proposers(c, stack: contextlib.ExitStack, d: int) -> dict[str, object]:
    """This delay's proposers on core 1, each stopped when `stack` closes (at +d ms through a
    delay proxy it advertises). One delay's at a time: idle nodes on the proposers' core cost
    a drafter ~20 % of it (8 idle nodes: core 1 22 % busy, 2200 context switches a second),
    which is not the two machines this bench plays."""
    from tools.delay_proxy import Delay, DelayProxy
    from tools.local_cluster import ClusterStartError, free_port_pair

    out: dict[str, object] = {}
    for drafter in ("ngram", "int8", "int8-chain", "eagle"):
        if drafter == "int8-chain" and d not in CHAIN_DELAYS_MS:
            continue
        flags = ("--drafter", "int8", "--tree-width", "1") if drafter == "int8-chain" else (
            "--drafter", drafter)
        for attempt in range(3):  # a free port can be taken before the node binds it
            extra: tuple[str, ...] = ()
            if d:
                port = free_port_pair()
                proxy = stack.enter_context(
                    DelayProxy(("127.0.0.1", port), Delay(d / 2000.0), cpus=PROPOSER_CPUS))
                extra = ("--port", str(port), "--advertise", proxy.address)
            try:
                node = c.start_node(f"p-{drafter}-{d}ms-{attempt}", "--role", "proposer",
                                    *flags, *PROPOSER_CORE, *extra, seed=True)
            except ClusterStartError:
                if attempt == 2 or not d:
                    raise
                continue
            stack.callback(node.stop)
            out[drafter] = node
            break
    return out


def _run_phase(args, c, verifier_node, d: int, prompts: list[tuple[str, str]], n: int,
               hf: _HfRows | None) -> dict[str, list[dict]]:
    """Every row at delay d, interleaved prompt by prompt, with its own plain baseline (first
    and last in each pass); with `hf`, the in-process ngram and HF rows too."""
    from nodes.cluster_client import ClusterClient, GenerateRequest

    tag = f"+{d}ms"
    with contextlib.ExitStack() as stack:
        props = _start_proposers(c, stack, d)
        ids = {p.node_id for p in props.values()}
        peers = (verifier_node.stream, *(p.stream for p in props.values()))
        cc = stack.enter_context(ClusterClient(c.cluster, peers=peers, mdns=False))
        cc.wait_for(lambda ms: ids <= {m.card.node_id for m in ms if m.card.is_worker}, 60)
        verifier = next(m for m in cc.verifiers() if m.card.name == "v-ngram")
        ng, i8 = props["ngram"].node_id, props["int8"].node_id
        configs = [("bus-plain", dict(speculate=False))]
        if hf is not None:
            configs.append(("inproc-ngram", dict(proposers=[])))
        configs += [(f"bus-ngram{tag}", dict(proposers=[ng])),
                    (f"bus-int8{tag}", dict(proposers=[i8])),
                    (f"bus-ngram+int8{tag}", dict(proposers=[ng, i8]))]
        if "int8-chain" in props:  # the same int8 drafter sending chains only
            configs.append((f"bus-int8-chain{tag}",
                            dict(proposers=[props["int8-chain"].node_id])))
        # the shipped EAGLE-3 head, fed the verifier's hidden states with every commit
        configs.append((f"bus-eagle{tag}", dict(proposers=[props["eagle"].node_id])))
        # warm-up: learn costs, open connections
        for _, over in configs:
            cc.generate(GenerateRequest(prompts[0][1][:200], max_tokens=8, **over), verifier)
        results: dict[str, list[dict]] = {name: [] for name, _ in configs}
        results["bus-plain-again"] = []
        if hf is not None:
            hf.run(*prompts[0], n, warm_up=True)
        passes = args.repeat  # >= 1: the argument parser refuses less
        for i, (klass, text) in enumerate(prompts):
            print(f"{tag}: prompt {i + 1}/{len(prompts)} ({klass})", file=sys.stderr)
            runs: dict[str, list[dict]] = {name: [] for name in results}
            hf_runs: dict[str, list[dict]] = {name: [] for name in hf.out} if hf else {}
            for rep in range(passes):
                # plain first and last (the baseline is their mean; the second shows any
                # drift within a pass), the others in an order rotated per prompt and pass
                rest = configs[1:]
                shift = ((i * passes + rep) * 5) % len(rest)
                order = [configs[0], *rest[shift:], *rest[:shift],
                         ("bus-plain-again", dict(speculate=False))]
                for name, over in order:
                    r = cc.generate(GenerateRequest(text, max_tokens=n, **over), verifier)
                    runs[name].append({"class": klass, "prompt": i, **r.stats})
                # each run against its own pass's plain baseline: the VM's speed drifts over
                # minutes, so a ratio within a pass is steadier than one across passes
                base = (runs["bus-plain"][-1]["tok_per_s"]
                        + runs["bus-plain-again"][-1]["tok_per_s"]) / 2
                for name, _ in order:
                    runs[name][-1]["in_pass"] = (runs[name][-1]["tok_per_s"] / base
                                                 if base else None)
                if hf is not None:
                    for name, rec in hf.run(klass, text, n).items():
                        hf_runs[name].append(rec)
            for name, recs in runs.items():
                results[name].append(median_run(recs))
            for name, recs in hf_runs.items():
                hf.out[name].append(median_run(recs))
    if hf is not None:
        results.update(hf.out)
    return results


class _HfRows:
    """HF greedy and HF prompt lookup on the same prompts, token ids and token counts as the
    bus rows (the verifier's own encoding: the chat template, as `GenerateRequest` asks), run
    in this process right after each prompt's bus rows (the VM's speed drifts over minutes, so
    HF is measured beside ours, not after), with the calling thread pinned to core 0 and one
    torch thread, the cluster idle meanwhile."""

    def __init__(self, args) -> None:
        import torch

        from nodes.backends.registry import load_backend
        from tools.decode_runs import hf_runner

        torch.set_num_threads(1)
        self.backend = load_backend("torch", getattr(args, "model", None))
        self.runners = {"hf-plain": hf_runner(self.backend),
                        "hf-prompt-lookup": hf_runner(self.backend,
                                                       prompt_lookup_num_tokens=8)}
        self.out: dict[str, list[dict]] = {name: [] for name in self.runners}

    def run(self, klass: str, text: str, n: int, warm_up: bool = False) -> dict[str, dict]:
        """One run of each HF configuration on this prompt (the caller keeps them)."""
        import os

        ids = self.backend.tokenizer.encode(text, chat=True)
        pin = hasattr(os, "sched_getaffinity")
        cores = os.sched_getaffinity(0) if pin else None
        if pin:
            os.sched_setaffinity(0, {0})  # this thread only: the proxies' threads stay free
        try:
            if warm_up:
                self.runners["hf-plain"](ids[:64], 4)
                return {}
            out = {}
            for name, run in self.runners.items():
                r = run(ids, n)
                out[name] = {
                    "class": klass, "prompt": len(self.out[name]), "token_ids": r.token_ids,
                    "tok_per_s": len(r.token_ids) / r.elapsed_s if r.elapsed_s else 0.0,
                    "acceptance": 0.0, "mean_accepted_len": 0.0, "accepted": 0,
                    "drafted": 0, "blocks": 0}
            return out
        finally:
            if pin:
                os.sched_setaffinity(0, cores)


def delay_list(text: str) -> tuple[int, ...]:
    """`--delays`: a comma-separated subset of DELAYS_MS, run in DELAYS_MS's order."""
    picked = set()
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a delay in ms: {part!r}") from None
        if value not in DELAYS_MS:
            raise argparse.ArgumentTypeError(
                f"{value} ms is not one of the bench's delays ({', '.join(map(str, DELAYS_MS))})")
        picked.add(value)
    return tuple(d for d in DELAYS_MS if d in picked)


def median_run(runs: list[dict]) -> dict:
    """The run of median speed among a configuration's passes over one prompt (the lower
    middle of an even count), whole: its figures belong together. One pass: that pass. Speed
    is the run's against its own pass's plain baseline (`in_pass`) where every run has one,
    else its tok/s."""
    if not runs:
        raise ValueError("no runs to take the median of")
    paired = all(r.get("in_pass") is not None for r in runs)
    ranked = sorted(runs, key=lambda r: r["in_pass"] if paired else r["tok_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "passes": len(runs)}


def _rows(results: dict[str, list[dict]]) -> list[dict]:
    first, again = results["bus-plain"], results["bus-plain-again"]
    plain = [{**a, "tok_per_s": (a["tok_per_s"] + b["tok_per_s"]) / 2}
             for a, b in zip(first, again, strict=True)]
    rows = []
    for name, runs in results.items():
        base = results["hf-plain"] if name.startswith("hf-") else plain
        for klass in sorted({r["class"] for r in runs}):
            idx = [i for i, r in enumerate(runs) if r["class"] == klass]
            speed = [_speedup(runs[i], base[i]) for i in idx]
            speed = [x for x in speed if x is not None]
            blocks = [runs[i].get("blocks", 0) for i in idx]
            row = {
                "name": name, "backend": "torch", "prompt_class": klass,
                "tok_per_s": round(statistics.median(runs[i]["tok_per_s"] for i in idx), 2),
                "speedup": round(statistics.median(speed), 3) if speed else None,
                "min_speedup": round(min(speed), 3) if speed else None,
                "acceptance": round(statistics.median(runs[i]["acceptance"] for i in idx), 3),
                "accepted_per_forward": round(statistics.median(
                    runs[i]["accepted"] / b for i, b in zip(idx, blocks, strict=True) if b)
                    if any(blocks) else 0.0, 2),
                "fed_per_forward": round(statistics.median(
                    (runs[i]["drafted"] + b) / b for i, b in zip(idx, blocks, strict=True) if b)
                    if any(blocks) else 0.0, 2),
                "tree_blocks_per_forward": round(statistics.median(
                    runs[i].get("tree_blocks", 0) / b for i, b in zip(idx, blocks, strict=True)
                    if b) if any(blocks) else 0.0, 2),
                # against the row's own baseline: an HF row's is HF greedy (fp32), which the
                # verifier's quantized plain decoding differs from wherever the weights tip a
                # token, so compared with ours it read "False" on open-ended text at every run
                "identical_to_plain": all(runs[i]["token_ids"] == base[i]["token_ids"]
                                          for i in idx),
                #: per prompt of the class (in the prompt set's order): the worst is named
                "per_prompt": [{"prompt": runs[i].get("prompt", i), "speedup": (
                    None if (x := _speedup(runs[i], base[i])) is None else round(x, 3))}
                    for i in idx],
            }
            if name == "hf-prompt-lookup":  # the comparison: our ngram vs HF's
                for ours_name, key in (("bus-ngram+0ms", "bus_ngram_vs_this"),
                                       ("inproc-ngram", "inproc_ngram_vs_this")):
                    ours = results[ours_name]
                    vs = [ours[i]["tok_per_s"] / runs[i]["tok_per_s"] for i in idx
                          if runs[i]["tok_per_s"]]
                    row[key] = round(statistics.median(vs), 3) if vs else None
                    row[key + "_min"] = round(min(vs), 3) if vs else None
                    row[key + "_per_prompt"] = [round(v, 3) for v in vs]  # names the worst
            rows.append(row)
    return rows


def _speedup(run: dict, base: dict) -> float | None:
    """A prompt's speedup: the median run's against its own pass's plain baseline where it
    has one (bus rows), else against the baseline's median run (HF rows)."""
    if run.get("in_pass") is not None:
        return run["in_pass"]
    return run["tok_per_s"] / base["tok_per_s"] if base["tok_per_s"] else None


def _print(rows: list[dict], n: int) -> None:
    print(f"decode over the bus: up to {n} new tokens, medians over prompts; speedup vs the "
          "same verifier decoding plainly on the same prompt (hf-* rows: vs hf-plain)")
    print(f"{'name':22s} {'class':15s} {'tok/s':>7s} {'speedup':>8s} {'worst':>6s} "
          f"{'accept':>7s} {'acc/fwd':>7s} {'fed/fwd':>7s} {'identical':>9s}")
    for r in rows:
        extra = ""
        if "bus_ngram_vs_this" in r:
            extra = (f"  bus-ngram+0ms vs this: {r['bus_ngram_vs_this']:.2f}x "
                     f"(worst {r['bus_ngram_vs_this_min']:.2f}x); inproc-ngram vs this: "
                     f"{r['inproc_ngram_vs_this']:.2f}x (worst "
                     f"{r['inproc_ngram_vs_this_min']:.2f}x)")
        print(f"{r['name']:22s} {r['prompt_class']:15s} {r['tok_per_s']:7.1f} "
              f"{r['speedup'] or 0:8.2f} {r['min_speedup'] or 0:6.2f} {r['acceptance']:7.2f} "
              f"{r['accepted_per_forward']:7.2f} {r['fed_per_forward']:7.2f} "
              f"{str(r['identical_to_plain']):>9s}{extra}")
