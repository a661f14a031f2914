"""Node identity: a stable random id per (cluster, name) and an incarnation that only grows.

Layout under the state directory (default: `$XDG_CACHE_HOME/specbus`, else `~/.cache/specbus`;
override with `--state-dir` or `SPECBUS_STATE_DIR`):

    names/<cluster>/<name>         the node id given to that display name (created once)
    nodes/<node id>/incarnation    a counter, incremented at every start and every refutation
    nodes/<node id>/lock           flock held while the node runs

The incarnation is a counter file, never a clock: a restarted node always comes back with a
larger incarnation than any it used before, whatever the clocks of the machines say. A node
started without `--name` gets a fresh random id every time, so there is nothing to remember
and nothing is written (its incarnation starts at 1). If two processes claim the same name at
once, the second one gets a fresh id (ids must stay unique; the name is only a label).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from discovery.cards import check_cluster, check_node_id, new_node_id
from discovery.limits import MAX_COUNTER, parse_decimal

log = logging.getLogger(__name__)


def default_state_dir() -> Path:
    env = os.environ.get("SPECBUS_STATE_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "specbus"


class IncarnationExhausted(ValueError):
    """No incarnation is left above the one asked for (only a hostile claim gets here)."""


class Identity:
    """This process's node id and current incarnation; `bump()` persists the new value."""

    def __init__(self, node_id: str, incarnation: int, counter: Path | None,
                 lock_fd: int | None) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self._counter = counter
        self._lock_fd = lock_fd

    @property
    def persistent(self) -> bool:
        return self._counter is not None

    def bump(self, at_least: int = 0) -> int:
        """Move to a new incarnation, larger than the current one and than `at_least`.

        Raises IncarnationExhausted (and changes nothing, on disk or here) if that would pass
        MAX_COUNTER: the persisted value must stay one that a card can carry.
        """
        new = max(self.incarnation, at_least) + 1
        if new > MAX_COUNTER:
            raise IncarnationExhausted(
                f"incarnation {new} would pass the ceiling {MAX_COUNTER}; staying at "
                f"{self.incarnation}")
        if self._counter is not None:
            _write_counter(self._counter, new)
        self.incarnation = new
        return new

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None


def acquire_identity(cluster: str, name: str | None, state_dir: Path | None = None) -> Identity:
    """The identity for this start: persisted for named nodes, fresh otherwise."""
    check_cluster(cluster)
    if not name:
        return Identity(new_node_id(), 1, None, None)
    if "/" in name or name in (".", "..") or "\0" in name or len(name) > 100:
        raise ValueError(f"--name must be a plain label without '/', got {name!r}")
    root = state_dir or default_state_dir()
    name_file = root / "names" / cluster / name
    name_file.parent.mkdir(parents=True, exist_ok=True)
    node_id = _read_or_create_id(name_file)
    ident = _lock_and_increment(root, node_id)
    if ident is None:
        fresh = new_node_id()
        log.warning("name %r is in use by a running node (%s); using a fresh id %s",
                    name, node_id, fresh)
        ident = _lock_and_increment(root, fresh)
    return ident


def _read_or_create_id(name_file: Path) -> str:
    try:
        node_id = name_file.read_text().strip()
        check_node_id(node_id)
        return node_id
    except FileNotFoundError:
        pass
    except ValueError:
        log.warning("ignoring a corrupt id in %s", name_file)
    node_id = new_node_id()
    tmp = name_file.with_name(f".{name_file.name}.{os.getpid()}.tmp")
    tmp.write_text(node_id + "\n")
    try:
        os.link(tmp, name_file)  # atomic create-if-absent: the first writer wins
    except FileExistsError:
        node_id = name_file.read_text().strip()
        check_node_id(node_id)
    finally:
        tmp.unlink(missing_ok=True)
    return node_id


def _lock_and_increment(root: Path, node_id: str) -> Identity | None:
    node_dir = root / "nodes" / node_id
    node_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(node_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    counter = node_dir / "incarnation"
    incarnation = _read_counter(counter) + 1
    _write_counter(counter, incarnation)
    # every raise of the incarnation is logged with its reason (issue 47); a start's is the
    # ordinary one, so it is info, where a refutation's is a warning (discovery/refuter.py)
    log.info("incarnation %d for node %s: started again (its counter file %s held %d)",
             incarnation, node_id, counter, incarnation - 1)
    return Identity(node_id, incarnation, counter, fd)


def _read_counter(path: Path) -> int:
    """The last incarnation used, or 0 (a fresh start) if the file is absent or unusable.

    A corrupt or out-of-range value (never written by an honest run: see `Identity.bump`) is
    a warning, not a failed start: the node comes back at incarnation 1 and, as after a lost
    file, outgrows its past when a peer shows it its old card (docs/discovery.md).
    """
    try:
        with open(path, "rb") as f:
            text = f.read(64).decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("cannot read incarnation file %s (%s); starting a fresh incarnation",
                    path, exc)
        return 0
    value = parse_decimal(text, MAX_COUNTER - 1)  # - 1: this start adds one
    if value is None:
        log.warning("incarnation file %s is corrupt or out of range (%r, expected an integer "
                    "in [0, %d]); starting a fresh incarnation", path, text[:24], MAX_COUNTER - 1)
        return 0
    return value


def _write_counter(path: Path, value: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{value}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
