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
    draft_tok_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))


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
            ns.latest, ns.at = stats, time.monotonic()
            v, p = stats.get("verifier"), stats.get("proposer")
            if isinstance(v, dict):
                ns.tok_s.append(float(v.get("tok_s") or 0.0))
                ns.acceptance.append(float(v.get("acceptance") or 0.0))
            if isinstance(p, dict):
                ns.draft_tok_s.append(float(p.get("draft_tok_s") or 0.0))
        return {"event": "stats", "node_id": node_id, "ts": time.time(), "stats": stats}

    def refresh(self, members: list[Member]) -> None:
        """Replace member views with a fresh copy of the table (heartbeat ages move on)."""
        with self._lock:
            for m in members:
                if not m.is_self:
                    self._members[m.node_id] = m

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
                             deque(ns.acceptance, HISTORY), deque(ns.draft_tok_s, HISTORY))

    def snapshot(self) -> dict[str, Any]:
        """Everything, as one JSON-able object (`--once --json`)."""
        out = []
        for m in self.members():
            ns = self.stats(m.node_id)
            out.append({**member_fields(m), "node_id": m.node_id,
                        "stats": ns.latest if ns else {}})
        return {"members": out, "ts": time.time()}


def member_fields(m: Member) -> dict[str, Any]:
    c = m.card
    return {
        "name": c.name, "roles": list(c.roles), "backend": c.backend, "model": c.model,
        "state": m.state.value, "incarnation": c.incarnation, "load": c.load, "tok_s": c.tok_s,
        "heartbeat_age_s": round(max(0.0, time.monotonic() - m.last_heard), 2),
        "endpoints": dict(c.endpoints), "observer": c.observer,
        "insecure": bool(c.extras.get("insecure")),
    }


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
    """Rows of the members table: name, id, roles, backend, model, state, inc, hb age, load."""
    rows = []
    for m in view.members():
        f = member_fields(m)
        roles = ",".join(f["roles"]) or ("observer" if f["observer"] else "-")
        rows.append((f["name"] or "-", m.node_id, roles, f["backend"] or "-", f["model"] or "-",
                     f["state"] + (" INSECURE" if f["insecure"] else ""),
                     str(f["incarnation"]), f"{f['heartbeat_age_s']:.1f}s",
                     f"{f['load']:.2f}"))
    return rows


MEMBER_COLUMNS = ("name", "id", "roles", "backend", "model", "state", "inc", "heartbeat", "load")


def role_lines(view: ClusterView) -> tuple[list[str], list[str]]:
    """Text lines of the verifier and proposer panels."""
    verifiers, proposers = [], []
    for m in view.members():
        ns = view.stats(m.node_id)
        if ns is None:
            continue
        name = m.card.name or m.node_id
        v, p = ns.latest.get("verifier"), ns.latest.get("proposer")
        if isinstance(v, dict):
            verifiers.append(
                f"{name:16} tok/s {v.get('tok_s', 0):6.1f} {sparkline(ns.tok_s):20} "
                f"accept {v.get('acceptance', 0):4.2f} {sparkline(ns.acceptance):20} "
                f"active {v.get('active', 0)} queued {v.get('queued', 0)} "
                f"orphans {v.get('orphans_dropped', 0)}")
            for pid, ps in (v.get("proposers") or {}).items():
                label = printable(ps.get("name") or pid, 40) if isinstance(ps, dict) else "?"
                if not isinstance(ps, dict):
                    continue
                verifiers.append(
                    f"  └ {label:14} accept {ps.get('acceptance', 0):4.2f} "
                    f"drafts {ps.get('drafts', 0):5} timeouts {ps.get('timeouts', 0):3} "
                    f"rtt {ps.get('rtt_ms', 0):.2f} ms")
        if isinstance(p, dict):
            drafting = rate_text(float(p.get("draft_tok_s") or 0.0))
            proposers.append(
                f"{name:16} sessions {p.get('sessions_open', 0):3} drafts "
                f"{p.get('drafts_served', 0):6} draft tok/s {drafting} "
                f"{sparkline(ns.draft_tok_s):20}")
        cpu = ns.latest.get("cpu_percent", 0)
        rss = ns.latest.get("rss_bytes", 0) / 2**20
        dropped = sum((ns.latest.get("dropped") or {}).values())
        line = f"   {name:16} cpu {cpu:5.1f}%  mem {rss:7.1f} MiB  dropped {dropped}"
        (verifiers if isinstance(v, dict) else proposers if isinstance(p, dict) else []).append(
            line)
    return verifiers, proposers


def render_text(view: ClusterView) -> str:
    """A plain-text snapshot: members table, role panels, recent events."""
    rows = [MEMBER_COLUMNS, *member_rows(view)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(MEMBER_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verifiers, proposers = role_lines(view)
    lines += ["", "verifiers:", *(verifiers or ["  (no stats yet)"]),
              "", "proposers:", *(proposers or ["  (no stats yet)"]),
              "", "events:", *list(view.log)[-10:]]
    return "\n".join(lines)
