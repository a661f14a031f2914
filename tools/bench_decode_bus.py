"""`specbus bench decode` (without `--local`): decoding over the bus vs in-process, one run.

A local cluster of real processes, this 2-core box played as two machines: verifiers pinned
to core 0 with one torch thread, proposers pinned to core 1. A verifier with an in-process
`ngram` drafter, a verifier with an in-process `int8` drafter, an `ngram` proposer, an `int8`
proposer, and `ngram` proposers reached only through a userspace delay proxy adding 5, 20 and
50 ms of round trip (this kernel has no netem: see `tools/delay_proxy.py`; each such proposer
advertises the proxy's address with `--advertise`). Every configuration runs on the same prompts
through the same verifier processes, interleaved prompt by prompt; speedups are over that
verifier's own plain decoding of the same prompt on its core.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

DELAYS_MS = (0, 5, 20, 50)
VERIFIER_CORE = ("--cpus", "0", "--threads", "1")
PROPOSER_CORE = ("--cpus", "1")


def free_port_pair() -> int:
    """A port P with P + 1 free too (a node's request port and its gossip port)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def run_bus(args, prompts: list[tuple[str, str]]) -> int:
    from nodes.cluster_client import ClusterClient, GenerateRequest
    from tools.delay_proxy import Delay, DelayProxy
    from tools.local_cluster import LocalCluster

    n = 48 if args.quick else args.max_tokens
    if args.quick:
        prompts = [prompts[0], prompts[2], prompts[-2]]
    log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-decode-"))
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False))
        print(f"starting cluster (logs: {log_dir}); verifiers on core 0 (1 torch thread), "
              "proposers on core 1", file=sys.stderr)
        c.start_node("v-ngram", "--role", "verifier", "--drafter", "ngram", *VERIFIER_CORE)
        c.start_node("v-int8", "--role", "verifier", "--drafter", "int8", *VERIFIER_CORE,
                     seed=True)
        pn = c.start_node("p-ngram", "--role", "proposer", "--drafter", "ngram",
                          *PROPOSER_CORE, seed=True)
        pi = c.start_node("p-int8", "--role", "proposer", "--drafter", "int8", *PROPOSER_CORE,
                          seed=True)
        delayed = {0: pn}
        for d in DELAYS_MS[1:]:
            port = free_port_pair()
            proxy = stack.enter_context(DelayProxy(("127.0.0.1", port), Delay(d / 2000.0)))
            delayed[d] = c.start_node(f"p-ngram-{d}ms", "--role", "proposer", *PROPOSER_CORE,
                                      "--port", str(port), "--advertise", proxy.address,
                                      seed=True)
        with ClusterClient(c.cluster, peers=tuple(x.stream for x in c.nodes), mdns=False) as cc:
            cc.wait_for(lambda ms: len([m for m in ms if m.card.is_worker]) >= len(c.nodes), 30)
            by_name = {m.card.name: m for m in cc.verifiers()}
            configs = [
                # (row name, verifier, generate_req overrides)
                ("bus-plain", "v-ngram", dict(speculate=False)),
                ("inproc-ngram", "v-ngram", dict(proposers=[])),
                ("bus-ngram", "v-ngram", dict(proposers=[pn.node_id])),
                ("bus-plain-int8v", "v-int8", dict(speculate=False)),
                ("inproc-int8", "v-int8", dict(proposers=[])),
                ("bus-int8", "v-int8", dict(proposers=[pi.node_id])),
                *[(f"bus-ngram+{d}ms", "v-ngram", dict(proposers=[delayed[d].node_id]))
                  for d in DELAYS_MS[1:]],
            ]
            # warm-up: learn costs, open connections
            for _, vname, over in configs:
                cc.generate(GenerateRequest(prompts[0][1][:200], max_tokens=8, **over),
                            by_name[vname])
            results: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
            for i, (klass, text) in enumerate(prompts):
                print(f"prompt {i + 1}/{len(prompts)} ({klass})", file=sys.stderr)
                for name, vname, over in configs:
                    r = cc.generate(GenerateRequest(text, max_tokens=n, **over), by_name[vname])
                    results[name].append({"class": klass, **r.stats})
    rows = _rows(results)
    _print(rows, n)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "max_tokens": n}, indent=2) + "\n")
    return 0


def _rows(results: dict[str, list[dict]]) -> list[dict]:
    base = {"v-ngram": results["bus-plain"], "v-int8": results["bus-plain-int8v"]}
    rows = []
    for name, runs in results.items():
        plain = base["v-int8"] if "int8" in name else base["v-ngram"]
        for klass in sorted({r["class"] for r in runs}):
            idx = [i for i, r in enumerate(runs) if r["class"] == klass]
            speed = [runs[i]["tok_per_s"] / plain[i]["tok_per_s"] for i in idx
                     if plain[i]["tok_per_s"]]
            rows.append({
                "name": name, "backend": "torch", "prompt_class": klass,
                "tok_per_s": round(statistics.median(runs[i]["tok_per_s"] for i in idx), 2),
                "speedup": round(statistics.median(speed), 3) if speed else None,
                "min_speedup": round(min(speed), 3) if speed else None,
                "acceptance": round(statistics.median(runs[i]["acceptance"] for i in idx), 3),
                "mean_accepted_len": round(
                    statistics.median(runs[i]["mean_accepted_len"] for i in idx), 2),
                "identical_to_plain": all(runs[i]["token_ids"] == plain[i]["token_ids"]
                                          for i in idx),
            })
    return rows


def _print(rows: list[dict], n: int) -> None:
    print(f"decode over the bus: up to {n} new tokens, medians over prompts; speedup vs the "
          "same verifier decoding plainly on the same prompt")
    print(f"{'name':18s} {'class':15s} {'tok/s':>7s} {'speedup':>8s} {'min':>6s} "
          f"{'accept':>7s} {'mean acc':>8s} {'identical':>9s}")
    for r in rows:
        print(f"{r['name']:18s} {r['prompt_class']:15s} {r['tok_per_s']:7.1f} "
              f"{r['speedup'] or 0:8.2f} {r['min_speedup'] or 0:6.2f} {r['acceptance']:7.2f} "
              f"{r['mean_accepted_len']:8.2f} {str(r['identical_to_plain']):>9s}")
