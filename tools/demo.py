"""`specbus demo`: a local cluster doing real speculative decoding, plain vs speculative.

Starts separate node processes on loopback — one verifier on the embedded default model, one
`ngram` proposer (or those `--proposers` names), one gateway (OpenAI-compatible HTTP on an ephemeral
port) — lets them find each other (mDNS on 127.0.0.1), runs a fixed prompt set plain and
speculative through the cluster, checks the outputs are identical token for token, prints a
table, then makes one chat call through the gateway and prints it as a `curl` command line
with its answer, and shuts the cluster down cleanly.

This 2-core box plays two machines: the verifier is pinned to core 0 with one torch thread
(`--cpus 0 --threads 1`), the proposers and the gateway to core 1 (`--cpus 1`). The plain
baseline is that same verifier decoding on its own core, so the speedup is what borrowing a
second machine buys.

The verifier runs the product's default weights (`--weights auto`: the embedded model's
shipped Q4_1 file through the quantized forward, docs/engine/quantized.md), which the ready line
names. Its proposer is `ngram` (`--proposers ngram,int8` adds the int8 copy): next to a ~7 ms
quantized step the int8 copy (~7-10 ms a drafted token on the other core) is no longer cheap,
and with it here speculation ran below plain (0.93x / 0.76x median against 1.50x / 0.93x
without). Not the proposers' default `suffix`: the demo decodes each prompt plain and then
speculatively, and the plain run's answer, published by the verifier, would be drafted whole
by a suffix proposer the second time: a repeat's 4-5x, not what a new request gets
(`specbus bench decode --trace` measures repeats apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools.prompts import PROMPTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt")
    parser.add_argument("--proposers", default="ngram",
                        help="comma-separated drafters, one proposer process each")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep node logs here (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from nodes.cluster_client import ClusterClient, ClusterError
    from tools.local_cluster import ClusterStartError, LocalCluster

    if args.max_tokens <= 0:
        print("specbus demo: --max-tokens must be positive", file=sys.stderr)
        return 2
    drafters = [d.strip() for d in args.proposers.split(",") if d.strip()]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specbus-demo-"))
    say = _Say()
    verifier_core, proposer_core = _cores()
    with LocalCluster(log_dir=log_dir) as cluster:
        try:
            say(f"starting cluster {cluster.cluster!r} on 127.0.0.1 (logs: {log_dir})")
            # no prefix cache: plain and speculative runs send the same prompts, and the
            # later one would get its prompt's prefill for free
            v = cluster.start_node("verifier", "--role", "verifier", "--drafter", "none",
                                   "--cpus", verifier_core, "--threads", "1",
                                   "--prefix-cache-mb", "0")
            say(f"  verifier   {v.node_id}  ready (core {verifier_core}, 1 torch thread)")
            for d in drafters:
                p = cluster.start_node(f"proposer-{d}", "--role", "proposer", "--drafter", d,
                                       "--cpus", proposer_core, "--threads", "1")
                say(f"  proposer   {p.node_id}  ready ({d}, core {proposer_core})")
            gw = cluster.start_node("gateway", "--role", "gateway", "--http", "127.0.0.1:0",
                                    "--cpus", proposer_core)
            url = gw.ready["http"]
            say(f"  gateway    {gw.node_id}  ready ({url}/v1, core {proposer_core})")
        except ClusterStartError as exc:
            print(f"specbus demo: {exc}", file=sys.stderr)
            return 1
        with ClusterClient(cluster.cluster) as client:
            t0 = time.monotonic()
            members = client.wait_for(
                lambda ms: len([m for m in ms if m.card.is_worker]) >= 1 + len(drafters), 15.0)
            workers = [m for m in members if m.card.is_worker]
            say(f"discovered {len(workers)} workers over mDNS in {time.monotonic() - t0:.1f}s")
            for m in workers:
                if "verifier" in m.card.roles:
                    say(f"  the verifier computes with weights: {m.card.extras.get('weights')} "
                        "(its log says which file and blocks)")
            if len(workers) < 1 + len(drafters):
                print("specbus demo: not every node was discovered", file=sys.stderr)
                return 1
            names = {m.node_id: m.card.name for m in members}
            try:
                rows = _run_prompts(client, args.max_tokens, say, names)
            except ClusterError as exc:
                print(f"specbus demo: {exc}", file=sys.stderr)
                return 1
        try:
            curl = _curl_call(url)
        except (OSError, ValueError, KeyError) as exc:
            print(f"specbus demo: the gateway call failed: {exc}", file=sys.stderr)
            return 1
        snapshot = _monitor_snapshot(cluster.cluster)
    say("cluster stopped")
    print(render(rows))
    print(f"(two machines played by two cores: verifier on core {verifier_core} with 1 torch "
          f"thread, proposers on core {proposer_core}; plain = the same verifier alone)")
    print("\nmonitor snapshot (specbus monitor --once) taken before shutdown:\n" + snapshot)
    print("\nthe same cluster through the gateway's OpenAI-compatible API:\n" + curl)
    ok = all(r["identical"] for r in rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "identical": ok}, indent=2) + "\n")
    if not ok:
        print("specbus demo: speculative output differed from plain output", file=sys.stderr)
        return 1
    return 0


CURL_QUESTION = "What is the capital of France? Answer in one sentence."


def _curl_call(url: str, wait: float = 30.0) -> str:
    """One chat completion through the gateway (urllib), shown as the equivalent `curl`."""
    import shlex
    import urllib.request

    def get_json(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    end = time.monotonic() + wait
    models = get_json("/v1/models")["data"]
    while not models and time.monotonic() < end:  # the gateway finds the verifier itself
        time.sleep(0.2)
        models = get_json("/v1/models")["data"]
    if not models:
        raise ValueError(f"the gateway saw no verifier within {wait:g}s")
    body = {"model": models[0]["id"], "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": CURL_QUESTION}]}
    answer = get_json("/v1/chat/completions", body)
    text = answer["choices"][0]["message"]["content"]
    usage = answer.get("usage", {})
    command = (f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
               f"-d {shlex.quote(json.dumps(body))}")
    return (f"$ {command}\n-> {text!r}\n   ({usage.get('completion_tokens', '?')} tokens, "
            f"finish_reason {answer['choices'][0].get('finish_reason')!r})")


def _cores() -> tuple[str, str]:
    """Verifier and proposer cores: two machines played by two cores (one core: shared)."""
    import os

    have = sorted(os.sched_getaffinity(0))
    return str(have[0]), str(have[1] if len(have) > 1 else have[0])


def _run_prompts(client, max_tokens: int, say, names: dict[str, str]) -> list[dict]:
    from nodes.cluster_client import GenerateRequest

    verifier = client.verifiers()[0]
    rows = []
    for i, (klass, prompt) in enumerate(PROMPTS):
        name = f"{klass.split('-')[0]}-{i + 1}"
        base = dict(prompt=prompt, max_tokens=max_tokens)
        plain = client.generate(GenerateRequest(**base, speculate=False), verifier)
        spec = client.generate(GenerateRequest(**base), verifier)
        p, s = plain.stats, spec.stats
        row = {
            "prompt": name, "class": klass,
            "tokens": len(s["token_ids"]),
            "plain_tok_s": p["tok_per_s"], "spec_tok_s": s["tok_per_s"],
            "speedup": round(s["tok_per_s"] / p["tok_per_s"], 3) if p["tok_per_s"] else 0.0,
            "acceptance": s["acceptance"], "mean_accepted_len": s["mean_accepted_len"],
            "identical": p["token_ids"] == s["token_ids"],
            "proposers": {names.get(k, k): v for k, v in s.get("proposers", {}).items()},
        }
        rows.append(row)
        say(f"  {name:14} plain {row['plain_tok_s']:6.1f} tok/s   speculative "
            f"{row['spec_tok_s']:6.1f} tok/s   x{row['speedup']:.2f}   "
            f"{'identical' if row['identical'] else 'DIFFERENT'}")
    return rows


def render(rows: list[dict]) -> str:
    head = (f"{'prompt':14} {'class':15} {'plain tok/s':>11} {'spec tok/s':>10} "
            f"{'speedup':>8} {'accept':>7} {'mean acc':>8} {'same':>5}")
    lines = ["", "specbus demo: plain vs speculative through the cluster", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['prompt']:14} {r['class']:15} {r['plain_tok_s']:>11.1f} {r['spec_tok_s']:>10.1f} "
            f"{r['speedup']:>7.2f}x {r['acceptance']:>7.2f} {r['mean_accepted_len']:>8.2f} "
            f"{'yes' if r['identical'] else 'NO':>5}")
    for klass in sorted({r["class"] for r in rows}):
        med = statistics.median(r["speedup"] for r in rows if r["class"] == klass)
        lines.append(f"median speedup, {klass}: x{med:.2f}")
    lines += ["", "per proposer (all prompts):",
              f"{'proposer':18} {'drafts':>7} {'drafted':>8} {'accepted':>9} {'accept':>7} "
              f"{'timeouts':>8} {'rtt ms':>7}"]
    totals: dict[str, dict] = {}
    for r in rows:
        for name, st in r["proposers"].items():
            t = totals.setdefault(name, {"drafts": 0, "drafted": 0, "accepted": 0,
                                         "verified": 0, "timeouts": 0, "rtt": []})
            for k in ("drafts", "drafted", "accepted", "verified", "timeouts"):
                t[k] += st[k]
            if st.get("rtt_ms") is not None:  # None: never timed (a quiet proposer's)
                t["rtt"].append(st["rtt_ms"])
    for name, t in totals.items():
        acc = t["accepted"] / t["verified"] if t["verified"] else 0.0
        lines.append(f"{name:18} {t['drafts']:>7} {t['drafted']:>8} {t['accepted']:>9} "
                     f"{acc:>7.2f} {t['timeouts']:>8} {_median_ms(t['rtt']):>7}")
    return "\n".join(lines)


def _median_ms(values: list[float]) -> str:
    """The median round trip, or '-' where none was timed."""
    return f"{statistics.median(values):.2f}" if values else "-"


def _monitor_snapshot(cluster: str, wait: float = 2.5) -> str:
    """What `specbus monitor --once` shows of the running cluster."""
    from tools.monitor import Attached
    from tools.monitor_view import render_text

    args = argparse.Namespace(cluster=cluster, interface="127.0.0.1", peer=[], no_mdns=False)
    att = Attached(args).start()
    try:
        time.sleep(wait)
        att.refresh()
        return render_text(att.view)
    finally:
        att.stop()


class _Say:
    def __call__(self, text: str) -> None:
        print(text, flush=True)
