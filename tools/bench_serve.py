"""`specbus bench serve`: time to first token and tok/s through the gateway vs the bus client.

A local cluster of real processes (1 or 2 SmolLM2 verifiers, one gateway). The same completion
requests run at each concurrency, first straight through the cluster client (round-robin over
the verifiers), then through the gateway's HTTP API (streaming); TTFT is the time from sending
to the first token (bus: first `token_chunk`; HTTP: first chunk with text), tok/s is all
generated tokens over the wall time of the batch. Greedy, no proposers: the figures measure the
serving path, not speculation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# completion prompts that do not end at once (a first token that is EOS has no text to time)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "Here is a list of the fifty states of the United States: Alabama,",
           "The three most important inventions of the twentieth century are"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--verifiers", type=int, default=1, choices=(1, 2))
    parser.add_argument("--concurrency", default="1,4",
                        help="comma-separated concurrency levels (default 1,4)")
    parser.add_argument("--requests", type=int, default=8, help="requests per level (default 8)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per verifier")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _via_bus(cc, verifiers, i: int, max_tokens: int) -> tuple[float, int]:
    from nodes.cluster_client import GenerateRequest

    req = GenerateRequest(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, chat=False)
    t0 = time.perf_counter()
    ttft, n = None, 0
    for msg in cc.stream(req, verifiers[i % len(verifiers)]):
        if msg.type == "token_chunk":
            n += len(msg.tensors[0])
            if ttft is None:
                ttft = time.perf_counter() - t0
    return ttft, n


def _via_http(url: str, i: int, max_tokens: int) -> tuple[float, int]:
    import http.client
    import urllib.parse

    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = {"model": "smollm2-135m", "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, n = None, 0
    if resp.status != 200:
        conn.close()
        return None, 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            break
        if ttft is None and obj.get("choices") and obj["choices"][0].get("text"):
            ttft = time.perf_counter() - t0
        if obj.get("usage"):
            n = obj["usage"]["completion_tokens"]
    conn.close()
    return ttft, n


def _level(fn, conc: int, requests: int, gateway_pid: int) -> dict:
    import psutil

    gw = psutil.Process(gateway_pid)
    cpu0 = sum(gw.cpu_times()[:2])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        out = list(pool.map(fn, range(requests)))
    wall = time.perf_counter() - t0
    gateway_cpu = sum(gw.cpu_times()[:2]) - cpu0
    ttfts = [t * 1000 for t, n in out if t is not None and n > 0]
    return {"ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(_pct(ttfts, 0.99), 1) if ttfts else None,
            "tok_s": round(sum(n for _, n in out) / wall, 2), "requests": requests,
            "failed": requests - len(ttfts), "tokens": [n for _, n in out],
            "gateway_cpu_s": round(gateway_cpu, 3)}


def run(args: argparse.Namespace) -> int:
    from nodes.cluster_client import ClusterClient
    from tools.local_cluster import LocalCluster

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-serve-"))
    rows = []
    with LocalCluster(log_dir=log_dir, mdns=False) as c:
        print(f"starting cluster (logs: {log_dir})", file=sys.stderr)
        for k in range(args.verifiers):
            c.start_node(f"v{k + 1}", "--role", "verifier", "--threads", str(args.threads),
                         seed=bool(k))
        gw = c.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0", seed=True)
        url = gw.ready["http"]
        with ClusterClient(c.cluster, peers=tuple(n.stream for n in c.nodes), mdns=False) as cc:
            cc.wait_for(lambda ms: sum("verifier" in m.card.roles for m in ms)
                        >= args.verifiers, 30)
            verifiers = cc.verifiers()
            for i in range(2 * args.verifiers):  # warm-up: connections, tokenizer, caches
                _via_bus(cc, verifiers, i, 4)
                _via_http(url, i, 4)
            for conc in levels:
                for path, fn in (
                        ("bus", lambda i: _via_bus(cc, verifiers, i, args.max_tokens)),
                        ("gateway", lambda i: _via_http(url, i, args.max_tokens))):
                    row = {"path": path, "concurrency": conc, "verifiers": args.verifiers,
                           **_level(fn, conc, args.requests, gw.proc.pid)}
                    rows.append(row)
                    print(f"{path:8} c={conc:<3} verifiers={args.verifiers} "
                          f"ttft p50 {row['ttft_p50_ms']:7.1f} ms  p99 {row['ttft_p99_ms']:7.1f}"
                          f" ms  {row['tok_s']:6.2f} tok/s  failed {row['failed']}  gateway "
                          f"cpu {row['gateway_cpu_s']:.2f} s", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
