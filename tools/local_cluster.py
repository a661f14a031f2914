"""Start a cluster of real node processes on this machine (loopback), and stop it cleanly.

Used by `specbus demo`, the decode benchmark and the multi-process tests. Each node is
`python -m nodes --role ... --print-events`, so this module learns its id and endpoints from the
node's own `ready` line rather than guessing.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


class ClusterStartError(RuntimeError):
    """A node process exited or did not become ready in time."""


@dataclass
class NodeProc:
    args: list[str]
    proc: subprocess.Popen
    name: str
    node_id: str = ""
    endpoints: dict[str, str] = field(default_factory=dict)
    lines: list[dict] = field(default_factory=list)

    @property
    def stream(self) -> str:
        return self.endpoints.get("stream", "")

    def read_events(self, timeout: float = 0.0) -> list[dict]:
        """JSON lines the node printed since the last call (non-blocking by default)."""
        out = []
        end = time.monotonic() + timeout
        while True:
            left = max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                return out
            line = self.proc.stdout.readline()
            if not line:
                return out
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.lines.append(ev)
            out.append(ev)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


@dataclass
class LocalCluster:
    """A set of node processes in one cluster; a context manager that always cleans up."""

    cluster: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex[:8]}")
    log_dir: Path | None = None
    mdns: bool = True
    env: dict[str, str] = field(default_factory=dict)
    nodes: list[NodeProc] = field(default_factory=list)

    def start_node(self, name: str, *flags: str, wait: float = 180.0,
                   seed: bool = False, prefix: list[str] | None = None,
                   env: dict[str, str] | None = None) -> NodeProc:
        """Start `python -m nodes --name NAME FLAGS...` and wait for its `ready` line.

        `prefix` runs it under another command (e.g. `ip netns exec NS`); `env` adds variables.
        """
        args = [*(prefix or []), sys.executable, "-m", "nodes", "--cluster", self.cluster,
                "--name", name, "--print-events", *flags]
        if not self.mdns:
            args.append("--no-mdns")
        if seed or not self.mdns:
            for other in self.nodes:
                if other.stream:
                    args += ["--peer", other.stream.removeprefix("tcp://")]
        stderr = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - child owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=env, cwd=Path(__file__).resolve().parents[1])
        node = NodeProc(args, proc, name)
        self.nodes.append(node)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            for ev in node.read_events(timeout=0.2):
                if ev.get("event") == "ready":
                    node.node_id = ev["node_id"]
                    node.endpoints = ev.get("endpoints", {})
                    return node
            if proc.poll() is not None:
                raise ClusterStartError(
                    f"node {name} exited with {proc.returncode} before it was ready"
                    + (f" (log: {self.log_dir / (name + '.log')})" if self.log_dir else ""))
        raise ClusterStartError(f"node {name} not ready after {wait:g}s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM everyone (a graceful leave), then SIGKILL stragglers."""
        for n in self.nodes:
            if n.proc.poll() is None:
                try:
                    n.proc.send_signal(signal.SIGCONT)  # a stopped node cannot exit
                except ProcessLookupError:
                    pass
                n.signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for n in self.nodes:
            try:
                n.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()
            if n.proc.stdout:
                n.proc.stdout.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
