"""`specbus bench membership`: join, failure detection, leave and convergence, with real
node processes on loopback.

Each node runs `python -m nodes --print-events`, which prints one JSON line per membership
event stamped with `time.monotonic()`. CLOCK_MONOTONIC is system-wide on Linux, so times
from different processes on this machine compare directly with the benchmark's own clock.
`NodeProcess` is also what the multi-process tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

NODE_START_TIMEOUT_S = 20.0


class NodeProcess:
    """A `specbus node` subprocess whose stdout events are collected on a thread."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:
        cmd = [*prefix, sys.executable, "-m", "nodes", *args, "--print-events"]
        full_env = {**os.environ, **(env or {})}
        self.spawned_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env)
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
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

    # -- waiting ------------------------------------------------------------------------
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

    def wait_ready(self, timeout: float = NODE_START_TIMEOUT_S) -> dict:
        ev = self.wait_event(lambda e: e["event"] == "ready", timeout)
        if ev is None:
            raise RuntimeError("node did not start:\n" + "\n".join(self.stderr[-20:]))
        return ev

    @property
    def ready(self) -> dict:
        return self.wait_ready()

    @property
    def node_id(self) -> str:
        return self.ready["node_id"]

    @property
    def stream(self) -> str:
        return self.ready["endpoints"]["stream"]

    def view(self) -> dict[str, str]:
        """node id -> latest state, from this node's events."""
        out: dict[str, str] = {}
        with self._cond:
            for ev in self.events:
                if ev["event"] in ("join", "update", "suspect", "alive", "dead", "leave"):
                    out[ev["node_id"]] = ev["state"]
        return out

    def events_about(self, node_id: str, kind: str | None = None) -> list[dict]:
        with self._cond:
            return [e for e in self.events if e.get("node_id") == node_id
                    and e["event"] != "ready" and (kind is None or e["event"] == kind)]

    # -- lifecycle ----------------------------------------------------------------------
    def signal(self, sig: int) -> float:
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return t

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_all(pred: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
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


# -- the benchmark ------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster = f"bench-{uuid.uuid4().hex[:8]}"
        self.procs: list[NodeProcess] = []

    def spawn(self, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
        p = NodeProcess(["--role", "proposer", "--drafter", "ngram", "--cluster", self.cluster,
                         *extra], env=env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.procs:
            p.proc.wait()

    def join_leave_kill(self, trials: int) -> dict[str, list[float]]:
        base = [self.spawn() for _ in range(3)]
        if not wait_all(lambda: all_see_each_other(base), 15):
            raise RuntimeError("base cluster did not converge")
        out: dict[str, list[float]] = {"join_s": [], "dead_after_kill_s": [], "leave_s": []}
        for _ in range(trials):
            new = self.spawn()
            t0 = new.spawned_at
            nid = new.node_id
            dt = event_time(base, nid, "join", t0, 10)
            new_sees = wait_all(lambda new=new: all_see_each_other([*base, new]), 10)
            if dt is None or not new_sees:
                raise RuntimeError("a joining node was not seen by every member")
            mine = max(e["t"] for e in new.events if e["event"] == "join") - t0
            out["join_s"].append(max(dt, mine))
            time.sleep(0.3)
            t_term = new.signal(signal.SIGTERM)
            dt = event_time(base, nid, "leave", t_term, 5)
            if dt is None:
                raise RuntimeError("leave not seen")
            out["leave_s"].append(dt)
            new.proc.wait(5)
            victim = self.spawn()
            if not wait_all(lambda v=victim: all_see_each_other([*base, v]), 10):
                raise RuntimeError("victim did not join")
            time.sleep(0.3)
            t_kill = victim.signal(signal.SIGKILL)
            dt = event_time(base, victim.node_id, "dead", t_kill, 6)
            if dt is None:
                raise RuntimeError("killed node not declared dead")
            out["dead_after_kill_s"].append(dt)
            victim.proc.wait(5)
        for p in base:
            p.stop()
        return out

    def converge(self, n: int) -> dict[str, float]:
        procs = [self.spawn() for _ in range(n)]
        for p in procs:
            p.wait_ready(60)
        last_ready = max(p.ready["t"] for p in procs)
        first_spawn = min(p.spawned_at for p in procs)
        if not wait_all(lambda: all_see_each_other(procs), 30, step=0.05):
            raise RuntimeError(f"{n} nodes did not converge in 30 s")
        done = max(max((e["t"] for e in p.events if e["event"] == "join"), default=0)
                   for p in procs)
        steady = self.args.steady_s
        time.sleep(steady)
        for p in procs:
            p.proc.send_signal(signal.SIGTERM)
        rates_out, rates_in = [], []
        for p in procs:
            ev = p.wait_event(lambda e: e["event"] == "exit", 15)
            p.proc.wait(10)
            if ev is not None:
                life = ev["t"] - p.ready["t"]
                rates_out.append(ev["bytes_out"] / life)
                rates_in.append(ev["bytes_in"] / life)
        suspects = sum(len([e for e in p.events if e["event"] == "suspect"]) for p in procs)
        return {"converge_s": done - last_ready, "from_spawn_s": done - first_spawn,
                "spawn_to_last_ready_s": last_ready - first_spawn,
                "bytes_out": statistics.mean(rates_out), "bytes_in": statistics.mean(rates_in),
                "suspects": suspects}

    def busy(self, n_busy: int, n_idle: int, seconds: float) -> int:
        env = {"SPECBUS_TEST_BUSY_S": str(seconds)}
        idle = [self.spawn() for _ in range(n_idle)]
        busy = [self.spawn(env=env) for _ in range(n_busy)]
        allp = idle + busy
        if not wait_all(lambda: all_see_each_other(allp), 15):
            raise RuntimeError("busy cluster did not converge")
        time.sleep(seconds + 0.5)
        count = sum(len([e for e in p.events if e["event"] in ("suspect", "dead")])
                    for p in allp)
        for p in allp:
            p.stop()
        return count


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 4), "max": round(max(values), 4),
            "n": len(values)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--trials", type=int, default=5,
                        help="join/leave/kill trials (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=20,
                        help="nodes in the convergence run (default: %(default)s)")
    parser.add_argument("--steady-s", type=float, default=5.0,
                        help="steady-state seconds for gossip bytes (default: %(default)s)")
    parser.add_argument("--busy-s", type=float, default=5.0,
                        help="seconds the CPU-bound nodes spin (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.trials <= 50 or not 2 <= args.nodes <= 40:
        print("specbus bench membership: --trials must be 1..50 and --nodes 2..40",
              file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        jlk = bench.join_leave_kill(args.trials)
        conv = bench.converge(args.nodes)
        busy = bench.busy(n_busy=3, n_idle=3, seconds=args.busy_s)
    finally:
        bench.close()
    result = {
        "join_s": summary(jlk["join_s"]),
        "dead_after_kill_s": summary(jlk["dead_after_kill_s"]),
        "leave_s": summary(jlk["leave_s"]),
        f"converge_{args.nodes}_s": round(conv["converge_s"], 4),
        f"converge_{args.nodes}_from_spawn_s": round(conv["from_spawn_s"], 4),
        f"spawn_to_last_ready_{args.nodes}_s": round(conv["spawn_to_last_ready_s"], 4),
        "false_suspicions": busy + conv["suspects"],
        "false_suspicions_busy_run": busy,
        "false_suspicions_convergence_run": conv["suspects"],
        "gossip_bytes_per_s_per_node": round(conv["bytes_out"], 1),
        "gossip_bytes_in_per_s_per_node": round(conv["bytes_in"], 1),
        "nodes": args.nodes,
        "timeouts": {"heartbeat": 0.2, "suspect_after": 0.8, "dead_after": 1.6},
    }
    print(format_table(result, args.nodes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


def format_table(r: dict, n: int) -> str:
    rows = [
        ("join (start -> seen by all)", f"p50 {r['join_s']['p50']:.3f} s", "max "
         f"{r['join_s']['max']:.3f} s", "<= 1.0 s p50"),
        ("dead after SIGKILL", f"p50 {r['dead_after_kill_s']['p50']:.3f} s",
         f"max {r['dead_after_kill_s']['max']:.3f} s", "<= 2.0 s"),
        ("leave after SIGTERM", f"p50 {r['leave_s']['p50']:.3f} s",
         f"max {r['leave_s']['max']:.3f} s", "<= 0.2 s"),
        (f"converge, {n} nodes (last ready)", f"{r[f'converge_{n}_s']:.3f} s",
         f"from spawn {r[f'converge_{n}_from_spawn_s']:.3f} s", "<= 3 s"),
        ("false suspicions", str(r["false_suspicions"]), "", "0"),
        ("gossip bytes/s per node", f"out {r['gossip_bytes_per_s_per_node']:.0f}",
         f"in {r['gossip_bytes_in_per_s_per_node']:.0f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    head = ("metric", "value", "", "target")
    widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)
