"""`specbus bench structured --gateway`: the same workloads as a client sends them.

Real node processes on loopback: one verifier per configuration (both on core 0, one torch
thread each, each with its prefix cache as served; only one works at a time), a proposer per
drafter of `--proposers` (default: one ngram proposer; core 1) and a gateway (core 1); this
process (the openai client) sits on core 1 too. Why a verifier per configuration: with one
verifier, whichever configuration ran a request second found that request's whole prompt in the
prefix cache, stored by the first. A user never sends the same prompt twice in a row, and the
order alternated, so each request's median over three rounds sat on one side: at stop 61 a
31-token extraction answer read 1.15x with the speculative run cold against plain warm, and
3.5x the other way round. Each verifier is served under its own name (`--served-name`) and the
client picks the configuration's; both see the same requests in the same order, as each
configuration's own cache does in process. For the same reason each round runs on a cluster
started for it (`_round`): kept across rounds, both prefix caches held every prompt from the
second round on (the figures were those of warm prompts, whose prefill, the same on both sides,
no longer counted), and a suffix proposer's index held each request's own answer. And the plain
verifier publishes nothing to the cluster's shared suffix index (`--no-share`; its answers were
drafted whole for the speculative run of the same prompt right after). A model proposer
(`int8`) takes the grammar (its card says so): it drafts from its logits masked by it. The
speculative verifier's own drafter (`--verifier-drafter`, default none) drafts where no
proposer is up (`--proposers ''`), as a verifier node's does. Every request goes through the
OpenAI-compatible API as an app sends it:

- extraction: `response_format` `json_schema` (strict) with the text's schema;
- tools: the fixed tool set, `tool_choice` "required", `parallel_tool_calls` false;
- agent: the suffix work's agent trace with `response_format` its tool schema (`AGENT_SCHEMA`),
  counted after its first `AGENT_AFTER` requests.

Two configurations per request, interleaved (their order alternates request by request and
round by round): `plain` (`specbus.speculate: false`: the verifier's constrained plain
decoding) and `speculative` (the default: the proposers' drafts and the grammar's forced
tokens, merged in one tree). Figures: per request the median wall time over rounds of the whole
call (HTTP, prefill, decode), speedup = plain's time / speculative's on the same completion
(greedy: the same tokens, checked), median and worst per workload; invalid outputs (each
answer parsed and checked against its schema or tool parameters) and speculative != plain.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORE_VERIFIER, CORE_CLIENT = 0, 1


def _answer(m) -> str:
    """What a completion's message says, for comparing plain with speculative."""
    if m.tool_calls:
        return json.dumps([[c.function.name, c.function.arguments] for c in m.tool_calls])
    return m.content or ""


def run_gateway(args, reqs: list[dict[str, Any]], workloads: dict[str, int]
                ) -> dict[str, Any]:
    """`reqs`: each request's workload, chat keyword arguments and validity check
    (`bench_structured.gateway_requests`); `workloads`: each workload's requests left out of
    its figures (the first few of a trace)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {CORE_CLIENT})
    rounds = 2 if args.quick else args.rounds
    drafters = [d for d in getattr(args, "proposers", "ngram").split(",") if d]
    runs = _Runs(len(reqs))
    for r in range(rounds):
        _round(args, reqs, r, drafters, runs)
        print(f"gateway round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    times, tokens = runs.times, runs.tokens
    mismatched = runs.mismatched + sum(
        runs.answers["plain"][i] != runs.answers["speculative"][i] for i in range(len(reqs)))
    per_request = [{"workload": r["workload"], "tokens": tokens[i],
                    "plain_s": [round(x, 4) for x in times["plain"][i]],
                    "speculative_s": [round(x, 4) for x in times["speculative"][i]]}
                   for i, r in enumerate(reqs)]
    out: dict[str, Any] = {"rounds": rounds, "proposers": drafters, "verifiers": dict(SERVED),
                           "verifier_drafter": getattr(args, "verifier_drafter", "none"),
                           "cluster": "fresh each round", "invalid_outputs": runs.invalid,
                           "per_request": per_request,
                           "cut_by_max_tokens": runs.cut,
                           "speculative_not_equal_plain": mismatched,
                           "load": os.getloadavg()}
    for w, skip in workloads.items():
        idx = [i for i, r in enumerate(reqs) if r["workload"] == w][skip:]
        if not idx:
            continue
        plain = [statistics.median(times["plain"][i]) for i in idx]
        spec = [statistics.median(times["speculative"][i]) for i in idx]
        x = [p / s for p, s in zip(plain, spec, strict=True)]
        toks = [tokens[i] for i in idx]
        out[w] = {"requests": len(idx), "tokens": sum(toks),
                  "plain_tok_s_median": statistics.median(
                      t / p for t, p in zip(toks, plain, strict=True)),
                  "speculative_tok_s_median": statistics.median(
                      t / s for t, s in zip(toks, spec, strict=True)),
                  "speedup_median": statistics.median(x), "speedup_worst": min(x)}
    return out


#: the warm-up call of each configuration, before a round's requests: constrained (the
#: grammar compiler's tokenizer is built at the first constraint, ~0.5 s) and unrelated to
#: every request, so no request finds its prompt in a prefix cache or its answer in the
#: shared suffix index
WARMUP = {"messages": [{"role": "user", "content": "Pick a number from one to ten."}],
          "response_format": {"type": "json_schema", "json_schema": {
              "name": "pick", "strict": True, "schema": {
                  "type": "object", "properties": {"n": {"type": "integer"}},
                  "required": ["n"], "additionalProperties": False}}}}


@dataclass
class _Runs:
    """What the rounds measured, per configuration and request (greedy: every round's answer
    the same, counted in `mismatched` where not), and the first round's checks."""

    requests: int
    times: dict[str, list[list[float]]] = field(init=False)
    answers: dict[str, list[str | None]] = field(init=False)
    tokens: list[int] = field(init=False)
    invalid: int = 0
    mismatched: int = 0
    cut: int = 0

    def __post_init__(self) -> None:
        self.times = {k: [[] for _ in range(self.requests)] for k in CONFIGS}
        self.answers = {k: [None] * self.requests for k in CONFIGS}
        self.tokens = [0] * self.requests


def _round(args, reqs: list[dict[str, Any]], r: int, drafters: list[str],
           runs: _Runs) -> None:
    """Round `r` on a cluster started for it (verifiers, proposers, gateway), its plain
    verifier publishing nothing (the module docstring says why), into `runs`."""
    import openai

    from tools.local_cluster import LocalCluster

    model = ("--model", args.model) if args.model else ()
    log_dir = Path(tempfile.mkdtemp(prefix=f"specbus-bench-structured-r{r + 1}-"))
    print(f"round {r + 1}: starting a verifier per configuration (core 0, 1 torch thread "
          f"each), proposers {drafters} and a gateway (core 1); logs: {log_dir}",
          file=sys.stderr, flush=True)
    with LocalCluster(log_dir=log_dir, mdns=False, env={"OMP_NUM_THREADS": "1"}) as c:
        for cfg in CONFIGS:  # one after the other: each times its own forward at start
            c.start_node(f"v-{cfg}", "--role", "verifier", "--cpus", str(CORE_VERIFIER),
                         "--threads", "1", "--weights", args.weights,
                         "--served-name", SERVED[cfg], *model,
                         *(("--no-share",) if cfg == "plain" else
                           ("--drafter", getattr(args, "verifier_drafter", "none"))))
        nodes = [*(c.spawn(f"p{i}-{d}", "--role", "proposer", "--drafter", d, "--cpus",
                           str(CORE_CLIENT), "--threads", "1", seed=True)
                   for i, d in enumerate(drafters)),
                 c.spawn("gw", "--role", "gateway", "--http", "127.0.0.1:0", "--cpus",
                         str(CORE_CLIENT), seed=True)]
        for n in nodes:
            n.wait_ready()
        url = c.node("gw").ready["http"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        served = {m.id for m in client.models.list().data}
        if served != set(SERVED.values()):
            raise RuntimeError(f"the gateway serves {sorted(served)}, expected "
                               f"{sorted(SERVED.values())}")
        time.sleep(3)  # gossip: the verifiers link their proposers
        for cfg in CONFIGS:  # warm: the proposers' links, the grammar compiler, the forward
            client.chat.completions.create(model=SERVED[cfg], temperature=0, max_tokens=8,
                                           extra_body={"specbus": {
                                               "speculate": cfg == "speculative"}},
                                           **WARMUP)
        for i, req in enumerate(reqs):
            order = CONFIGS if (i + r) % 2 == 0 else CONFIGS[::-1]
            for cfg in order:
                body = {"specbus": {"speculate": cfg == "speculative"}}
                t0 = time.perf_counter()
                resp = client.chat.completions.create(
                    model=SERVED[cfg], temperature=0, max_tokens=args.max_tokens,
                    extra_body=body, **req["kw"])
                runs.times[cfg][i].append(time.perf_counter() - t0)
                choice = resp.choices[0]
                answer = _answer(choice.message)
                if r == 0:
                    runs.tokens[i] = resp.usage.completion_tokens
                    if choice.finish_reason == "length":
                        runs.cut += 1
                    elif not req["valid"](choice.message):
                        runs.invalid += 1
                        print(f"INVALID ({cfg}, {req['workload']} {i}): {answer!r}",
                              file=sys.stderr)
                if runs.answers[cfg][i] is not None and runs.answers[cfg][i] != answer:
                    runs.mismatched += 1  # (greedy: every round the same)
                runs.answers[cfg][i] = answer


CONFIGS = ("plain", "speculative")
#: the name each configuration's verifier is served under
SERVED = {cfg: f"bench-{cfg}" for cfg in CONFIGS}


def print_gateway(rep: dict[str, Any]) -> None:
    print(f"\nthrough the gateway (openai client; a verifier per configuration, core 0 one "
          f"torch thread, "
          f"{'+'.join(rep.get('proposers', ['ngram'])) or 'no'} proposer(s) + gateway + client "
          f"core 1; the speculative verifier's own drafter: {rep.get('verifier_drafter', 'none')})"
          f", {rep['rounds']} rounds interleaved, a cluster started for each, load "
          f"{' '.join(f'{x:.2f}' for x in rep['load'])}")
    head = (f"{'workload':<10} {'requests':>8} {'tokens':>6} {'plain tok/s':>11} "
            f"{'spec tok/s':>10} {'x plain':>7} {'worst':>6}")
    print(head)
    print("-" * len(head))
    for w in ("extraction", "tools", "agent"):
        if w in rep:
            r = rep[w]
            print(f"{w:<10} {r['requests']:8d} {r['tokens']:6d} {r['plain_tok_s_median']:11.1f} "
                  f"{r['speculative_tok_s_median']:10.1f} {r['speedup_median']:7.2f} "
                  f"{r['speedup_worst']:6.2f}")
    print(f"invalid outputs: {rep['invalid_outputs']}; cut by max_tokens: "
          f"{rep['cut_by_max_tokens']}; speculative != plain: "
          f"{rep['speculative_not_equal_plain']}")
