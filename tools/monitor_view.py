"""The monitor's model of the cluster: members, latest telemetry, short histories, event log.

Fed from the observer node's threads (membership events, `stats` gossip on the I/O thread) and
read by the renderers (JSON lines, the snapshot, the terminal UI); one lock guards it all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from discovery.cards import printable
from discovery.table import Event, Member

HISTORY = 60  # samples kept per sparkline (about a minute at one stats message per second)
LOG_LINES = 200
MAX_STATS = 256  # senders whose telemetry is kept before only members' is


@dataclass
class NodeStats:
    latest: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0  # monotonic time of the latest stats
    tok_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    acceptance: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    draft_tok_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # per wall s
    last_drafted: float | None = None  # the proposer's draft_tokens at the previous sample
    last_at: float = 0.0
    #: a verifier's batch figures (mean batch, rows per forward, tokens per forward per
    #: sequence) over the latest stats interval in which it stepped; before two samples, over
    #: its whole life
    batch: dict[str, float] | None = None
    last_steps: tuple[float, ...] | None = None  # its (steps, stepped, rows, committed) then
    #: seconds the batch figures are over (the stats interval they came from); None: they are
    #: since the verifier started (one sample only, or it restarted)
    batch_window_s: float | None = None
    #: seconds the latest `draft_tok_s` sample is over (the interval between two stats)
    draft_window_s: float | None = None


class ClusterView:
    """Thread-safe state of what the monitor has seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._stats: dict[str, NodeStats] = {}
        self.log: deque[str] = deque(maxlen=LOG_LINES)
        self.log_total = 0  # lines ever logged (the deque forgets old ones)

    def on_event(self, ev: Event) -> dict[str, Any]:
        """Record a membership event; returns its JSON-line form."""
        m = ev.member
        with self._lock:
            self._members[m.node_id] = m
            self.log.append(f"{time.strftime('%H:%M:%S')} {ev.kind:8} {_label(m)}")
            self.log_total += 1
        return {"event": ev.kind, "node_id": m.node_id, "ts": time.time(), **member_fields(m)}

    def on_stats(self, node_id: str, stats: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if node_id not in self._members and len(self._stats) >= MAX_STATS:
                # telemetry keyed by whoever sends it: bounded, members' first
                return {"event": "stats", "node_id": node_id, "ts": time.time(), "stats": {}}
            ns = self._stats.setdefault(node_id, NodeStats())
            previous_at = ns.at
            ns.latest, ns.at = stats, time.monotonic()
            v, p = stats.get("verifier"), stats.get("proposer")
            if isinstance(v, dict):
                ns.tok_s.append(float(v.get("tok_s") or 0.0))
                ns.acceptance.append(float(v.get("acceptance") or 0.0))
                _batch_figures(ns, v, ns.at - previous_at if previous_at else None)
            if isinstance(p, dict):
                # tokens drafted per second of wall time (from the counter's growth): what a
                # proposer gives; its own `draft_tok_s` is its speed while drafting, which for an
                # index lookup runs to six digits and says nothing of the work done
                drafted = p.get("draft_tokens")
                if isinstance(drafted, int | float) and ns.last_drafted is not None:
                    dt = ns.at - ns.last_at
                    if dt > 0:
                        ns.draft_tok_s.append(max(0.0, (drafted - ns.last_drafted) / dt))
                        ns.draft_window_s = dt
                if isinstance(drafted, int | float):
                    ns.last_drafted, ns.last_at = float(drafted), ns.at
        return {"event": "stats", "node_id": node_id, "ts": time.time(), "stats": stats}

    def refresh(self, members: list[Member]) -> None:
        """Mirror the membership table (heartbeat ages move on; members it forgot go); an
        observer that left or died (a `members` run, another monitor) goes at once."""
        with self._lock:
            self._members = {m.node_id: m for m in members if not m.is_self and not (
                m.card.observer and m.state.value in ("left", "dead"))}
            for node_id in [n for n in self._stats if n not in self._members]:
                del self._stats[node_id]

    def new_log_lines(self, seen: int) -> tuple[list[str], int]:
        """Log lines after the first `seen` ever logged, and the new total."""
        with self._lock:
            fresh = min(self.log_total - seen, len(self.log))
            return (list(self.log)[len(self.log) - fresh:] if fresh > 0 else []), self.log_total

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.card.name, m.node_id))

    def stats(self, node_id: str) -> NodeStats | None:
        with self._lock:
            ns = self._stats.get(node_id)
            if ns is None:
                return None
            return NodeStats(dict(ns.latest), ns.at, deque(ns.tok_s, HISTORY),
                             deque(ns.acceptance, HISTORY), deque(ns.draft_tok_s, HISTORY),
                             ns.last_drafted, ns.last_at,
                             None if ns.batch is None else dict(ns.batch), ns.last_steps,
                             ns.batch_window_s, ns.draft_window_s)

    def snapshot(self) -> dict[str, Any]:
        """Everything, as one JSON-able object (`--once --json`)."""
        out = []
        for m in self.members():
            ns = self.stats(m.node_id)
            out.append({**member_fields(m), "node_id": m.node_id,
                        "stats": ns.latest if ns else {}})
        return {"members": out, "ts": time.time()}


BATCH_COUNTERS = ("steps", "stepped", "rows", "committed")


def _batch_figures(ns: NodeStats, v: dict[str, Any], interval_s: float | None) -> None:
    """Update a verifier's batch figures from its cumulative step counters (issue 24):
    sequences per step, positions fed per step (rows per forward) and tokens committed per
    sequence per step. Over the growth since the previous sample when it stepped meanwhile
    (what it does now), else kept; the first sample gives the means since it started."""
    now = []
    for key in BATCH_COUNTERS:
        n = v.get(key)
        if isinstance(n, bool) or not isinstance(n, int | float) or n < 0:
            return  # an older verifier, or a malformed report: no figures
        now.append(float(n))
    prev = ns.last_steps
    since_start = prev is None or now[0] < prev[0]  # a restarted verifier counts from 0 again
    grew = now if since_start else [a - b for a, b in zip(now, prev, strict=True)]
    ns.last_steps = tuple(now)
    steps, stepped, rows, committed = grew
    if steps > 0 and stepped > 0:
        ns.batch = {"mean_batch": stepped / steps, "rows_per_forward": rows / steps,
                    "tokens_per_forward_per_seq": committed / stepped}
        ns.batch_window_s = None if since_start else interval_s


def member_fields(m: Member) -> dict[str, Any]:
    c = m.card
    return {
        "name": c.name, "roles": list(c.roles), "backend": c.backend, "model": c.model,
        "drafter": card_drafter(c), "state": m.state.value, "incarnation": c.incarnation,
        "load": c.load, "tok_s": c.tok_s,
        "heartbeat_age_s": round(max(0.0, time.monotonic() - m.last_heard), 2),
        "endpoints": dict(c.endpoints), "observer": c.observer,
        "insecure": bool(c.extras.get("insecure")),
        "kv_bound": card_kv_bound(c),
    }


def card_kv_bound(card) -> str:
    """A verifier's bounded K/V as its card says it (`extras.kv_bound`, [sink, window]:
    `--kv-sink/--kv-window`, and `extras.kv_positions`, where the sinks sit), e.g.
    "kv 4+64 reindexed", or "" for full attention."""
    extras = card.extras if isinstance(card.extras, dict) else {}
    got = extras.get("kv_bound")
    if (isinstance(got, list | tuple) and len(got) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in got)):
        mode = extras.get("kv_positions")
        mode = f" {printable(mode, 16)}" if isinstance(mode, str) and mode else ""
        return f"kv {got[0]}+{got[1]}{mode}"
    return ""


def card_drafter(card) -> str:
    """The drafter a node's card names (`extras.drafter`: a proposer's, e.g. `suffix`, `ngram`,
    `int8`, `eagle`, `model:<ref>`), or "" when it names none (a plain verifier, a gateway)."""
    name = card.extras.get("drafter") if isinstance(card.extras, dict) else None
    return printable(name, 40) if isinstance(name, str) else ""


def _label(m: Member) -> str:
    name = m.card.name or "-"
    roles = ",".join(m.card.roles) or ("observer" if m.card.observer else "-")
    return f"{name} ({m.node_id}, {roles})"


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 20) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    hi = max(vals)
    if hi <= 0:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / hi * (len(SPARK) - 1)))] for v in vals)


def rate_text(per_s: float, width: int = 8) -> str:
    """A rate in `width` characters: one decimal below 1000, then thousands or millions. An
    n-gram drafter matches in microseconds, so its tokens per drafting second run to six
    digits; the exact figure there says nothing more than its magnitude."""
    if per_s < 1000:
        return f"{per_s:{width}.1f}"
    if per_s < 1_000_000:
        return f"{per_s / 1000:{width - 1}.0f}k"
    return f"{per_s / 1_000_000:{width - 1}.0f}M"


def member_rows(view: ClusterView) -> list[tuple[str, ...]]:
    """Rows of the members table: name, id, roles, backend, model, drafter, state, inc, hb age,
    load (the node's own figure from its telemetry: generations running and queued on a
    verifier, open sessions on a proposer, requests in flight on a gateway; the card's until
    its first stats arrive)."""
    rows = []
    for m in view.members():
        f = member_fields(m)
        roles = ",".join(f["roles"]) or ("observer" if f["observer"] else "-")
        ns = view.stats(m.node_id)
        load = ns.latest.get("load") if ns is not None else None
        if isinstance(load, bool) or not isinstance(load, int | float):
            load = f["load"]
        model = " ".join(x for x in (f["model"], f["kv_bound"]) if x)  # the bound beside it
        rows.append((display_name(m), m.node_id, roles, f["backend"] or "-", model or "-",
                     f["drafter"] or "-", f["state"] + (" INSECURE" if f["insecure"] else ""),
                     str(f["incarnation"]), f"{f['heartbeat_age_s']:.1f}s",
                     f"{float(load):.2f}"))
    return rows


MEMBER_COLUMNS = ("name", "id", "roles", "backend", "model", "drafter", "state", "inc", "heartbeat",
                  "load")


SPARK_WIDTH = 16


def display_name(m: Member) -> str:
    """A member as the panels name it: its card name, else its id (never `-`)."""
    return printable(m.card.name or m.node_id, 16)


def role_lines(view: ClusterView) -> tuple[list[str], list[str], list[str]]:
    """Text lines of the verifier, proposer and gateway panels, each under 110 columns.

    Units, the same word for the same thing everywhere: a verifier's `steps` with a proposer
    are its verify steps whose tree held that proposer's tokens; a proposer's `chunks` are the
    draft messages it streamed; `drafted` is tokens drafted per second of wall time."""
    verifiers, proposers, gateways = [], [], []
    for m in view.members():
        ns = view.stats(m.node_id)
        if ns is None:
            continue
        name = display_name(m)
        latest = ns.latest
        v, p, g = latest.get("verifier"), latest.get("proposer"), latest.get("gateway")
        if isinstance(v, dict):
            speed = sparkline(ns.tok_s, SPARK_WIDTH).ljust(SPARK_WIDTH)
            accept = sparkline(ns.acceptance, SPARK_WIDTH).ljust(SPARK_WIDTH)
            verifiers.append(
                f"{name:16} last gen {v.get('tok_s', 0):6.1f} tok/s {speed} accept "
                f"{v.get('acceptance', 0):4.2f} {accept} now {v.get('active', 0)} active "
                f"{v.get('queued', 0)} queued")
            if "max_batch" in v:
                verifiers.append(batch_line(v, ns.batch, ns.batch_window_s))
                reused = v.get("reused")
                cumulative = v.get("acceptance_cumulative")
                verifiers.append(f"  total: steps {v.get('steps', 0)}" + (
                    f"  accept {cumulative:4.2f} of {v.get('drafted', 0)} drafted"
                    if isinstance(cumulative, (int, float)) and not isinstance(cumulative, bool)
                    else "") + (
                    f"  prompt reused {reused}" if isinstance(reused, int) and not isinstance(
                        reused, bool) and reused > 0 else ""))
            links = v.get("proposers")
            for pid, ps in (links.items() if isinstance(links, dict) else ()):
                if not isinstance(ps, dict):
                    continue
                label = printable(ps.get("name") or pid, 22)
                verifiers.append(
                    f"  └ {label:22} total: accept {ps.get('acceptance', 0):4.2f} steps "
                    f"{ps.get('drafts', 0):6} timeouts {ps.get('timeouts', 0):4}  last rtt "
                    f"{_rtt(ps.get('rtt_ms'))}")
        if isinstance(p, dict):
            rate = ns.draft_tok_s[-1] if ns.draft_tok_s else 0.0
            drafter = printable(card_drafter(m.card) or "-", 24)
            proposers.append(
                f"{name:16} drafter {drafter:24}  now {p.get('sessions_open', 0):3} sessions  "
                f"total {p.get('drafts_served', 0):7} chunks" + (
                    f"  accept {p['acceptance_cumulative']:4.2f} (commits confirmed)"
                    if isinstance(p.get("acceptance_cumulative"), (int, float))
                    and not isinstance(p.get("acceptance_cumulative"), bool) else ""))
            proposers.append(
                f"   {'':16} {window_text(ns.draft_window_s)}: drafted {rate_text(rate, 7)} "
                f"tok/s {sparkline(ns.draft_tok_s, SPARK_WIDTH)}")
        if isinstance(g, dict):
            gateways.append(
                f"{name:16} {printable(g.get('http', ''), 28):28} now {g.get('inflight', 0)} "
                f"in flight  total {g.get('requests', 0):6} requests {g.get('failovers', 0)} "
                f"failovers {g.get('cancelled', 0)} cancelled")
        cpu = latest.get("cpu_percent", 0)
        rss = latest.get("rss_bytes", 0) / 2**20
        dropped = sum((latest.get("dropped") or {}).values())
        orphans = ""
        if isinstance(v, dict):
            orphans = f"  orphans {v.get('orphans_dropped', 0)}"
        line = (f"{'':10} last 1s: cpu {cpu:5.1f}%  now: mem {rss:7.1f} MiB  total: dropped "
                f"{dropped}{orphans}")
        for panel, role in ((verifiers, v), (proposers, p), (gateways, g)):
            if isinstance(role, dict):
                panel.append(line)
                break
    return verifiers, proposers, gateways


def _rtt(ms: Any) -> str:
    """A proposer link's round trip; '-' until the verifier timed one (or not a number)."""
    if isinstance(ms, bool) or not isinstance(ms, int | float):
        return "     - ms"
    return f"{ms:6.2f} ms"


def window_text(seconds: float | None) -> str:
    """How a windowed figure is labelled: `last 1.0s` (the stats interval it is over), or
    `since start` before a second sample gives an interval."""
    return "since start" if seconds is None else f"last {min(seconds, 999.0):.1f}s"


def batch_line(v: dict[str, Any], batch: dict[str, float] | None,
               window_s: float | None = None) -> str:
    """A verifier's batch: running / --max-batch (now), then per step over a window (see
    `_batch_figures`: the latest stats interval it stepped in, or since it started), labelled
    so: sequences, rows fed (rows per forward), tokens committed per sequence; then its total
    steps and prompt positions reused are on the totals line below it."""
    head = f"  batch {v.get('active', 0)}/{v.get('max_batch', 0)}"
    if batch is None:
        return f"{head} now  (no steps yet)"
    return (f"{head}  per step: sequences {batch['mean_batch']:5.2f}  rows/forward "
            f"{batch['rows_per_forward']:6.1f}  tokens/forward/seq "
            f"{batch['tokens_per_forward_per_seq']:5.2f} ({window_text(window_s)})")


#: what the labels on the figures mean, shown above the panels (live view and `--once` alike)
LEGEND = ("labels: now = at its latest stats · total = since the node started · last gen = its "
          "latest generation",
          "        last Ns = between its latest two stats, N s apart (batch: the latest two it "
          "stepped between)",
          "        since start = over its whole life (one stats heard so far)")


def render_text(view: ClusterView) -> str:
    """A plain-text snapshot: members table, role panels, recent events."""
    rows = [MEMBER_COLUMNS, *member_rows(view)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(MEMBER_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verifiers, proposers, gateways = role_lines(view)
    lines += ["", *LEGEND, "", "verifiers:", *(verifiers or ["  (no stats yet)"]),
              "", "proposers:", *(proposers or ["  (no stats yet)"]),
              *(["", "gateways:", *gateways] if gateways else []),
              "", "events:", *list(view.log)[-10:]]
    return "\n".join(lines)
