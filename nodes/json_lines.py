"""JSON lines on stdout: one whole line per object, from any thread.

Used by a node's `--print-events` (membership events, ready, exit) and the monitor's `--json`.
"""

from __future__ import annotations

import json
import sys
import threading

from discovery.table import Event


def event_json(ev: Event) -> dict:
    m = ev.member
    return {"event": ev.kind, "node_id": m.node_id, "name": m.card.name,
            "incarnation": m.incarnation, "state": m.state.value, "t": ev.at}


class JsonLines:
    """Writes JSON lines to stdout from any thread, one whole line at a time (a node's
    `--print-events`, the monitor's `--json`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, obj: dict) -> None:
        line = json.dumps(obj, separators=(",", ":"), default=str)
        with self._lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass  # reader went away; the node keeps running
