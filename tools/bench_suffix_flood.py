"""`specbus bench flood`: a suffix proposer fed GiBs of hostile publications, on loopback.

Issue #25 asks that a proposer fed 1 GB of publications stays within its budget. The unit test
(`tests/security/test_suffix_flood.py`) feeds ~20 MiB in process; this feeds the real thing:
a verifier (core 0, one torch thread) and a suffix proposer (core 1) in their own processes,
and this process as a member of their cluster publishing `--gib` GiB of `suffix_pub` on the
share topic, as fast as its gossip socket takes them: 8,192-token documents of random ids of
the verifier's tokenizer under `--senders` forged sender ids (more than the proposer tracks, so
per-sender rates bound nothing), with one in 32 malformed, one in 32 of another tokenizer and
one in 32 oversized. Nothing is paced but the sender's own loop (batches of 64 handed over,
then a round trip through it), so the flood lasts as long as the machine takes to move it.

While it runs, the proposer's resident memory (`/proc/PID/status`) is sampled every 0.2 s and
its telemetry read (what it indexed, dropped and counted; its index's bytes). Before and after,
the verifier answers the same request drafted by that proposer: the answers must be the same
(the flood changes speed at most, never output) and the proposer must still be the one drafting.
The proposer's own count of the gossip bytes it received comes from its exit line.

Pass: index bytes never above the budget, the proposer alive and drafting after the flood, the
two answers identical. Memory is reported, not judged: it includes what the transport held
while the flood lasted (docs/security.md, "The shared suffix index").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.bench_trace import INDEX  # where a suffix proposer's index figures are in its stats

PROMPT = ("Copy exactly, word for word: The committee will meet on Tuesday at the main office "
          "to review the budget for the next year.")
DOC_TOKENS = 8192  # MAX_PUB_TOKENS: the largest publication a proposer takes
BATCH = 64  # publications handed to the gossip loop before waiting for it
SAMPLE_S = 0.2
SETTLE_S = 3.0  # indexed count unchanged this long, queue empty: the flood is all taken
#: one publication in `_EVERY` of each hostile kind
_EVERY = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--gib", type=float, default=1.0,
                        help="GiB of publications to send (default 1)")
    parser.add_argument("--budget", type=float, default=64.0,
                        help="the proposer's --suffix-budget, MB (default 64, the product's)")
    parser.add_argument("--senders", type=int, default=4096,
                        help="forged sender ids the flood rotates through (default 4096)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens of the request answered before and after (default 32)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--model", default=None,
                        help="the verifier's model (default the embedded SmolLM2-135M)")


def status_kb(pid: int, field: str) -> int:
    """A `/proc/PID/status` figure in kB (VmRSS, VmHWM); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _Sampler:
    """The proposer's RSS and index figures every `SAMPLE_S`, on a thread of its own."""

    def __init__(self, pid: int, tel, node_id: str) -> None:
        self.pid, self.tel, self.node_id = pid, tel, node_id
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="flood-sampler", daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            idx = self.tel.latest(self.node_id, *INDEX)
            self.samples.append({"t": round(time.monotonic() - self._t0, 2),
                                 "rss_mb": round(status_kb(self.pid, "VmRSS") / 1024, 1),
                                 "index_bytes": idx.get("index_bytes"),
                                 "queued": idx.get("queued")})


def _wait_drained(tel, node_id: str, timeout: float = 300.0) -> float:
    """Seconds until the proposer's indexing queue is empty and its count of indexed
    publications has held for `SETTLE_S` (telemetry comes about once a second, so a reading
    taken before the flood reached it also says `queued` 0)."""
    t0 = time.monotonic()
    last, since = None, t0
    while time.monotonic() - t0 < timeout:
        idx = tel.latest(node_id, *INDEX)
        now = time.monotonic()
        if idx.get("indexed") != last:
            last, since = idx.get("indexed"), now
        elif idx.get("queued") == 0 and now - since >= SETTLE_S:
            return round(since - t0, 2)
        time.sleep(SAMPLE_S)
    raise RuntimeError(f"the proposer's queue did not drain in {timeout:.0f} s")


def _flood(node, cluster: str, tokenizer: str, gib: float, senders: int) -> dict:
    """Publish `gib` GiB of suffix publications from `node` (see the module doc)."""
    import numpy as np

    from codec.messages import make
    from codec.structs import SuffixPub
    from nodes.node_common.suffix_share import share_topic

    topic = share_topic(cluster)
    rng = np.random.default_rng(25)
    gossip = node.gossip
    sent0, bytes0 = gossip.published, gossip.bytes_out
    docs = max(1, int(gib * 2**30 / (DOC_TOKENS * 4)))
    kinds = {"valid": 0, "malformed": 0, "foreign": 0, "oversized": 0}
    t0 = time.monotonic()
    for i in range(docs):
        sender = f"forged-{i % senders}"
        kind = ("malformed", "foreign", "oversized")[i % 3] if i % _EVERY == _EVERY - 1 else "valid"
        if kind == "malformed":  # output_start past the end
            msg = make("suffix_pub", cluster=cluster, tokenizer=tokenizer, output_start=5,
                       tensors=[np.arange(3, dtype=np.int32)], sender=sender)
        elif kind == "oversized":  # over MAX_PUB_TOKENS
            msg = make("suffix_pub", cluster=cluster, tokenizer=tokenizer, output_start=0,
                       tensors=[rng.integers(0, 49152, DOC_TOKENS + 808, dtype=np.int32)],
                       sender=sender)
        else:
            fp = tokenizer if kind == "valid" else "another-tokenizer"
            msg = SuffixPub(cluster, fp, rng.integers(0, 49152, DOC_TOKENS, dtype=np.int32),
                            0).to_message(sender=sender)
        msg.seq = i + 1
        gossip.publish(topic, msg)
        kinds[kind] += 1
        if i % BATCH == BATCH - 1:
            node.loop.run_sync(lambda: None)  # bounded hand-over: the loop sent the batch
        if i % 2048 == 2047:
            mb = (gossip.bytes_out - bytes0) / 2**20
            print(f"  sent {i + 1}/{docs} publications, {mb:,.0f} MiB, "
                  f"{time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    node.loop.run_sync(lambda: None)
    return {"publications": docs, "kinds": kinds, "sent": gossip.published - sent0,
            "sent_mib": round((gossip.bytes_out - bytes0) / 2**20, 1),
            "seconds": round(time.monotonic() - t0, 2)}


def run(args: argparse.Namespace) -> int:
    from nodes import models
    from nodes.backends.tokenizer import Tokenizer
    from nodes.cluster_client import ClusterClient, GenerateRequest
    from nodes.telemetry import StatsWatcher
    from tools.local_cluster import LocalCluster

    if not args.gib > 0 or not args.budget > 0 or args.senders < 1 or args.max_tokens < 1:
        print("specbus bench flood: --gib, --budget, --senders and --max-tokens must be "
              "positive", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-flood-"))
    print(f"logs: {log_dir}", file=sys.stderr, flush=True)
    model = ("--model", args.model) if args.model else ()
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False,
                                             env={"OMP_NUM_THREADS": "1"}))
        v = c.start_node("v0", "--role", "verifier", "--cpus", "0", "--threads", "1",
                         "--prefix-cache-mb", "0", *model)
        p = c.start_node("p0", "--role", "proposer", "--cpus", "1", "--drafter",
                         f"suffix:budget={args.budget:g}", seed=True)
        cc = stack.enter_context(ClusterClient(c.cluster, peers=(v.stream, p.stream),
                                               mdns=False))
        tel = StatsWatcher(cc.node, c.cluster)
        ms = cc.wait_for(lambda ms: {"v0", "p0"} <= {m.card.name for m in ms}, 60)
        members = {m.card.name: m for m in ms}
        if {"v0", "p0"} - set(members):
            raise RuntimeError("the bench client never saw v0 and p0")
        ids = Tokenizer(models.resolve(args.model).path).encode(PROMPT, chat=True)

        def answer() -> dict:
            req = GenerateRequest(tokens=list(ids), max_tokens=args.max_tokens, speculate=True,
                                  proposers=[p.node_id])
            st = cc.generate(req, members["v0"], failover=False).stats
            return {"token_ids": list(st["token_ids"]), "elapsed_s": st["elapsed_s"],
                    "proposers_used": sorted(st.get("proposers") or {})}

        before = answer()
        # the verifier's publication pins the proposer to the verifier's tokenizer
        tel.wait(p.node_id, lambda s: s.get("indexed", 0) >= 1, *INDEX, timeout=30)
        rss0 = status_kb(p.proc.pid, "VmRSS") / 1024
        print(f"flooding p0 with {args.gib:g} GiB (budget {args.budget:g} MB, RSS "
              f"{rss0:.0f} MB)", file=sys.stderr, flush=True)
        with _Sampler(p.proc.pid, tel, p.node_id) as sampler:
            sent = _flood(cc.node, c.cluster, members["v0"].card.tokenizer, args.gib,
                          args.senders)
            drain_s = _wait_drained(tel, p.node_id)
        after = answer()
        peak_mb = status_kb(p.proc.pid, "VmHWM") / 1024
        rss_end = status_kb(p.proc.pid, "VmRSS") / 1024
        idx = tel.latest(p.node_id, *INDEX)
        p.stop()
        exit_line = p.wait_event(lambda e: e.get("event") == "exit", 10) or {}
    budget_bytes = int(args.budget * 2**20)
    max_index = max(s.get("index_bytes") or 0 for s in [*sampler.samples, idx])
    result = {
        "command": (f"specbus bench flood --gib {args.gib:g} --budget {args.budget:g} "
                    f"--senders {args.senders} --max-tokens {args.max_tokens}"),
        "budget_mb": args.budget, "senders": args.senders, "flood": sent,
        "received_mib": round(exit_line.get("bytes_in", 0) / 2**20, 1),
        "drain_s": round(drain_s, 2), "index": idx, "max_index_bytes": max_index,
        "within_budget": max_index <= budget_bytes,
        "rss_mb": {"before": round(rss0, 1), "peak": round(peak_mb, 1),
                   "after": round(rss_end, 1)},
        "answers_identical": before["token_ids"] == after["token_ids"],
        "drafted_by_proposer_after": p.node_id in after["proposers_used"],
        "answer_s": {"before": before["elapsed_s"], "after": after["elapsed_s"]},
        "samples": sampler.samples,
    }
    _print(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    ok = (result["within_budget"] and result["answers_identical"]
          and result["drafted_by_proposer_after"])
    return 0 if ok else 1


def _print(r: dict) -> None:
    f, i, m = r["flood"], r["index"], r["rss_mb"]
    print(f"sent      {f['sent']} publications, {f['sent_mib']:,} MiB in {f['seconds']} s "
          f"({f['kinds']}); the proposer received {r['received_mib']:,} MiB")
    print(f"index     {i.get('indexed')} indexed ({i.get('indexed_tokens'):,} tokens), "
          f"{i.get('index_bytes'):,} bytes now, at most {r['max_index_bytes']:,} "
          f"(budget {r['budget_mb']:g} MB): within budget {r['within_budget']}")
    print("dropped   " + ", ".join(f"{k} {i.get(k, 0)}" for k in
                                    ("malformed", "foreign", "rate_limited", "queue_full")))
    print(f"memory    proposer RSS {m['before']} MB before, peak {m['peak']} MB, "
          f"{m['after']} MB after; last publication indexed {r['drain_s']} s after the flood")
    print(f"serving   answers identical {r['answers_identical']}; drafted by the proposer "
          f"after {r['drafted_by_proposer_after']} ({r['answer_s']['before']:.2f} s before, "
          f"{r['answer_s']['after']:.2f} s after)")
