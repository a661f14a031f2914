"""`specbus bench shard`: a verifier sharded into 1, 2 and 3 pipeline stages on loopback.

Real processes (tools/local_cluster.py), each with one torch thread. For every stage count:
resident memory (RSS) of each stage process after warm-up, greedy tok/s plain and with an
`ngram` proposer (forced every block), and the time per verify block; the pipeline's overhead
per block is that time minus the unsharded verifier's. One box plays every host, so the stages
share its cores with each other: this measures what the pipeline costs, never a speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

PROMPT = ("Copy exactly, word for word: The committee will meet on Tuesday at the main office "
          "to review the budget for the next year.")
LOOP = ("--interface", "127.0.0.1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--stages", default="1,2,3", help="stage counts (default 1,2,3)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (best kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--model", default=None,
                        help="the verifier's model (alias, folder or cached HF repo id; default "
                             "the embedded SmolLM2-135M), e.g. a larger one where the weights, "
                             "not the ~320 MB each process costs before any weight, dominate")


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _start(c, n: int, threads: str, model: str | None):
    from tools.local_cluster import free_port_pair

    common = ("--role", "verifier", "--threads", threads, *LOOP,
              *(("--model", model) if model else ()))
    if n == 1:
        # no prefix cache (a sharded verifier has none; runs repeat their prompts)
        v = c.start_node("whole", *common, "--prefix-cache-mb", "0", seed=True)
        return [v], v.node_id, [None]
    group = f"bench{n}"
    procs = [c.spawn(f"{group}-{i}", *common, "--shards", str(n), "--shard-group", group,
                     "--port", str(free_port_pair()), seed=True) for i in range(n)]
    formed = [p.wait_event(lambda e: e["event"] in ("shard_formed", "eof"), 300) for p in procs]
    if not all(f and f["event"] == "shard_formed" for f in formed):
        raise RuntimeError(f"shard group of {n} did not form: {procs[-1].tail_of_log()}")
    order = sorted(range(n), key=lambda i: formed[i]["rank"])
    leader = formed[order[0]]
    return [procs[i] for i in order], leader["node_id"], [formed[i]["param_mb"] for i in order]


def _measure(cc, verifier_id: str, proposer_id: str, max_tokens: int, repeats: int) -> dict:
    from nodes.cluster_client import GenerateRequest

    found = cc.wait_for(lambda ms: any(m.node_id == verifier_id for m in ms), 60)
    verifier = next(m for m in found if m.node_id == verifier_id)
    out = {}
    cc.generate(GenerateRequest(prompt="Hello", max_tokens=4, chat=False, speculate=False),
                verifier)  # warm-up
    for mode, kw in (("plain", dict(speculate=False)),
                     ("ngram", dict(proposers=[proposer_id], force_draft=True))):
        best = None
        for _ in range(repeats):
            r = cc.generate(GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, **kw),
                            verifier)
            if best is None or r.stats["tok_per_s"] > best.stats["tok_per_s"]:
                best = r
        s = best.stats
        out[mode] = {"tok_s": s["tok_per_s"], "blocks": s["blocks"],
                     "ms_per_block": round(1000 * s["elapsed_s"] / max(1, s["blocks"]), 1),
                     "acceptance": s.get("acceptance"), "token_ids": s["token_ids"]}
    return out


def run(args: argparse.Namespace) -> int:
    from nodes.cluster_client import ClusterClient
    from tools.local_cluster import LocalCluster

    counts = [int(x) for x in args.stages.split(",") if x.strip()]
    if not counts or any(not 1 <= n <= 8 for n in counts):
        print("specbus bench shard: --stages takes counts in 1..8", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-shard-"))
    rows = []
    print(f"logs: {log_dir}", file=sys.stderr)
    for n in counts:
        with LocalCluster(log_dir=log_dir / f"s{n}", mdns=False) as c:
            p = c.start_node("ngram", "--role", "proposer", "--drafter", "ngram", *LOOP)
            procs, leader_id, params = _start(c, n, str(args.threads), args.model)
            peers = tuple(x.stream for x in c.nodes if x.proc.poll() is None)
            with ClusterClient(c.cluster, interface="127.0.0.1", peers=peers, mdns=False) as cc:
                res = _measure(cc, leader_id, p.node_id, args.max_tokens, args.repeats)
            rss = [round(_rss_mb(x.proc.pid), 1) for x in procs]
        rows.append({"stages": n, "rss_mb": rss, "weights_mb": params, **res})
    base = rows[0] if rows and rows[0]["stages"] == 1 else None
    for r in rows:
        same = base is None or r["plain"]["token_ids"] == base["plain"]["token_ids"]
        over = (round(r["plain"]["ms_per_block"] - base["plain"]["ms_per_block"], 1)
                if base else None)
        r["overhead_ms_per_block"] = over
        r["same_tokens_as_unsharded"] = same
        ratio = (" (" + ", ".join(f"{m / base['rss_mb'][0]:.2f}x" for m in r["rss_mb"]) + ")"
                 if base else "")
        print(f"stages={r['stages']}  rss MB {r['rss_mb']}{ratio}  weights MB "
              f"{r['weights_mb']}  plain "
              f"{r['plain']['tok_s']:6.2f} tok/s {r['plain']['ms_per_block']:7.1f} ms/block  "
              f"ngram {r['ngram']['tok_s']:6.2f} tok/s (acc {r['ngram']['acceptance']})  "
              f"overhead {over} ms/block  same tokens {same}", flush=True)
    if args.json is not None:
        for r in rows:
            for mode in ("plain", "ngram"):
                r[mode].pop("token_ids", None)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
