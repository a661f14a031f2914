"""A node whose process is kept CPU-bound in pure Python after it joins (tests and benchmarks).

`python -m tools.busy_node --busy-s SECONDS NODE_ARGS... --print-events` runs `specbus node`
and, as soon as the node prints its `ready` line, spins a thread in pure-Python work for SECONDS.
That thread competes for the GIL exactly like a busy main thread would, which proves heartbeats
come from the I/O thread. A harness, not a product flag: nothing of it is in `specbus node`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger(__name__)


class _ReadyWatch:
    """Passes stdout through and fires `on_ready` once, when the node's `ready` line goes out."""

    def __init__(self, out: TextIO, on_ready: threading.Event) -> None:
        self._out = out
        self._on_ready = on_ready

    def write(self, text: str) -> int:
        if not self._on_ready.is_set() and '"event":"ready"' in text:
            self._on_ready.set()
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()

    def __getattr__(self, name: str):
        return getattr(self._out, name)


def spin(seconds: float, ready: threading.Event) -> None:
    """Pure-Python work for `seconds` once `ready` is set (never releases the GIL by choice)."""
    ready.wait()
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for i in range(10_000):
            x += i * i
    log.info("busy spin finished (%d)", x & 0xFF)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.busy_node", add_help=False)
    parser.add_argument("--busy-s", type=float, required=True)
    ours, node_args = parser.parse_known_args(argv)
    if not 0 < ours.busy_s <= 600:
        print("tools.busy_node: --busy-s must be in (0, 600]", file=sys.stderr)
        return 2
    from nodes.cli import main as specbus

    ready = threading.Event()
    sys.stdout = _ReadyWatch(sys.stdout, ready)
    threading.Thread(target=spin, args=(ours.busy_s, ready), name="busy", daemon=True).start()
    return specbus(["node", *node_args])


if __name__ == "__main__":
    sys.exit(main())
