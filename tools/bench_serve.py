"""`specbus bench serve`: time to first token and tok/s through the gateway vs the bus client.

A local cluster of real processes (1 or 2 SmolLM2 verifiers, one gateway); with several
`--drafter` values, one such cluster per drafter, all started first, every level run on each
in turn (`--rounds` times, the order rotated), and each drafter's tok/s over the first's given
per round with the median and the worst: ratios measured in one run, interleaved, not across
separate runs (which differ by about 5 % on a 2-core machine). The same completion
requests run at each concurrency, first straight through the cluster client (round-robin over
the verifiers), then through the gateway's HTTP API (streaming); TTFT is the time from sending
to the first token (bus: first `token_chunk`; HTTP: first chunk with text), tok/s is all
generated tokens over the wall time of the batch. Greedy, no proposers; `--drafter ngram` gives
the verifiers their own drafter (speculative rows), `--max-batch 1,8` compares one generation
at a time with batches of 8. `--prompts mixed` sends the decode benchmark's chat prompts
(tools/prompts.py: four input-grounded, two open-ended, in turn) through the chat endpoints
instead of the short completion prompts, where speculation has something to draft from.
`--prefill-chunk 0,256` runs each drafter's cluster with each verifier `--prefill-chunk`,
interleaved like drafters (the clusters are named `none`, `none/pc256`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
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
PROMPT_SETS = ("completion", "mixed", "grounded", "open")


def _prompts(kind: str) -> list[tuple[str, bool]]:
    """(text, chat) per request, taken in turn."""
    from tools.prompts import INPUT_GROUNDED, OPEN_ENDED
    from tools.prompts import PROMPTS as CHAT

    if kind == "completion":
        return [(p, False) for p in PROMPTS]
    keep = {"mixed": (INPUT_GROUNDED, OPEN_ENDED), "grounded": (INPUT_GROUNDED,),
            "open": (OPEN_ENDED,)}[kind]
    return [(text, True) for cls, text in CHAT if cls in keep]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--verifiers", default="1,2",
                        help="comma-separated verifier counts, one cluster each (default 1,2)")
    parser.add_argument("--concurrency", default="1,4,16",
                        help="comma-separated concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=8,
                        help="requests per level, at least the concurrency (default 8)")
    parser.add_argument("--max-batch", default="8",
                        help="comma-separated verifier --max-batch values, one cluster each "
                             "(default 8, the node's default; 1: one generation at a time)")
    parser.add_argument("--drafter", default="none",
                        help="the verifiers' own drafter (e.g. ngram: speculative rows; "
                             "default none: plain decoding); comma-separated values start one "
                             "cluster each, all at once, and run every level on each in turn "
                             "(interleaved: `none,eagle` gives eagle / none per round)")
    parser.add_argument("--prefix-cache-mb", type=int, default=0, metavar="MB",
                        help="the verifiers' --prefix-cache-mb (default 0: off; this benchmark "
                             "sends the same prompts again and again, so with a prefix cache "
                             "every request after the first would skip its prefill: "
                             "`specbus bench prefix` measures the cache on conversations)")
    parser.add_argument("--prefill-chunk", default="0",
                        help="comma-separated verifier --prefill-chunk values (default 0: whole "
                             "prompts); several start one cluster each per drafter, interleaved "
                             "like drafters (named DRAFTER/pcN)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each level runs on each cluster, the clusters' order "
                             "rotated each round (default 1)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", choices=PROMPT_SETS, default="completion",
                        help="completion: short completion prompts (default); mixed / grounded "
                             "/ open: the decode benchmark's chat prompts of those classes")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 verifier, concurrency 1 and 4, 4 requests of 8 "
                             "tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _via_bus(cc, verifiers, i: int, max_tokens: int,
             prompts: list[tuple[str, bool]]) -> tuple[float, int]:
    from nodes.cluster_client import ClusterError, GenerateRequest

    text, chat = prompts[i % len(prompts)]
    req = GenerateRequest(text, max_tokens=max_tokens, chat=chat)
    t0 = time.perf_counter()
    ttft, n = None, 0
    try:
        for msg in cc.stream(req, verifiers[i % len(verifiers)]):
            if msg.type == "token_chunk":
                n += len(msg.tensors[0])
                if ttft is None:
                    ttft = time.perf_counter() - t0
    except ClusterError as exc:  # counted as failed (e.g. the verifier's queue was full)
        print(f"bus request {i} failed: {exc}", file=sys.stderr)
        return None, 0
    return ttft, n


def _via_http(url: str, i: int, max_tokens: int,
              prompts: list[tuple[str, bool]]) -> tuple[float, int]:
    import http.client
    import urllib.parse

    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    text, chat = prompts[i % len(prompts)]
    body = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions",
                 body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
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
        choice = obj["choices"][0] if obj.get("choices") else {}
        if ttft is None and (choice.get("text") or choice.get("delta", {}).get("content")):
            ttft = time.perf_counter() - t0
        if obj.get("usage"):
            n = obj["usage"]["completion_tokens"]
    conn.close()
    return ttft, n


def _level(fn, conc: int, requests: int, gateway_pid: int) -> dict:
    import psutil

    gw = psutil.Process(gateway_pid)
    cpu0 = sum(gw.cpu_times()[:2])

    def timed(i: int) -> tuple[float | None, int, float]:
        start = time.perf_counter()
        ttft, n = fn(i)
        return ttft, n, time.perf_counter() - start

    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        out = list(pool.map(timed, range(requests)))
    wall = time.perf_counter() - t0
    gateway_cpu = sum(gw.cpu_times()[:2]) - cpu0
    ttfts = [t * 1000 for t, n, _ in out if t is not None and n > 0]
    per_request = [n / el for t, n, el in out if t is not None and n > 0 and el > 0]
    return {"ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(_pct(ttfts, 0.99), 1) if ttfts else None,
            "tok_s": round(sum(n for _, n, _ in out) / wall, 2), "requests": requests,
            "request_tok_s_p50": round(statistics.median(per_request), 2) if per_request
            else None,
            "failed": requests - len(ttfts), "tokens": [n for _, n, _ in out],
            "gateway_cpu_s": round(gateway_cpu, 3)}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.verifiers, args.concurrency, args.requests, args.max_tokens = "1", "1,4", 4, 8
    try:
        counts = [int(x) for x in args.verifiers.split(",") if x.strip()]
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        batches = [int(x) for x in args.max_batch.split(",") if x.strip()]
        chunks = [int(x) for x in args.prefill_chunk.split(",") if x.strip()]
    except ValueError:
        print("specbus bench serve: --verifiers, --concurrency, --max-batch and "
              "--prefill-chunk take integers", file=sys.stderr)
        return 2
    if args.prefix_cache_mb < 0:
        print("specbus bench serve: --prefix-cache-mb takes an integer >= 0", file=sys.stderr)
        return 2
    if not chunks or min(chunks) < 0 or len(set(chunks)) != len(chunks):
        print("specbus bench serve: --prefill-chunk takes distinct integers >= 0",
              file=sys.stderr)
        return 2
    if (not counts or not levels or not batches or min(counts + levels + batches) < 1
            or max(counts) > 8
            or max(levels) > 64 or not 1 <= args.max_tokens <= 512 or args.requests < 1):
        print("specbus bench serve: verifiers 1..8, concurrency 1..64, max tokens 1..512, "
              "requests >= 1", file=sys.stderr)
        return 2
    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    if not drafters or len(set(drafters)) != len(drafters) or not 1 <= args.rounds <= 20:
        print("specbus bench serve: --drafter takes distinct names; --rounds 1..20",
              file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    variants = [(d, pc) for pc in chunks for d in drafters]
    rows = []
    for n in counts:
        for batch in batches:
            rows += _bench_interleaved(n, batch, variants, levels, args, cores)
    summary = _summary(rows, [variant_name(d, pc) for d, pc in variants])
    print(render(rows, summary, cores))
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": len(cores), "args": {
            "verifiers": counts, "concurrency": levels, "requests": args.requests,
            "max_tokens": args.max_tokens, "max_batch": batches, "drafters": drafters,
            "prefill_chunk": chunks,
            "rounds": args.rounds, "prompts": args.prompts}, "rows": rows,
            "summary": summary}, indent=2) + "\n")
    return 0


def variant_name(drafter: str, prefill_chunk: int) -> str:
    """A cluster's name in rows and ratios: its drafter, and its prefill chunk when set."""
    return drafter if not prefill_chunk else f"{drafter}/pc{prefill_chunk}"


def _bench_interleaved(n: int, batch: int, variants: list[tuple[str, int]], levels: list[int],
                       args: argparse.Namespace, cores: list[int]) -> list[dict]:
    """One cluster per variant (drafter, prefill chunk), all started before the first level;
    each level then runs on every cluster in turn, `--rounds` times, the order rotated each
    round, so a ratio between variants compares runs taken minutes apart at most, not whole
    benchmark runs apart (which differ by ~5 % here). The clusters' verifiers share their
    cores; only one serves at a time."""
    from contextlib import ExitStack

    rows = []
    with ExitStack() as stack:
        clusters = [stack.enter_context(_Cluster(n, batch, d, args, cores, max(levels), pc))
                    for d, pc in variants]
        for conc in levels:
            for r in range(args.rounds):
                for cluster in clusters[r % len(clusters):] + clusters[:r % len(clusters)]:
                    rows += cluster.level(conc, r)
    return rows


class _Cluster:
    """A cluster of `n` verifiers (verifier k pinned to core k, 1 torch thread each, stepping
    up to `max_batch` generations together, drafting with `drafter`) and a gateway on the last
    core, warmed up; `level` runs one concurrency level through the bus client, then through
    the gateway."""

    def __init__(self, n: int, max_batch: int, drafter: str, args: argparse.Namespace,
                 cores: list[int], top_level: int, prefill_chunk: int = 0) -> None:
        self.n, self.max_batch, self.drafter, self.args = n, max_batch, drafter, args
        self.prefill_chunk = prefill_chunk
        self.name = variant_name(drafter, prefill_chunk)
        self.cores, self.top_level = cores, top_level
        self.prompts = _prompts(args.prompts)

    def __enter__(self) -> _Cluster:
        from contextlib import ExitStack

        from nodes.cluster_client import ClusterClient
        from tools.local_cluster import LocalCluster

        n, cores = self.n, self.cores
        log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-serve-"))
        with ExitStack() as stack:
            c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False))
            print(f"starting {n} verifier(s) drafting with {self.drafter} (prefill chunk "
                  f"{self.prefill_chunk}) and a gateway (logs: {log_dir})", file=sys.stderr)
            for k in range(n):
                c.start_node(f"v{k + 1}", "--role", "verifier", "--threads", "1",
                             "--cpus", str(cores[k % len(cores)]), "--max-batch",
                             str(self.max_batch), "--drafter", self.drafter,
                             "--prefill-chunk", str(self.prefill_chunk),
                             "--prefix-cache-mb", str(self.args.prefix_cache_mb), seed=bool(k))
            # the gateway must not answer 429 at the top level
            self.gw = c.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0", "--cpus",
                                   str(cores[-1]), "--gateway-max-inflight",
                                   str(self.top_level), seed=True)
            self.url = self.gw.ready["http"]
            self.cc = stack.enter_context(ClusterClient(
                c.cluster, peers=tuple(x.stream for x in c.nodes), mdns=False))
            self.cc.wait_for(lambda ms: sum("verifier" in m.card.roles for m in ms) >= n, 60)
            self.verifiers = self.cc.verifiers()
            _wait_gateway(self.url, n)
            for i in range(2 * n):  # warm-up: connections, tokenizer, caches
                _via_bus(self.cc, self.verifiers, i, 4, self.prompts)
                _via_http(self.url, i, 4, self.prompts)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def level(self, conc: int, round_: int = 0) -> list[dict]:
        args = self.args
        requests = max(args.requests, conc)
        rows = []
        for path, fn in (
                ("bus", lambda i: _via_bus(self.cc, self.verifiers, i, args.max_tokens,
                                           self.prompts)),
                ("gateway", lambda i: _via_http(self.url, i, args.max_tokens, self.prompts))):
            row = {"path": path, "concurrency": conc, "verifiers": self.n,
                   "max_batch": self.max_batch, "drafter": self.name,
                   "prefill_chunk": self.prefill_chunk, "round": round_,
                   "prompts": args.prompts, **_level(fn, conc, requests, self.gw.proc.pid)}
            rows.append(row)
            print(f"{path:8} c={conc:<3} verifiers={self.n} batch={self.max_batch} "
                  f"drafter={self.name} round={round_} ttft p50 "
                  f"{_ms(row['ttft_p50_ms'])} ms  p99 {_ms(row['ttft_p99_ms'])} ms  "
                  f"{row['tok_s']:6.2f} tok/s  failed {row['failed']}", file=sys.stderr,
                  flush=True)
        return rows


def _wait_gateway(url: str, n: int, timeout: float = 60.0) -> None:
    """Until the gateway lists `n` verifiers of the model."""
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            data = json.loads(resp.read())["data"]
        if data and len(data[0]["specbus"]["verifiers"]) >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not see {n} verifier(s) within {timeout:g}s")


def _ms(v: float | None) -> str:
    return f"{v:7.1f}" if v is not None else "      -"


def _row(rows: list[dict], path: str, conc: int, n: int, batch: int | None = None,
         drafter: str | None = None) -> dict | None:
    """The first round's row (of the first cluster's drafter and batch size unless given)."""
    if not rows:
        return None
    drafter = drafter if drafter is not None else rows[0].get("drafter")
    batch = batch if batch is not None else rows[0].get("max_batch", 1)
    return next((r for r in rows if (r["path"], r["concurrency"], r["verifiers"],
                                     r.get("max_batch", 1), r.get("drafter"))
                 == (path, conc, n, batch, drafter)), None)


def drafter_ratios(rows: list[dict], drafters: list[str]) -> dict:
    """Each later drafter's aggregate tok/s over the first's, per round (taken back to back),
    with their median and worst: {drafter: {"path c=N v=.. b=..": {...}}}."""
    out: dict = {}
    base = drafters[0]
    for other in drafters[1:]:
        table: dict = {}
        for r in rows:
            if r.get("drafter") != other:
                continue
            same = next((b for b in rows if b.get("drafter") == base and all(
                b.get(k) == r.get(k) for k in ("path", "concurrency", "verifiers", "max_batch",
                                                "round"))), None)
            if same is None or not same["tok_s"]:
                continue
            key = (f"{r['path']} c={r['concurrency']} v={r['verifiers']} "
                   f"b={r.get('max_batch', 1)}")
            table.setdefault(key, []).append(round(r["tok_s"] / same["tok_s"], 3))
        out[other] = {key: {"ratios": xs, "median": round(statistics.median(xs), 3),
                            "worst": min(xs)} for key, xs in table.items()}
    return out


def _summary(rows: list[dict], drafters: list[str] | None = None) -> dict:
    """The issue's targets, from the rows that exist."""
    out: dict = {}
    if drafters and len(drafters) > 1:
        out["vs_" + drafters[0]] = drafter_ratios(rows, drafters)
    bus, gw = _row(rows, "bus", 1, 1), _row(rows, "gateway", 1, 1)
    if bus and gw and bus["ttft_p50_ms"] is not None and gw["ttft_p50_ms"] is not None:
        out["gateway_ttft_p50_added_ms"] = round(gw["ttft_p50_ms"] - bus["ttft_p50_ms"], 1)
        out["gateway_tok_s_change_pct"] = round(100 * (gw["tok_s"] / bus["tok_s"] - 1), 1)
    for path in ("bus", "gateway"):
        one, two = _row(rows, path, 4, 1), _row(rows, path, 4, 2)
        if one and two and one["tok_s"]:
            out[f"scaling_2v_c4_{path}"] = round(two["tok_s"] / one["tok_s"], 2)
        top = max((r.get("max_batch", 1) for r in rows), default=1)
        one, many = _row(rows, path, 8, 1, 1), _row(rows, path, 8, 1, top)
        if top > 1 and one and many and one["tok_s"]:  # issue 24: batched plain vs one at a time
            out[f"batched_c8_{path}"] = round(many["tok_s"] / one["tok_s"], 2)
    return out


TARGETS = {"gateway_ttft_p50_added_ms": ("<= 5 ms", lambda v: v <= 5),
           "gateway_tok_s_change_pct": (">= -2 %", lambda v: v >= -2),
           "scaling_2v_c4_bus": (">= 1.8x", lambda v: v >= 1.8),
           "scaling_2v_c4_gateway": (">= 1.8x", lambda v: v >= 1.8),
           "batched_c8_bus": (">= 2.5x", lambda v: v >= 2.5),
           "batched_c8_gateway": (">= 2.5x", lambda v: v >= 2.5)}


def render(rows: list[dict], summary: dict, cores: list[int]) -> str:
    head = (f"{'drafter':>10} {'rnd':>3} {'verifiers':>9} {'batch':>5} {'path':8} {'conc':>4} "
            f"{'reqs':>4} "
            f"{'ttft p50 ms':>11} "
            f"{'ttft p99 ms':>11} {'tok/s':>7} {'req tok/s':>9} {'failed':>6} {'gw cpu s':>8}")
    lines = ["", "specbus bench serve: time to first token and aggregate tok/s", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{str(r.get('drafter', '-'))[:10]:>10} {r.get('round', 0):>3} "
                     f"{r['verifiers']:>9} {r.get('max_batch', 1):>5} {r['path']:8} "
                     f"{r['concurrency']:>4} "
                     f"{r['requests']:>4} {_ms(r['ttft_p50_ms']):>11} {_ms(r['ttft_p99_ms']):>11}"
                     f" {r['tok_s']:>7.2f} {r.get('request_tok_s_p50') or 0:>9.2f}"
                     f" {r['failed']:>6} {r['gateway_cpu_s']:>8.2f}")
    for key, per in summary.items():
        if not key.startswith("vs_"):
            continue
        for other, table in per.items():
            lines += ["", f"{other} over {key[3:]}, aggregate tok/s, per round (interleaved):"]
            for level, got in table.items():
                lines.append(f"  {level:28} {' '.join(f'{x:.2f}' for x in got['ratios']):24} "
                             f"median {got['median']:.2f}  worst {got['worst']:.2f}")
    lines += ["", "targets (issues 10, 24):"]
    for key, (want, ok) in TARGETS.items():
        if key in summary:
            lines.append(f"  {key:28} {summary[key]:>7}   target {want:9} "
                         f"{'met' if ok(summary[key]) else 'NOT met'}")
    lines.append(f"(this machine: {len(cores)} core(s) {cores}; verifier k pinned to core k with "
                 "1 torch thread, the gateway on the last core, the benchmark's own client "
                 "unpinned; with 2 cores the gateway and the client share the verifiers' cores)")
    return "\n".join(lines)
