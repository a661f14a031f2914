"""Gateway figures and their Prometheus text rendering (`GET /metrics`).

Two sources: what the gateway counts itself (requests by endpoint and status, tokens, failovers,
cancellations, speculation figures from each `done`, request latencies), and what the cluster's
nodes publish in their telemetry (verifier active/queued/tok/s/acceptance, proposer drafts).
Owned by the gateway's asyncio thread; telemetry arrives there as messages, never as a shared
dict.

Beside the `specbus_*` names, the figures dashboards already read are served under vLLM's own
names (`vllm:` prefix, `model_name` label): its speculative-decoding counters and its request
histograms (time to first token, time per output token, end-to-end latency, queue time), as
measured at this gateway (docs/api.md, Metrics).
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


#: vLLM's buckets for its request histograms (vllm/v1/metrics/loggers.py), so that its
#: dashboards' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: name, help, buckets of each request histogram, keyed as `observe_request` takes them
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",
             "Time from the request's arrival to its first output token", TTFT_BUCKETS),
    "tpot": ("vllm:time_per_output_token_seconds",
             "Mean time per output token after the first, per request", TPOT_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds",
            "Time from the request's arrival to its last token", LATENCY_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds",
              "Time from the request's arrival until a verifier took it (the gateway's queue)",
              LATENCY_BUCKETS),
}
#: draft positions counted per position (vLLM's num_accepted_tokens_per_pos); deeper ones are
#: left out
MAX_POSITIONS = 32


class Histogram:
    """Counts per bucket, a sum and a count (one label set)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out


#: entries kept in each table keyed by something a peer chooses (node ids in telemetry and in
#: a verifier's per-proposer figures); the least recently updated go first
MAX_TRACKED = 256


class Bounded(OrderedDict):
    """A dict of at most `limit` entries; setting or touching a key makes it the newest, and
    the oldest goes when the limit is passed. Missing keys get `factory()` (like defaultdict)."""

    def __init__(self, limit: int, factory=None) -> None:
        super().__init__()
        self.limit = limit
        self.factory = factory

    def __missing__(self, key):
        if self.factory is None:
            raise KeyError(key)
        self[key] = value = self.factory()
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # keyed by route: bounded
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.failovers = 0
        self.cancelled = 0
        self.stream_errors = 0
        self.body_timeouts = 0  # requests whose body did not arrive in time (408)
        self.stats_refused = 0  # telemetry from a sender that is not a member
        self.per_verifier: dict[str, dict[str, float]] = Bounded(
            MAX_TRACKED, lambda: defaultdict(float))
        self.per_proposer: dict[str, dict[str, float]] = Bounded(
            MAX_TRACKED, lambda: defaultdict(float))
        self.proposer_names: dict[str, str] = Bounded(MAX_TRACKED)
        #: node id -> its last `stats` payload
        self.telemetry: dict[str, dict[str, Any]] = Bounded(MAX_TRACKED)
        #: per served model: vLLM's spec-decode counters and request histograms
        self.per_model: dict[str, dict[str, Any]] = Bounded(MAX_TRACKED, _model_figures)

    # -- counting (asyncio thread) ------------------------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def observe_request(self, model: str, seconds: dict[str, float]) -> None:
        """A finished request's latencies (`HISTOGRAMS` keys; the ones measured)."""
        m = self.per_model[model]
        for key, value in seconds.items():
            if key in HISTOGRAMS and value is not None and math.isfinite(value) and value >= 0:
                m[key].observe(value)

    def count_done(self, verifier: str, prompt_tokens: int, completion_tokens: int,
                   stats: dict[str, Any], model: str | None = None) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if model is not None:
            m = self.per_model[model]
            m["prompt_tokens"] += prompt_tokens
            m["generation_tokens"] += completion_tokens
            m["requests"] += 1
            for key, name in (("spec_blocks", "drafts"), ("drafted", "draft_tokens"),
                              ("accepted", "accepted_tokens")):
                n = _num(stats.get(key))
                if n is not None and n >= 0:
                    m[name] += n
            per_pos = stats.get("accepted_per_pos")  # when the verifier reports it
            if isinstance(per_pos, list):
                for pos, n in enumerate(per_pos[:MAX_POSITIONS]):
                    n = _num(n)
                    if n is not None and n >= 0:
                        m["per_pos"][pos] += n
        v = self.per_verifier[verifier]
        v["generations"] += 1
        v["tokens"] += completion_tokens
        for key in ("drafted", "accepted"):
            n = _num(stats.get(key))
            if n is not None and n >= 0:
                v[key] += n
        proposers = stats.get("proposers")
        if isinstance(proposers, dict):
            for pid, figures in list(proposers.items())[:64]:
                if not isinstance(figures, dict):
                    continue
                p = self.per_proposer[str(pid)]
                for key in ("drafted", "accepted", "verified", "timeouts"):
                    n = _num(figures.get(key))
                    if n is not None and n >= 0:
                        p[key] += n
                if isinstance(figures.get("name"), str):
                    self.proposer_names[str(pid)] = figures["name"]

    def on_stats(self, node_id: str, stats: dict[str, Any]) -> None:
        self.telemetry[node_id] = stats

    def forget(self, node_id: str) -> None:
        self.telemetry.pop(node_id, None)

    # -- rendering ------------------------------------------------------------------------------
    def render(self, verifiers: list, inflight: dict[str, int], queued: int = 0,
               queue_refused: int = 0, prefix_routed: int = 0) -> bytes:
        """The Prometheus text exposition of every figure, through `prometheus_client` (its
        format, escaping and content type, `CONTENT_TYPE`); built from this object's state
        at scrape time, on the asyncio thread that owns it."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(list(self._families(verifiers, inflight, queued,
                                                        queue_refused, prefix_routed))))
        return generate_latest(registry)

    def _families(self, verifiers: list, inflight: dict[str, int], queued: int = 0,
                  queue_refused: int = 0, prefix_routed: int = 0):
        def family(name: str, kind: str, help_: str, labels: tuple[str, ...],
                   samples: list[tuple[tuple[str, ...], float]]):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(name, help_, labels=list(labels))
            for values, value in samples:
                fam.add_metric([str(v)[:100] for v in values], value)
            return fam

        yield family("specbus_gateway_requests_total", "counter",
                     "HTTP requests by endpoint and status", ("endpoint", "status"),
                     [((e, str(st)), n) for (e, st), n in sorted(self.requests.items())])
        yield family("specbus_gateway_tokens_total", "counter", "Tokens served", ("kind",),
                     [(("prompt",), self.prompt_tokens),
                      (("completion",), self.completion_tokens)])
        for name, help_, value in (
                ("failovers", "Generations resumed on another verifier", self.failovers),
                ("cancelled", "Generations cancelled because the client went away",
                 self.cancelled),
                ("stream_errors", "Streams ended by an error event", self.stream_errors),
                ("body_timeouts", "Requests answered 408: their body did not arrive within "
                 "the deadline", self.body_timeouts)):
            yield family(f"specbus_gateway_{name}_total", "counter", help_, (), [((), value)])
        yield family("specbus_gateway_queued", "gauge",
                     "Requests waiting in the gateway's queue for a verifier slot", (),
                     [((), queued)])
        yield family("specbus_gateway_queue_refused_total", "counter",
                     "Requests answered 429 because the gateway's queue was full or their "
                     "wait in it ran out", (), [((), queue_refused)])
        yield family("specbus_gateway_prefix_routed_total", "counter",
                     "Generations sent to the verifier that served the conversation they "
                     "continue (its prefix cache holds it)", (), [((), prefix_routed)])
        drafted = sum(v["drafted"] for v in self.per_verifier.values())
        accepted = sum(v["accepted"] for v in self.per_verifier.values())
        yield family("specbus_gateway_acceptance", "gauge",
                     "Accepted / drafted tokens over all generations served", (),
                     [((), accepted / drafted if drafted else 0.0)])

        yield from self._vllm_families()

        names = {v.node_id: v for v in verifiers}
        ids = sorted(set(names) | set(self.per_verifier))
        vlabels = ("verifier", "name", "model")

        def vl(node_id: str) -> tuple[str, str, str]:
            info = names.get(node_id)
            return node_id, info.name if info else "", info.model if info else ""

        yield family("specbus_verifier_up", "gauge",
                     "1 for an alive verifier the gateway can use", vlabels,
                     [(vl(i), 1.0 if i in names else 0.0) for i in ids])
        yield family("specbus_verifier_gateway_inflight", "gauge",
                     "Requests this gateway has in flight on the verifier", vlabels,
                     [(vl(i), inflight.get(i, 0)) for i in ids])
        for key, help_ in (("generations", "Generations served via this gateway"),
                           ("tokens", "Completion tokens served"),
                           ("drafted", "Draft tokens verified"),
                           ("accepted", "Draft tokens accepted")):
            yield family(f"specbus_verifier_{key}_total", "counter", help_, vlabels,
                         [(vl(i), self.per_verifier[i][key]) for i in ids
                          if i in self.per_verifier])
        for name, key, help_ in (
                ("active", "active", "Generations running (verifier telemetry)"),
                ("queued", "queued", "Generations queued (verifier telemetry)"),
                ("completed", "generations", "Generations completed, all clients (telemetry)"),
                ("tok_s", "tok_s", "Tokens/s of its last generation (verifier telemetry)"),
                ("acceptance", "acceptance", "Acceptance of its last generation, any client's "
                 "(telemetry); specbus_verifier_acceptance_cumulative is the running figure"),
                ("orphans_dropped", "orphans_dropped",
                 "Requests dropped because their client left or died (verifier telemetry)"),
                ("max_batch", "max_batch", "Generations it steps together (--max-batch)"),
                ("steps", "steps", "Batched engine steps (verifier telemetry)"),
                ("stepped", "stepped",
                 "Sequences those steps carried; stepped / steps is the mean batch size"),
                ("rows", "rows", "Positions those steps fed; rows / steps per forward"),
                ("committed", "committed",
                 "Tokens those steps committed; committed / stepped per forward per sequence"),
                ("prompt_reused", "reused",
                 "Prompt positions started from its prefix cache instead of prefilled"),
                ("acceptance_cumulative_all_clients", "acceptance_cumulative",
                 "Cumulative: accepted / drafted tokens over every generation the verifier "
                 "served since it started, any client's (verifier telemetry)"),
                ("drafted_all_clients", "drafted", "Cumulative: draft tokens the verifier "
                 "verified since it started, any client's (verifier telemetry)"),
                ("accepted_all_clients", "accepted", "Cumulative: draft tokens the verifier "
                 "accepted since it started, any client's (verifier telemetry)")):
            samples = []
            for i in names:  # alive ones only: a dead verifier's last report is stale
                v = (self.telemetry.get(i) or {}).get("verifier")
                n = _num(v.get(key)) if isinstance(v, dict) else None
                if n is not None:
                    samples.append((vl(i), n))
            yield family(f"specbus_verifier_{name}", "gauge", help_, vlabels, samples)
        # the batch figures as ratios of those counters, since the verifier started
        for name, num, den, help_ in (
                ("batch_mean", "stepped", "steps", "Mean sequences per batched step"),
                ("rows_per_forward", "rows", "steps", "Mean positions fed per batched step"),
                ("tokens_per_forward_per_sequence", "committed", "stepped",
                 "Mean tokens a sequence commits per step it is in (speculation's gain)")):
            samples = []
            for i in names:
                v = (self.telemetry.get(i) or {}).get("verifier")
                if not isinstance(v, dict):
                    continue
                a, b = _num(v.get(num)), _num(v.get(den))
                if a is not None and b:
                    samples.append((vl(i), a / b))
            yield family(f"specbus_verifier_{name}", "gauge", help_, vlabels, samples)

        yield family("specbus_verifier_acceptance_cumulative", "gauge",
                     "Accepted / drafted tokens over every generation served via this gateway",
                     vlabels, [(vl(i), _ratio(self.per_verifier[i])) for i in ids
                               if i in self.per_verifier])
        # what each verifier knows of each proposer since it started (its links), any client's
        samples = []
        for i in names:
            v = (self.telemetry.get(i) or {}).get("verifier")
            links = v.get("proposers") if isinstance(v, dict) else None
            if not isinstance(links, dict):
                continue
            for pid, link in list(links.items())[:64]:
                n = _num(link.get("acceptance")) if isinstance(link, dict) else None
                if n is not None:
                    name = link.get("name") if isinstance(link.get("name"), str) else ""
                    samples.append(((i, str(pid), name[:100]), n))
        yield family("specbus_proposer_acceptance_cumulative_at_verifier", "gauge",
                     "Cumulative: accepted / verified tokens of the proposer's drafts over every "
                     "generation the verifier served since it started, any client's (verifier "
                     "telemetry)", ("verifier", "proposer", "name"), samples)
        pids = sorted(self.per_proposer)
        yield family("specbus_proposer_acceptance_cumulative", "gauge",
                     "Accepted / drafted tokens of the proposer's drafts over every generation "
                     "served via this gateway", ("proposer", "name"),
                     [((p, self.proposer_names.get(p, "")), _ratio(self.per_proposer[p]))
                      for p in pids])
        for key in ("drafted", "accepted", "verified", "timeouts"):
            yield family(f"specbus_proposer_{key}_total", "counter",
                         f"Per-proposer {key} tokens/replies in generations served via this "
                         "gateway", ("proposer", "name"),
                         [((p, self.proposer_names.get(p, "")), self.per_proposer[p][key])
                          for p in pids])
        samples = []
        for node_id, stats in sorted(self.telemetry.items()):
            p = stats.get("proposer")
            if not isinstance(p, dict):
                continue
            for key in ("draft_tokens", "drafts_served", "sessions_open", "confirmed",
                        "acceptance_cumulative"):
                n = _num(p.get(key))
                if n is not None:
                    samples.append(((node_id, key), n))
        yield family("specbus_proposer_telemetry", "gauge",
                     "Proposer figures from its telemetry (draft_tokens, drafts_served, "
                     "sessions_open; cumulative since it started: confirmed, drafted tokens "
                     "its verifiers' commits confirmed, and acceptance_cumulative = confirmed "
                     "/ draft_tokens)", ("proposer", "figure"), samples)


    def _vllm_families(self):
        """vLLM's names for the same figures, per served model (`model_name`)."""
        models = sorted(self.per_model)
        label = ["model_name"]
        for name, key, help_ in (
                ("vllm:spec_decode_num_drafts", "drafts",
                 "Speculative blocks verified (drafts), as vLLM counts them"),
                ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens verified"),
                ("vllm:spec_decode_num_accepted_tokens", "accepted_tokens",
                 "Draft tokens accepted"),
                ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests"),
                ("vllm:generation_tokens", "generation_tokens", "Tokens generated"),
                ("vllm:request_success", "requests", "Requests finished")):
            fam = CounterMetricFamily(name, help_, labels=label)
            for model in models:
                fam.add_metric([model[:100]], self.per_model[model][key])
            yield fam
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at `position` was accepted (when the "
                                  "verifiers report it)", labels=["model_name", "position"])
        for model in models:
            for pos, n in sorted(self.per_model[model]["per_pos"].items()):
                fam.add_metric([model[:100], str(pos)], n)
        yield fam
        for key, (name, help_, _) in HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, help_, labels=label)
            for model in models:
                h = self.per_model[model][key]
                fam.add_metric([model[:100]], h.buckets(), sum_value=h.sum)
            yield fam


def _model_figures() -> dict[str, Any]:
    out: dict[str, Any] = defaultdict(float)
    out["per_pos"] = defaultdict(float)
    for key, (_, _, bounds) in HISTOGRAMS.items():
        out[key] = Histogram(bounds)
    return out


def _ratio(figures: dict[str, float]) -> float:
    drafted = figures.get("drafted", 0.0)
    return figures.get("accepted", 0.0) / drafted if drafted else 0.0


class _Snapshot:
    """A prometheus_client collector over families built for one scrape."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)
