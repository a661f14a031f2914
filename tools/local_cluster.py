"""Start real node processes on this machine (loopback), watch their events, stop them cleanly.

The one process launcher of the project: the demo, the benchmarks and the multi-process tests
all start nodes through `NodeProcess` (one `python -m nodes ... --print-events` child) or
`LocalCluster` (a set of them in one cluster). A node prints one JSON line per membership event
stamped with `time.monotonic()`; CLOCK_MONOTONIC is system-wide on Linux, so times from different
processes compare directly with the caller's clock. The launcher learns a node's id and endpoints
from its own `ready` line rather than guessing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODE_START_TIMEOUT_S = 180.0
MEMBER_EVENTS = ("join", "update", "suspect", "alive", "dead", "leave")


class ClusterStartError(RuntimeError):
    """A node process exited or did not become ready in time."""


class NodeProcess:
    """One node subprocess; a reader thread collects its JSON event lines.

    `module` is what `python -m` runs (`nodes`, or a harness such as `tools.busy_node`);
    stderr goes to `log_path` when given, else into a short ring kept for error messages.
    """

    def __init__(self, args: Sequence[str], *, name: str = "", env: dict[str, str] | None = None,
                 prefix: Sequence[str] = (), module: str = "nodes",
                 log_path: Path | None = None) -> None:
        self.name = name
        self.args = [*prefix, sys.executable, "-m", module, *args, "--print-events"]
        self.log_path = log_path
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            err = open(log_path, "w")  # noqa: SIM115 - the child writes it; closed below
        else:
            err = subprocess.PIPE
        self.spawned_at = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err, text=True,
                                     env=full_env, cwd=ROOT)
        if log_path is not None:
            err.close()
        else:
            threading.Thread(target=self._drain_stderr, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    # -- reader threads ---------------------------------------------------------------------
    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict) or "event" not in ev:
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "eof", "t": time.monotonic()})
            self._cond.notify_all()

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())
            del self.stderr[:-200]

    # -- waiting ------------------------------------------------------------------------------
    def wait_event(self, pred: Callable[[dict], bool], timeout: float) -> dict | None:
        """The first event (past or future) matching `pred`, or None after `timeout`."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = end - time.monotonic()
                if left <= 0 or (self.events and self.events[-1]["event"] == "eof"):
                    return None
                self._cond.wait(left)

    def read_events(self, timeout: float = 0.0) -> list[dict]:
        """Events that arrived since the last call, waiting up to `timeout` for the first."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self.events) == self._cursor:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            out = self.events[self._cursor:]
            self._cursor = len(self.events)
            return out

    def wait_ready(self, timeout: float = NODE_START_TIMEOUT_S) -> dict:
        ev = self.wait_event(lambda e: e["event"] in ("ready", "eof"), timeout)
        if ev is None or ev["event"] != "ready":
            why = "exited" if ev is not None else f"not ready after {timeout:g}s"
            raise ClusterStartError(f"node {self.name or self.args[-1]} {why}: "
                                    + self.tail_of_log())
        return ev

    def tail_of_log(self, lines: int = 20) -> str:
        if self.log_path is not None:
            try:
                text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                return f"(log: {self.log_path})"
            return f"(log: {self.log_path})\n" + "\n".join(text)
        return "\n".join(self.stderr[-lines:])

    # -- what it said ---------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        """Whether its `ready` line has arrived (never waits)."""
        with self._cond:
            return any(e["event"] == "ready" for e in self.events)

    @property
    def ready(self) -> dict:
        return self.wait_ready()

    @property
    def node_id(self) -> str:
        return self.ready["node_id"]

    @property
    def endpoints(self) -> dict[str, str]:
        return self.ready.get("endpoints", {})

    @property
    def stream(self) -> str:
        return self.endpoints.get("stream", "")

    def view(self) -> dict[str, str]:
        """node id -> latest state, from this node's events."""
        out: dict[str, str] = {}
        with self._cond:
            for ev in self.events:
                if ev["event"] in MEMBER_EVENTS:
                    out[ev["node_id"]] = ev["state"]
        return out

    def events_about(self, node_id: str, kind: str | None = None) -> list[dict]:
        with self._cond:
            return [e for e in self.events if e.get("node_id") == node_id
                    and e["event"] != "ready" and (kind is None or e["event"] == kind)]

    # -- lifecycle ------------------------------------------------------------------------------
    def signal(self, sig: int) -> float:
        """Send `sig` if the process still runs; returns when it was sent (monotonic)."""
        t = time.monotonic()
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        return t

    def stop(self, timeout: float = 5.0) -> None:
        """SIGCONT (a stopped node cannot exit), SIGTERM, then SIGKILL if it does not exit."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        self.reap(timeout)

    def reap(self, timeout: float) -> None:
        try:
            self.proc.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class LocalCluster:
    """A set of node processes in one cluster; a context manager that always cleans up."""

    cluster: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex[:8]}")
    log_dir: Path | None = None
    mdns: bool = True
    env: dict[str, str] = field(default_factory=dict)
    nodes: list[NodeProcess] = field(default_factory=list)

    def start_node(self, name: str, *flags: str, wait: float = NODE_START_TIMEOUT_S,
                   seed: bool = False, prefix: Sequence[str] = (),
                   env: dict[str, str] | None = None, module: str = "nodes") -> NodeProcess:
        """Start `python -m nodes --name NAME FLAGS...` and wait for its `ready` line.

        Without mDNS (or with `seed`), every running node that is ready is given as a `--peer`
        seed (gossip spreads the rest).
        `prefix` runs it under another command (e.g. `ip netns exec NS`); `env` adds variables.
        """
        node = self.spawn(name, *flags, seed=seed, prefix=prefix, env=env, module=module)
        node.wait_ready(wait)
        return node

    def spawn(self, name: str, *flags: str, seed: bool = False, prefix: Sequence[str] = (),
              env: dict[str, str] | None = None, module: str = "nodes") -> NodeProcess:
        """Start a node without waiting for it (several can then load their models at once)."""
        args = ["--cluster", self.cluster, "--name", name, *flags]
        if not self.mdns:
            args.append("--no-mdns")
        if seed or not self.mdns:
            for other in self.nodes:
                if other.proc.poll() is None and other.is_ready and other.stream:
                    args += ["--peer", other.stream.removeprefix("tcp://")]
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        node = NodeProcess(args, name=name, env={**self.env, **(env or {})}, prefix=prefix,
                           module=module, log_path=log_path)
        self.nodes.append(node)
        return node

    def node(self, name: str) -> NodeProcess:
        return next(n for n in self.nodes if n.name == name)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM everyone (a graceful leave), then SIGKILL stragglers."""
        for n in self.nodes:
            n.signal(signal.SIGCONT)
            n.signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for n in self.nodes:
            n.reap(end - time.monotonic())
            if n.proc.stdout:
                n.proc.stdout.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P + 1 free too (a node's `--port`: request port P, gossip port P + 1).

    For nodes that must be told their port before they start (behind a delay proxy, shard
    groups with seeds); another process may still take it in between, so callers retry.
    """
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError(f"no free port pair on {host}")


def wait_all(pred: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Poll `pred` until it holds or `timeout` passes; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def all_see_each_other(nodes: Sequence[NodeProcess]) -> bool:
    ids = {n.node_id for n in nodes}
    return all({k for k, s in n.view().items() if s == "alive"} >= ids - {n.node_id}
               for n in nodes)


def event_time(nodes: Sequence[NodeProcess], node_id: str, kind: str, after: float,
               timeout: float) -> float | None:
    """Latest time at which every node in `nodes` reported `kind` for `node_id` after `after`."""
    worst = after
    for n in nodes:
        ev = n.wait_event(lambda e: e.get("node_id") == node_id and e["event"] == kind
                          and e["t"] >= after, max(0.0, after + timeout - time.monotonic()))
        if ev is None:
            return None
        worst = max(worst, ev["t"])
    return worst - after
