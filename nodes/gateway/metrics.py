"""Gateway figures and their Prometheus text rendering (`GET /metrics`).

Two sources: what the gateway counts itself (requests by endpoint and status, tokens, failovers,
cancellations, speculation figures from each `done`), and what the cluster's nodes publish in
their telemetry (verifier active/queued/tok/s/acceptance, proposer drafts). Owned by the
gateway's asyncio thread; telemetry arrives there as messages, never as a shared dict.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


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

    # -- counting (asyncio thread) ------------------------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def count_done(self, verifier: str, prompt_tokens: int, completion_tokens: int,
                   stats: dict[str, Any]) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
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
                ("acceptance", "acceptance", "Acceptance of its last generation (telemetry)"),
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
                 "Prompt positions started from its prefix cache instead of prefilled")):
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

        pids = sorted(self.per_proposer)
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
            for key in ("draft_tokens", "drafts_served", "sessions_open"):
                n = _num(p.get(key))
                if n is not None:
                    samples.append(((node_id, key), n))
        yield family("specbus_proposer_telemetry", "gauge",
                     "Proposer figures from its telemetry (draft_tokens, drafts_served, "
                     "sessions_open)", ("proposer", "figure"), samples)


class _Snapshot:
    """A prometheus_client collector over families built for one scrape."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)
