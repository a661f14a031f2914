"""Logging set-up shared by every subcommand: one format, the node id on every line."""

from __future__ import annotations

import logging
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _NodeIdFilter(logging.Filter):
    """Stamps each record with the node id so interleaved logs from many nodes stay readable."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "node"):
            record.node = self.node_id
        return True


def configure_logging(level: str = "WARNING", node_id: str = "-") -> logging.Handler:
    """Send all specbus logging to stderr with the node id on every line.

    Called once per process by the CLI; returns the handler so a node can later rename itself
    (its id is only known after start-up) with `set_node_id`.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_NodeIdFilter(node_id))
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s [%(node)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def set_node_id(handler: logging.Handler, node_id: str) -> None:
    """Change the node id printed by a handler made by `configure_logging`."""
    for f in handler.filters:
        if isinstance(f, _NodeIdFilter):
            f.node_id = node_id
