"""`specbus bench decode --trace NAME[,NAME...]|all`: repeated workloads, request by request.

Replays the traces of tools/traces (issue #25; each file says how it was made in
tools/traces/README.md) and decodes every request with each row, interleaved request by request
(rows in an order rotated per request, traces taken in turn), so background load hits every
row alike:

* `plain`: our engine, greedy, no drafts (the baseline of the in-process rows);
* `ngram`: the per-request ngram drafter (the current sequence only);
* `suffix`: the suffix drafter, one global index for the whole run (the earlier answers of
  every trace, outputs only, as a verifier shares by default);
* `hf-plain`, `hf-prompt-lookup`: Hugging Face `generate`, greedy and with
  `prompt_lookup_num_tokens` (`--hf-lookup`, default 10), same token ids and counts;
* `suffix-shared`: over the bus, real node processes on loopback: 2 verifiers (core 0, one
  torch thread each) and one suffix proposer per verifier (core 1); requests alternate between
  the verifiers (request k of the run goes to verifier k % 2 with its own proposer), and every
  proposer indexes what both verifiers publish. `bus-plain` is the same verifier decoding the
  same request plainly, run *after* the shared row (its answer is published too, so it must
  not come first) and the shared row's baseline.

In-process rows run in this process with its thread pinned to core 0 and one torch thread;
the rest of the time this process's threads (the bus client) sit on core 1 with the
proposers. Speedups are tok/s over `plain` (in-process rows) or over `bus-plain` (the shared
row: same verifier, same request); "vs ngram" divides a row's speedup by ngram's on the same
request. Every output is checked against HF greedy's (token ids and decoded bytes).

After the traces (`--late N`, default 2): a third verifier and a third suffix proposer are
started (the proposer first, so it asks the two verifiers that answered for their snapshot;
both join after every answer was given) and each trace's first N requests are asked again on
the new verifier: `late-shared` (drafted by the late proposer, warm from the snapshots),
`late-shared-p0` (the first proposer, there all along) and `late-plain` (its baseline).

`--singles`: before the traces (and before the cluster starts), single requests with nothing
indexed (a fresh suffix drafter per prompt): tools/prompts.py's set and a held-out set written
for this bench, never used to tune a drafter (`HELD_OUT`). Input-grounded: suffix vs HF prompt
lookup; open-ended: suffix vs plain. The set runs `--singles-rounds` times (default 3) and
each row's figure is its median run (`run_singles`). One more row runs there, `plain-again`:
a second plain engine, rotated with the others, whose ratio to `plain` is the noise of the
measurement itself (both do the same forwards); a row's worst ratio is read against it.

`--no-cluster` keeps everything in this process (no shared or late rows). `--shared-int8`
adds an int8 proposer (core 1, one torch thread, for both verifiers) to the shared row's
drafters, merged with the suffix proposer's in one tree: what a cluster running both gets on
the answers the suffix index cannot draft. The row keeps its name; the JSON's
`shared_proposers` says which it was. `--bus-ngram` adds the same row with an ngram proposer
(core 1) in the suffix proposers' place, on the same verifier, interleaved: `bus-ngram`
(ngram, or ngram+int8 with `--shared-int8`, what the demo runs) against `suffix-shared` over
the same bus, the comparison that decides a proposer's default drafter.

Each request (traces and singles) also gets its oracle ceiling (tools/trace_ceiling.py): the
suffix and ngram drafters replayed over the plain row's answer against a verifier that feeds
exactly the accepted path, on the forward costs measured for that prompt. It is what those
drafters' proposals allow at best on this model's answers: the measured row over it is the
engine's judging, a target above it is out of the drafter's reach on these answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

CORE_VERIFIER, CORE_PROPOSER = 0, 1
SKIP_FIRST = 3  # "after the first few requests": medians over requests SKIP_FIRST..
INPROC_ROWS = ("plain", "ngram", "suffix", "hf-plain", "hf-prompt-lookup")
#: the singles' rows: the in-process ones and a second plain engine, the control (`run_singles`)
AA_ROW = "plain-again"
#: opposite plain in the turn, so it runs after plain as often as before it
SINGLE_ROWS = ("plain", "ngram", "suffix", AA_ROW, "hf-plain", "hf-prompt-lookup")
SPEC_ROWS = ("ngram", "suffix", "suffix-shared", "hf-prompt-lookup")
#: rows over the bus, each against `bus-plain` on the same verifier
BUS_ROWS = ("suffix-shared", "bus-ngram")

#: single requests written for this bench (not tools/prompts.py's, not the suffix drafter's
#: compare prompts): nothing was tuned on them
HELD_OUT: list[tuple[str, str]] = [
    ("input-grounded", "Convert this CSV into a Markdown table:\n\nsku,item,qty,price\n"
                       "A-17,blue mug,4,7.50\nB-02,steel kettle,1,32.00\nC-33,linen towel,6,"
                       "9.90\nD-48,oak tray,2,24.00"),
    ("input-grounded", "Fix the spelling mistakes in this note and return the whole note:\n\n"
                       "Dear neighbours, the recycleing bins will be colected on Tuesday "
                       "insted of Monday this week. Please put them out befor 7 am and keep "
                       "the lids closed so the wind does not scater the paper."),
    ("input-grounded", "Add type hints to this function and return the whole function:\n\n"
                       "def merge_counts(a, b):\n    out = dict(a)\n    for key, value in "
                       "b.items():\n        out[key] = out.get(key, 0) + value\n    return out\n"),
    ("open-ended", "Describe a walk through a street market on a cold winter morning."),
    ("open-ended", "What should a family think about before adopting a cat?"),
    ("open-ended", "Write a limerick about a wizard who keeps forgetting his spells."),
]


def add_arguments(parser) -> None:
    """The trace options of `specbus bench decode` (tools/bench_decode.py adds them)."""
    from tools.arg_types import positive_int as _positive_int

    parser.add_argument("--trace", default=None, metavar="NAME[,NAME...]|all",
                        help="replay tools/traces/NAME.json (several: taken in turn, "
                             "interleaved); 'all': every trace (tools/bench_trace.py)")
    parser.add_argument("--limit", type=int, default=0, metavar="N",
                        help="--trace: the first N requests of each trace only")
    parser.add_argument("--late", type=int, default=2, metavar="N",
                        help="--trace: ask each trace's first N requests again on a verifier "
                             "and a suffix proposer started afterwards (0: not)")
    parser.add_argument("--singles", action="store_true",
                        help="--trace: single requests with nothing indexed first (input-"
                             "grounded vs HF prompt lookup, open-ended vs plain)")
    parser.add_argument("--singles-rounds", type=_positive_int, default=3, metavar="N",
                        help="--singles: run the whole set N times, each row's figure its "
                             "median run (default 3)")
    parser.add_argument("--no-cluster", action="store_true",
                        help="--trace: in-process rows only (no node processes)")
    parser.add_argument("--suffix-spec", default="suffix", metavar="SPEC",
                        help="--trace: the suffix drafter measured, in process and in the "
                             "proposers (default: suffix)")
    parser.add_argument("--hf-lookup", type=int, default=10, metavar="N",
                        help="--trace: HF prompt_lookup_num_tokens (default 10)")
    parser.add_argument("--shared-int8", action="store_true",
                        help="--trace: the shared row's verifiers also draft with an int8 "
                             "proposer (one, core 1, for both), merged with their suffix "
                             "proposer's drafts: what a cluster running both gets")
    parser.add_argument("--bus-ngram", action="store_true",
                        help="--trace: also the shared row with an ngram proposer (core 1) "
                             "in the suffix proposer's place, on the same verifier "
                             "(row bus-ngram; with --shared-int8 beside the int8 proposer)")


# -- helpers -----------------------------------------------------------------------------------

def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


#: the cores this process may use, read once before any pinning (a thread's own affinity,
#: once pinned, no longer says which others exist)
_ALLOWED: set[int] = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def _pin(cores: set[int]) -> None:
    """Pin the calling thread (Linux: sched_setaffinity(0) is this thread only); where those
    cores are not ours, to every core we have."""
    if _ALLOWED:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores & _ALLOWED or _ALLOWED)


def trace_names(arg: str) -> list[str]:
    from tools.bench_suffix import TRACES

    if arg == "all":
        return sorted(p.stem for p in TRACES.glob("*.json"))
    return [n.strip() for n in arg.split(",") if n.strip()]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _min(xs):
    xs = [x for x in xs if x is not None]
    return round(min(xs), 3) if xs else None


def _rec(tokens: list[int], seconds: float, forwards: int, drafted: int) -> dict:
    return {"tokens": list(tokens), "s": round(seconds, 4),
            "tok_s": round(len(tokens) / seconds, 3) if seconds > 0 else 0.0,
            "forwards": forwards, "drafted": drafted,
            "tok_per_fwd": round(len(tokens) / forwards, 3) if forwards else None}


# -- in process --------------------------------------------------------------------------------

class InProcess:
    """Our engine (plain, ngram, suffix) and HF generate on one backend, this thread pinned to
    the verifier's core while they run."""

    def __init__(self, model: str | None, spec: str, hf_lookup: int, threads: int = 1) -> None:
        import torch

        from nodes.backends.registry import load_backend
        from nodes.drafters.registry import make_drafter
        from nodes.engine.core import Engine
        from tools.decode_runs import hf_runner

        torch.set_num_threads(max(threads, 1))
        self.spec = spec
        self.backend = load_backend("torch", model)
        self.tokenizer = self.backend.tokenizer
        self.engines = {"plain": Engine(self.backend, None),
                        AA_ROW: Engine(self.backend, None),
                        "ngram": Engine(self.backend, make_drafter("ngram")),
                        "suffix": Engine(self.backend, make_drafter(spec))}
        self.hf = {"hf-plain": hf_runner(self.backend),
                   "hf-prompt-lookup": hf_runner(self.backend,
                                                 prompt_lookup_num_tokens=hf_lookup)}

    @property
    def suffix_index(self):
        return self.engines["suffix"].drafter.index

    def fresh_suffix(self) -> None:
        """A suffix drafter with nothing indexed (single requests)."""
        from nodes.drafters.registry import make_drafter

        self.engines["suffix"].drafter = make_drafter(self.spec)

    def run(self, name: str, ids: list[int], n: int) -> dict:
        from nodes.engine.core import GenerationParams, Stats

        _pin({CORE_VERIFIER})
        try:
            if name in self.hf:
                r = self.hf[name](ids, n)
                return _rec(r.token_ids, r.elapsed_s, 0, 0)
            stats = Stats()
            out: list[int] = []
            t0 = time.perf_counter()
            for block in self.engines[name].stream(ids, GenerationParams(max_tokens=n),
                                                   stats=stats):
                out.extend(block.token_ids)
            return _rec(out, time.perf_counter() - t0, stats.blocks, stats.drafted)
        finally:
            _pin({CORE_PROPOSER})

    def costs(self, ids: list[int], max_rows: int):
        """The prompt's prefill and verify forwards after it, measured on core 0 like the
        rows (`trace_ceiling.measure_costs`)."""
        from tools.trace_ceiling import measure_costs

        _pin({CORE_VERIFIER})
        try:
            return measure_costs(self.backend, ids, max_rows)
        finally:
            _pin({CORE_PROPOSER})

    def warm(self, ids: list[int]) -> None:
        for name in (*INPROC_ROWS, AA_ROW):
            self.run(name, ids, 8)


#: where a suffix proposer's index figures are in its stats
INDEX = ("proposer", "suffix_index")

# -- over the bus ------------------------------------------------------------------------------

class Cluster:
    """Verifiers v0, v1 (core 0, one torch thread) with suffix proposers p0, p1 (core 1);
    later a third pair (`start_late`)."""

    def __init__(self, stack: contextlib.ExitStack, model: str | None, spec: str,
                 int8: bool = False, ngram: bool = False) -> None:
        from nodes.cluster_client import ClusterClient
        from tools.local_cluster import LocalCluster

        self.log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-trace-"))
        self.model = ("--model", model) if model else ()
        self.spec = spec
        self.c = stack.enter_context(LocalCluster(log_dir=self.log_dir, mdns=False,
                                                  env={"OMP_NUM_THREADS": "1"}))
        print(f"starting 2 verifiers (core 0, 1 torch thread) and 2 suffix proposers "
              f"(core 1); logs: {self.log_dir}", file=sys.stderr, flush=True)
        vs = [self._spawn_verifier(f"v{i}") for i in range(2)]
        for v in vs:
            v.wait_ready()
        ps = [self._spawn_proposer(f"p{i}") for i in range(2)]
        if int8:  # one int8 proposer beside them, for both verifiers (--shared-int8)
            ps.append(self.c.spawn("q0", "--role", "proposer", "--drafter", "int8",
                                   "--cpus", str(CORE_PROPOSER), "--threads", "1",
                                   *self.model, seed=True))
        if ngram:  # one ngram proposer for both verifiers' bus-ngram row (--bus-ngram)
            ps.append(self.c.spawn("n0", "--role", "proposer", "--drafter", "ngram",
                                   "--cpus", str(CORE_PROPOSER), seed=True))
        for p in ps:
            p.wait_ready()
        self.nodes = {n.name: n for n in (*vs, *ps)}
        self.ngram = ngram
        #: proposers each verifier's shared row drafts with, beside its own suffix proposer
        self.extra = ("q0",) if int8 else ()
        self.cc = stack.enter_context(ClusterClient(
            self.c.cluster, peers=tuple(n.stream for n in self.nodes.values()), mdns=False))
        from nodes.telemetry import StatsWatcher

        self.tel = StatsWatcher(self.cc.node, self.c.cluster)
        self.members: dict = {}
        self._find({"v0", "v1", "p0", "p1", *self.extra, *(("n0",) if ngram else ())})
        self.published = 0  # generations the sharing verifiers ran (each one publishes)

    def _spawn_verifier(self, name: str, seed: bool = False):
        # no prefix cache: every row replays the same requests on these verifiers
        return self.c.spawn(name, "--role", "verifier", "--cpus", str(CORE_VERIFIER),
                            "--threads", "1", "--prefix-cache-mb", "0", *self.model,
                            seed=seed)

    def _spawn_proposer(self, name: str):
        return self.c.spawn(name, "--role", "proposer", "--drafter", self.spec,
                            "--cpus", str(CORE_PROPOSER), seed=True)

    def _find(self, names: set[str], timeout: float = 60.0) -> None:
        ms = self.cc.wait_for(lambda ms: names <= {m.card.name for m in ms}, timeout)
        missing = names - {m.card.name for m in ms}
        if missing:
            raise RuntimeError(f"nodes not seen by the bench client: {sorted(missing)}")
        self.members.update({m.card.name: m for m in ms if m.card.name in names})

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def generate(self, verifier: str, ids: list[int], n: int,
                 proposer: str | None = None, extra: tuple[str, ...] = ()) -> dict:
        """One request on `verifier`, drafted by `proposer` (and `extra` ones) or plain."""
        from nodes.cluster_client import GenerateRequest

        names = [proposer, *extra] if proposer else []
        req = GenerateRequest(tokens=list(ids), max_tokens=n, speculate=bool(names),
                              proposers=[self.node_id(x) for x in names] or None)
        r = self.cc.generate(req, self.members[verifier], failover=False)
        st = r.stats
        rec = _rec(st["token_ids"], st["elapsed_s"], st.get("blocks", 0), st.get("drafted", 0))
        rec["proposers_used"] = sorted(st.get("proposers") or {})
        if verifier in ("v0", "v1"):
            self.published += 1
        return rec

    def wait_indexed(self, proposers: tuple[str, ...], at_least: int,
                     timeout: float = 20.0) -> bool:
        """Until each proposer's index took `at_least` publications (telemetry, ~1 s late)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self.tel.latest(self.node_id(p), *INDEX).get("indexed", 0) >= at_least
                   for p in proposers):
                return True
            time.sleep(0.05)
        return False

    def warm(self, ids: list[int]) -> None:
        """Open connections, learn costs; each verifier must have drafted with its proposer."""
        for v, p in (("v0", "p0"), ("v1", "p1")):
            want = {self.node_id(x) for x in (p, *self.extra)}
            for _ in range(20):
                self.generate(v, ids, 8)
                used = self.generate(v, ids, 8, proposer=p, extra=self.extra)["proposers_used"]
                if want <= set(used):
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"{v} never drafted with {sorted(want)}")
            if self.ngram:
                self.generate(v, ids, 8, proposer="n0", extra=self.extra)
        if not self.wait_indexed(("p0", "p1"), self.published, 30):
            raise RuntimeError("the proposers did not index the warm-up publications")

    def start_late(self, ids: list[int]) -> dict:
        """A proposer, then a verifier, started after every answer was given."""
        p = self._spawn_proposer("p-late")
        p.wait_ready()
        self.nodes["p-late"] = p
        warm = self.wait_indexed(("p-late",), self.published, 60)
        v = self._spawn_verifier("v-late", seed=True)
        v.wait_ready()
        self.nodes["v-late"] = v
        self._find({"p-late", "v-late"})
        for _ in range(20):
            self.generate("v-late", ids, 8)
            used = self.generate("v-late", ids, 8, proposer="p-late")["proposers_used"]
            if self.node_id("p-late") in used:
                break
            time.sleep(0.5)
        return {"snapshot_indexed": warm, **self.tel.latest(self.node_id("p-late"), *INDEX)}


# -- the run -----------------------------------------------------------------------------------

def _speedups(res: dict) -> dict:
    """Per request: each row's speed over its baseline, and over ngram's speedup."""
    out = {}
    for name, r in res.items():
        ref = res.get("bus-plain") if name in BUS_ROWS else res["plain"]
        if name == "bus-plain" or not ref or not ref["tok_s"]:
            continue
        out[name] = round(r["tok_s"] / ref["tok_s"], 3)
    ng = out.get("ngram")
    vs_ngram = {n: round(s / ng, 3) for n, s in out.items() if ng and n not in ("plain", AA_ROW)}
    extra = {}
    if "hf-prompt-lookup" in res and res["hf-prompt-lookup"]["tok_s"]:
        extra["suffix_vs_hf_lookup"] = round(res["suffix"]["tok_s"]
                                             / res["hf-prompt-lookup"]["tok_s"], 3)
        if res["hf-plain"]["tok_s"]:
            extra["hf_lookup_vs_hf_plain"] = round(res["hf-prompt-lookup"]["tok_s"]
                                                   / res["hf-plain"]["tok_s"], 3)
    if "bus-ngram" in out and out.get("suffix-shared"):
        extra["shared_vs_bus_ngram"] = round(out["suffix-shared"] / out["bus-ngram"], 3)
    return {"vs_plain": out, "vs_ngram": vs_ngram, **extra}


def _identity(res: dict, decode) -> dict:
    """Each row's output against HF greedy's: token ids, and the decoded bytes."""
    ref = res["hf-plain"]["tokens"]
    ref_bytes = decode(ref).encode()
    return {n: r["tokens"] == ref and decode(r["tokens"]).encode() == ref_bytes
            for n, r in res.items()}


def _same(a: dict, b: dict) -> bool:
    return (a.get("messages"), a.get("prompt")) == (b.get("messages"), b.get("prompt"))


def _order(rows: list[str], k: int, step: int = 2) -> list[str]:
    """The rows of turn k, rotated by `step` a turn (a step sharing no factor with the row
    count puts every row on every turn)."""
    shift = (k * step) % len(rows)
    return rows[shift:] + rows[:shift]


def run_singles(inproc: InProcess, n: int, rounds: int = 1) -> list[dict]:
    """Every single request with every row, `rounds` times: the whole set once per round
    (rows in an order rotated per request and per round), each row's figure its median run.
    `plain-again` (`AA_ROW`) is the control: plain decoding by a second engine, whose ratio
    to `plain` is what the machine alone does to a ratio (an A/A test), so a worst figure
    can be told from noise.

    Why rounds over the set and not repeats of one prompt: the engines keep each source's
    long-run acceptance across generations (docs/engine.md), so a prompt run again at once
    would start from a record of itself; a round later its own blocks have decayed under
    the other prompts'. Why a median: one run's time drifts with the machine far more than
    the open-ended target's margin (one prompt's plain row, the same 64 forwards each time,
    took 3.98 to 5.51 s over five rounds with no node process running; docs/benchmarks.md)."""
    from nodes.drafters.registry import make_drafter
    from tools.prompts import PROMPTS

    prompts = [(c, t, "tools/prompts.py") for c, t in PROMPTS] + [
        (c, t, "held-out") for c, t in HELD_OUT]
    encoded = [inproc.tokenizer.encode(text, chat=True) for _, text, _ in prompts]
    runs: list[dict[str, list[dict]]] = [{name: [] for name in SINGLE_ROWS} for _ in prompts]
    identical: list[dict[str, bool]] = [dict.fromkeys(SINGLE_ROWS, True) for _ in prompts]
    loads: list[list] = [[] for _ in prompts]  # load average after each round's rows
    for r in range(rounds):
        for k, (klass, _, source) in enumerate(prompts):
            res = {}
            # rotated by one per prompt and round: with 6 rows a step of 2 would keep each
            # row on the same 3 of the 6 turns
            for name in _order(list(SINGLE_ROWS), k + r, step=1):
                if name == "suffix":
                    inproc.fresh_suffix()  # nothing indexed: a single request
                res[name] = inproc.run(name, encoded[k], n)
                runs[k][name].append(res[name])
            for name, same in _identity(res, inproc.tokenizer.decode).items():
                identical[k][name] = identical[k][name] and same
            loads[k].append(loadavg())
            ratios = _speedups(res)
            print(f"single {k + 1}/{len(prompts)} round {r + 1}/{rounds} {klass} ({source}): "
                  f"suffix/plain {ratios['vs_plain'].get('suffix')} suffix/hf-lookup "
                  f"{ratios['suffix_vs_hf_lookup']} {AA_ROW}/plain "
                  f"{ratios['vs_plain'].get(AA_ROW)} load {loads[k][-1]}",
                  file=sys.stderr, flush=True)
    out = []
    for k, (klass, text, source) in enumerate(prompts):
        res = {name: _median_run(rs) for name, rs in runs[k].items()}
        rec = {"class": klass, "source": source, "prompt": text[:60], "tokens": len(
            res["hf-plain"]["tokens"]), "rounds": rounds, "loadavg": loads[k],
            "identical_to_hf": identical[k], **_speedups(res),
            "rows": {k2: {x: v for x, v in r.items() if x != "tokens"}
                     | {"s_runs": [x["s"] for x in runs[k][k2]]} for k2, r in res.items()},
            "ceiling": _ceiling(inproc, make_drafter(inproc.spec), encoded[k], res)}
        out.append(rec)
    inproc.fresh_suffix()
    return out


def _median_run(runs: list[dict]) -> dict:
    """The run of median time (the slower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["s"])[len(runs) // 2]


def run_traces(args, inproc: InProcess, cluster: Cluster | None, names: list[str],
               answers: list | None = None) -> dict:
    """Every request of the traces, in turn, with every row; `answers` (when given) gets
    (trace, request, prompt ids, the plain and HF lookup rows) in run order (`add_ceilings`)."""
    from tools.bench_suffix import encode_request, load_trace

    traces = {name: load_trace(name)[: args.limit or None] for name in names}
    schedule = [(name, j) for j in range(max(len(t) for t in traces.values()))
                for name in names if j < len(traces[name])]
    rows = list(INPROC_ROWS) + (["bus"] if cluster else [])
    out: dict[str, list[dict]] = {name: [] for name in names}
    for k, (name, j) in enumerate(schedule):
        req = traces[name][j]
        ids = encode_request(inproc.tokenizer, req)
        n = min(int(req.get("max_tokens", args.max_tokens)), args.max_tokens)
        earlier = [i for i in range(j) if _same(traces[name][i], req)]
        res: dict[str, dict] = {}
        v = k % 2
        for row in _order(rows, k):
            if row != "bus":
                res[row] = inproc.run(row, ids, n)
                continue
            # the shared row first: the plain run's answer is published too
            indexed = cluster.wait_indexed(("p0", "p1"), cluster.published)
            res["suffix-shared"] = cluster.generate(f"v{v}", ids, n, proposer=f"p{v}",
                                                    extra=cluster.extra)
            res["suffix-shared"]["indexed_before"] = indexed
            res["bus-plain"] = cluster.generate(f"v{v}", ids, n)
            if cluster.ngram:
                res["bus-ngram"] = cluster.generate(f"v{v}", ids, n, proposer="n0",
                                                    extra=cluster.extra)
        rec = {"trace": name, "request": j, "run_order": k, "repeat_of": earlier[0] if earlier
               else None, "verifier": f"v{v}" if cluster else None, "max_tokens": n,
               "tokens": len(res["hf-plain"]["tokens"]), "loadavg": loadavg(),
               "identical_to_hf": _identity(res, inproc.tokenizer.decode), **_speedups(res),
               "rows": {r: {x: y for x, y in d.items() if x != "tokens"} for r, d in res.items()}}
        out[name].append(rec)
        if answers is not None:
            answers.append((name, j, ids, {r: res[r] for r in ("plain", "hf-prompt-lookup")}))
        print(f"{name} {j + 1}/{len(traces[name])}: vs plain {rec['vs_plain']} "
              f"identical {all(rec['identical_to_hf'].values())} load {rec['loadavg']}",
              file=sys.stderr, flush=True)
    return out


def run_late(args, inproc: InProcess, cluster: Cluster, names: list[str], warm_ids) -> dict:
    from tools.bench_suffix import encode_request, load_trace

    start = cluster.start_late(warm_ids)
    out = []
    for name in names:
        for j in range(min(args.late, len(load_trace(name)))):
            req = load_trace(name)[j]
            ids = encode_request(inproc.tokenizer, req)
            n = min(int(req.get("max_tokens", args.max_tokens)), args.max_tokens)
            res = {"late-shared": cluster.generate("v-late", ids, n, proposer="p-late"),
                   "late-shared-p0": cluster.generate("v-late", ids, n, proposer="p0"),
                   "late-plain": cluster.generate("v-late", ids, n)}
            ref = res["late-plain"]
            rec = {"trace": name, "request": j, "tokens": len(ref["tokens"]),
                   "loadavg": loadavg(),
                   "identical_to_plain": {k: r["tokens"] == ref["tokens"]
                                          for k, r in res.items()},
                   "vs_plain": {k: round(r["tok_s"] / ref["tok_s"], 3)
                                for k, r in res.items() if k != "late-plain"},
                   "rows": {k: {x: y for x, y in r.items() if x != "tokens"}
                            for k, r in res.items()}}
            out.append(rec)
            print(f"late {name} {j}: {rec['vs_plain']} load {rec['loadavg']}",
                  file=sys.stderr, flush=True)
    return {"start": start, "requests": out}


def _ceiling(inproc: InProcess, suffix, ids: list[int], res: dict) -> dict:
    """One request's oracle ceilings (tools/trace_ceiling.py) on the cost curve measured for
    its prompt here (core 0): the suffix drafter (`suffix`, replayed; its index carries on to
    the next call) and ngram (a fresh one per request), whole requests against a plain one
    on the same curve. Against HF prompt lookup: the measured plain row's time scaled by the
    ceiling's ratio."""
    from nodes.drafters.registry import make_drafter
    from tools.trace_ceiling import oracle_replay

    max_k = inproc.engines["suffix"].max_draft
    curve = inproc.costs(ids, max_k + 1)
    answer = res["plain"]["tokens"]
    sfx = oracle_replay(suffix, ids, answer, curve.verify, max_k)
    ngr = oracle_replay(make_drafter("ngram"), ids, answer, curve.verify, max_k)
    plain = curve.prefill_s + sfx.plain_s
    s_total, n_total = curve.prefill_s + sfx.drafted_s, curve.prefill_s + ngr.drafted_s
    out = {"suffix_vs_plain": round(plain / s_total, 3),
           "ngram_vs_plain": round(plain / n_total, 3),
           "suffix_vs_ngram": round(n_total / s_total, 3),
           "suffix_tok_per_fwd": round((sfx.tokens - 1) / max(sfx.forwards, 1), 2)}
    hf = res.get("hf-prompt-lookup")
    if hf and hf["s"] > 0:
        out["suffix_vs_hf_lookup"] = round(hf["s"] / (res["plain"]["s"] * s_total / plain), 3)
    return out


def add_ceilings(per_trace: dict[str, list[dict]], answers: list, inproc: InProcess) -> None:
    """Each trace request's ceilings (`_ceiling`) as `rec["ceiling"]`, the suffix drafter
    replayed over the answers in run order as the in-process row's index saw them (its
    warm-up answer aside)."""
    from nodes.drafters.registry import make_drafter

    suffix = make_drafter(inproc.spec)
    recs = {(r["trace"], r["request"]): r for rs in per_trace.values() for r in rs}
    for name, j, ids, res in answers:
        recs[name, j]["ceiling"] = _ceiling(inproc, suffix, ids, res)


def summarize(per_trace: dict[str, list[dict]], skip: int = SKIP_FIRST) -> dict:
    """Per trace and pooled: medians and the worst request, over requests `skip`.. and all."""
    def block(recs: list[dict]) -> dict:
        names = [n for n in ("ngram", "suffix", "suffix-shared", "bus-ngram", "hf-plain",
                             "hf-prompt-lookup")
                 if any(n in r["vs_plain"] for r in recs)]
        out = {}
        for n in names:
            vp = [r["vs_plain"].get(n) for r in recs]
            vn = [r["vs_ngram"].get(n) for r in recs]
            tpf = [r["rows"][n].get("tok_per_fwd") for r in recs]
            worst = min((r for r in recs if r["vs_plain"].get(n) is not None),
                        key=lambda r: r["vs_plain"][n], default=None)
            out[n] = {"vs_plain_median": _median(vp), "vs_plain_worst": _min(vp),
                      "worst_request": (worst["trace"], worst["request"]) if worst else None,
                      "vs_ngram_median": _median(vn) if n != "ngram" else None,
                      "vs_ngram_worst": _min(vn) if n != "ngram" else None,
                      "tok_per_fwd_median": _median(tpf)}
        ceil = [r["ceiling"] for r in recs if "ceiling" in r]
        if ceil:
            out["ceiling"] = {k: {"median": _median(c[k] for c in ceil),
                                  "worst": _min(c[k] for c in ceil)}
                              for k in ("suffix_vs_plain", "suffix_vs_ngram", "ngram_vs_plain",
                                        "suffix_tok_per_fwd", "suffix_vs_hf_lookup")}
        vb = [r.get("shared_vs_bus_ngram") for r in recs]
        if any(x is not None for x in vb):
            out["shared_vs_bus_ngram"] = {"median": _median(vb), "worst": _min(vb)}
        out["identical_to_hf"] = sum(all(r["identical_to_hf"].values()) for r in recs)
        out["requests"] = len(recs)
        return out

    summary = {}
    for name, recs in per_trace.items():
        summary[name] = {"all": block(recs)}
        if len(recs) > skip:
            summary[name] = {f"after {skip}": block(recs[skip:]), **summary[name]}
    pooled = [r for recs in per_trace.values() for r in recs[skip:]]
    if pooled and len(per_trace) > 1:
        summary["pooled"] = {f"after {skip}": block(pooled)}
    return summary


def summarize_singles(singles: list[dict]) -> dict:
    out = {}
    for klass in sorted({s["class"] for s in singles}):
        sel = [s for s in singles if s["class"] == klass]
        out[klass] = {
            "prompts": len(sel),
            **{f"{n}_vs_plain": {"median": _median(s["vs_plain"].get(n) for s in sel),
                                 "worst": _min(s["vs_plain"].get(n) for s in sel)}
               for n in ("ngram", "suffix", "hf-prompt-lookup", AA_ROW)},
            "suffix_vs_hf_lookup": {"median": _median(s["suffix_vs_hf_lookup"] for s in sel),
                                    "worst": _min(s["suffix_vs_hf_lookup"] for s in sel)},
            "suffix_vs_ngram": {"median": _median(s["vs_ngram"].get("suffix") for s in sel),
                                "worst": _min(s["vs_ngram"].get("suffix") for s in sel)},
            "ceiling": {k: {"median": _median(s["ceiling"][k] for s in sel),
                            "worst": _min(s["ceiling"][k] for s in sel)}
                        for k in ("suffix_vs_plain", "suffix_vs_hf_lookup")},
            "identical_to_hf": sum(all(s["identical_to_hf"].values()) for s in sel),
        }
    return out


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(doc: dict) -> None:
    print(f"trace decode benchmark: up to {doc['max_tokens']} new tokens per request; "
          f"{doc['pinning']}; load average {doc['loadavg_start']} -> {doc['loadavg_end']}; "
          f"the shared row drafts with {doc.get('shared_proposers', 'suffix')}"
          + (f", the bus-ngram row with {doc['bus_ngram_proposers']}"
             if doc.get("bus_ngram_proposers") else ""))
    for name, s in doc["summary"].items():
        for label, b in s.items():
            print(f"\n{name} ({label}, {b['requests']} requests, {b['identical_to_hf']} with "
                  "every row identical to HF greedy)")
            print(f"  {'row':17s} {'vs plain':>8s} {'worst':>6s} {'vs ngram':>8s} "
                  f"{'worst':>6s} {'tok/fwd':>7s}  worst request")
            for row, r in b.items():
                if not isinstance(r, dict) or row in ("ceiling", "shared_vs_bus_ngram"):
                    continue
                print(f"  {row:17s} {_fmt(r['vs_plain_median']):>8s} "
                      f"{_fmt(r['vs_plain_worst']):>6s} {_fmt(r['vs_ngram_median']):>8s} "
                      f"{_fmt(r['vs_ngram_worst']):>6s} {_fmt(r['tok_per_fwd_median']):>7s}"
                      f"  {r['worst_request']}")
            c = b.get("ceiling")
            if c:
                print(f"  {'suffix ceiling':17s} {_fmt(c['suffix_vs_plain']['median']):>8s} "
                      f"{_fmt(c['suffix_vs_plain']['worst']):>6s} "
                      f"{_fmt(c['suffix_vs_ngram']['median']):>8s} "
                      f"{_fmt(c['suffix_vs_ngram']['worst']):>6s} "
                      f"{_fmt(c['suffix_tok_per_fwd']['median']):>7s}  (oracle verifier; "
                      f"ngram's {_fmt(c['ngram_vs_plain']['median'])}x plain)")
            vb = b.get("shared_vs_bus_ngram")
            if vb:
                print(f"  suffix-shared vs bus-ngram (same verifier, same bus): "
                      f"{_fmt(vb['median'])}x (worst {_fmt(vb['worst'])}x)")
    late = doc.get("late")
    if late:
        print("\nasked again on a verifier and a proposer started after the answers "
              f"(snapshot: {late['start']})")
        print(f"  {'trace':12s} {'req':>3s} {'tokens':>6s} {'late-shared':>11s} "
              f"{'via p0':>7s} {'tok/fwd':>7s} identical")
        for r in late["requests"]:
            print(f"  {r['trace']:12s} {r['request']:3d} {r['tokens']:6d} "
                  f"{_fmt(r['vs_plain']['late-shared']):>11s} "
                  f"{_fmt(r['vs_plain']['late-shared-p0']):>7s} "
                  f"{_fmt(r['rows']['late-shared']['tok_per_fwd']):>7s} "
                  f"{all(r['identical_to_plain'].values())}")
    singles = doc.get("singles_summary")
    if singles:
        rounds = doc["singles"][0].get("rounds", 1)
        print("\nsingle requests, nothing indexed (fresh suffix drafter per prompt; each row "
              f"its median of {rounds} rounds)")
        for klass, s in singles.items():
            print(f"  {klass} ({s['prompts']} prompts, {s['identical_to_hf']} identical): "
                  + "; ".join(f"{k} {v['median']:.2f}x (worst {v['worst']:.2f}x)"
                              for k, v in s.items() if isinstance(v, dict) and k != "ceiling"))
            print("    suffix ceiling (oracle verifier): " + "; ".join(
                f"{k} {_fmt(v['median'])}x (worst {_fmt(v['worst'])}x)"
                for k, v in s["ceiling"].items()))
    idx = doc.get("index")
    if idx:
        print(f"\nsuffix index (in process): {idx}")


def run_trace(args) -> int:
    names = trace_names(args.trace)
    from tools.bench_suffix import TRACES

    for name in names:
        if not (TRACES / f"{name}.json").exists():
            print(f"specbus bench decode: no trace {name!r}", file=sys.stderr)
            return 2
    for flag, on in (("--shared-int8", args.shared_int8), ("--bus-ngram", args.bus_ngram)):
        if on and args.no_cluster:
            print(f"specbus bench decode: {flag} needs the cluster (not --no-cluster)",
                  file=sys.stderr)
            return 2
    start_load = loadavg()
    t_start = time.monotonic()
    # SIGTERM (and SIGINT, which a shell's background job ignores) end the run through the
    # exit stack, so the node processes are stopped, never orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _pin({CORE_PROPOSER})  # threads made from here on (the bus client's) sit on core 1
    inproc = InProcess(args.model, args.suffix_spec, args.hf_lookup, args.threads or 1)
    warm_ids = inproc.tokenizer.encode("Count from one to ten.", chat=True)
    inproc.warm(warm_ids)
    doc: dict = {
        "command": "specbus bench decode " + " ".join(sys.argv[3:] if sys.argv[1:3] == [
            "bench", "decode"] else sys.argv[1:]),
        "traces": names, "max_tokens": args.max_tokens, "limit": args.limit,
        "suffix_spec": args.suffix_spec, "hf_prompt_lookup_num_tokens": args.hf_lookup,
        "pinning": ("in-process rows and HF: this thread on core 0, 1 torch thread; "
                    + ("verifiers on core 0 (1 torch thread), suffix proposers on core 1"
                       + (", an int8 proposer on core 1 (1 torch thread) drafting with "
                          "them in the shared row" if args.shared_int8 else "")
                       + (", an ngram proposer on core 1 for the bus-ngram row"
                          if args.bus_ngram else "")
                       if not args.no_cluster else "no cluster")),
        "shared_proposers": "suffix+int8" if args.shared_int8 else "suffix",
        "bus_ngram_proposers": (("ngram+int8" if args.shared_int8 else "ngram")
                                if args.bus_ngram else None),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "loadavg_start": start_load,
    }
    with contextlib.ExitStack() as stack:
        if args.singles:  # in process only: before the cluster's idle nodes share core 0
            doc["singles"] = run_singles(inproc, args.max_tokens, args.singles_rounds)
            doc["singles_summary"] = summarize_singles(doc["singles"])
        cluster = None
        if not args.no_cluster:
            cluster = Cluster(stack, args.model, args.suffix_spec, args.shared_int8,
                              args.bus_ngram)
            cluster.warm(warm_ids)
        answers: list = []
        per_trace = run_traces(args, inproc, cluster, names, answers)
        add_ceilings(per_trace, answers, inproc)
        doc["requests"] = per_trace
        doc["summary"] = summarize(per_trace)
        stats = inproc.suffix_index.stats()
        doc["index"] = {**stats, "bytes_per_million_tokens": round(
            stats["bytes"] / max(stats["tokens"], 1) * 1e6)}
        if cluster is not None:
            doc["proposer_index"] = {p: cluster.tel.latest(cluster.node_id(p), *INDEX)
                                     for p in ("p0", "p1")}
            if args.late > 0:
                doc["late"] = run_late(args, inproc, cluster, names, warm_ids)
    doc["loadavg_end"] = loadavg()
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    print_report(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
