"""`specbus bench prefix`: time to first token of a conversation's later turns, with the
verifier's prefix cache and without it.

Two local clusters of `--verifiers` SmolLM2 verifiers each (verifier k pinned to core k with
one torch thread; the two clusters' verifiers share those cores, only one cluster serves at a
time), the client on the last core: one cluster with the default prefix cache, one with
`--prefix-cache-mb 0`. The same conversations run on both: each turn sends the whole
conversation so far as chat messages, as OpenAI-style clients do, and appends the answer.
With `--concurrency 1` the clusters alternate request by request; with C > 1, C conversations
run at once (each its turns in order, the cluster client choosing verifiers: with several,
a turn goes back to the verifier holding its conversation, load allowing), a group of C on
one cluster then on the other, the order alternating by group. The conversations start from
the decode benchmark's chat prompts (tools/prompts.py) and go on with fixed follow-up questions
written for this benchmark. Greedy: every answer must be the same on both clusters (checked,
counted in `mismatches`). Reports per turn the prompt tokens, TTFT and tok/s with and without
the cache, their ratio (median and worst over conversations), and the cached positions the
verifier reported.

`--burst N` measures the other shape of repeated work instead: N requests that share one long
system prompt (an agent's instructions and tool schema, written for this benchmark, ~390
tokens) with different questions, sent at once, `--rounds` times on each cluster in turn. On
the first burst nothing is kept yet: the verifier computes the shared prompt once and the
others wait a step to copy it (docs/engine.md, "Prefix reuse"); later bursts find it kept.
Reports TTFT p50 / p99 and the burst's wall time per round, on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

AGENT_SYSTEM = """You are the operations assistant of a small online bookshop. You answer staff
questions by calling tools, one call per message, and you reply with a single JSON object and
nothing else. Never invent order numbers, prices or stock levels: look them up.

Tools:
- find_book(query: string, limit: integer = 5): search the catalogue by title, author or ISBN.
  Returns a list of {isbn, title, author, price_eur, stock}.
- get_order(order_id: string): one order with its lines, status (pending, paid, shipped,
  delivered, returned), customer id and shipping address.
- list_orders(customer_id: string, status: string | null, since: date | null): a customer's
  orders, newest first.
- update_stock(isbn: string, delta: integer, reason: string): add or remove copies; reason is
  one of restock, damage, correction, return.
- refund(order_id: string, amount_eur: number, reason: string): refund part or all of an order;
  refunds over 100 EUR need a manager and must be flagged with "needs_approval": true.
- send_email(customer_id: string, subject: string, body: string): email a customer; keep the
  body under 120 words and sign it "The Bookshop team".

Reply format: {"tool": NAME, "arguments": {...}, "why": ONE SHORT SENTENCE}. When no tool
fits, reply {"tool": null, "answer": TEXT}. Dates are ISO 8601 (2026-11-25). Amounts are
euros with two decimals. Customer ids look like C-10492, order ids like O-2026-000381, and an
ISBN has 13 digits. If a request is ambiguous, ask one question with {"tool": null}."""

AGENT_QUESTIONS = (
    "Do we still have copies of Dune by Frank Herbert?",
    "Customer C-10492 says order O-2026-000381 never arrived. What is its status?",
    "Add 12 copies of ISBN 9780141439518 to stock, we restocked this morning.",
    "Refund 18.50 EUR on order O-2026-000217, one book arrived damaged.",
    "Which orders did customer C-20117 place since 2026-10-01?",
    "Email customer C-10492 that their parcel ships tomorrow.",
    "Three copies of ISBN 9780007525546 were water damaged, remove them.",
    "Find books by Ursula K. Le Guin under 15 EUR.",
)

FOLLOW_UPS = ("Can you say that more briefly?", "Give me one concrete example.",
              "What is the single most important point here?",
              "Summarise our whole conversation in one sentence.",
              "Is there anything you would add?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--turns", type=int, default=4,
                        help="turns per conversation, 2..6 (default 4)")
    parser.add_argument("--conversations", type=int, default=6,
                        help="conversations, one per chat prompt of tools/prompts.py, 1..6 "
                             "(default 6)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens per answer (default 48)")
    parser.add_argument("--verifiers", type=int, default=1,
                        help="verifiers per cluster, 1..4 (default 1)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="conversations at once, 1..6 (default 1)")
    parser.add_argument("--burst", type=int, default=0,
                        help="instead of conversations: N requests sharing one long system "
                             "prompt sent at once, 2..8 (default 0: conversations)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="bursts per cluster with --burst, 1..10 (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def run(args: argparse.Namespace) -> int:
    from tools.prompts import PROMPTS

    if not 2 <= args.turns <= 1 + len(FOLLOW_UPS) or not 1 <= args.conversations <= len(
            PROMPTS) or not 1 <= args.max_tokens <= 256 or not 1 <= args.verifiers <= 4 or not (
            1 <= args.concurrency <= len(PROMPTS)):
        print("specbus bench prefix: --turns 2..6, --conversations 1..6, --max-tokens 1..256, "
              "--verifiers 1..4, --concurrency 1..6", file=sys.stderr)
        return 2
    if args.burst and not (2 <= args.burst <= len(AGENT_QUESTIONS) and 1 <= args.rounds <= 10):
        print("specbus bench prefix: --burst 2..8, --rounds 1..10", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    if args.burst:
        return _run_bursts(args, cores)
    from contextlib import ExitStack

    rows = []
    convs = list(enumerate(PROMPTS[:args.conversations]))
    with ExitStack() as stack:
        clusters = _both(stack, cores, args.verifiers)
        if args.concurrency == 1:
            for c, prompt in convs:
                rows += _interleaved(clusters, c, prompt, args)
        else:
            for g in range(0, len(convs), args.concurrency):
                group = convs[g:g + args.concurrency]
                got = {mb: _concurrent(clusters[mb], group, args)
                       for mb in _order(clusters, g // args.concurrency)}
                for (c, (cls, _)), on, off in zip(group, got["default"], got["0"],
                                                  strict=True):
                    rows += [_row(c, cls, t, a, b) for t, (a, b) in enumerate(zip(on, off,
                                                                                strict=True))]
    summary = _summary(rows, args.turns)
    print(render(summary, cores))
    return _finish(args, cores, rows, summary=summary)


def _run_bursts(args: argparse.Namespace, cores: list[int]) -> int:
    """`--burst`: the same bursts on both clusters, alternating, round by round."""
    from contextlib import ExitStack

    msgs = [[{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": q}]
            for q in AGENT_QUESTIONS[:args.burst]]
    rows, answers = [], {}
    with ExitStack() as stack:
        clusters = _both(stack, cores, args.verifiers)
        for r in range(args.rounds):
            for mb in _order(clusters, r):
                row, ids = _burst(clusters[mb], msgs, args.max_tokens)
                answers.setdefault("first", ids)
                row.update({"round": r + 1, "cache": "on" if mb == "default" else "off",
                            "same": ids == answers["first"]})
                rows.append(row)
                print(f"round {r + 1} cache {row['cache']}: TTFT p50 {row['ttft_p50_ms']:.0f} "
                      f"ms, p99 {row['ttft_p99_ms']:.0f} ms, burst {row['wall_s']:.2f} s, "
                      f"cached {row['cached_tokens']:.0f} of {row['prompt_tokens']:.0f}",
                      file=sys.stderr, flush=True)
    lines = [f"{args.burst} requests sharing a system prompt, sent at once; medians over the "
             f"burst (load {os.getloadavg()[0]:.2f})",
             "round  cache  prompt  cached  TTFT p50 ms  TTFT p99 ms  burst s  same"]
    lines += [f"{r['round']:>5}  {r['cache']:>5}  {r['prompt_tokens']:>6.0f}  "
              f"{r['cached_tokens']:>6.0f}  {r['ttft_p50_ms']:>11.0f}  {r['ttft_p99_ms']:>11.0f}"
              f"  {r['wall_s']:>7.2f}  {r['same']}" for r in rows]
    print("\n".join(lines))
    return _finish(args, cores, rows)


def _both(stack, cores: list[int], n: int) -> dict[str, _Cluster]:
    """The two clusters, entered on `stack`: the default prefix cache, and none."""
    return {mb: stack.enter_context(_Cluster(mb, cores, n)) for mb in ("default", "0")}


def _order(clusters: dict, k: int) -> list[str]:
    """Which cluster goes first in the k-th request, burst or group: alternating."""
    return list(clusters) if k % 2 == 0 else list(clusters)[::-1]


def _finish(args: argparse.Namespace, cores: list[int], rows: list[dict], **extra) -> int:
    """Write the JSON (`--json`); exit 1 when any answer differed between the clusters."""
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": len(cores), "load": os.getloadavg(),
                                         "args": {k: v for k, v in vars(args).items()
                                                  if isinstance(v, (int, float, str))},
                                         "rows": rows, **extra}, indent=2) + "\n")
    return 0 if all(r["same"] for r in rows) else 1


def _burst(cluster: _Cluster, msgs: list, max_tokens: int) -> tuple[dict, list]:
    """All of `msgs` sent at once on `cluster`: the burst's figures, and each answer's ids."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(msgs)) as pool:
        got = list(pool.map(lambda m: cluster.ask(m, max_tokens), msgs))
    wall = time.perf_counter() - t0
    ttfts = sorted(g["ttft_ms"] for g in got)
    return ({"prompt_tokens": statistics.median(g["prompt_tokens"] for g in got),
             "cached_tokens": statistics.median(g["cached"] for g in got),
             "ttft_p50_ms": statistics.median(ttfts), "ttft_p99_ms": ttfts[-1],
             "wall_s": wall}, [g["token_ids"] for g in got])


def _interleaved(clusters: dict, c: int, prompt: tuple[str, str],
                 args: argparse.Namespace) -> list[dict]:
    """One conversation on both clusters, request by request, the order alternating."""
    cls, text = prompt
    talks = {mb: [{"role": "user", "content": text}] for mb in clusters}
    rows = []
    for turn in range(args.turns):
        got = {}
        for mb in _order(clusters, c + turn):
            got[mb] = clusters[mb].ask(talks[mb], args.max_tokens)
            _next_turn(talks[mb], got[mb], turn, args.turns)
        rows.append(_row(c, cls, turn, got["default"], got["0"]))
    return rows


def _concurrent(cluster: _Cluster, group: list, args: argparse.Namespace) -> list[list[dict]]:
    """The group's conversations at once on one cluster: each conversation's turns."""
    from concurrent.futures import ThreadPoolExecutor

    def talk(prompt: tuple[str, str]) -> list[dict]:
        talk_ = [{"role": "user", "content": prompt[1]}]
        out = []
        for turn in range(args.turns):
            out.append(cluster.ask(talk_, args.max_tokens))
            _next_turn(talk_, out[-1], turn, args.turns)
        return out

    with ThreadPoolExecutor(len(group)) as pool:
        return list(pool.map(talk, [p for _, p in group]))


def _next_turn(talk: list[dict], got: dict, turn: int, turns: int) -> None:
    talk.append({"role": "assistant", "content": got["text"]})
    if turn + 1 < turns:
        talk.append({"role": "user", "content": FOLLOW_UPS[turn]})


def _row(c: int, cls: str, turn: int, on: dict, off: dict) -> dict:
    row = {"conversation": c, "class": cls, "turn": turn + 1,
           "prompt_tokens": on["prompt_tokens"], "cached_tokens": on["cached"],
           "verifier_on": on["verifier"], "ttft_on_ms": on["ttft_ms"],
           "ttft_off_ms": off["ttft_ms"], "ttft_ratio": off["ttft_ms"] / on["ttft_ms"],
           "tok_s_on": on["tok_s"], "tok_s_off": off["tok_s"],
           "same": on["token_ids"] == off["token_ids"]}
    print(f"conversation {c} turn {turn + 1}: {row['prompt_tokens']} prompt tokens "
          f"({row['cached_tokens']} cached), TTFT {off['ttft_ms']:.0f} -> {on['ttft_ms']:.0f} "
          f"ms, same={row['same']}", file=sys.stderr, flush=True)
    return row


def _summary(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for turn in range(1, turns + 1):
        rs = [r for r in rows if r["turn"] == turn]
        ratios = [r["ttft_ratio"] for r in rs]
        out.append({"turn": turn,
                    "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rs),
                    "cached_tokens": statistics.median(r["cached_tokens"] for r in rs),
                    "ttft_off_ms": statistics.median(r["ttft_off_ms"] for r in rs),
                    "ttft_on_ms": statistics.median(r["ttft_on_ms"] for r in rs),
                    "ttft_ratio_median": statistics.median(ratios),
                    "ttft_ratio_worst": min(ratios),
                    "tok_s_ratio_median": statistics.median(
                        r["tok_s_on"] / r["tok_s_off"] for r in rs),
                    "mismatches": sum(not r["same"] for r in rs)})
    return out


def render(summary: list[dict], cores: list[int]) -> str:
    lines = [f"prefix cache on vs off, verifiers pinned from core {cores[0]}, one torch "
             f"thread each; medians over conversations (load {os.getloadavg()[0]:.2f})",
             "turn  prompt  cached  TTFT off ms  TTFT on ms  off/on median (worst)  "
             "tok/s on/off  mismatches"]
    for s in summary:
        lines.append(f"{s['turn']:>4}  {s['prompt_tokens']:>6.0f}  {s['cached_tokens']:>6.0f}  "
                     f"{s['ttft_off_ms']:>11.0f}  {s['ttft_on_ms']:>10.0f}  "
                     f"{s['ttft_ratio_median']:>10.2f}x ({s['ttft_ratio_worst']:.2f}x)  "
                     f"{s['tok_s_ratio_median']:>12.2f}  {s['mismatches']:>10}")
    return "\n".join(lines)


class _Cluster:
    """`n` verifier processes (`--prefix-cache-mb MB`, or its default) and a cluster client
    (the one the CLI uses: it tokenizes, so it routes turns by prefix)."""

    def __init__(self, mb: str, cores: list[int], n: int) -> None:
        self.mb, self.cores, self.n = mb, cores, n

    def __enter__(self) -> _Cluster:
        from contextlib import ExitStack

        from nodes.cluster_client import ClusterClient
        from tools.local_cluster import LocalCluster

        log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-prefix-"))
        flags = () if self.mb == "default" else ("--prefix-cache-mb", self.mb)
        with ExitStack() as stack:
            c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False))
            print(f"starting {self.n} verifier(s) (prefix cache {self.mb}; logs: {log_dir})",
                  file=sys.stderr)
            nodes = [c.start_node(f"v{k}", "--role", "verifier", "--threads", "1", "--cpus",
                                  str(self.cores[k % len(self.cores)]), *flags, seed=bool(k))
                     for k in range(self.n)]
            self.cc = stack.enter_context(ClusterClient(
                c.cluster, peers=tuple(x.stream for x in nodes), mdns=False))
            self.cc.wait_for(lambda ms: sum("verifier" in m.card.roles for m in ms) >= self.n,
                             60)
            self._stack = stack.pop_all()
        # warm-up, unmeasured: the client loads its tokenizer (seconds, once), each verifier
        # serves a request (as a running one has: its prefix cache then holds the chat
        # template's header, as it would after any earlier user)
        from nodes.cluster_client import GenerateRequest

        hello = GenerateRequest(messages=[{"role": "user", "content": "Hello!"}], max_tokens=4)
        for member in self.cc.verifiers():
            list(self.cc.stream(hello, member))
        self.ask([{"role": "user", "content": "Hello!"}], 4)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def ask(self, messages: list[dict], max_tokens: int) -> dict:
        """One turn through the cluster client's choice of verifier: TTFT, tok/s, the answer
        and what the verifier reported."""
        from nodes.cluster_client import GenerateRequest
        from nodes.cluster_client.failover import Final, Piece

        req = GenerateRequest(messages=messages, max_tokens=max_tokens)
        t0 = time.perf_counter()
        ttft = final = None
        for ev in self.cc.events(req):
            if isinstance(ev, Piece) and ttft is None:
                ttft = time.perf_counter() - t0
            elif isinstance(ev, Final):
                final = ev
        elapsed = time.perf_counter() - t0
        if final is None or ttft is None:
            raise RuntimeError("a turn ended without an answer")
        stats = final.stats
        ids = list(final.token_ids)
        return {"text": final.text, "token_ids": ids, "ttft_ms": ttft * 1000,
                "tok_s": len(ids) / elapsed, "prompt_tokens": stats["prompt_tokens"],
                "cached": stats.get("cached_tokens", 0), "verifier": final.verifiers[-1]}
