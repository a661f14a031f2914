"""`specbus bench prefix`: time to first token of a conversation's later turns, with the
verifier's prefix cache and without it.

Two local clusters of one SmolLM2 verifier each, both pinned to the first core with one torch
thread (only one serves at a time), the client on the last core: one verifier with the default
prefix cache, one with `--prefix-cache-mb 0`. The same conversations run on both, interleaved
request by request (the order alternating): each turn sends the whole conversation so far as
chat messages, as OpenAI-style clients do, and appends the answer. The conversations start from
the decode benchmark's chat prompts (tools/prompts.py) and go on with fixed follow-up questions
written for this benchmark. Greedy: every answer must be the same on both clusters (checked,
counted in `mismatches`). Reports per turn the prompt tokens, TTFT and tok/s with and without
the cache, their ratio (median and worst over conversations), and the cached positions the
verifier reported.
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
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def run(args: argparse.Namespace) -> int:
    from tools.prompts import PROMPTS

    if not 2 <= args.turns <= 1 + len(FOLLOW_UPS) or not 1 <= args.conversations <= len(
            PROMPTS) or not 1 <= args.max_tokens <= 256:
        print("specbus bench prefix: --turns 2..6, --conversations 1..6, --max-tokens 1..256",
              file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    from contextlib import ExitStack

    rows = []
    with ExitStack() as stack:
        clusters = {mb: stack.enter_context(_Verifier(mb, cores)) for mb in ("default", "0")}
        for c, (cls, text) in enumerate(PROMPTS[:args.conversations]):
            talks = {mb: [{"role": "user", "content": text}] for mb in clusters}
            for turn in range(args.turns):
                order = list(clusters) if (c + turn) % 2 == 0 else list(clusters)[::-1]
                got = {}
                for mb in order:
                    got[mb] = clusters[mb].ask(talks[mb], args.max_tokens)
                    talks[mb].append({"role": "assistant", "content": got[mb]["text"]})
                    if turn + 1 < args.turns:
                        talks[mb].append({"role": "user", "content": FOLLOW_UPS[turn]})
                on, off = got["default"], got["0"]
                row = {"conversation": c, "class": cls, "turn": turn + 1,
                       "prompt_tokens": on["prompt_tokens"], "cached_tokens": on["cached"],
                       "ttft_on_ms": on["ttft_ms"], "ttft_off_ms": off["ttft_ms"],
                       "ttft_ratio": off["ttft_ms"] / on["ttft_ms"],
                       "tok_s_on": on["tok_s"], "tok_s_off": off["tok_s"],
                       "same": on["token_ids"] == off["token_ids"]}
                rows.append(row)
                print(f"conversation {c} turn {turn + 1}: {row['prompt_tokens']} prompt tokens "
                      f"({row['cached_tokens']} cached), TTFT {off['ttft_ms']:.0f} -> "
                      f"{on['ttft_ms']:.0f} ms, same={row['same']}", file=sys.stderr,
                      flush=True)
    summary = _summary(rows, args.turns)
    print(render(summary, cores))
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": len(cores), "load": os.getloadavg(),
                                         "args": {"turns": args.turns,
                                                  "conversations": args.conversations,
                                                  "max_tokens": args.max_tokens},
                                         "rows": rows, "summary": summary}, indent=2) + "\n")
    return 0 if all(r["same"] for r in rows) else 1


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
    lines = [f"prefix cache on vs off, one verifier on core {cores[0]}, one torch thread; "
             f"medians over conversations (load {os.getloadavg()[0]:.2f})",
             "turn  prompt  cached  TTFT off ms  TTFT on ms  off/on median (worst)  "
             "tok/s on/off  mismatches"]
    for s in summary:
        lines.append(f"{s['turn']:>4}  {s['prompt_tokens']:>6.0f}  {s['cached_tokens']:>6.0f}  "
                     f"{s['ttft_off_ms']:>11.0f}  {s['ttft_on_ms']:>10.0f}  "
                     f"{s['ttft_ratio_median']:>10.2f}x ({s['ttft_ratio_worst']:.2f}x)  "
                     f"{s['tok_s_ratio_median']:>12.2f}  {s['mismatches']:>10}")
    return "\n".join(lines)


class _Verifier:
    """One verifier process (`--prefix-cache-mb MB`, or its default) and a cluster client."""

    def __init__(self, mb: str, cores: list[int]) -> None:
        self.mb, self.cores = mb, cores

    def __enter__(self) -> _Verifier:
        from contextlib import ExitStack

        from nodes.cluster_client import ClusterClient
        from tools.local_cluster import LocalCluster

        log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-prefix-"))
        flags = () if self.mb == "default" else ("--prefix-cache-mb", self.mb)
        with ExitStack() as stack:
            c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False))
            print(f"starting a verifier (prefix cache {self.mb}; logs: {log_dir})",
                  file=sys.stderr)
            node = c.start_node("v", "--role", "verifier", "--threads", "1", "--cpus",
                                str(self.cores[0]), *flags)
            self.cc = stack.enter_context(ClusterClient(c.cluster, peers=(node.stream,),
                                                        mdns=False))
            self.cc.wait_for(lambda ms: any("verifier" in m.card.roles for m in ms), 60)
            self.verifier = self.cc.verifiers()[0]
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def ask(self, messages: list[dict], max_tokens: int) -> dict:
        """One turn, streamed: TTFT, tok/s, the answer and what the verifier reported."""
        from nodes.cluster_client import GenerateRequest

        req = GenerateRequest(messages=messages, max_tokens=max_tokens)
        t0 = time.perf_counter()
        ttft = done = None
        for msg in self.cc.stream(req, self.verifier):
            if msg.type == "token_chunk" and ttft is None:
                ttft = time.perf_counter() - t0
            elif msg.type == "done":
                done = msg
        elapsed = time.perf_counter() - t0
        if done is None or ttft is None:
            raise RuntimeError("the verifier ended a turn without an answer")
        stats = done["stats"]
        ids = list(stats["token_ids"])
        return {"text": done["text"], "token_ids": ids, "ttft_ms": ttft * 1000,
                "tok_s": len(ids) / elapsed, "prompt_tokens": stats["prompt_tokens"],
                "cached": stats.get("cached_tokens", 0)}
